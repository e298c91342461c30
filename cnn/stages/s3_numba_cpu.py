"""Stage 3 ``numba-cpu``: the loops of stage 1, compiled by Numba, run on every core, and fused.

What changes against stage 2:

- The loops come back — compiled. ``@njit`` turns loops into machine code, so a loop
  costs what it costs in C, and no im2col matrix is built. The convolution is written
  one weight at a time: ``z += W[f, c, p, q] · (input channel c shifted by (p, q))``.
- Memory layout for SIMD. A thread copies channel c of a block of samples, zero-padded,
  into a private scratch with the sample index innermost — (row, column, sample) order
  (``_load_channel``) — and keeps its conv outputs in the same layout. The shift by
  (p, q) is then ONE offset for every output of every sample in the block, so the loops
  over rows, columns and samples collapse into one contiguous loop of a few thousand
  steps per weight, which the compiler turns into SIMD fused multiply-adds (``_axpy``,
  ``_dot``). The K − 1 columns at the right edge of each row straddle two rows: they are
  computed too and never read (30 % extra work for LeNet-5's second conv; stacking the
  samples one under the other instead also wastes K − 1 rows per sample, 56 %, and
  measured ~40 % slower on that layer). Loop lengths are rounded up to a multiple of
  SIMD_ROUND so that no scalar tail loop runs; BLOCK_NUMBERS keeps a block's plane
  about L1-sized. A convolution of stride s > 1 is computed at stride 1 and read every
  s-th output: s² times the arithmetic, but one set of loops (no network of the course
  has one).
- Conv + bias + ReLU + max-pool run as ONE kernel, as the CUDA stage 5 will do: the
  conv plane stays in cache and is pooled straight into the output, so only the pooled
  output and the argmax "switches" reach memory. Backward, the gradient at the conv
  output is rebuilt from the switches (the ReLU gate is "pooled output > 0") into the
  scratch plane, and dW, db, dx are taken from it, with no full-size intermediate
  array and no separate ReLU or pool pass. A Conv that is not followed by ReLU +
  MaxPool runs through the same kernel with ReLU and pooling off, then through the
  separate ReLU and max-pool kernels — so any network of layer specs works.
- Threads (``parallel=True``, ``prange``). Work items are (block of samples, filter)
  forward and (block of samples, input channel) backward, one contiguous range of
  items per thread — enough items even at batch 1. Backward, each thread sums dW and
  db into its own copy and the copies are added at the end: no two threads ever write
  the same number (no races, no atomics), and for a given thread count the sum is
  deterministic. dx of (block, channel) belongs to a single item.
- ``fastmath`` only where it is safe: ``reassoc`` (the dot products of dW keep SIMD
  partial sums) and ``contract`` (fused multiply-add), never ``nnan``/``ninf``, so a
  diverging loss still shows up as NaN.
- Little Python per step: one call per layer; activation, switch and gradient buffers
  are allocated once per batch size and reused. The first layer skips dL/d(images),
  which training never needs (PyTorch skips it too); ``input_grad`` computes it on
  demand. The SGD update is one compiled pass (``sgd_momentum_kernel``).
- Dense layers are compiled loops too (threads over (sample, output) pairs forward,
  over rows of dW and of dx backward). numpy's BLAS is faster per FLOP (LeNet-5's three
  dense layers, forward + backward at batch 64 on one thread: 0.26 ms against 0.8 ms),
  but OpenBLAS brings a second thread pool that fights Numba's for the same two cores:
  a whole step measured a median 18-23 ms with BLAS dense layers against 13-20 ms with
  the compiled ones (separate runs, alternated, on this machine while it was loaded).

What it bought, measured on this machine (2-core Intel Xeon, AVX-512; numba 0.68, torch
2.13 CPU; 2 threads each; one LeNet-5 training step, batch 64, float32, real MNIST; median
of 120 steps per row (numpy: 40), the rows taking turns)::

    python benchmarks/numba_vs_torch.py --repeats 120

    stage numpy (stage 2)     31.41 ms/step   (10th-90th percentile 29.60-33.35)
    numba-cpu, fuse=False      7.61 ms/step   (10th-90th percentile 6.70-8.21)
    numba-cpu                  5.35 ms/step   (10th-90th percentile 4.75-8.88)
    PyTorch 2.13 CPU           7.24 ms/step   (10th-90th percentile 6.56-14.94)

numba-cpu / PyTorch = 0.74 (ratio of the minima: 0.79); 5.9x faster than stage 2; fused
against ``fuse=False`` (whose separate ReLU and max-pool kernels are single-threaded):
1.42x. Measured with no other job running (the file records a 1-minute load average of 1.8,
the tail of a training run just before); the numbers are in
benchmarks/results/numba_vs_torch-vm-2026-11-22.json. An earlier run while other jobs loaded
the machine (load average 3.5) gave the same order: 6.42 against 9.62 ms (ratio 0.67). On one
thread (``--threads 1``, loaded, load 2.6): numba-cpu 9.30 ms, PyTorch 10.13 ms (ratio 0.92)
— the compiled loops match PyTorch's kernels, and scale better to the second core.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange

from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, window_count
from cnn.stages.base import HostStage, Ops, softmax_cross_entropy

# reassociate sums (SIMD partial sums) and contract a*b+c into FMA; keep NaN/inf semantics
SAFE_FASTMATH = {"reassoc", "contract", "nsz"}


# Tuning constants, counted in numbers (not bytes). 2048 and 4096 measured alike on this machine.
BLOCK_NUMBERS = 4096   # a block of samples holds about this many numbers per channel (L1-sized in float32)
SIMD_ROUND = 32        # loop lengths are rounded up to a multiple of this: no scalar tail loop


# -- building blocks ------------------------------------------------------------------------

@njit(cache=True)
def _chunk(chunk, chunks, total):
    """Items [lo, hi) of ``range(total)`` that chunk number ``chunk`` of ``chunks`` handles."""
    return chunk * total // chunks, (chunk + 1) * total // chunks


@njit(cache=True)
def _geometry(x, W, stride, pad):
    """Sizes of a convolution: padded input (Hp, Wp) and output (Ho, Wo)."""
    Hp, Wp = x.shape[2] + 2 * pad, x.shape[3] + 2 * pad
    K = W.shape[2]
    return Hp, Wp, (Hp - K) // stride + 1, (Wp - K) // stride + 1


@njit(cache=True)
def _samples_per_block(samples, Hp, Wp):
    """Stack at most BLOCK_NUMBERS numbers per channel, in blocks of (nearly) equal size."""
    blocks = -(-samples // max(1, BLOCK_NUMBERS // (Hp * Wp)))
    return -(-samples // blocks)


@njit(cache=True)
def _scratch(channels, samples, Hp, Wp, dtype):
    """Zeroed scratch for ``samples`` stacked padded planes per channel, plus room for rounded-up loops."""
    return np.zeros((channels, samples * Hp * Wp + SIMD_ROUND), dtype)


@njit(cache=True)
def _load_channel(x, n0, count, c, pad, Hp, Wp, block):
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
def _store_channel(block, n0, count, c, pad, Hp, Wp, dx):
    """The inverse of ``_load_channel``; what fell on the padding is dropped."""
    H, W = dx.shape[2], dx.shape[3]
    for b in range(count):
        for h in range(H):
            row = ((pad + h) * Wp + pad) * count + b
            for w in range(W):
                dx[n0 + b, c, h, w] = block[row + w * count]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _axpy(y, a, x):
    """y += a·x: with contiguous x and y, a loop the compiler turns into SIMD fused multiply-adds."""
    for k in range(y.size):
        y[k] += a * x[k]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _dot(x, y):
    """Σ_k x[k]·y[k]; ``reassoc`` lets the compiler keep several SIMD partial sums."""
    total = x.dtype.type(0)
    for k in range(x.size):
        total += x[k] * y[k]
    return total


@njit(cache=True)
def _run_length(count, Hp, Wp, K):
    """Length of the run of block positions that holds every stride-1 output — rows i < Hp − K + 1,
    columns j < Wp − K + 1, ``count`` samples each — rounded up to a multiple of SIMD_ROUND."""
    run = ((Hp - K) * Wp + Wp - K + 1) * count
    return -(-run // SIMD_ROUND) * SIMD_ROUND


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _correlate_channel(x_c, w_fc, run, Wp, count, z):
    """Add one input channel's contribution to one filter's stride-1 outputs, for a block of samples:

    z[(i·Wp + j)·count + b] += Σ_{p,q} w_fc[p, q] · x_c[((i + p)·Wp + j + q)·count + b]

    Output and input share the layout, so the shift by (p, q) is the same offset
    (p·Wp + q)·count for every output: one weight at a time, ``z += w · (shifted x)`` is
    ONE contiguous loop over the whole block — a SIMD loop. The outputs at columns
    j ≥ Wp − K + 1 straddle a row edge: computed too, never read.
    """
    K = w_fc.shape[0]
    for p in range(K):
        for q in range(K):
            shift = (p * Wp + q) * count
            _axpy(z[:run], w_fc[p, q], x_c[shift:shift + run])


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _correlate_channel_backward(dz, x_c, w_fc, run, Wp, count, dw_fc, dx_c, need_dx):
    """The two adjoints of ``_correlate_channel``, from dz = dL/dz (zero where z is not an output):

    dw_fc[p, q]        += Σ_k dz[k] · x_c[k + (p·Wp + q)·count]
    dx_c[k + (p·Wp + q)·count] += w_fc[p, q] · dz[k]
    """
    K = w_fc.shape[0]
    for p in range(K):
        for q in range(K):
            shift = (p * Wp + q) * count
            dw_fc[p, q] += _dot(dz[:run], x_c[shift:shift + run])
            if need_dx:
                _axpy(dx_c[shift:shift + run], w_fc[p, q], dz[:run])


@njit(cache=True)
def _pool_plane(z, row_step, col_step, plane_width, bias, relu, size, stride, out, switch):
    """Max-pool one plane into ``out``, adding ``bias`` and, if ``relu``, ReLU. Element (h, w) of
    the plane is z[h·row_step + w·col_step] (a conv of stride s reads every s-th stride-1 output).

    out[i, j]    = max_{h,w in window (i, j)} plane[h, w] + bias        (then max(·, 0) if relu)
    switch[i, j] = h·plane_width + w of the first maximum (the tie rule of np.argmax)

    max(z) + b = max(z + b) and ReLU(max) = max(ReLU): the order of the three does not matter.
    """
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
def _bias_relu_plane(z, row_step, col_step, bias, relu, out):
    """out[i, j] = z[i·row_step + j·col_step] + bias (then ReLU if ``relu``): a conv with no pooling after it."""
    Ho, Wo = out.shape
    for i in range(Ho):
        for j in range(Wo):
            value = z[i * row_step + j * col_step] + bias
            out[i, j] = value if value > 0 or not relu else 0


@njit(cache=True)
def _unpool_plane(dout, out, switch, relu, pooled, plane_width, row_step, col_step, dz):
    """Add into dz the gradient arriving at a plane before ReLU and pooling (element (h, w) of the
    plane is dz[h·row_step + w·col_step]); return its sum, the bias gradient of a conv's plane.

    pooled:   plane[switch[i, j]] += dout[i, j]   (a pixel winning overlapping windows gets each one's share)
    else:     plane[i, j] += dout[i, j]
    relu:     only where the output was positive (out > 0).
    """
    total = dz.dtype.type(0)
    Hq, Wq = dout.shape
    for i in range(Hq):
        for j in range(Wq):
            if relu and not out[i, j] > 0:
                continue
            h, w = i, j
            if pooled:
                h, w = switch[i, j] // plane_width, switch[i, j] % plane_width
            dz[h * row_step + w * col_step] += dout[i, j]
            total += dout[i, j]
    return total


# -- the kernels: one call per layer (parallel=True ones spread work items over the threads) --

@njit(cache=True)
def _conv_block_forward_chunk(x, W, b, stride, pad, relu, pool_size, pool_stride, out, switch, lo, hi):
    """Work items lo ≤ item < hi, item = (block of samples, filter), with this thread's own scratch."""
    N, C = x.shape[0], x.shape[1]
    F = W.shape[0]
    Hp, Wp, Ho, Wo = _geometry(x, W, stride, pad)
    per_block = _samples_per_block(N, Hp, Wp)
    block, z = _scratch(C, per_block, Hp, Wp, x.dtype), _scratch(1, per_block, Hp, Wp, x.dtype)[0]
    loaded = -1
    for item in range(lo, hi):
        block_index, f = item // F, item % F
        n0 = block_index * per_block
        count = min(per_block, N - n0)
        if block_index != loaded:
            for c in range(C):
                _load_channel(x, n0, count, c, pad, Hp, Wp, block[c])
            loaded = block_index
        run = _run_length(count, Hp, Wp, W.shape[2])
        z[:run] = 0
        for c in range(C):
            _correlate_channel(block[c], W[f, c], run, Wp, count, z)
        row_step, col_step = stride * Wp * count, stride * count     # output (i, j) at stride s
        for s in range(count):
            if pool_size > 0:
                _pool_plane(z[s:], row_step, col_step, Wo, b[f], relu, pool_size, pool_stride,
                            out[n0 + s, f], switch[n0 + s, f])
            else:
                _bias_relu_plane(z[s:], row_step, col_step, b[f], relu, out[n0 + s, f])


@njit(parallel=True, cache=True)
def conv_block_forward(x, W, b, stride, pad, relu, pool_size, pool_stride, out, switch, threads):
    """Conv + bias (+ ReLU) (+ max-pool, when pool_size > 0) for the whole batch.

    Threads: the work items (block of samples, filter), one contiguous chunk per thread.
    Each thread owns a padded copy of its current block and a scratch conv plane that
    stays in cache; when pooled, the conv plane never reaches memory.
    """
    Hp, Wp, _, _ = _geometry(x, W, stride, pad)
    items = -(-x.shape[0] // _samples_per_block(x.shape[0], Hp, Wp)) * W.shape[0]
    chunks = min(threads, items)
    for chunk in prange(chunks):
        lo, hi = _chunk(chunk, chunks, items)
        _conv_block_forward_chunk(x, W, b, stride, pad, relu, pool_size, pool_stride, out, switch, lo, hi)


@njit(cache=True)
def _conv_block_backward_chunk(dout, out, switch, x, W, stride, pad, relu, pooled, dW, db, dx, need_dx, lo, hi):
    """Work items lo ≤ item < hi, item = (block of samples, input channel c): add the item's
    share of dW[:, c] (and, from the item of channel 0, of db) into this thread's own copies
    ``dW``, ``db``; write dx[block, c], which no other item touches.

    dz, the gradient at the convolution's output for every filter, is rebuilt from the
    switches whenever the thread moves to a new block of samples.
    """
    N, C, F = x.shape[0], x.shape[1], W.shape[0]
    Hp, Wp, Ho, Wo = _geometry(x, W, stride, pad)
    per_block = _samples_per_block(N, Hp, Wp)
    x_c, dx_c = _scratch(1, per_block, Hp, Wp, x.dtype)[0], _scratch(1, per_block, Hp, Wp, x.dtype)[0]
    dz, bias_grad = _scratch(F, per_block, Hp, Wp, x.dtype), np.zeros(F, x.dtype)
    loaded = -1
    for item in range(lo, hi):
        block_index, c = item // C, item % C
        n0 = block_index * per_block
        count = min(per_block, N - n0)
        if block_index != loaded:
            dz[:] = 0
            for f in range(F):
                bias_grad[f] = 0
                for s in range(count):
                    bias_grad[f] += _unpool_plane(dout[n0 + s, f], out[n0 + s, f], switch[n0 + s, f], relu, pooled,
                                                  Wo, stride * Wp * count, stride * count, dz[f, s:])
            loaded = block_index
        if c == 0:
            db += bias_grad
        _load_channel(x, n0, count, c, pad, Hp, Wp, x_c)
        if need_dx:
            dx_c[:] = 0
        run = _run_length(count, Hp, Wp, W.shape[2])
        for f in range(F):
            _correlate_channel_backward(dz[f], x_c, W[f, c], run, Wp, count, dW[f, c], dx_c, need_dx)
        if need_dx:
            _store_channel(dx_c, n0, count, c, pad, Hp, Wp, dx)


@njit(cache=True)
def _zeroed_copies(copies, size, dtype):
    """``copies`` zeroed flat vectors of ``size``: one private gradient copy per thread."""
    return np.zeros((copies, size), dtype)


@njit(cache=True)
def _sum_copies(copies, total):
    """total[i] = Σ_k copies[k, i]: the reduction of the per-thread gradient copies (flat views)."""
    for i in range(total.size):
        value = copies[0, i]
        for k in range(1, copies.shape[0]):
            value += copies[k, i]
        total[i] = value


@njit(parallel=True, cache=True)
def conv_block_backward(dout, out, switch, x, W, stride, pad, relu, pooled, dW, db, dx, need_dx, threads):
    """Backward of ``conv_block_forward``: writes dW, db and (if need_dx) dx.

    Threads: the work items (block of samples, input channel), one contiguous chunk per
    thread — enough work even at batch 1. Each thread sums into its own copy of dW and db;
    the copies are added at the end, so no two threads ever write the same number.
    """
    Hp, Wp, _, _ = _geometry(x, W, stride, pad)
    items = -(-x.shape[0] // _samples_per_block(x.shape[0], Hp, Wp)) * x.shape[1]
    chunks = min(threads, items)
    dW_copies, db_copies = _zeroed_copies(chunks, dW.size, W.dtype), _zeroed_copies(chunks, db.size, W.dtype)
    for chunk in prange(chunks):
        lo, hi = _chunk(chunk, chunks, items)
        _conv_block_backward_chunk(dout, out, switch, x, W, stride, pad, relu, pooled,
                                   dW_copies[chunk].reshape(dW.shape), db_copies[chunk], dx, need_dx, lo, hi)
    _sum_copies(dW_copies, dW.reshape(-1))
    _sum_copies(db_copies, db)


@njit(cache=True)
def maxpool_kernel(x, size, stride, out, switch):
    """Max-pool every (sample, channel) plane (used only where a pool is not fused into a conv).

    One thread: the pass is memory-bound and cheap next to a convolution, and a parallel
    kernel costs seconds more to compile.
    """
    N, C, H, W = x.shape
    for item in range(N * C):
        n, c = item // C, item % C
        _pool_plane(x[n, c].reshape(H * W), W, 1, W, x.dtype.type(0), False, size, stride, out[n, c], switch[n, c])


@njit(cache=True)
def maxpool_backward_kernel(dout, switch, dx):
    """dx[n, c, switch] += dout, plane by plane (one thread, as ``maxpool_kernel``)."""
    N, C, H, W = dx.shape
    for item in range(N * C):
        n, c = item // C, item % C
        plane = dx[n, c].reshape(H * W)
        plane[:] = 0
        _unpool_plane(dout[n, c], dout[n, c], switch[n, c], False, True, W, W, 1, plane)


@njit(cache=True)
def relu_kernel(x, y):
    """y = max(x, 0) on flat arrays (memory-bound: one thread is enough at these sizes)."""
    for k in range(x.size):
        y[k] = x[k] if x[k] > 0 else 0


@njit(cache=True)
def relu_backward_kernel(dy, y, dx):
    """dx = dy where y > 0, else 0, on flat arrays."""
    for k in range(dy.size):
        dx[k] = dy[k] if y[k] > 0 else 0


@njit(cache=True)
def _dense_weight_grad_row(dy, x, o, dW_o):
    """dW[o] = Σ_n dy[n, o] · x[n]; returns db[o] = Σ_n dy[n, o]."""
    dW_o[:] = 0
    total = dy.dtype.type(0)
    for n in range(x.shape[0]):
        _axpy(dW_o, dy[n, o], x[n])
        total += dy[n, o]
    return total


@njit(cache=True)
def _dense_input_grad_row(dy, W, n, dx_n):
    """dx[n] = Σ_o dy[n, o] · W[o]."""
    dx_n[:] = 0
    for o in range(W.shape[0]):
        _axpy(dx_n, dy[n, o], W[o])


@njit(parallel=True, cache=True)
def dense_forward_kernel(x, W, b, y):
    """y[n, o] = Σ_i x[n, i] · W[o, i] + b[o]; threads take (sample, output) pairs."""
    N, O = y.shape
    for item in prange(N * O):
        n, o = item // O, item % O
        y[n, o] = _dot(x[n], W[o]) + b[o]


@njit(parallel=True, cache=True)
def dense_backward_kernel(dy, x, W, dx, dW, db, need_dx):
    """dW = dyᵀ·x and db = Σ_n dy (threads take rows o of dW), then dx = dy·W (threads take samples n).

    Every row has one owner, so there is nothing to reduce.
    """
    N, O = dy.shape
    for o in prange(O):
        db[o] = _dense_weight_grad_row(dy, x, o, dW[o])
    if need_dx:
        for n in prange(N):
            _dense_input_grad_row(dy, W, n, dx[n])


@njit(cache=True)
def sgd_momentum_kernel(params, velocity, grad, lr, momentum, weight_decay):
    """``cnn.stages.base.sgd_momentum_update`` in one pass over the flat vectors, no temporaries:

    v ← μ·v + (g + λ·θ)
    θ ← θ − η·v
    """
    for k in range(params.size):
        velocity[k] = velocity[k] * momentum + grad[k] + weight_decay * params[k]
        params[k] -= lr * velocity[k]


# -- the same kernels behind the common op signatures (they allocate their outputs) -----------

def _no_switch(N, F):
    """An empty switch array for kernels called without pooling (never read)."""
    return np.empty((N, F, 0, 0), np.int64)


def conv_forward(x, W, b, stride, pad):
    x = np.ascontiguousarray(x)
    N, _, H, Wd = x.shape
    F, _, K, _ = W.shape
    y = np.empty((N, F, window_count(H, K, stride, pad), window_count(Wd, K, stride, pad)), x.dtype)
    conv_block_forward(x, np.ascontiguousarray(W, x.dtype), np.ascontiguousarray(b, x.dtype),
                       stride, pad, False, 0, 0, y, _no_switch(N, F), numba.get_num_threads())
    return y


def conv_backward(dy, x, W, stride, pad):
    x, dy = np.ascontiguousarray(x), np.ascontiguousarray(dy, x.dtype)
    dx, dW, db = np.empty_like(x), np.empty(W.shape, x.dtype), np.empty(W.shape[0], x.dtype)
    conv_block_backward(dy, dy, _no_switch(*dy.shape[:2]), x, np.ascontiguousarray(W, x.dtype),
                        stride, pad, False, False, dW, db, dx, True, numba.get_num_threads())
    return dx, dW, db


def relu_forward(x):
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    relu_kernel(x.reshape(-1), y.reshape(-1))
    return y


def relu_backward(dy, y):
    y = np.ascontiguousarray(y)
    dy, dx = np.ascontiguousarray(dy, y.dtype), np.empty_like(y)
    relu_backward_kernel(dy.reshape(-1), y.reshape(-1), dx.reshape(-1))
    return dx


def maxpool_forward(x, size, stride):
    x = np.ascontiguousarray(x)
    N, C, H, W = x.shape
    shape = (N, C, window_count(H, size, stride), window_count(W, size, stride))
    y, argmax = np.empty(shape, x.dtype), np.empty(shape, np.int64)
    maxpool_kernel(x, size, stride, y, argmax)
    return y, argmax


def maxpool_backward(dy, argmax, x_shape, size, stride):
    dx = np.empty(x_shape, dy.dtype)
    maxpool_backward_kernel(np.ascontiguousarray(dy), np.ascontiguousarray(argmax, np.int64), dx)
    return dx


def dense_forward(x, W, b):
    x = np.ascontiguousarray(x)
    y = np.empty((x.shape[0], W.shape[0]), x.dtype)
    dense_forward_kernel(x, np.ascontiguousarray(W, x.dtype), np.ascontiguousarray(b, x.dtype), y)
    return y


def dense_backward(dy, x, W):
    x = np.ascontiguousarray(x)
    dx, dW, db = np.empty_like(x), np.empty(W.shape, x.dtype), np.empty(W.shape[0], x.dtype)
    dense_backward_kernel(np.ascontiguousarray(dy, x.dtype), x, np.ascontiguousarray(W, x.dtype), dx, dW, db, True)
    return dx, dW, db


# -- the stage: a fusion plan, and buffers kept per batch size -------------------------------

class Step(NamedTuple):
    """One kernel call of the forward pass, covering ``layers`` starting at net.layers[first]."""

    kind: str        # "conv_relu_pool", "conv", "relu", "maxpool", "flatten", "dense"
    first: int
    layers: tuple


_KIND = {Conv: "conv", ReLU: "relu", MaxPool: "maxpool", Flatten: "flatten", Dense: "dense"}


def fusion_plan(net: Network, fuse: bool = True) -> list[Step]:
    """The layers grouped into kernel calls: every Conv → ReLU → MaxPool becomes one fused step (if ``fuse``)."""
    steps, layers, index = [], net.layers, 0
    while index < len(layers):
        group = layers[index:index + 3]
        if fuse and [type(layer) for layer in group] == [Conv, ReLU, MaxPool]:
            steps.append(Step("conv_relu_pool", index, group))
        else:
            steps.append(Step(_KIND[type(layers[index])], index, layers[index:index + 1]))
        index += len(steps[-1].layers)
    return steps


class Buffers(NamedTuple):
    """Everything one batch size needs, allocated once: per step its output, switches and input gradient."""

    outputs: list
    switches: list
    input_grads: list


class NumbaCpuStage(HostStage):
    name = "numba-cpu"
    summary = "stage-1 loops compiled with Numba: threads over the batch, conv+ReLU+pool fused"
    ops = Ops(conv_forward, conv_backward, relu_forward, relu_backward,
              maxpool_forward, maxpool_backward, dense_forward, dense_backward)

    MAX_BUFFER_SETS = 4     # batch sizes kept (training, last partial batch, evaluation, ...)

    def __init__(self, net: Network, dtype=np.float32, fuse: bool = True):
        """``fuse=False`` runs every layer as its own kernel: what fusion buys, measured by the benchmark."""
        super().__init__(net, dtype)
        self.plan = fusion_plan(net, fuse)
        self._buffer_sets: dict = {}
        self._first_step_grad = None     # what the lazy ``input_grad`` needs

    # -- the phases -------------------------------------------------------------------------
    def forward(self):
        buffers = self._buffers(self.images.shape[0], "train")
        self.logits, self.step_inputs = self._forward_steps(self.images, buffers)
        self.step_buffers = buffers
        self.loss, self.dlogits = softmax_cross_entropy(self.logits, self.labels)
        self._first_step_grad = self._input_grad = None

    def backward(self):
        grad = self.dlogits
        for index in reversed(range(1, len(self.plan))):
            grad = self._step_backward(index, grad, need_dx=True)
        self._step_backward(0, grad, need_dx=False)
        self._first_step_grad, self._input_grad = grad, None

    def update(self, lr, momentum, weight_decay):
        dtype = self.dtype.type
        sgd_momentum_kernel(self.params, self.velocity, self.grad, dtype(lr), dtype(momentum), dtype(weight_decay))
        self._first_step_grad = self._input_grad = None    # the weights it needs have changed

    def predict(self, images):
        images = np.ascontiguousarray(images, dtype=self.dtype)
        logits, _ = self._forward_steps(images, self._buffers(images.shape[0], "predict"))
        return logits.copy()

    @property
    def input_grad(self):
        """dL/d(images), computed on first use after backward() (training never needs it)."""
        if self._first_step_grad is None:
            raise RuntimeError(f"stage {self.name!r}: input_grad exists between backward() and update(); "
                               "call backward() first")
        if self._input_grad is None:
            self._input_grad = self._step_backward(0, self._first_step_grad, need_dx=True).copy()
        return self._input_grad

    # -- internals ---------------------------------------------------------------------------
    def _buffers(self, batch: int, purpose: str) -> Buffers:
        """The buffers of this batch size, made on first use (predict keeps its own set)."""
        key = (batch, purpose)
        if key not in self._buffer_sets:
            if len(self._buffer_sets) >= self.MAX_BUFFER_SETS:
                self._buffer_sets.pop(next(iter(self._buffer_sets)))
            shapes = self.net.activation_shapes()
            outputs, switches, input_grads = [], [], []
            for step in self.plan:
                shape_in, shape_out = shapes[step.first], shapes[step.first + len(step.layers)]
                pooled = step.kind in ("conv_relu_pool", "maxpool")
                outputs.append(np.empty((batch, *shape_out), self.dtype))
                switches.append(np.empty((batch, *shape_out), np.int64) if pooled else _no_switch(batch, 0))
                input_grads.append(np.empty((batch, *shape_in), self.dtype))
            self._buffer_sets[key] = Buffers(outputs, switches, input_grads)
        return self._buffer_sets[key]

    def _forward_steps(self, x, buffers: Buffers):
        """Run every step into its buffers; return the logits and each step's input."""
        inputs = []
        for step, out, switch in zip(self.plan, buffers.outputs, buffers.switches):
            inputs.append(x)
            params, layer = self.param_views[step.first], step.layers[0]
            if step.kind == "conv_relu_pool":
                pool = step.layers[2]
                conv_block_forward(x, params["W"], params["b"], layer.stride, layer.pad,
                                   True, pool.size, pool.stride, out, switch, numba.get_num_threads())
            elif step.kind == "conv":
                conv_block_forward(x, params["W"], params["b"], layer.stride, layer.pad,
                                   False, 0, 0, out, _no_switch(x.shape[0], layer.out_channels),
                                   numba.get_num_threads())
            elif step.kind == "relu":
                relu_kernel(x.reshape(-1), out.reshape(-1))
            elif step.kind == "maxpool":
                maxpool_kernel(x, layer.size, layer.stride, out, switch)
            elif step.kind == "flatten":
                out = x.reshape(x.shape[0], -1)
            else:
                dense_forward_kernel(x, params["W"], params["b"], out)
            x = out
        return x, inputs

    def _step_backward(self, index, grad_out, need_dx):
        """Backward through step ``index``: return dL/d(its input) (None if not need_dx), write its dW, db."""
        step, buffers = self.plan[index], self.step_buffers
        x, out, switch = self.step_inputs[index], buffers.outputs[index], buffers.switches[index]
        dx = buffers.input_grads[index]
        params, grads, layer = self.param_views[step.first], self.grad_views[step.first], step.layers[0]
        if step.kind in ("conv_relu_pool", "conv"):
            fused = step.kind == "conv_relu_pool"
            if not fused:
                out, switch = grad_out, _no_switch(*grad_out.shape[:2])
            conv_block_backward(grad_out, out, switch, x, params["W"], layer.stride, layer.pad,
                                fused, fused, grads["W"], grads["b"], dx, need_dx, numba.get_num_threads())
        elif step.kind == "relu":
            relu_backward_kernel(grad_out.reshape(-1), out.reshape(-1), dx.reshape(-1))
        elif step.kind == "maxpool":
            maxpool_backward_kernel(grad_out, switch, dx)
        elif step.kind == "flatten":
            return grad_out.reshape(x.shape)
        else:
            dense_backward_kernel(grad_out, x, params["W"], dx, grads["W"], grads["b"], need_dx)
        return dx if need_dx else None
