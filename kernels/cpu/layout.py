"""Stage 3's memory layout and the SIMD loops over it: the building blocks of every compiled CPU kernel.

A thread copies channel c of a block of samples, zero-padded, into a private scratch with the
sample index innermost — (row, column, sample) order (``load_channel``). A shift by (p, q) in
the image is then ONE offset for every position of every sample of the block, so the loops over
rows, columns and samples collapse into one contiguous loop (``axpy``, ``dot``) that the compiler
turns into SIMD fused multiply-adds. ``BLOCK_NUMBERS`` keeps a block's plane about L1-sized;
loop lengths are rounded up to a multiple of ``SIMD_ROUND`` so that no scalar tail loop runs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# reassociate sums (SIMD partial sums) and contract a*b+c into FMA; keep NaN/inf semantics
SAFE_FASTMATH = {"reassoc", "contract", "nsz"}

# Tuning constants, counted in numbers (not bytes). 2048 and 4096 measured alike on this machine.
BLOCK_NUMBERS = 4096   # a block of samples holds about this many numbers per channel (L1-sized in float32)
SIMD_ROUND = 32        # loop lengths are rounded up to a multiple of this: no scalar tail loop


@njit(cache=True)
def chunk_range(chunk, chunks, total):
    """Items [lo, hi) of ``range(total)`` that chunk number ``chunk`` of ``chunks`` handles."""
    return chunk * total // chunks, (chunk + 1) * total // chunks


@njit(cache=True)
def geometry(x, W, stride, pad):
    """Sizes of a convolution: padded input (Hp, Wp) and output (Ho, Wo)."""
    Hp, Wp = x.shape[2] + 2 * pad, x.shape[3] + 2 * pad
    K = W.shape[2]
    return Hp, Wp, (Hp - K) // stride + 1, (Wp - K) // stride + 1


@njit(cache=True)
def samples_per_block(samples, Hp, Wp):
    """Stack at most BLOCK_NUMBERS numbers per channel, in blocks of (nearly) equal size."""
    blocks = -(-samples // max(1, BLOCK_NUMBERS // (Hp * Wp)))
    return -(-samples // blocks)


@njit(cache=True)
def scratch(channels, samples, Hp, Wp, dtype):
    """Zeroed scratch for ``samples`` stacked padded planes per channel, plus room for rounded-up loops."""
    return np.zeros((channels, samples * Hp * Wp + SIMD_ROUND), dtype)


@njit(cache=True)
def load_channel(x, n0, count, c, pad, Hp, Wp, block):
    """Channel c of samples n0 … n0+count−1, zero-padded, sample index innermost:

    block[((pad + h)·Wp + pad + w)·count + b] = x[n0 + b, c, h, w]

    The offsets are unsigned, here and in the other copies between layouts: an index Numba cannot prove
    non-negative gets a wraparound fixup (index < 0 → index + size) on every access."""
    H, W = x.shape[2], x.shape[3]
    if pad > 0:
        block[:Hp * Wp * count] = 0
    step = np.uint64(count)
    for b in range(count):
        for h in range(H):
            row = np.uint64(((pad + h) * Wp + pad) * count + b)
            for w in range(W):
                block[row + np.uint64(w) * step] = x[n0 + b, c, h, w]


@njit(cache=True)
def store_channel(block, n0, count, c, pad, Hp, Wp, dx):
    """The inverse of ``load_channel``; what fell on the padding is dropped."""
    H, W = dx.shape[2], dx.shape[3]
    step = np.uint64(count)
    for b in range(count):
        for h in range(H):
            row = np.uint64(((pad + h) * Wp + pad) * count + b)
            for w in range(W):
                dx[n0 + b, c, h, w] = block[row + np.uint64(w) * step]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def axpy(y, a, x):
    """y += a·x: with contiguous x and y, a loop the compiler turns into SIMD fused multiply-adds."""
    for k in range(y.size):
        y[k] += a * x[k]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def fma_4x4(y0, y1, y2, y3, X, rows, starts, a):
    """y_i += Σ_t a[i, t]·x_t for four outputs i and four inputs t, in ONE pass: 16 multiply-adds an
    element for 4 loads of x and 4 loads and 4 stores of y (a single axpy: 1 multiply-add for 3).
    The sixteen weights are read once, before the loop, and stay in registers.

    The inputs come as rows and starts of one array, x_t[k] = X[rows[t], starts[t] + k], and their views
    are made here, where Numba's reference-count pruning removes the atomic increment and decrement each
    view costs; handed in from the caller, eight views a pass cost tens of cycles each — a quarter of a
    LeNet-5 step (see ``add_runs``)."""
    a00, a01, a02, a03 = a[0, 0], a[0, 1], a[0, 2], a[0, 3]
    a10, a11, a12, a13 = a[1, 0], a[1, 1], a[1, 2], a[1, 3]
    a20, a21, a22, a23 = a[2, 0], a[2, 1], a[2, 2], a[2, 3]
    a30, a31, a32, a33 = a[3, 0], a[3, 1], a[3, 2], a[3, 3]
    n = y0.size
    x0, x1, x2, x3 = (X[rows[0], starts[0]:starts[0] + n], X[rows[1], starts[1]:starts[1] + n],
                      X[rows[2], starts[2]:starts[2] + n], X[rows[3], starts[3]:starts[3] + n])
    for k in range(n):
        v0, v1, v2, v3 = x0[k], x1[k], x2[k], x3[k]
        y0[k] += a00 * v0 + a01 * v1 + a02 * v2 + a03 * v3
        y1[k] += a10 * v0 + a11 * v1 + a12 * v2 + a13 * v3
        y2[k] += a20 * v0 + a21 * v1 + a22 * v2 + a23 * v3
        y3[k] += a30 * v0 + a31 * v1 + a32 * v2 + a33 * v3


@njit(cache=True, fastmath=SAFE_FASTMATH)
def dot_4x4(Y, y_rows, y_starts, X, x_rows, x_starts, length, sums):
    """sums[i, t] += y_i · x_t for four y and four x of ``length`` numbers, in ONE pass: 16 multiply-adds an
    element for 8 loads (sixteen running sums, held in registers). Read in place, as in ``fma_4x4``:
    y_i[k] = Y[y_rows[i], y_starts[i] + k], x_t[k] = X[x_rows[t], x_starts[t] + k]."""
    y0, y1, y2, y3 = (Y[y_rows[0], y_starts[0]:y_starts[0] + length], Y[y_rows[1], y_starts[1]:y_starts[1] + length],
                      Y[y_rows[2], y_starts[2]:y_starts[2] + length], Y[y_rows[3], y_starts[3]:y_starts[3] + length])
    x0, x1, x2, x3 = (X[x_rows[0], x_starts[0]:x_starts[0] + length], X[x_rows[1], x_starts[1]:x_starts[1] + length],
                      X[x_rows[2], x_starts[2]:x_starts[2] + length], X[x_rows[3], x_starts[3]:x_starts[3] + length])
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = Y.dtype.type(0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = Y.dtype.type(0)
    for k in range(length):
        u0, u1, u2, u3 = y0[k], y1[k], y2[k], y3[k]
        v0, v1, v2, v3 = x0[k], x1[k], x2[k], x3[k]
        s00 += u0 * v0
        s01 += u0 * v1
        s02 += u0 * v2
        s03 += u0 * v3
        s10 += u1 * v0
        s11 += u1 * v1
        s12 += u1 * v2
        s13 += u1 * v3
        s20 += u2 * v0
        s21 += u2 * v1
        s22 += u2 * v2
        s23 += u2 * v3
        s30 += u3 * v0
        s31 += u3 * v1
        s32 += u3 * v2
        s33 += u3 * v3
    sums[0, 0] += s00
    sums[0, 1] += s01
    sums[0, 2] += s02
    sums[0, 3] += s03
    sums[1, 0] += s10
    sums[1, 1] += s11
    sums[1, 2] += s12
    sums[1, 3] += s13
    sums[2, 0] += s20
    sums[2, 1] += s21
    sums[2, 2] += s22
    sums[2, 3] += s23
    sums[3, 0] += s30
    sums[3, 1] += s31
    sums[3, 2] += s32
    sums[3, 3] += s33


@njit(cache=True, fastmath=SAFE_FASTMATH)
def add_runs(y, y_at, a, x, x_at, shift, first, end, length):
    """y[y_at + j] += Σ_{first ≤ e < end} a[e]·x[x_at[e] + shift + j] for j < length: a weighted sum of runs of x
    (one vector, each term's run where ``x_at`` says) added into one run of y; four terms a pass, the rest one
    by one.

    Four terms in one pass keep each partial sum y[k] in a register: a term costs one load, where a
    separate axpy costs a load, a load and a store. The runs are indexed in x itself, with unsigned
    offsets, not taken as views x[s:s + length]: Numba counts the references to an array's memory, and
    every view made and dropped is an atomic increment and decrement (a few tens of cycles), as much as a
    short run's sums; and it adds no wraparound for negative indices, which would keep the loop from SIMD.
    """
    y_at, shift, length = np.uint64(y_at), np.uint64(shift), np.uint64(length)
    e = first
    while e + 4 <= end:
        s0, s1 = np.uint64(x_at[e]) + shift, np.uint64(x_at[e + 1]) + shift
        s2, s3 = np.uint64(x_at[e + 2]) + shift, np.uint64(x_at[e + 3]) + shift
        a0, a1, a2, a3 = a[e], a[e + 1], a[e + 2], a[e + 3]
        for j in range(length):
            y[y_at + j] += a0 * x[s0 + j] + a1 * x[s1 + j] + a2 * x[s2 + j] + a3 * x[s3 + j]
        e += 4
    for e in range(e, end):
        s0, a0 = np.uint64(x_at[e]) + shift, a[e]
        for j in range(length):
            y[y_at + j] += a0 * x[s0 + j]


@njit(cache=True)
def four_rows(M, first, past_the_end):
    """Rows first … first+3 of M; each one past M's last row is ``past_the_end`` (a spare row to write into
    that nothing reads)."""
    rows = M.shape[0]
    return (M[first], M[first + 1] if first + 1 < rows else past_the_end,
            M[first + 2] if first + 2 < rows else past_the_end, M[first + 3] if first + 3 < rows else past_the_end)


@njit(cache=True)
def four_indices(first, count):
    """(first, first+1, first+2, first+3), each one past count − 1 replaced by count − 1: rows to read in place
    (a repeated row's terms get weight 0, or its sums are not read)."""
    last = count - 1
    return first, min(first + 1, last), min(first + 2, last), min(first + 3, last)


@njit(cache=True, fastmath=SAFE_FASTMATH)
def add_product(Y, A, X):
    """Y += A·X (Y: m × L, A: m × k, X: k × L, rows contiguous): four rows of Y by four rows of X a pass
    (``fma_4x4``, the 4 × 4 block of A its weights) — 16 multiply-adds for 12 loads and stores, where a
    row at a time (``add_runs``) does 4 for 6."""
    m, k = A.shape
    tile, spare = np.zeros((4, 4), Y.dtype), np.empty(Y.shape[1], Y.dtype)
    starts = (0, 0, 0, 0)
    for i0 in range(0, m, 4):
        y0, y1, y2, y3 = four_rows(Y, i0, spare)
        for t0 in range(0, k, 4):
            for i in range(4):
                for t in range(4):
                    tile[i, t] = A[i0 + i, t0 + t] if i0 + i < m and t0 + t < k else 0
            fma_4x4(y0, y1, y2, y3, X, four_indices(t0, k), starts, tile)


@njit(cache=True, fastmath=SAFE_FASTMATH)
def add_dot_products(Y, A, B):
    """Y[i, j] += A[i]·B[j] (A: m × L, B: k × L, rows contiguous) for four rows of A by four of B a pass
    (``dot_4x4``: 16 running sums for 8 loads, where ``dot`` keeps 1 for 2)."""
    m, k = A.shape[0], B.shape[0]
    sums, starts = np.zeros((4, 4), Y.dtype), (0, 0, 0, 0)
    for i0 in range(0, m, 4):
        for j0 in range(0, k, 4):
            sums[:] = 0
            dot_4x4(A, four_indices(i0, m), starts, B, four_indices(j0, k), starts, A.shape[1], sums)
            for i in range(min(4, m - i0)):
                for j in range(min(4, k - j0)):
                    Y[i0 + i, j0 + j] += sums[i, j]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def dot(x, y):
    """Σ_k x[k]·y[k]; ``reassoc`` lets the compiler keep several SIMD partial sums."""
    total = x.dtype.type(0)
    for k in range(x.size):
        total += x[k] * y[k]
    return total


@njit(cache=True)
def run_length(count, Hp, Wp, K):
    """Length of the run of block positions that holds every stride-1 output — rows i < Hp − K + 1,
    columns j < Wp − K + 1, ``count`` samples each — rounded up to a multiple of SIMD_ROUND."""
    run = ((Hp - K) * Wp + Wp - K + 1) * count
    return -(-run // SIMD_ROUND) * SIMD_ROUND
