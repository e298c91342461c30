"""Stage 2 ``numpy``: im2col turns every convolution into one matrix product.

What changes against stage 1: no Python loop runs per output element any more.

- Convolution: ``im2col`` lays every receptive field out as a row of a matrix
  (N·Ho·Wo rows of C·K·K numbers, taken with ``sliding_window_view``, no copy until
  the reshape), so the whole layer is ``cols @ Wᵀ`` — one call into BLAS.
  Backward is two more products (dW = dYᵀ·cols, dcols = dY·W) and ``col2im``,
  which adds every column back onto the pixels it came from: K·K strided
  ``+=`` over the whole batch, correct when windows overlap.
- Max-pool: the windows as a view, one ``argmax`` over the last axis; backward
  scatters with ``np.bincount`` so that a pixel winning two overlapping windows
  receives both gradients.
- Dense: one product per layer instead of one per sample.

What it bought: the stage table in README.md (``python -m cnn bench``) gives the
measured speedup over stage 1; LeNet-5 becomes trainable to 99 % on a laptop CPU.
The cost: im2col copies each input pixel K·K/s² times into ``cols``, memory
traffic the fused kernels of stage 5 avoid.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from cnn.model import window_count
from cnn.stages.base import HostStage, Ops, pad_images
from cnn.stages.s1_loops import relu_backward, relu_forward   # already element-wise numpy


def _windows(x: np.ndarray, size: int, stride: int) -> np.ndarray:
    """View of shape (N, C, Ho, Wo, size, size): every window, without copying."""
    return sliding_window_view(x, (size, size), axis=(2, 3))[:, :, ::stride, ::stride]


def im2col(x, K, stride, pad):
    """Rows = receptive fields: shape (N·Ho·Wo, C·K·K), row order (n, i, j), column order (c, p, q)."""
    windows = _windows(pad_images(x, pad), K, stride)              # N, C, Ho, Wo, K, K
    N, C, Ho, Wo = windows.shape[:4]
    return windows.transpose(0, 2, 3, 1, 4, 5).reshape(N * Ho * Wo, C * K * K), (Ho, Wo)


def col2im(dcols, x_shape, K, stride, pad):
    """Adjoint of im2col: add every entry of ``dcols`` back onto the input pixel it was copied from."""
    N, C, H, W = x_shape
    Ho, Wo = window_count(H, K, stride, pad), window_count(W, K, stride, pad)
    dcols = dcols.reshape(N, Ho, Wo, C, K, K).transpose(0, 3, 1, 2, 4, 5)   # N, C, Ho, Wo, K, K
    dxp = np.zeros((N, C, H + 2 * pad, W + 2 * pad), dtype=dcols.dtype)
    for p in range(K):
        for q in range(K):
            dxp[:, :, p:p + stride * Ho:stride, q:q + stride * Wo:stride] += dcols[..., p, q]
    return dxp[:, :, pad:pad + H, pad:pad + W]


def conv_forward(x, W, b, stride, pad):
    """y = im2col(x) · W_matᵀ + b, with W_mat = W reshaped to (F, C·K·K)."""
    F, _, K, _ = W.shape
    cols, (Ho, Wo) = im2col(x, K, stride, pad)
    y = cols @ W.reshape(F, -1).T + b                        # (N·Ho·Wo, F)
    return np.ascontiguousarray(y.reshape(x.shape[0], Ho, Wo, F).transpose(0, 3, 1, 2))


def conv_backward(dy, x, W, stride, pad):
    """dW = dY_matᵀ · cols,  db = Σ rows of dY_mat,  dx = col2im(dY_mat · W_mat).

    ``cols`` is recomputed rather than kept from the forward pass: cheaper in memory, and
    it keeps every stage's ``conv_backward`` to the same signature.
    """
    F, _, K, _ = W.shape
    cols, _ = im2col(x, K, stride, pad)
    dy_mat = dy.transpose(0, 2, 3, 1).reshape(-1, F)          # (N·Ho·Wo, F)
    dW = (dy_mat.T @ cols).reshape(W.shape)
    db = dy_mat.sum(axis=0)
    dx = col2im(dy_mat @ W.reshape(F, -1), x.shape, K, stride, pad)
    return dx, dW, db


def maxpool_forward(x, size, stride):
    """One argmax over each flattened window; the winner's flat index in the H×W plane is kept."""
    N, C, H, W = x.shape
    windows = _windows(x, size, stride)
    Ho, Wo = windows.shape[2:4]
    local = windows.reshape(N, C, Ho, Wo, size * size).argmax(axis=-1)
    rows = np.arange(Ho)[:, None] * stride + local // size
    cols = np.arange(Wo)[None, :] * stride + local % size
    argmax = rows * W + cols
    y = np.take_along_axis(x.reshape(N, C, H * W), argmax.reshape(N, C, -1), axis=2)
    return y.reshape(N, C, Ho, Wo), argmax


def maxpool_backward(dy, argmax, x_shape, size, stride):
    """Scatter-add each dy onto its window's winner: ``bincount`` sums the collisions of overlapping windows."""
    N, C, H, W = x_shape
    plane = np.arange(N * C).reshape(N, C, 1, 1) * (H * W)
    dx = np.bincount((plane + argmax).ravel(), weights=dy.ravel(), minlength=N * C * H * W)
    return dx.astype(dy.dtype, copy=False).reshape(x_shape)


def dense_forward(x, W, b):
    return x @ W.T + b


def dense_backward(dy, x, W):
    return dy @ W, dy.T @ x, dy.sum(axis=0)


class NumpyStage(HostStage):
    name = "numpy"
    summary = "im2col + BLAS matrix products, vectorised pooling"
    ops = Ops(conv_forward, conv_backward, relu_forward, relu_backward,
              maxpool_forward, maxpool_backward, dense_forward, dense_backward)
