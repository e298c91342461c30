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
def pool_plane(z, first, row_step, col_step, plane_width, bias, relu, size, stride, out, switch, n, f):
    """Max-pool one plane into out[n, f], adding ``bias`` and, if ``relu``, ReLU. Element (h, w) of the
    plane is z[first + h·row_step + w·col_step] (z flat; a conv of stride s reads every s-th stride-1 output).

    out[n, f, i, j]    = max_{h,w in window (i, j)} plane[h, w] + bias        (then max(·, 0) if relu)
    switch[n, f, i, j] = h·plane_width + w of the first maximum (the tie rule of np.argmax)

    max(z) + b = max(z + b) and ReLU(max) = max(ReLU): the order of the three does not matter.

    What keeps it fast, each measured:
    - the common 2×2 windows every 2 pixels read their four values at once (``first_max_of_four``) at
      unsigned offsets: Numba adds no wraparound for a negative index to each read (1.6x faster with the
      switch taken straight from the window's corner position);
    - the plane comes as (array, first) and the output as (arrays, n, f), not as views, and no array is
      handed on to another compiled function: Numba counts the references to an array's memory; a view
      made for a call costs an atomic increment and decrement, and so does each array argument that a
      function passes on (see ``layout.add_runs``) — here, a call for every plane of every sample.
    """
    Hq, Wq = out.shape[2], out.shape[3]
    if size == 2 and stride == 2:
        rows, cols = np.uint64(row_step), np.uint64(col_step)
        for i in range(Hq):
            for j in range(Wq):
                at = np.uint64(first) + np.uint64(2 * i) * rows + np.uint64(2 * j) * cols
                out[n, f, i, j], switch[n, f, i, j] = first_max_of_four(
                    z[at], z[at + cols], z[at + rows], z[at + rows + cols], 2 * i * plane_width + 2 * j, plane_width,
                    bias, relu)
        return
    for i in range(Hq):
        for j in range(Wq):
            top, left = i * stride, j * stride
            best, winner = z[first + top * row_step + left * col_step], top * plane_width + left
            for h in range(top, top + size):
                for w in range(left, left + size):
                    value = z[first + h * row_step + w * col_step]
                    greater = value > best          # written as selects, not a branch: random data
                    best = value if greater else best       # would mispredict half the time
                    winner = h * plane_width + w if greater else winner
            best += bias
            out[n, f, i, j] = best if best > 0 or not relu else 0
            switch[n, f, i, j] = winner


@njit(cache=True)
def gradient_reaching(grad, output, relu):
    """The gradient that a pooled output passes back, given the gradient ``grad`` arriving at it and its value
    ``output``: grad, or 0 where its ReLU passed nothing. Numbers, not arrays: see ``pool_plane``."""
    return grad if output > 0 or not relu else 0       # a select, not a branch: random data would mispredict


@njit(cache=True)
def _switch_row(winner, top, size, plane_width):
    """The row of position ``winner`` (= h·plane_width + w) in a window whose rows start at ``top``, without a
    division (an integer division costs ~20 cycles; there are size − 1 compares)."""
    h = top
    for r in range(1, size):
        h += 1 if winner >= (top + r) * plane_width else 0
    return h


@njit(cache=True)
def unpool_plane(dout, out, switch, n, f, relu, pool_size, pool_stride, plane_width, dz, first, row_step, col_step):
    """Add into dz the gradient arriving at plane (n, f) before ReLU and pooling (element (h, w) of the
    plane is dz[first + h·row_step + w·col_step], dz flat); return its sum, the bias gradient of a conv's plane.

    pooled (pool_size > 0):  plane[switch[n, f, i, j]] += dout[n, f, i, j]   (a pixel winning overlapping
                             windows gets each one's share)
    else:                    plane[i, j] += dout[n, f, i, j]
    relu:                    only where the output was positive (out > 0).
    Arrays and indices, not views, as in ``pool_plane``.
    """
    total = dz.dtype.type(0)
    Hq, Wq = dout.shape[2], dout.shape[3]
    rows, cols = np.uint64(row_step), np.uint64(col_step)
    for i in range(Hq):
        for j in range(Wq):
            grad = gradient_reaching(dout[n, f, i, j], out[n, f, i, j], relu)
            h, w = i, j
            if pool_size > 0:
                h = _switch_row(switch[n, f, i, j], i * pool_stride, pool_size, plane_width)
                w = switch[n, f, i, j] - h * plane_width
            dz[np.uint64(first) + np.uint64(h) * rows + np.uint64(w) * cols] += grad
            total += grad
    return total


@njit(cache=True)
def maxpool_kernel(x, size, stride, out, switch):
    """Max-pool every (sample, channel) plane (used only where a pool is not fused into a conv).

    One thread: the pass is memory-bound and cheap next to a convolution, and a parallel
    kernel costs seconds more to compile.
    """
    N, C, H, W = x.shape
    planes = x.reshape(x.size)
    for item in range(N * C):
        pool_plane(planes, item * H * W, W, 1, W, x.dtype.type(0), False, size, stride, out, switch, item // C, item % C)


@njit(cache=True)
def maxpool_backward_kernel(dout, switch, size, stride, dx):
    """dx[n, c, switch] += dout, plane by plane (one thread, as ``maxpool_kernel``)."""
    N, C, H, W = dx.shape
    planes = dx.reshape(dx.size)
    planes[:] = 0
    for item in range(N * C):
        unpool_plane(dout, dout, switch, item // C, item % C, False, size, stride, W, planes, item * H * W, W, 1)
