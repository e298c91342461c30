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
    """
    H, W = x.shape[2], x.shape[3]
    if pad > 0:
        block[:Hp * Wp * count] = 0
    for b in range(count):
        for h in range(H):
            row = ((pad + h) * Wp + pad) * count + b
            for w in range(W):
                block[row + w * count] = x[n0 + b, c, h, w]


@njit(cache=True)
def store_channel(block, n0, count, c, pad, Hp, Wp, dx):
    """The inverse of ``load_channel``; what fell on the padding is dropped."""
    H, W = dx.shape[2], dx.shape[3]
    for b in range(count):
        for h in range(H):
            row = ((pad + h) * Wp + pad) * count + b
            for w in range(W):
                dx[n0 + b, c, h, w] = block[row + w * count]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def axpy(y, a, x):
    """y += a·x: with contiguous x and y, a loop the compiler turns into SIMD fused multiply-adds."""
    for k in range(y.size):
        y[k] += a * x[k]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def axpy4(y, a0, x0, a1, x1, a2, x2, a3, x3):
    """y += a0·x0 + a1·x1 + a2·x2 + a3·x3: four axpy in ONE pass. The partial sum of an element stays in
    a register, so each term costs one load where a separate axpy costs a load, a load and a store —
    the loops here are limited by memory operations, not by multiply-adds."""
    for k in range(y.size):
        y[k] += a0 * x0[k] + a1 * x1[k] + a2 * x2[k] + a3 * x3[k]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def dot4(y, x0, x1, x2, x3):
    """(y·x0, y·x1, y·x2, y·x3) in ONE pass: y is loaded once for four dot products."""
    t0 = t1 = t2 = t3 = y.dtype.type(0)
    for k in range(y.size):
        t0 += y[k] * x0[k]
        t1 += y[k] * x1[k]
        t2 += y[k] * x2[k]
        t3 += y[k] * x3[k]
    return t0, t1, t2, t3


@njit(cache=True, fastmath=SAFE_FASTMATH)
def add_rows(y, a, X):
    """y += Σ_t a[t]·X[t] (X a matrix, one row a term): four rows a pass (``axpy4``), the rest one by one."""
    t = 0
    while t + 4 <= X.shape[0]:
        axpy4(y, a[t], X[t], a[t + 1], X[t + 1], a[t + 2], X[t + 2], a[t + 3], X[t + 3])
        t += 4
    for t in range(t, X.shape[0]):
        axpy(y, a[t], X[t])


@njit(cache=True)
def taps(x, start, step, length):
    """Four windows of x, ``step`` apart: x[start + t·step : start + t·step + length] for t = 0 … 3."""
    return (x[start:start + length], x[start + step:start + step + length],
            x[start + 2 * step:start + 2 * step + length], x[start + 3 * step:start + 3 * step + length])


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
