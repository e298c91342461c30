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

Every output element is written by exactly one thread, and every sum is taken in an order fixed by
the tiles, so the results are the same bit for bit from run to run (stage 5's atomics are not).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import float32

from kernels.conv_pool_smem import tap, unravel3
from kernels.device import cuda
from kernels.implicit_gemm import Tiles, gemm, matrix_rows, row_index, split_k, store_partial
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
        """One line when a size does not fit the 16 + 8 + 8 bits of ``index_codes``."""
        if max(self.batch, self.channels, self.filters) >= 1 << 16 or max(self.kernel, self.conv_h, self.conv_w) >= 256:
            raise ValueError(f"conv geometry {self}: the tiled kernels need batch, channels and filters < 65536 "
                             f"and kernel and conv output sides < 256")
        return self


class ConvTables(NamedTuple):
    """Decode tables of one layer, on the device (``conv_tables``): a lookup instead of divisions."""

    taps: object          # t → (c, p, q) of the C × K × K taps of a filter
    filter_taps: object   # k → (f, p, q) of the F × K × K taps of dX's sum
    positions: object     # k → (n, ci, cj) of the N × Hc × Wc conv output positions


def index_codes(a: int, b: int, c: int) -> np.ndarray:
    """int32 codes i << 16 | j << 8 | k of every (i, j, k) of an a × b × c grid, in C order.

    A flat index k of the grid would need two integer divisions to split; the kernels read its
    code instead and split it with shifts (``decode``). (j, k < 256, i < 65536.)
    """
    i, j, k = np.indices((a, b, c)).reshape(3, -1)
    return (i << 16 | j << 8 | k).astype(np.int32)


def conv_tables(g: ConvGeometry) -> ConvTables:
    """The decode tables of ``g``, copied to the device once (the stage keeps them with the layer)."""
    g.check_codes()
    return ConvTables(cuda.to_device(index_codes(g.channels, g.kernel, g.kernel)),
                      cuda.to_device(index_codes(g.filters, g.kernel, g.kernel)),
                      cuda.to_device(index_codes(g.batch, g.conv_h, g.conv_w)))


@cuda.jit(device=True)
def decode(code):
    """(i, j, k) of an ``index_codes`` code."""
    return code >> 16, (code >> 8) & 255, code & 255


# -- forward: loaders of the patch matrix, and the bias + ReLU + pool epilogue ------------------
@cuda.jit(device=True)
def pooled_window(col, threads_n, window):
    """(pooled output, position in its window) of column ``col``: a tile's BN columns are the
    ``threads_n`` windows of consecutive pooled outputs, position-major, so thread tx's TN columns
    are window tx."""
    block_cols = threads_n * window
    return (col // block_cols) * threads_n + col % threads_n, (col % block_cols) // threads_n


@cuda.jit(device=True)
def patch_setup(src, col, threads_n):
    """b_setup of the forward: (valid, n, top row, left column) of the input window under column ``col``."""
    x, taps, g = src
    pooled, offset = pooled_window(col, threads_n, g.pool * g.pool)
    n, i, j = unravel3(pooled, g.batch, g.pooled_h, g.pooled_w)
    ci = i * g.pool_stride + offset // g.pool
    cj = j * g.pool_stride + offset % g.pool
    return pooled < g.batch * g.pooled_h * g.pooled_w, n, ci * g.stride - g.pad, cj * g.stride - g.pad


@cuda.jit(device=True)
def patch_load(src, col, t):
    """X[t, col]: the input under tap t = (c, p, q) of the window ``col`` (0 in the padding)."""
    x, taps, g = src
    valid, n, top, left = col
    c, p, q = decode(taps[t])
    h, w = top + p, left + q
    if valid and 0 <= h < g.height and 0 <= w < g.width:
        return x[n, c, h, w]
    return float32(0.0)


@cuda.jit(device=True)
def bias_relu_pool_store(out, f, col, threads_n, values):
    """y[n, f, i, j] = max over the window of ReLU(values + b[f]), switches = where (first max wins)."""
    b, y, switches, g = out
    pooled, _ = pooled_window(col, threads_n, g.pool * g.pool)
    if f >= g.filters or pooled >= g.batch * g.pooled_h * g.pooled_w:
        return
    n, i, j = unravel3(pooled, g.batch, g.pooled_h, g.pooled_w)
    best = float32(-1.0)                    # below any ReLU output: the first position always wins
    best_at = 0
    for offset in range(values.size):             # = S·S, the window (a constant of the compiled kernel)
        value = max(values[offset] + b[f], float32(0.0))
        if value > best:
            best = value
            best_at = (i * g.pool_stride + offset // g.pool) * g.conv_w + j * g.pool_stride + offset % g.pool
    y[n, f, i, j] = best
    switches[n, f, i, j] = best_at


FORWARD = (row_index, matrix_rows, patch_setup, patch_load, bias_relu_pool_store)


# -- dZ: the pooled gradient pulled back through max-pool and ReLU ----------------------------------
@cuda.jit
def relu_pool_backward_kernel(dy, y, switches, dz, g):
    index = cuda.grid(1)
    if index >= dz.size:
        return
    n, f, ci, cj = unravel4(index, dz.shape)
    here = ci * g.conv_w + cj
    first_i, last_i = covering_windows(ci, g.pool, g.pool_stride, g.pooled_h)
    first_j, last_j = covering_windows(cj, g.pool, g.pool_stride, g.pooled_w)
    total = float32(0.0)
    for i in range(first_i, last_i + 1):
        for j in range(first_j, last_j + 1):
            if switches[n, f, i, j] == here and y[n, f, i, j] > 0:
                total += dy[n, f, i, j]
    dz[n, f, ci, cj] = total


# -- dW and db: dZ times the patch matrix (plus a column of ones), split along the positions -------
@cuda.jit(device=True)
def conv_grad_load(src, f, k):
    """A[f, k] = dz[n, f, ci, cj] at position k = (n, ci, cj)."""
    dz, positions, g = src
    if f < g.filters:
        n, ci, cj = decode(positions[k])
        return dz[n, f, ci, cj]
    return float32(0.0)


@cuda.jit(device=True)
def tap_setup(src, col, threads_n):
    """b_setup of dW: (kind, c, p, q) of column ``col`` — kind 0 a tap, 1 the ones column (db), 2 outside."""
    x, positions, g = src
    taps = g.channels * g.kernel * g.kernel
    c, p, q = tap(min(col, taps - 1), g.kernel)
    return (0 if col < taps else (1 if col == taps else 2)), c, p, q


@cuda.jit(device=True)
def tap_load(src, col, k):
    """B[k, col] = x under tap (c, p, q) at position k = (n, ci, cj); 1 in the ones column."""
    x, positions, g = src
    kind, c, p, q = col
    if kind != 0:
        return float32(1.0) if kind == 1 else float32(0.0)
    n, ci, cj = decode(positions[k])
    h, w = ci * g.stride - g.pad + p, cj * g.stride - g.pad + q
    if 0 <= h < g.height and 0 <= w < g.width:
        return x[n, c, h, w]
    return float32(0.0)


WEIGHT_GRADS = (row_index, conv_grad_load, tap_setup, tap_load, store_partial)


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
def filter_tap_load(src, c, k):
    """A[c, k] = w[f, c, p, q] for k = (f, p, q)."""
    w, filter_taps, g = src
    if c < g.channels:
        f, p, q = decode(filter_taps[k])
        return w[f, c, p, q]
    return float32(0.0)


@cuda.jit(device=True)
def pixel_setup(src, col, threads_n):
    """b_setup of dX: (valid, n, h + pad, w + pad) of input pixel ``col`` = (n, h, w)."""
    dz, filter_taps, g = src
    n, h, w = unravel3(col, g.batch, g.height, g.width)
    return col < g.batch * g.height * g.width, n, h + g.pad, w + g.pad


@cuda.jit(device=True)
def window_grad_load(src, col, k):
    """B[k, col] = dz[n, f, ci, cj] for k = (f, p, q) when (ci, cj)·s + (p, q) − pad is pixel ``col``, else 0."""
    dz, filter_taps, g = src
    valid, n, h_padded, w_padded = col
    f, p, q = decode(filter_taps[k])
    ci, cj = h_padded - p, w_padded - q
    if not valid or ci < 0 or cj < 0:
        return float32(0.0)
    if g.stride > 1:                                # (a stride of 1 needs no division: every tap lands)
        if ci % g.stride != 0 or cj % g.stride != 0:
            return float32(0.0)
        ci, cj = ci // g.stride, cj // g.stride
    if ci < g.conv_h and cj < g.conv_w:
        return dz[n, f, ci, cj]
    return float32(0.0)


@cuda.jit(device=True)
def pixel_store(out, c, col, threads_n, values):
    """dx[n, c, h, w] for the thread's pixels col + j·threads_n (dx seen as N × C × H·W)."""
    dx, g = out
    plane = g.height * g.width
    if c < g.channels:
        for j in range(values.size):
            pixel = col + j * threads_n
            if pixel < g.batch * plane:
                dx[pixel // plane, c, pixel % plane] = values[j]


DATA_GRADS = (row_index, filter_tap_load, pixel_setup, window_grad_load, pixel_store)


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


def conv_relu_pool_forward_tiled(x, w, b, y, switches, g: ConvGeometry, tables: ConvTables, launch=launch):
    """y, switches ← maxpool(ReLU(conv(x, w) + b)), one implicit GEMM."""
    gemm(FORWARD, forward_tiles(g), (w.reshape((g.filters, g.taps)),), (x, tables.taps, g), (b, y, switches, g),
         g.filters, g.pooled * g.pool * g.pool, g.taps, launch=launch)


def conv_relu_pool_backward_tiled(dy, y, switches, x, w, dx, dw, db, dz, partial, g: ConvGeometry,
                                  tables: ConvTables, with_dx=True, launch=launch):
    """dz, then dw and db (split-K and its sum), then dx when ``with_dx``: 3 or 4 launches, no atomics.

    ``dz`` (N, F, Hc, Wc) and ``partial`` (``partial_shape(g)``) are scratch buffers; every output
    is overwritten, so nothing needs zeroing first.
    """
    launch(relu_pool_backward_kernel, *grid_1d(dz.size), dy, y, switches, dz, g)
    if tuple(partial.shape) != partial_shape(g):
        raise ValueError(f"conv backward: partial sums need shape {partial_shape(g)}, got {partial.shape}")
    gemm(WEIGHT_GRADS, weight_grad_plan(g)[0], (dz, tables.positions, g), (x, tables.positions, g), (partial,),
         g.filters, g.taps + 1, g.positions, partial.shape[0], launch=launch)
    launch(sum_splits_kernel, *grid_1d(g.filters * (g.taps + 1)), partial, dw.reshape((g.filters, g.taps)), db)
    if with_dx:
        gemm(DATA_GRADS, data_grad_tiles(g), (w, tables.filter_taps, g), (dz, tables.filter_taps, g),
             (dx.reshape((g.batch, g.channels, g.height * g.width)), g),
             g.channels, g.batch * g.height * g.width, g.filters * g.kernel * g.kernel, launch=launch)
