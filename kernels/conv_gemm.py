"""Conv + bias + ReLU + max-pool, forward and backward, as tiled implicit matrix products — no atomics.

Reference: ``cnn.stages.s1_loops`` (conv, relu, maxpool, in sequence), as for ``conv_pool_fused``.
Shapes: x (N, C, H, W), w (F, C, K, K), b (F,); conv output (N, F, Hc, Wc), pooled y and
switches (N, F, Hp, Wp) with S × S windows every PS conv outputs. With T = C·K·K taps, every
pass is one product of ``kernels/implicit_gemm.py`` with its own loaders (nothing is im2col'ed):

    forward   Z[f, pos] = Σ_t W[f, t] · X[t, pos]          F × (N·Hc·Wc), over T
              A = the filters seen as an F × T matrix; B[t, pos] = x at tap t of position pos.
              The columns are numbered so that the TN = S·S registers of one thread hold the S × S
              positions of ONE pooling window: the epilogue adds b[f], applies the ReLU and keeps
              the max and where it was, in registers. Z itself is never stored.
    dZ        dz[n, f, ci, cj] = Σ dy[n, f, i, j] over the pooled windows (i, j) whose winner is
              (ci, cj) and whose ReLU was active (y > 0): one thread per element of dz, pulling
              (``relu_pool_backward``) — the scatter of stage 5 turned into a gather.
    dW, db    G[f, t] = Σ_pos dZ[f, pos] · X[t, pos]       F × (T + 1), over N·Hc·Wc
              B has one more column of ones: G[f, T] = Σ_pos dZ[f, pos] = db[f]. The sum over
              positions is long and the output small, so it is split over ``splits`` blocks along
              k (split-K); ``sum_splits_kernel`` adds the partial tiles up, one thread an output,
              in a fixed order.
    dX        dX[c, (n,h,w)] = Σ_(f,p,q) W[f, c, p, q] · dz[n, f, (h + pad − p)/s, (w + pad − q)/s]
              C × (N·H·W), over F·K·K; terms whose division by s is not exact, or that fall
              outside dz, are 0. Each element of dX is computed by one thread: a pull.

Addresses without divisions. Every loader reads a flat view of its array at (a part that depends
on its row or column only, computed once a thread by ``*_setup`` — the only divisions, outside
every loop) + (a part that depends on k only, read from a table made once a layer on the host,
``conv_tables``): the loop over k does a table read, an add and a few compares for the padding. The
layer's sizes reach the kernels as one small int32 array (``ConvTables.geometry``, read as
``g[FILTERS]``…), not as a named tuple of 14 numbers: numba-cuda types every number of a tuple argument
at every launch, which the calibrated prediction put at ~18 µs of host time each. The
static report (``python -m cnn bench --static cuda-tuned``) counts the integer divisions inside
loops of each compiled kernel: none, where the loaders of commit ecf7081 did 3-5 per element of B
and the H100 measured them at 10-12 % of its SM throughput.

Every output element is written by exactly one thread, and every sum is taken in an order fixed by
the tiles, so the results are the same bit for bit from run to run (stage 5's atomics are not).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import float32, uint32

from kernels.conv_pool_smem import tap, unravel3
from kernels.device import cuda
from kernels.implicit_gemm import Tiles, gemm, split_k, store_partial
from kernels.launch import covering_windows, grid_1d, launch, unravel4
from kernels.launch_config import multiprocessors

WEIGHT_GRAD_TN = 4           # TN of the dW and dX products (the forward's is the pooling window, S·S)


class ConvGeometry(NamedTuple):
    """Every size the kernels need, computed once on the host (kernels read it as a named tuple)."""

    batch: int
    channels: int
    height: int
    width: int
    filters: int
    kernel: int
    stride: int
    pad: int
    conv_h: int
    conv_w: int
    pool: int
    pool_stride: int
    pooled_h: int
    pooled_w: int

    @classmethod
    def of(cls, x_shape, w_shape, stride, pad, pool, pool_stride) -> "ConvGeometry":
        batch, channels, height, width = x_shape
        filters, _, kernel, _ = w_shape
        conv_h, conv_w = (height + 2 * pad - kernel) // stride + 1, (width + 2 * pad - kernel) // stride + 1
        pooled_h, pooled_w = (conv_h - pool) // pool_stride + 1, (conv_w - pool) // pool_stride + 1
        return cls(batch, channels, height, width, filters, kernel, stride, pad, conv_h, conv_w,
                   pool, pool_stride, pooled_h, pooled_w)

    @property
    def taps(self) -> int:
        return self.channels * self.kernel * self.kernel

    @property
    def positions(self) -> int:
        return self.batch * self.conv_h * self.conv_w

    @property
    def pooled(self) -> int:
        return self.batch * self.pooled_h * self.pooled_w

    def check_codes(self) -> "ConvGeometry":
        """One line when a size does not fit the tables' packed fields (8 bits for p, q; 16 for a
        window's corner) or their int32 offsets."""
        if (max(self.kernel, self.conv_h, self.conv_w, self.height + self.pad, self.width + self.pad) >= 256
                or self.batch * max(self.channels * self.height * self.width,
                                    self.filters * self.conv_h * self.conv_w) >= 1 << 31):
            raise ValueError(f"conv geometry {self}: the tiled kernels need kernel, image and conv output sides "
                             f"< 256 and a batch of activations < 2**31 elements")
        return self


