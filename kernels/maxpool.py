"""Max-pooling over size×size windows every ``stride`` pixels, with its backward pass in both forms.

Reference: ``cnn.stages.s1_loops.maxpool_forward`` / ``maxpool_backward``. Shapes: x and dx
(N, C, H, W), y, dy and argmax (N, C, Ho, Wo). ``argmax`` (int32) holds the winner's flat index
h·W + w within its H×W plane; the first maximum in row-major window order wins a tie, as
``np.argmax`` does.

Thread-to-data mapping:

- ``maxpool_forward_kernel``        thread (n, c, i, j) of y: scans its window,
      y[n, c, i, j] = max_{p,q} x[n, c, i·s + p, j·s + q],  argmax[n, c, i, j] = where it was
- ``maxpool_backward_kernel``       pull: thread (n, c, h, w) of dx gathers from every window covering it
      dx[n, c, h, w] = Σ_{(i, j) covering (h, w), argmax[n, c, i, j] = h·W + w} dy[n, c, i, j]
- ``maxpool_backward_push_kernel``  push: thread (n, c, i, j) of dy adds dy[n, c, i, j] to its winner,
      dx[n, c, argmax] += dy[n, c, i, j]      (atomic: with overlapping windows, stride < size,
      one pixel can win several windows; dx must be zeroed first)
"""

from __future__ import annotations

import numpy as np

from kernels.device import cuda
from kernels.launch import covering_windows, grid_1d, launch, unravel4


@cuda.jit
def maxpool_forward_kernel(x, y, argmax, size, stride):
    index = cuda.grid(1)
    if index >= y.size:
        return
    n, c, i, j = unravel4(index, y.shape)
    width = x.shape[3]
    top, left = i * stride, j * stride
    best = x[n, c, top, left]
    best_at = top * width + left
    for p in range(size):
        for q in range(size):
            value = x[n, c, top + p, left + q]
            if value > best:
                best = value
                best_at = (top + p) * width + left + q
    y[n, c, i, j] = best
    argmax[n, c, i, j] = best_at


@cuda.jit
def maxpool_backward_kernel(dy, argmax, dx, size, stride):
    index = cuda.grid(1)
    if index >= dx.size:
        return
    n, c, h, w = unravel4(index, dx.shape)
    me = h * dx.shape[3] + w
    i_first, i_last = covering_windows(h, size, stride, dy.shape[2])
    j_first, j_last = covering_windows(w, size, stride, dy.shape[3])
    total = np.float32(0.0)
    for i in range(i_first, i_last + 1):
        for j in range(j_first, j_last + 1):
            if argmax[n, c, i, j] == me:
                total += dy[n, c, i, j]
    dx[n, c, h, w] = total


@cuda.jit
def maxpool_backward_push_kernel(dy, argmax, dx):
    index = cuda.grid(1)
    if index >= dy.size:
        return
    n, c, i, j = unravel4(index, dy.shape)
    winner = argmax[n, c, i, j]
    width = dx.shape[3]
    cuda.atomic.add(dx, (n, c, winner // width, winner % width), dy[n, c, i, j])


def maxpool_forward(x, y, argmax, size, stride, launch=launch):
    launch(maxpool_forward_kernel, *grid_1d(y.size), x, y, argmax, size, stride)


def maxpool_backward(dy, argmax, dx, size, stride, launch=launch):
    """Pull form: dx is fully written, no zeroing needed."""
    launch(maxpool_backward_kernel, *grid_1d(dx.size), dy, argmax, dx, size, stride)


def maxpool_backward_push(dy, argmax, dx, launch=launch):
    """Push form: dx must hold zeros before the call."""
    launch(maxpool_backward_push_kernel, *grid_1d(dy.size), dy, argmax, dx)
