"""Conv + bias (+ ReLU) (+ max-pool) as ONE compiled, threaded kernel on the CPU, and its backward.

Forward, each thread takes work items (block of samples, filter): it correlates every input
channel into a scratch conv plane that stays in cache, then pools it straight into the output
(``pool.pool_plane``), so only the pooled output and the argmax switches reach memory. Backward,
items are (block of samples, input channel): the gradient at the conv output is rebuilt from the
switches into the scratch plane, and dW, db, dx taken from it; each thread sums dW and db into
its own copy, added up at the end (no races, no atomics). The layout and the SIMD loops are
``layout.py``'s.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.layout import (SAFE_FASTMATH, SIMD_ROUND, axpy, axpy4, chunk_range, dot, dot4, geometry, load_channel,
                                run_length, samples_per_block, scratch, store_channel, taps)
from kernels.cpu.pool import pool_plane, unpool_plane


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _correlate_channel(x_c, w_fc, run, Wp, count, z):
    """Add one input channel's contribution to one filter's stride-1 outputs, for a block of samples:

    z[(i·Wp + j)·count + b] += Σ_{p,q} w_fc[p, q] · x_c[((i + p)·Wp + j + q)·count + b]

    Output and input share the layout, so the shift by (p, q) is the same offset
    (p·Wp + q)·count for every output: ``z += w · (shifted x)`` is ONE contiguous loop over
    the whole block — a SIMD loop — and four neighbouring taps q … q+3 of a row go in one
    pass (``axpy4``). The outputs at columns j ≥ Wp − K + 1 straddle a row edge: computed
    too, never read.
    """
    K = w_fc.shape[0]
    for p in range(K):
        q = 0
        while q + 4 <= K:
            x0, x1, x2, x3 = taps(x_c, (p * Wp + q) * count, count, run)
            axpy4(z[:run], w_fc[p, q], x0, w_fc[p, q + 1], x1, w_fc[p, q + 2], x2, w_fc[p, q + 3], x3)
            q += 4
        for q in range(q, K):
            shift = (p * Wp + q) * count
            axpy(z[:run], w_fc[p, q], x_c[shift:shift + run])


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _correlate_channel_backward(dz, margin, x_c, w_fc, run, Wp, count, dw_fc, dx_c, need_dx):
    """The two adjoints of ``_correlate_channel``, from dz = dL/dz (zero where z is not an output;
    the plane starts at dz[margin], after ``margin`` ≥ (K−1)·count zeros):

    dw_fc[p, q] += Σ_k dz[k] · x_c[k + (p·Wp + q)·count]                 (``dot4``: four taps a pass)
    dx_c[p·Wp·count + k] += Σ_q w_fc[p, q] · dz[k − q·count]             (``axpy4``: four taps a pass)

    The second is the scatter dx_c[k + shift] += w·dz[k] written as a gather, so that four
    taps add into the same dx element at once; the zeros before the plane stand for the
    dz[k − q·count] with k < q·count.
    """
    K = w_fc.shape[0]
    plane = dz[margin:]
    for p in range(K):
        q = 0
        while q + 4 <= K:
            x0, x1, x2, x3 = taps(x_c, (p * Wp + q) * count, count, run)
            t0, t1, t2, t3 = dot4(plane[:run], x0, x1, x2, x3)
            dw_fc[p, q] += t0
            dw_fc[p, q + 1] += t1
            dw_fc[p, q + 2] += t2
            dw_fc[p, q + 3] += t3
            q += 4
        for q in range(q, K):
            shift = (p * Wp + q) * count
            dw_fc[p, q] += dot(plane[:run], x_c[shift:shift + run])
    if not need_dx:
        return
    length = run + (K - 1) * count
    for p in range(K):
        row = dx_c[p * Wp * count:p * Wp * count + length]
        q = 0
        while q + 4 <= K:
            d0, d1, d2, d3 = taps(dz, margin - (q + 3) * count, count, length)     # d3 is the tap q, d0 is q+3
            axpy4(row, w_fc[p, q], d3, w_fc[p, q + 1], d2, w_fc[p, q + 2], d1, w_fc[p, q + 3], d0)
            q += 4
        for q in range(q, K):
            axpy(row, w_fc[p, q], dz[margin - q * count:margin - q * count + length])


@njit(cache=True)
def _bias_relu_plane(z, row_step, col_step, bias, relu, out):
    """out[i, j] = z[i·row_step + j·col_step] + bias (then ReLU if ``relu``): a conv with no pooling after it."""
    Ho, Wo = out.shape
    for i in range(Ho):
        for j in range(Wo):
            value = z[i * row_step + j * col_step] + bias
            out[i, j] = value if value > 0 or not relu else 0


@njit(cache=True)
def _conv_block_forward_chunk(x, W, b, stride, pad, relu, pool_size, pool_stride, out, switch, lo, hi):
    """Work items lo ≤ item < hi, item = (block of samples, filter), with this thread's own scratch."""
    N, C = x.shape[0], x.shape[1]
    F = W.shape[0]
    Hp, Wp, Ho, Wo = geometry(x, W, stride, pad)
    per_block = samples_per_block(N, Hp, Wp)
    block, z = scratch(C, per_block, Hp, Wp, x.dtype), scratch(1, per_block, Hp, Wp, x.dtype)[0]
    loaded = -1
    for item in range(lo, hi):
        block_index, f = item // F, item % F
        n0 = block_index * per_block
        count = min(per_block, N - n0)
        if block_index != loaded:
            for c in range(C):
                load_channel(x, n0, count, c, pad, Hp, Wp, block[c])
            loaded = block_index
        run = run_length(count, Hp, Wp, W.shape[2])
        z[:run] = 0
        for c in range(C):
            _correlate_channel(block[c], W[f, c], run, Wp, count, z)
        row_step, col_step = stride * Wp * count, stride * count     # output (i, j) at stride s
        for s in range(count):
            if pool_size > 0:
                pool_plane(z[s:], row_step, col_step, Wo, b[f], relu, pool_size, pool_stride,
                            out[n0 + s, f], switch[n0 + s, f])
            else:
                _bias_relu_plane(z[s:], row_step, col_step, b[f], relu, out[n0 + s, f])