#: where each ConvGeometry field sits in the int32 array the kernels read it from (``ConvTables.geometry``)
(BATCH, CHANNELS, HEIGHT, WIDTH, FILTERS, KERNEL, STRIDE, PAD, CONV_H, CONV_W, POOL, POOL_STRIDE, POOLED_H,
 POOLED_W) = range(14)


class ConvTables(NamedTuple):
    """Offset tables of one layer, on the device (``conv_tables``): what depends on k alone, looked up.

    A loader's address is (what depends on its row or column, computed once a thread in ``*_setup``)
    + (what depends on k, read here), so the loop over k does no integer division and no
    multiplication by a stride: one table read, an add, two comparisons for the padding.
    """

    taps: object          # (T, 2): t = (c, p, q) → [c·H·W + p·W + q, p << 8 | q]             (forward, dW)
    filter_taps: object   # (F·K·K, 2): k = (f, p, q) → dX's [w offset, dz offset, packed p, q // and % s]
    positions: object     # (P, 3): k = (n, ci, cj) → [dz offset, x offset of the window, packed top, left]
    geometry: object      # (14,) int32: the ConvGeometry, read by the kernels as g[FILTERS], … — one array
                          # argument instead of a named tuple of 14 numbers, which numba-cuda types at every
                          # launch (the static report's prediction: ~18 µs of host time a number)


PACK = 1 << 14            # top and left of a window (≥ −pad) are stored + PACK: 15 bits each, no sign bit


