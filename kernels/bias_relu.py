"""Bias + ReLU after a convolution or a dense product, and their backward passes.

Reference: ``cnn.stages.s1_loops.relu_forward`` / ``relu_backward``, and the bias terms of
``conv_forward`` / ``dense_forward`` (db = Σ dy over everything but the channel axis).

An activation of shape (N, F, *rest) is handled as a flat vector: element k belongs to channel
f = (k // inner) mod F, where inner = the product of ``rest`` (Ho·Wo after a convolution,
1 after a dense layer). One kernel therefore serves both layer kinds.

Thread-to-data mapping:

- ``bias_relu_kernel``      thread k of y (in place):  y[k] ← max(y[k] + b[f], 0), or y[k] + b[f] when relu is False
- ``relu_forward_kernel``   thread k of y:             y[k] = max(x[k], 0)   (a ReLU with no bias before it)
- ``relu_backward_kernel``  thread k of dx:            dx[k] = dy[k] if y[k] > 0 else 0   (dx may be dy itself)
- ``bias_grad_kernel``      block f, thread t:         thread t sums the elements t, t + T, t + 2T, … of
  channel f over the batch, then the block adds its T partial sums (``reduction.block_sum``):
      db[f] = Σ_n Σ_r dz[n, f, r]
"""

from __future__ import annotations

import numpy as np

from kernels.device import cuda
from kernels.launch import REDUCE_THREADS, grid_1d, launch, reduction_threads
from kernels.reduction import block_sum


@cuda.jit
def bias_relu_kernel(y, b, inner, relu):
    k = cuda.grid(1)
    if k < y.size:
        value = y[k] + b[(k // inner) % b.size]
        if relu and value < 0:
            value = np.float32(0.0)
        y[k] = value


@cuda.jit
def relu_forward_kernel(x, y):
    k = cuda.grid(1)
    if k < y.size:
        y[k] = max(x[k], np.float32(0.0))


@cuda.jit
def relu_backward_kernel(dy, y, dx):
    k = cuda.grid(1)
    if k < dx.size:
        dx[k] = dy[k] if y[k] > 0 else np.float32(0.0)


@cuda.jit
def bias_grad_kernel(dz, db, inner):
    partial = cuda.shared.array(REDUCE_THREADS, np.float32)
    f, t = cuda.blockIdx.x, cuda.threadIdx.x
    channels = db.size
    per_channel = dz.size // channels            # N · inner elements belong to channel f
    total = np.float32(0.0)
    for m in range(t, per_channel, cuda.blockDim.x):
        n, r = m // inner, m % inner
        total += dz[(n * channels + f) * inner + r]
    partial[t] = total
    block_sum(partial, t)
    if t == 0:
        db[f] = partial[0]


def flat(array):
    """The same device memory seen as a 1-D vector (arrays here are C-contiguous)."""
    return array.reshape(array.size)


def bias_relu(y, b, relu, launch=launch):
    """In place on y (N, F, …): y ← y + b[f], then ReLU when ``relu``."""
    inner = y.size // (y.shape[0] * y.shape[1])
    launch(bias_relu_kernel, *grid_1d(y.size), flat(y), b, inner, relu)


def relu_forward(x, y, launch=launch):
    launch(relu_forward_kernel, *grid_1d(y.size), flat(x), flat(y))


def relu_backward(dy, y, dx, launch=launch):
    """dx ← dy masked by y > 0; dx may be the same array as dy."""
    launch(relu_backward_kernel, *grid_1d(dx.size), flat(dy), flat(y), flat(dx))


def bias_grad(dz, db, launch=launch):
    """db[f] ← Σ of dz (N, F, …) over every axis but the channel axis."""
    inner = dz.size // (dz.shape[0] * dz.shape[1])
    threads = reduction_threads(dz.shape[0] * inner)
    launch(bias_grad_kernel, db.size, threads, flat(dz), db, inner)