@njit(cache=True)
def conv_items(x, W, stride, pad, backward=False):
    """Work items of a convolution over the samples of x: (block of samples, filter) forward,
    (block of samples, input channel) backward."""
    Hp, Wp, _, _ = geometry(x, W, stride, pad)
    blocks = -(-x.shape[0] // samples_per_block(x.shape[0], Hp, Wp))
    return blocks * (x.shape[1] if backward else W.shape[0])


@njit(parallel=True, cache=True)
def conv_block_forward(x, W, b, stride, pad, relu, pool_size, pool_stride, out, switch, threads):
    """Conv + bias (+ ReLU) (+ max-pool, when pool_size > 0) for the whole batch.

    Threads: the work items (block of samples, filter), one contiguous chunk per thread.
    Each thread owns a padded copy of its current block and a scratch conv plane that
    stays in cache; when pooled, the conv plane never reaches memory.
    """
    items = conv_items(x, W, stride, pad)
    chunks = min(threads, items)
    for chunk in prange(chunks):
        lo, hi = chunk_range(chunk, chunks, items)
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
    Hp, Wp, Ho, Wo = geometry(x, W, stride, pad)
    per_block = samples_per_block(N, Hp, Wp)
    x_c, dx_c = scratch(1, per_block, Hp, Wp, x.dtype)[0], scratch(1, per_block, Hp, Wp, x.dtype)[0]
    margin = (W.shape[2] - 1) * per_block         # zeros before each dz plane (see _correlate_channel_backward)
    dz, bias_grad = np.zeros((F, margin + per_block * Hp * Wp + SIMD_ROUND), x.dtype), np.zeros(F, x.dtype)
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
                    bias_grad[f] += unpool_plane(dout[n0 + s, f], out[n0 + s, f], switch[n0 + s, f], relu, pooled,
                                                  Wo, stride * Wp * count, stride * count, dz[f, margin + s:])
            loaded = block_index
        if c == 0:
            db += bias_grad
        load_channel(x, n0, count, c, pad, Hp, Wp, x_c)
        if need_dx:
            dx_c[:] = 0
        run = run_length(count, Hp, Wp, W.shape[2])
        for f in range(F):
            _correlate_channel_backward(dz[f], margin, x_c, W[f, c], run, Wp, count, dW[f, c], dx_c, need_dx)
        if need_dx:
            store_channel(dx_c, n0, count, c, pad, Hp, Wp, dx)


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
    items = conv_items(x, W, stride, pad, True)
    chunks = min(threads, items)
    dW_copies, db_copies = _zeroed_copies(chunks, dW.size, W.dtype), _zeroed_copies(chunks, db.size, W.dtype)
    for chunk in prange(chunks):
        lo, hi = chunk_range(chunk, chunks, items)
        _conv_block_backward_chunk(dout, out, switch, x, W, stride, pad, relu, pooled,
                                   dW_copies[chunk].reshape(dW.shape), db_copies[chunk], dx, need_dx, lo, hi)
    _sum_copies(dW_copies, dW.reshape(-1))
    _sum_copies(db_copies, db)