def conv_tables(g: ConvGeometry) -> ConvTables:
    """The offset tables of ``g`` (``ConvTables``), copied to the device once (the stage keeps them)."""
    g.check_codes()
    c, p, q = np.indices((g.channels, g.kernel, g.kernel)).reshape(3, -1)
    taps = np.stack([c * g.height * g.width + p * g.width + q, p << 8 | q], axis=1)
    f, p, q = np.indices((g.filters, g.kernel, g.kernel)).reshape(3, -1)
    s, plane = g.stride, g.conv_h * g.conv_w
    filter_taps = np.stack([f * g.channels * g.kernel * g.kernel + p * g.kernel + q,
                            f * plane - (p // s) * g.conv_w - q // s,
                            (p // s) << 24 | (q // s) << 16 | (p % s) << 8 | q % s], axis=1)
    n, ci, cj = np.indices((g.batch, g.conv_h, g.conv_w)).reshape(3, -1)
    top, left = ci * g.stride - g.pad, cj * g.stride - g.pad
    positions = np.stack([n * g.filters * plane + ci * g.conv_w + cj,
                          n * g.channels * g.height * g.width + top * g.width + left,
                          (top + PACK) << 16 | (left + PACK)], axis=1)
    return ConvTables(*(cuda.to_device(np.ascontiguousarray(table, dtype=np.int32))
                        for table in (taps, filter_taps, positions, np.array(g))))


@cuda.jit(device=True)
def inside(h, w, height, width):
    """0 <= h < height and 0 <= w < width."""
    return 0 <= h < height and 0 <= w < width


# -- forward: loaders of the patch matrix, and the bias + ReLU + pool epilogue ------------------
@cuda.jit(device=True)
def pooled_window(col, threads_n, window):
    """(pooled output, position in its window) of column ``col``: a tile's BN columns are the
    ``threads_n`` windows of consecutive pooled outputs, position-major, so thread tx's TN columns
    are window tx."""
    block_cols = threads_n * window
    return (col // block_cols) * threads_n + col % threads_n, (col % block_cols) // threads_n


@cuda.jit(device=True)
def filter_row(src, f):
    """a_setup of the forward: (valid, offset of filter f's row in the flat weights)."""
    w, g = src
    return f < g[FILTERS], min(f, g[FILTERS] - 1) * (g[CHANNELS] * g[KERNEL] * g[KERNEL])


@cuda.jit(device=True)
def filter_load(src, row, t):
    """A[f, t] = w[f, t] of the filters seen as an F × T matrix (w flat)."""
    w, g = src
    valid, offset = row
    value = w[uint32(offset + t)]                   # unsigned: no test for a negative index to wrap around
    return value if valid else float32(0.0)


@cuda.jit(device=True)
def patch_setup(src, col, threads_n):
    """b_setup of the forward: (valid, x offset of the window's corner, its top row, its left column)
    for column ``col`` — the divisions that place it, once a thread."""
    x, taps, g = src
    pooled, offset = pooled_window(col, threads_n, g[POOL] * g[POOL])
    valid = pooled < g[BATCH] * g[POOLED_H] * g[POOLED_W]
    n, i, j = unravel3(min(pooled, g[BATCH] * g[POOLED_H] * g[POOLED_W] - 1), g[BATCH], g[POOLED_H], g[POOLED_W])
    top = (i * g[POOL_STRIDE] + offset // g[POOL]) * g[STRIDE] - g[PAD]
    left = (j * g[POOL_STRIDE] + offset % g[POOL]) * g[STRIDE] - g[PAD]
    return valid, n * g[CHANNELS] * g[HEIGHT] * g[WIDTH] + top * g[WIDTH] + left, top, left


@cuda.jit(device=True)
def patch_load(src, col, t):
    """X[t, col]: the input under tap t = (c, p, q) of the window ``col`` (0 in the padding)."""
    x, taps, g = src
    valid, corner, top, left = col
    pq = taps[uint32(t), 1]
    ok = valid and inside(top + (pq >> 8), left + (pq & 255), g[HEIGHT], g[WIDTH])
    value = x[uint32(corner + taps[uint32(t), 0] if ok else 0)]
    return value if ok else float32(0.0)


@cuda.jit(device=True)
def bias_relu_pool_store(out, f, filters_step, col, threads_n, acc):
    """y[n, f, i, j] = max over the window of ReLU(acc + b[f]), switches = where (first max wins); the
    window's place (the divisions) found once for all the thread's filters."""
    b, y, switches, g = out
    pooled, _ = pooled_window(col, threads_n, g[POOL] * g[POOL])
    if pooled >= g[BATCH] * g[POOLED_H] * g[POOLED_W]:
        return
    n, i, j = unravel3(pooled, g[BATCH], g[POOLED_H], g[POOLED_W])
    for row in range(acc.shape[0]):
        filter_ = f + row * filters_step
        if filter_ < g[FILTERS]:
            best = float32(-1.0)                # below any ReLU output: the first position always wins
            best_at = 0
            offset = 0
            for di in range(g[POOL]):                # the window, row by row: no division to split an offset
                for dj in range(g[POOL]):
                    value = max(acc[row, offset] + b[filter_], float32(0.0))
                    if value > best:
                        best = value
                        best_at = (i * g[POOL_STRIDE] + di) * g[CONV_W] + j * g[POOL_STRIDE] + dj
                    offset += 1
            y[n, filter_, i, j] = best
            switches[n, filter_, i, j] = best_at


FORWARD = (filter_row, filter_load, patch_setup, patch_load, bias_relu_pool_store)


# -- dZ: the pooled gradient pulled back through max-pool and ReLU ----------------------------------
@cuda.jit
def relu_pool_backward_kernel(dy, y, switches, dz, g):
    index = cuda.grid(1)
    if index >= dz.size:
        return
    n, f, ci, cj = unravel4(index, dz.shape)
    here = ci * g[CONV_W] + cj
    first_i, last_i = covering_windows(ci, g[POOL], g[POOL_STRIDE], g[POOLED_H])
    first_j, last_j = covering_windows(cj, g[POOL], g[POOL_STRIDE], g[POOLED_W])
    total = float32(0.0)
    for i in range(first_i, last_i + 1):
        for j in range(first_j, last_j + 1):
            if switches[n, f, i, j] == here and y[n, f, i, j] > 0:
                total += dy[n, f, i, j]
    dz[n, f, ci, cj] = total


# -- dW and db: dZ times the patch matrix (plus a column of ones), split along the positions -------
@cuda.jit(device=True)
def grad_row(src, f):
    """a_setup of dW: (valid, f's offset in a sample's dz)."""
    dz, positions, g = src
    return f < g[FILTERS], min(f, g[FILTERS] - 1) * (g[CONV_H] * g[CONV_W])


@cuda.jit(device=True)
def table_row_load(src, row, k):
    """a_load of dW and dX: A[row, k] = values[table[k, 0] + the row's offset] (values flat).

    dW: values = dz, table = positions: dz[n, f, ci, cj] at position k = (n, ci, cj), row f.
    dX: values = w, table = filter_taps: w[f, c, p, q] at k = (f, p, q), row c."""
    values, table, g = src
    valid, offset = row
    value = values[uint32(table[uint32(k), 0] + offset)]
    return value if valid else float32(0.0)


@cuda.jit(device=True)
def tap_setup(src, col, threads_n):
    """b_setup of dW: (kind, x offset of tap (c, p, q), p, q) of column ``col`` — kind 0 a tap, 1 the
    ones column (db), 2 outside."""
    x, positions, g = src
    taps = g[CHANNELS] * g[KERNEL] * g[KERNEL]
    c, p, q = tap(min(col, taps - 1), g[KERNEL])
    kind = 0 if col < taps else (1 if col == taps else 2)
    return kind, c * g[HEIGHT] * g[WIDTH] + p * g[WIDTH] + q, p, q


@cuda.jit(device=True)
def tap_load(src, col, k):
    """B[k, col] = x under tap (c, p, q) at position k = (n, ci, cj); 1 in the ones column."""
    x, positions, g = src
    kind, offset, p, q = col
    corner = positions[uint32(k), 2]
    ok = kind == 0 and inside((corner >> 16) - PACK + p, (corner & 65535) - PACK + q, g[HEIGHT], g[WIDTH])
    value = x[uint32(positions[uint32(k), 1] + offset if ok else 0)]
    if ok:
        return value
    return float32(1.0) if kind == 1 else float32(0.0)


WEIGHT_GRADS = (grad_row, table_row_load, tap_setup, tap_load, store_partial)


@cuda.jit
def sum_splits_kernel(partial, dw, db):
    """Thread o owns output o = (f, t) and adds partial[0, f, t], partial[1, f, t], … in that fixed order;
    dw[f, t] (t < T) or db[f] (t = T) is the total. Neighbouring threads read neighbouring t: coalesced."""
    o = cuda.grid(1)
    columns = partial.shape[2]
    if o < partial.shape[1] * columns:
        f, t = o // columns, o % columns
        total = float32(0.0)
        for z in range(partial.shape[0]):
            total += partial[z, f, t]
        if t < columns - 1:
            dw[f, t] = total
        else:
            db[f] = total


# -- dX: the filters (transposed) times dz read through the windows ----------------------------------
@cuda.jit(device=True)
def channel_row(src, c):
    """a_setup of dX: (valid, channel c's offset in a filter)."""
    w, filter_taps, g = src
    return c < g[CHANNELS], min(c, g[CHANNELS] - 1) * (g[KERNEL] * g[KERNEL])


@cuda.jit(device=True)
def pixel_setup(src, col, threads_n):
    """b_setup of dX, for input pixel ``col`` = (n, h, w) — its divisions, once a thread: (valid, dz offset of
    (n, (h + pad) // s, (w + pad) // s), (h + pad) // s, (w + pad) // s, (h + pad) % s, (w + pad) % s)."""
    dz, filter_taps, g = src
    valid = col < g[BATCH] * g[HEIGHT] * g[WIDTH]
    n, h, w = unravel3(min(col, g[BATCH] * g[HEIGHT] * g[WIDTH] - 1), g[BATCH], g[HEIGHT], g[WIDTH])
    hq, wq = (h + g[PAD]) // g[STRIDE], (w + g[PAD]) // g[STRIDE]
    base = n * g[FILTERS] * g[CONV_H] * g[CONV_W] + hq * g[CONV_W] + wq
    return valid, base, hq, wq, (h + g[PAD]) % g[STRIDE], (w + g[PAD]) % g[STRIDE]


@cuda.jit(device=True)
def window_grad_load(src, col, k):
    """B[k, col] = dz[n, f, ci, cj] when conv output (ci, cj) covers pixel ``col`` = (n, h, w) with
    tap k = (f, p, q): ci·s + p − pad = h, i.e. p ≡ h + pad (mod s) and ci = (h + pad) // s − p // s
    (the residues are equal); 0 when no output does. Shifts and compares only: the table holds
    p // s, q // s, p % s, q % s and f's plane − (p // s, q // s)'s offset."""
    dz, filter_taps, g = src
    valid, base, hq, wq, hr, wr = col
    packed = filter_taps[uint32(k), 2]
    ci, cj = hq - (packed >> 24), wq - ((packed >> 16) & 255)
    ok = (valid and ((packed >> 8) & 255) == hr and (packed & 255) == wr
          and inside(ci, cj, g[CONV_H], g[CONV_W]))
    value = dz[uint32(base + filter_taps[uint32(k), 1] if ok else 0)]
    return value if ok else float32(0.0)


@cuda.jit(device=True)
def pixel_store(out, c, channels_step, col, threads_n, acc):
    """dx[n, c, h·W + w] for the thread's channels and pixels col + j·threads_n (dx seen as N × C × H·W); one
    division places the first pixel, the others step along without one."""
    dx, g = out
    plane = g[HEIGHT] * g[WIDTH]
    first_n, first_at = col // plane, col % plane
    for row in range(acc.shape[0]):
        channel = c + row * channels_step
        if channel < g[CHANNELS]:
            n, at = first_n, first_at
            for j in range(acc.shape[1]):
                if n < g[BATCH]:
                    dx[n, channel, at] = acc[row, j]
                at += threads_n
                while at >= plane:                  # threads_n < plane: at most once or twice
                    at -= plane
                    n += 1


DATA_GRADS = (channel_row, table_row_load, pixel_setup, window_grad_load, pixel_store)


# -- tiles, splits, and the host functions the stage calls ---------------------------------------
def forward_tiles(g: ConvGeometry) -> Tiles:
    """TN = S·S: each thread's register block along the columns is one pooling window."""
    return Tiles.for_columns(g.filters, g.pooled * g.pool * g.pool, g.taps, tn=g.pool * g.pool)


def weight_grad_plan(g: ConvGeometry) -> tuple[Tiles, int]:
    """(tiles, splits) of dW: few columns (T + 1), covered by as few blocks of up to 32 threads along
    them as will do, and enough splits of the positions for 2 blocks per SM, each ≥ 64 positions long."""
    columns = g.taps + 1
    tiles = Tiles.for_rows(g.filters, tn=WEIGHT_GRAD_TN, threads_n=32 if columns > 64 else 16 if columns > 32 else 8)
    (blocks_x, blocks_y, _), _ = tiles.grid(g.filters, columns)
    wanted = max(1, min(-(-2 * multiprocessors() // (blocks_x * blocks_y)), g.positions // 64))
    tiles = tiles.with_depth(-(-g.positions // wanted))
    return tiles, split_k(g.positions, wanted, tiles.bk)[1]


def data_grad_tiles(g: ConvGeometry) -> Tiles:
    return Tiles.for_columns(g.channels, g.batch * g.height * g.width, g.filters * g.kernel * g.kernel,
                             tn=WEIGHT_GRAD_TN)


def partial_shape(g: ConvGeometry) -> tuple[int, int, int]:
    """Shape of the buffer of split-K partial sums of dW and db."""
    return weight_grad_plan(g)[1], g.filters, g.taps + 1


def flat(array):
    """The same device memory as a vector: the loaders add offsets instead of indexing in 4-D."""
    return array.reshape(array.size)


def conv_relu_pool_forward_tiled(x, w, b, y, switches, g: ConvGeometry, tables: ConvTables, launch=launch):
    """y, switches ← maxpool(ReLU(conv(x, w) + b)), one implicit GEMM."""
    geometry = tables.geometry
    gemm(FORWARD, forward_tiles(g), (flat(w), geometry), (flat(x), tables.taps, geometry), (b, y, switches, geometry),
         g.filters, g.pooled * g.pool * g.pool, g.taps, launch=launch)


def conv_relu_pool_backward_tiled(dy, y, switches, x, w, dx, dw, db, dz, partial, g: ConvGeometry,
                                  tables: ConvTables, with_dx=True, launch=launch):
    """dz, then dw and db (split-K and its sum), then dx when ``with_dx``: 3 or 4 launches, no atomics.

    ``dz`` (N, F, Hc, Wc) and ``partial`` (``partial_shape(g)``) are scratch buffers; every output
    is overwritten, so nothing needs zeroing first.
    """
    geometry = tables.geometry
    launch(relu_pool_backward_kernel, *grid_1d(dz.size), dy, y, switches, dz, geometry)
    if tuple(partial.shape) != partial_shape(g):
        raise ValueError(f"conv backward: partial sums need shape {partial_shape(g)}, got {partial.shape}")
    gemm(WEIGHT_GRADS, weight_grad_plan(g)[0], (flat(dz), tables.positions, geometry), (flat(x), tables.positions, geometry),
         (partial,), g.filters, g.taps + 1, g.positions, partial.shape[0], launch=launch)
    launch(sum_splits_kernel, *grid_1d(g.filters * (g.taps + 1)), partial, dw.reshape((g.filters, g.taps)), db)
    if with_dx:
        gemm(DATA_GRADS, data_grad_tiles(g), (flat(w), tables.filter_taps, geometry),
             (flat(dz), tables.filter_taps, geometry), (dx.reshape((g.batch, g.channels, g.height * g.width)), geometry),
             g.channels, g.batch * g.height * g.width, g.filters * g.kernel * g.kernel, launch=launch)
