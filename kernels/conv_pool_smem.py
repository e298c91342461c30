"""Stage 5's fused conv + bias + ReLU + max-pool with the block's filter in shared memory (``smem-weights``).

Reference: ``kernels.conv_pool_fused`` (same results; its docstring has the maths). What changes
is which thread works on what, so that a block can share one filter:

- The grid is (⌈N·Hp·Wp / T⌉, F): ``blockIdx.y`` is the filter f; thread index
  r = blockIdx.x·T + threadIdx.x runs over the pooled positions (n, i, j) of that filter.
- forward: the block's T threads first copy W[f] (C·K·K floats) into a shared-memory tile —
  each weight is read from global memory once per block instead of once per thread and window
  position (4·C·K² reads a thread for 2 × 2 pools) — then each computes its pooled output with
  ``conv_pool_fused.relu_pool_window`` reading the tile.
- backward (push): the block accumulates dW[f] and db[f] in shared memory first — ``cuda.atomic.add``
  on shared memory, among the block's own T threads — and adds the block's totals to global
  memory once at the end: C·K² + 1 global atomics a block instead of up to C·K² + 1 a THREAD.
  That is the contention stage 5's docstring measures (N·Hp·Wp writers on each dW address,
  32 768 for AlexNet-small conv1 at batch 128) divided by T. dX still goes straight to global
  memory with atomics (threads of different filters share input pixels).

The tiles are (1, C, K, K) arrays, so stage 5's device functions (``relu_pool_window``,
``conv2d_push.push_conv_gradient``) run on them unchanged with filter index 0. Shared arrays need
shapes known at compile time: ``smem_kernels(C, K)`` compiles one pair of kernels per layer
shape. ``fits(C, K)`` says whether both tiles fit in ``MAX_TAPS`` floats each (8 KiB);
larger layers keep stage 5's kernels.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kernels.conv2d_push import push_conv_gradient
from kernels.conv_pool_fused import relu_pool_window
from kernels.device import cuda
from kernels.launch import blocks_for, launch

MAX_TAPS = 2048


def fits(channels: int, kernel: int) -> bool:
    return channels * kernel * kernel <= MAX_TAPS


@cuda.jit(device=True)
def unravel3(index, a_size, b_size, c_size):
    """(a, b, c) of flat C-order ``index`` in an a_size × b_size × c_size array."""
    c = index % c_size
    index //= c_size
    return index // b_size, index % b_size, c


@cuda.jit(device=True)
def tap(index, kernel):
    """(c, p, q) of the weight at flat ``index`` of one C × K × K filter."""
    q = index % kernel
    index //= kernel
    return index // kernel, index % kernel, q


@lru_cache(maxsize=None)
def smem_kernels(channels: int, kernel: int):
    """(forward, backward) kernels for filters of C = ``channels`` × K × K = ``kernel`` (compiled once per shape)."""
    shape = (1, channels, kernel, kernel)
    taps = channels * kernel * kernel

    @cuda.jit
    def conv_relu_pool_forward_smem_kernel(x, w, b, y, switches, stride, pad, size, pool_stride, conv_width):
        w_tile = cuda.shared.array(shape, np.float32)
        f, t = cuda.blockIdx.y, cuda.threadIdx.x
        for k in range(t, taps, cuda.blockDim.x):
            c, p, q = tap(k, kernel)
            w_tile[0, c, p, q] = w[f, c, p, q]
        cuda.syncthreads()                               # the filter is in shared memory
        r = cuda.blockIdx.x * cuda.blockDim.x + t
        if r < y.shape[0] * y.shape[2] * y.shape[3]:
            n, i, j = unravel3(r, y.shape[0], y.shape[2], y.shape[3])
            best, best_at = relu_pool_window(x, w_tile, b[f], n, 0, i, j, stride, pad, size, pool_stride, conv_width)
            y[n, f, i, j] = best
            switches[n, f, i, j] = best_at

    @cuda.jit
    def conv_relu_pool_backward_smem_kernel(dy, y, switches, x, w, dx, dw, db, stride, pad, conv_width, with_dx):
        w_tile = cuda.shared.array(shape, np.float32)
        dw_tile = cuda.shared.array(shape, np.float32)
        db_total = cuda.shared.array(1, np.float32)
        f, t = cuda.blockIdx.y, cuda.threadIdx.x
        for k in range(t, taps, cuda.blockDim.x):
            c, p, q = tap(k, kernel)
            w_tile[0, c, p, q] = w[f, c, p, q]
            dw_tile[0, c, p, q] = np.float32(0.0)
        if t == 0:
            db_total[0] = np.float32(0.0)
        cuda.syncthreads()                               # filter loaded, block sums zeroed
        r = cuda.blockIdx.x * cuda.blockDim.x + t
        if r < dy.shape[0] * dy.shape[2] * dy.shape[3]:
            n, i, j = unravel3(r, dy.shape[0], dy.shape[2], dy.shape[3])
            if y[n, f, i, j] > 0:                        # the ReLU was active at the winner
                g = dy[n, f, i, j]
                winner = switches[n, f, i, j]
                cuda.atomic.add(db_total, 0, g)
                push_conv_gradient(g, n, 0, winner // conv_width, winner % conv_width,
                                   x, w_tile, dx, dw_tile, stride, pad, with_dx)
        cuda.syncthreads()                               # every thread's share is in the block sums
        for k in range(t, taps, cuda.blockDim.x):
            c, p, q = tap(k, kernel)
            cuda.atomic.add(dw, (f, c, p, q), dw_tile[0, c, p, q])
        if t == 0:
            cuda.atomic.add(db, f, db_total[0])

    return conv_relu_pool_forward_smem_kernel, conv_relu_pool_backward_smem_kernel


def filter_grid(per_filter: int, filters: int, threads: int):
    """((blocks over the pooled positions, filters), threads)."""
    return (blocks_for(per_filter, threads), filters), threads


def conv_relu_pool_forward_smem(x, w, b, y, switches, stride, pad, size, pool_stride, conv_width, threads=128,
                                launch=launch):
    """y, switches ← maxpool(ReLU(conv(x, w) + b)), as ``conv_pool_fused.conv_relu_pool_forward``."""
    forward, _ = smem_kernels(w.shape[1], w.shape[2])
    launch(forward, *filter_grid(y.shape[0] * y.shape[2] * y.shape[3], w.shape[0], threads),
           x, w, b, y, switches, stride, pad, size, pool_stride, conv_width)


def conv_relu_pool_backward_smem(dy, y, switches, x, w, dx, dw, db, stride, pad, conv_width, with_dx=True,
                                 threads=128, launch=launch):
    """dw, db (and dx when ``with_dx``) += the block's gradients; all must hold zeros before the call."""
    _, backward = smem_kernels(w.shape[1], w.shape[2])
    launch(backward, *filter_grid(dy.shape[0] * dy.shape[2] * dy.shape[3], w.shape[0], threads),
           dy, y, switches, x, w, dx, dw, db, stride, pad, conv_width, with_dx)
