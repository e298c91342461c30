"""Max-pooling on the CPU, compiled: one plane pooled (with bias and ReLU folded in), its backward, and the standalone kernels.

``pool_plane`` and ``unpool_plane`` are what the fused conv kernels (``conv_pool.py``) pool and
unpool with; ``maxpool_kernel`` and ``maxpool_backward_kernel`` run them over every plane for a
max-pool that is not fused into a convolution.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def first_max_of_four(v0, v1, v2, v3, top, width, bias, relu):
    """A 2×2 window's pooled value (its maximum + bias, then ReLU if ``relu``) and its switch, the position of
    its first maximum: the values in window order (0,0), (0,1), (1,0), (1,1), the window's corner (0, 0) at
    position ``top`` of a plane ``width`` wide. Selects, not branches: random data mispredicts half of them."""
    best, winner = v0, top
    winner = top + 1 if v1 > best else winner
    best = v1 if v1 > best else best
    winner = top + width if v2 > best else winner
    best = v2 if v2 > best else best
    winner = top + width + 1 if v3 > best else winner
    best = (v3 if v3 > best else best) + bias
    return (max(best, 0) if relu else best), winner


@njit(cache=True)
def _pool_plane_2x2(z, row_step, col_step, plane_width, bias, relu, out, switch):
    """``pool_plane`` for the common 2×2 windows every 2 pixels: the four values read at once, pooled by
    ``first_max_of_four``. The offsets are unsigned: Numba adds no wraparound for a negative index to
    each read (four per window). Without them, and with the switch taken straight from the window's corner
    position, this kernel measured 1.6x faster."""
    Hq, Wq = out.shape
    rows, cols = np.uint64(row_step), np.uint64(col_step)
    for i in range(Hq):
        for j in range(Wq):
            at = np.uint64(2 * i) * rows + np.uint64(2 * j) * cols
            out[i, j], switch[i, j] = first_max_of_four(z[at], z[at + cols], z[at + rows], z[at + rows + cols],
                                                        2 * i * plane_width + 2 * j, plane_width, bias, relu)


@njit(cache=True)
def pool_plane(z, row_step, col_step, plane_width, bias, relu, size, stride, out, switch):
    """Max-pool one plane into ``out``, adding ``bias`` and, if ``relu``, ReLU. Element (h, w) of
    the plane is z[h·row_step + w·col_step] (a conv of stride s reads every s-th stride-1 output).

    out[i, j]    = max_{h,w in window (i, j)} plane[h, w] + bias        (then max(·, 0) if relu)
    switch[i, j] = h·plane_width + w of the first maximum (the tie rule of np.argmax)

    max(z) + b = max(z + b) and ReLU(max) = max(ReLU): the order of the three does not matter.
    """
    if size == 2 and stride == 2:
        return _pool_plane_2x2(z, row_step, col_step, plane_width, bias, relu, out, switch)
    Hq, Wq = out.shape
    for i in range(Hq):
        for j in range(Wq):
            top, left = i * stride, j * stride
            best, winner = z[top * row_step + left * col_step], top * plane_width + left
            for h in range(top, top + size):
                for w in range(left, left + size):
                    value = z[h * row_step + w * col_step]
                    greater = value > best          # written as selects, not a branch: random data
                    best = value if greater else best       # would mispredict half the time
                    winner = h * plane_width + w if greater else winner
            best += bias
            out[i, j] = best if best > 0 or not relu else 0
            switch[i, j] = winner


@njit(cache=True)
def gradient_reaching(dout, out, relu, at):
    """The gradient that pooled output ``at`` (an index: (i, j) in a plane, (f, i, j) in a sample) passes back:
    dout[at], or 0 where its ReLU passed nothing."""
    g = dout[at]
    if relu:
        g = g if out[at] > 0 else 0        # a select, not a branch: random data would mispredict
    return g


@njit(cache=True)
def _switch_row(winner, top, size, plane_width):
    """The row of position ``winner`` (= h·plane_width + w) in a window whose rows start at ``top``, without a
    division (an integer division costs ~20 cycles; there are size − 1 compares)."""
    h = top
    for r in range(1, size):
        h += 1 if winner >= (top + r) * plane_width else 0
    return h


@njit(cache=True)
def unpool_plane(dout, out, switch, relu, pool_size, pool_stride, plane_width, row_step, col_step, dz):
    """Add into dz the gradient arriving at a plane before ReLU and pooling (element (h, w) of the
    plane is dz[h·row_step + w·col_step]); return its sum, the bias gradient of a conv's plane.

    pooled (pool_size > 0):  plane[switch[i, j]] += dout[i, j]   (a pixel winning overlapping windows
                             gets each one's share)
    else:                    plane[i, j] += dout[i, j]
    relu:                    only where the output was positive (out > 0).
    """
    total = dz.dtype.type(0)
    Hq, Wq = dout.shape
    rows, cols = np.uint64(row_step), np.uint64(col_step)
    for i in range(Hq):
        for j in range(Wq):
            grad = gradient_reaching(dout, out, relu, (i, j))
            h, w = i, j
            if pool_size > 0:
                h = _switch_row(switch[i, j], i * pool_stride, pool_size, plane_width)
                w = switch[i, j] - h * plane_width
            dz[np.uint64(h) * rows + np.uint64(w) * cols] += grad
            total += grad
    return total


@njit(cache=True)
def maxpool_kernel(x, size, stride, out, switch):
    """Max-pool every (sample, channel) plane (used only where a pool is not fused into a conv).

    One thread: the pass is memory-bound and cheap next to a convolution, and a parallel
    kernel costs seconds more to compile.
    """
    N, C, H, W = x.shape
    for item in range(N * C):
        n, c = item // C, item % C
        pool_plane(x[n, c].reshape(H * W), W, 1, W, x.dtype.type(0), False, size, stride, out[n, c], switch[n, c])


@njit(cache=True)
def maxpool_backward_kernel(dout, switch, size, stride, dx):
    """dx[n, c, switch] += dout, plane by plane (one thread, as ``maxpool_kernel``)."""
    N, C, H, W = dx.shape
    for item in range(N * C):
        n, c = item // C, item % C
        plane = dx[n, c].reshape(H * W)
        plane[:] = 0
        unpool_plane(dout[n, c], dout[n, c], switch[n, c], False, size, stride, W, W, 1, plane)
