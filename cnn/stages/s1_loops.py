"""Stage 1 ``loops``: the network written as the equations read, one output element at a time.

What it is: pure numpy, sequential, with explicit Python loops over the batch, the
channels and the output positions. The only vectorisation is the innermost
window sum (a C×K×K dot product) and element-wise ReLU. Every backward pass is
written in *pull* (gather) form: a loop over the elements of the gradient being
computed, each gathering every term that contributes to it — the form a CUDA
thread that "owns" one gradient element will use in stage 4.

What it buys: nothing in speed — it is the reference. It is the oracle every
other stage is tested against (itself gradient-checked by finite differences in
float64), and it is the "before" of every speedup the benchmark reports.
Measured: see the stage table in README.md (``python -m cnn bench``); a LeNet-5
step at batch 64 takes seconds, which is why the benchmark times only a few.
"""

from __future__ import annotations

import numpy as np

from cnn.model import window_count
from cnn.stages.base import HostStage, Ops, pad_images


def _covering_windows(pos: int, kernel: int, stride: int, n_out: int) -> range:
    """Output indices i whose window [i·s, i·s + K) contains input position ``pos``.

    i·s ≤ pos < i·s + K   ⇔   (pos − K)/s < i ≤ pos/s
    """
    first = max(0, -(-(pos - kernel + 1) // stride))   # ceil((pos − K + 1) / s)
    last = min(n_out - 1, pos // stride)
    return range(first, last + 1)


def conv_forward(x, W, b, stride, pad):
    """y[n, f, i, j] = b[f] + Σ_{c,p,q} W[f, c, p, q] · x_pad[n, c, i·s + p, j·s + q]"""
    N, _, H, Wd = x.shape
    F, _, K, _ = W.shape
    xp = pad_images(x, pad)
    Ho, Wo = window_count(H, K, stride, pad), window_count(Wd, K, stride, pad)
    y = np.empty((N, F, Ho, Wo), dtype=x.dtype)
    for n in range(N):
        for f in range(F):
            for i in range(Ho):
                for j in range(Wo):
                    window = xp[n, :, i * stride:i * stride + K, j * stride:j * stride + K]
                    y[n, f, i, j] = np.sum(window * W[f]) + b[f]
    return y


def conv_backward(dy, x, W, stride, pad):
    """Pull form: each gradient element gathers the terms that touch it.

    db[f]          = Σ_{n,i,j} dy[n, f, i, j]
    dW[f, c, p, q] = Σ_{n,i,j} dy[n, f, i, j] · x_pad[n, c, i·s + p, j·s + q]
    dx_pad[n, c, h, w] = Σ_f Σ_{(i,j) whose window covers (h,w)} dy[n, f, i, j] · W[f, c, h − i·s, w − j·s]
    """
    N, C, H, Wd = x.shape
    F, _, K, _ = W.shape
    _, _, Ho, Wo = dy.shape
    xp = pad_images(x, pad)
    db = np.array([dy[:, f].sum() for f in range(F)], dtype=x.dtype)
    dW = np.empty_like(W)
    for f in range(F):
        for c in range(C):
            for p in range(K):
                for q in range(K):
                    inputs_seen = xp[:, c, p:p + stride * Ho:stride, q:q + stride * Wo:stride]
                    dW[f, c, p, q] = np.sum(dy[:, f] * inputs_seen)
    dxp = np.zeros_like(xp)
    for n in range(N):
        for h in range(xp.shape[2]):
            for w in range(xp.shape[3]):
                for i in _covering_windows(h, K, stride, Ho):
                    for j in _covering_windows(w, K, stride, Wo):
                        # all C input channels at once: Σ_f dy[n,f,i,j] · W[f, :, p, q]
                        dxp[n, :, h, w] += dy[n, :, i, j] @ W[:, :, h - i * stride, w - j * stride]
    dx = dxp[:, :, pad:pad + H, pad:pad + Wd]
    return dx, dW, db


def relu_forward(x):
    """y = max(x, 0)"""
    return np.maximum(x, 0)


def relu_backward(dy, y):
    """dx = dy where the unit was active (y > 0), else 0."""
    return dy * (y > 0)


def maxpool_forward(x, size, stride):
    """y[n, c, i, j] = max over the window; argmax keeps the winner's flat index h·W + w in the plane."""
    N, C, H, Wd = x.shape
    Ho, Wo = window_count(H, size, stride), window_count(Wd, size, stride)
    y = np.empty((N, C, Ho, Wo), dtype=x.dtype)
    argmax = np.empty((N, C, Ho, Wo), dtype=np.int64)
    for n in range(N):
        for c in range(C):
            for i in range(Ho):
                for j in range(Wo):
                    window = x[n, c, i * stride:i * stride + size, j * stride:j * stride + size]
                    p, q = divmod(int(np.argmax(window)), size)
                    y[n, c, i, j] = window[p, q]
                    argmax[n, c, i, j] = (i * stride + p) * Wd + (j * stride + q)
    return y, argmax


def maxpool_backward(dy, argmax, x_shape, size, stride):
    """Pull form: dx[n, c, h, w] = Σ over the windows covering (h, w) that (h, w) won, of dy.

    With overlapping windows (stride < size) one pixel can win several windows,
    so the sum really has more than one term.
    """
    N, C, H, Wd = x_shape
    _, _, Ho, Wo = dy.shape
    dx = np.zeros(x_shape, dtype=dy.dtype)
    for n in range(N):
        for c in range(C):
            for h in range(H):
                for w in range(Wd):
                    for i in _covering_windows(h, size, stride, Ho):
                        for j in _covering_windows(w, size, stride, Wo):
                            if argmax[n, c, i, j] == h * Wd + w:
                                dx[n, c, h, w] += dy[n, c, i, j]
    return dx


def dense_forward(x, W, b):
    """y[n] = W x[n] + b, one sample at a time."""
    y = np.empty((x.shape[0], W.shape[0]), dtype=x.dtype)
    for n in range(x.shape[0]):
        y[n] = W @ x[n] + b
    return y


def dense_backward(dy, x, W):
    """dW = Σ_n dy[n] x[n]ᵀ,  db = Σ_n dy[n],  dx[n] = Wᵀ dy[n]."""
    dW = np.zeros_like(W)
    db = np.zeros(W.shape[0], dtype=W.dtype)
    dx = np.empty_like(x)
    for n in range(x.shape[0]):
        dW += np.outer(dy[n], x[n])
        db += dy[n]
        dx[n] = W.T @ dy[n]
    return dx, dW, db


class LoopsStage(HostStage):
    name = "loops"
    summary = "pure numpy, explicit loops over batch, channels and positions (the reference)"
    ops = Ops(conv_forward, conv_backward, relu_forward, relu_backward,
              maxpool_forward, maxpool_backward, dense_forward, dense_backward)
