"""Convolution + bias + ReLU + max-pool in ONE kernel, and its backward pass in push form.

Reference: ``cnn.stages.s1_loops`` applied in sequence — ``conv_forward`` → ``relu_forward`` →
``maxpool_forward`` (and back: ``maxpool_backward`` → ``relu_backward`` → ``conv_backward``).
Shapes: x (N, C, H, W), w (F, C, K, K), b (F,); the convolution output (N, F, Hc, Wc) exists
only in registers; y and switches are (N, F, Hp, Wp), pooled with ``size`` × ``size`` windows
every ``pool_stride`` conv outputs (any size and stride, overlapping or not).

Thread-to-data mapping:

- ``conv_relu_pool_forward_kernel``  thread (n, f, i, j) of the POOLED output: for each position
  (ci, cj) = (i·ps + pi, j·ps + pj) of its pooling window it computes the convolution there
  (``conv2d.conv_window_sum``), adds b[f], applies the ReLU, and keeps the running maximum:
      y[n, f, i, j] = max_{pi,pj} ReLU(conv(x, w)[n, f, ci, cj] + b[f])
      switches[n, f, i, j] = ci·Wc + cj of the winner (first maximum wins a tie, as in stage 4)
  Only y and the switches reach global memory. When pooling windows overlap (ps < size) a conv
  output is recomputed by every window that contains it: compute traded for memory traffic.
- ``conv_relu_pool_backward_push_kernel``  thread (n, f, i, j) of the pooled gradient dy: the
  gradient flows only to its window's winner, and only if the ReLU was active there (y > 0):
      db[f] += g,   then ``conv2d_push.push_conv_gradient`` adds g·x to dw[f] and g·w to dx[n]
  with atomics (dx skipped for the network's first layer). Two pooled outputs can share a
  winner (overlapping pools) and neighbouring windows share inputs (kernel > stride): the
  atomics make those collisions add up. dx, dw and db must hold zeros before the launch.
"""

from __future__ import annotations

import numpy as np

from kernels.conv2d import conv_window_sum
from kernels.conv2d_push import push_conv_gradient
from kernels.device import cuda
from kernels.launch import grid_1d, launch, unravel4


@cuda.jit(device=True)
def relu_pool_window(x, w, bias, n, f, i, j, stride, pad, size, pool_stride, conv_width):
    """(max, where) of ReLU(conv(x, w)[n, f] + bias) over pooling window (i, j): one forward thread's work.

    Filter f of ``w`` is used; stage 7 passes a shared-memory copy of one filter (f = 0).
    """
    best = np.float32(-1.0)           # below any ReLU output, so the first window position always wins
    best_at = 0
    for pi in range(size):
        ci = i * pool_stride + pi
        for pj in range(size):
            cj = j * pool_stride + pj
            value = max(conv_window_sum(x, w, n, f, ci, cj, stride, pad) + bias, np.float32(0.0))
            if value > best:
                best = value
                best_at = ci * conv_width + cj
    return best, best_at


@cuda.jit
def conv_relu_pool_forward_kernel(x, w, b, y, switches, stride, pad, size, pool_stride, conv_width):
    index = cuda.grid(1)
    if index >= y.size:
        return
    n, f, i, j = unravel4(index, y.shape)
    best, best_at = relu_pool_window(x, w, b[f], n, f, i, j, stride, pad, size, pool_stride, conv_width)
    y[n, f, i, j] = best
    switches[n, f, i, j] = best_at


@cuda.jit
def conv_relu_pool_backward_push_kernel(dy, y, switches, x, w, dx, dw, db, stride, pad, conv_width, with_dx):
    index = cuda.grid(1)
    if index >= dy.size:
        return
    n, f, i, j = unravel4(index, dy.shape)
    if y[n, f, i, j] <= 0:            # ReLU inactive at the winner: nothing flows back
        return
    g = dy[n, f, i, j]
    winner = switches[n, f, i, j]
    cuda.atomic.add(db, f, g)
    push_conv_gradient(g, n, f, winner // conv_width, winner % conv_width, x, w, dx, dw, stride, pad, with_dx)


def conv_relu_pool_forward(x, w, b, y, switches, stride, pad, size, pool_stride, conv_width, launch=launch):
    """y, switches ← maxpool(ReLU(conv(x, w) + b)); ``conv_width`` = Wc, the width of the unstored conv output."""
    launch(conv_relu_pool_forward_kernel, *grid_1d(y.size),
           x, w, b, y, switches, stride, pad, size, pool_stride, conv_width)


def conv_relu_pool_backward_push(dy, y, switches, x, w, dx, dw, db, stride, pad, conv_width, with_dx=True,
                                 launch=launch):
    """dw, db (and dx when ``with_dx``) ← gradients of the fused block; they must hold zeros before the call."""
    launch(conv_relu_pool_backward_push_kernel, *grid_1d(dy.size),
           dy, y, switches, x, w, dx, dw, db, stride, pad, conv_width, with_dx)
