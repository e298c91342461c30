"""Convolution backward in push (scatter) form: each upstream gradient element pushes its contributions.

Reference: ``cnn.stages.s1_loops.conv_backward`` (same result as the pull kernels of ``conv2d``).
Shapes as in ``conv2d``: x, dx (N, C, H, W); w, dw (F, C, K, K); dy (N, F, Ho, Wo).

Thread-to-data mapping: thread (n, f, i, j) owns ONE element g = dy[n, f, i, j] and adds what it
contributes to every gradient it touches:

    db[f]                                     += g
    dw[f, c, p, q]                            += g · x[n, c, i·s + p − pad, j·s + q − pad]
    dx[n, c, i·s + p − pad, j·s + q − pad]    += g · w[f, c, p, q]          (for every c, p, q)

Threads collide: every thread of filter f adds into the same db[f] and the same C·K·K weights
(N·Ho·Wo writers per address), and neighbouring windows share input pixels whenever the kernel
is larger than the stride. Every add is therefore ``cuda.atomic.add``, and dx, dw, db must hold
zeros before the launch. Float atomics land in whatever order the hardware runs them, so
results match the pull form to rounding, not bit for bit.

``push_conv_gradient`` is the per-thread body; the fused conv+ReLU+pool backward
(``conv_pool_fused``) calls it for each pooling window's winner.
"""

from __future__ import annotations

from kernels.device import cuda
from kernels.launch import grid_1d, launch, unravel4


@cuda.jit(device=True)
def push_conv_gradient(g, n, f, i, j, x, w, dx, dw, stride, pad, with_dx):
    """Atomically add g's share to dw[f] and, when ``with_dx``, to dx[n] (db is the caller's)."""
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    kernel = w.shape[2]
    top = i * stride - pad
    left = j * stride - pad
    for c in range(channels):
        for p in range(kernel):
            h = top + p
            if 0 <= h < height:
                for q in range(kernel):
                    col = left + q
                    if 0 <= col < width:
                        cuda.atomic.add(dw, (f, c, p, q), g * x[n, c, h, col])
                        if with_dx:
                            cuda.atomic.add(dx, (n, c, h, col), g * w[f, c, p, q])


@cuda.jit
def conv2d_backward_push_kernel(dy, x, w, dx, dw, db, stride, pad):
    index = cuda.grid(1)
    if index >= dy.size:
        return
    n, f, i, j = unravel4(index, dy.shape)
    g = dy[n, f, i, j]
    cuda.atomic.add(db, f, g)
    push_conv_gradient(g, n, f, i, j, x, w, dx, dw, stride, pad, True)


def conv2d_backward_push(dy, x, w, dx, dw, db, stride, pad, launch=launch):
    """dx, dw, db ← the gradients of a convolution; all three must hold zeros before the call."""
    launch(conv2d_backward_push_kernel, *grid_1d(dy.size), dy, x, w, dx, dw, db, stride, pad)
