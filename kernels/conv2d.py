"""Direct 2-D convolution on NCHW batches: forward, and backward in pull (gather) form.

Reference (what the tests compare with): ``cnn.stages.s1_loops.conv_forward`` / ``conv_backward``
(and the im2col version in ``cnn.stages.s2_numpy``). Shapes: x (N, C, H, W), w (F, C, K, K),
y and dy (N, F, Ho, Wo), stride s, zero padding ``pad``. The bias is not added here: the
``bias_relu`` kernel adds it (and the ReLU) in the same pass over y.

Thread-to-data mapping — one thread per element of the array being *written*, found from its
flat index by ``unravel4``; each thread reads everything it needs and writes once (no atomics):

- ``conv2d_forward_kernel``          thread (n, f, i, j) of y:
      y[n, f, i, j] = Σ_{c,p,q} w[f, c, p, q] · x[n, c, i·s + p − pad, j·s + q − pad]
- ``conv2d_backward_data_kernel``    thread (n, c, h, w) of dx:
      dx[n, c, h, w] = Σ_f Σ_{(i, j) whose window covers (h, w)} dy[n, f, i, j] · w[f, c, h + pad − i·s, w + pad − j·s]
- ``conv2d_backward_filter_kernel``  thread (f, c, p, q) of dw:
      dw[f, c, p, q] = Σ_{n,i,j} dy[n, f, i, j] · x[n, c, i·s + p − pad, j·s + q − pad]

Taps that fall in the zero padding are skipped rather than read from a padded copy.
The pull form pays in redundant reads: each dy element is read by C·K·K filter-gradient
threads and by every input pixel under its window. ``conv2d_push`` is the scatter alternative.
"""

from __future__ import annotations

import numpy as np

from kernels.device import cuda
from kernels.launch import covering_windows, grid_1d, launch, unravel4


@cuda.jit(device=True)
def conv_window_sum(x, w, n, f, i, j, stride, pad):
    """Σ_{c,p,q} w[f, c, p, q] · x[n, c, i·s + p − pad, j·s + q − pad]: one output of the convolution, without bias."""
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    kernel = w.shape[2]
    top = i * stride - pad
    left = j * stride - pad
    total = np.float32(0.0)
    for c in range(channels):
        for p in range(kernel):
            h = top + p
            if 0 <= h < height:
                for q in range(kernel):
                    col = left + q
                    if 0 <= col < width:
                        total += w[f, c, p, q] * x[n, c, h, col]
    return total


@cuda.jit
def conv2d_forward_kernel(x, w, y, stride, pad):
    index = cuda.grid(1)
    if index < y.size:
        n, f, i, j = unravel4(index, y.shape)
        y[n, f, i, j] = conv_window_sum(x, w, n, f, i, j, stride, pad)


@cuda.jit
def conv2d_backward_data_kernel(dy, w, dx, stride, pad):
    index = cuda.grid(1)
    if index >= dx.size:
        return
    n, c, h, col = unravel4(index, dx.shape)
    filters, out_h, out_w = dy.shape[1], dy.shape[2], dy.shape[3]
    kernel = w.shape[2]
    i_first, i_last = covering_windows(h + pad, kernel, stride, out_h)
    j_first, j_last = covering_windows(col + pad, kernel, stride, out_w)
    total = np.float32(0.0)
    for f in range(filters):
        for i in range(i_first, i_last + 1):
            p = h + pad - i * stride
            for j in range(j_first, j_last + 1):
                total += dy[n, f, i, j] * w[f, c, p, col + pad - j * stride]
    dx[n, c, h, col] = total


@cuda.jit
def conv2d_backward_filter_kernel(dy, x, dw, stride, pad):
    index = cuda.grid(1)
    if index >= dw.size:
        return
    f, c, p, q = unravel4(index, dw.shape)
    batch, out_h, out_w = dy.shape[0], dy.shape[2], dy.shape[3]
    height, width = x.shape[2], x.shape[3]
    total = np.float32(0.0)
    for n in range(batch):
        for i in range(out_h):
            h = i * stride + p - pad
            if 0 <= h < height:
                for j in range(out_w):
                    col = j * stride + q - pad
                    if 0 <= col < width:
                        total += dy[n, f, i, j] * x[n, c, h, col]
    dw[f, c, p, q] = total


def conv2d_forward(x, w, y, stride, pad, launch=launch):
    """y ← conv(x, w) on device arrays (no bias)."""
    launch(conv2d_forward_kernel, *grid_1d(y.size), x, w, y, stride, pad)


def conv2d_backward_data(dy, w, dx, stride, pad, launch=launch):
    """dx ← dL/dx, one thread per element of dx."""
    launch(conv2d_backward_data_kernel, *grid_1d(dx.size), dy, w, dx, stride, pad)


def conv2d_backward_filter(dy, x, dw, stride, pad, launch=launch):
    """dw ← dL/dw, one thread per weight."""
    launch(conv2d_backward_filter_kernel, *grid_1d(dw.size), dy, x, dw, stride, pad)
