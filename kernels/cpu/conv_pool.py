"""Conv + bias (+ ReLU) (+ max-pool) as ONE compiled, threaded kernel on the CPU, and its backward.

Forward, each thread takes work items (block of samples, filter): it correlates every input
channel into a scratch conv plane that stays in cache, then pools it straight into the output
(``pool.pool_plane``), so only the pooled output and the argmax switches reach memory; a wide layer
(a long patch of C·K·K numbers) followed by 2 × 2 pooling goes a pooling window at a time from its
patches instead (``conv_patches.window_forward``). Backward, a layer whose patch is long takes only
the terms the switches select, from the winners' patches (``conv_patches``); a layer with short
patches takes whole planes: items are
(block of samples, input channel), the gradient at the conv output is rebuilt from the switches
into the scratch plane, and dW, db, dx taken from it. Each thread sums dW and db into its own copy,
added up at the end (no races, no atomics). The layout and the SIMD loops are ``layout.py``'s.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.layout import (SIMD_ROUND, chunk_range, dot_4x4, fma_4x4, geometry, load_channel, run_length,
                                samples_per_block, scratch, store_channel)
from kernels.cpu.conv_patches import PATCH_MIN_TAPS, WINDOW_MIN_TAPS, patch_backward, window_forward
from kernels.cpu.pool import pool_plane, unpool_plane
from kernels.cpu.winograd import tile_blocks, uses_winograd, weights_shape, winograd_forward, winograd_weights


@njit(cache=True)
def tap_table(C, K, Wp):
    """The taps (c, p, q) of a convolution, numbered c·K² + p·K + q, as rows (c, p·Wp + q): the channel and
    the shift, in positions, of the tap's input window. Padded with tap 0 to a multiple of four (the
    padding taps get weight 0)."""
    taps = C * K * K
    table = np.zeros((-(-taps // 4) * 4, 2), np.int64)
    for t in range(taps):
        c, p, q = t // (K * K), t % (K * K) // K, t % K
        table[t, 0], table[t, 1] = c, p * Wp + q
    return table


@njit(cache=True)
def weight_tiles(W):
    """W as 4 × 4 tiles for ``fma_4x4``: tiles[g, h, i, j] = W[4g + i, tap 4h + j] (0 past the last filter
    or tap), taps numbered as in ``tap_table``."""
    F, C, K = W.shape[0], W.shape[1], W.shape[2]
    taps = C * K * K
    tiles = np.zeros((-(-F // 4), -(-taps // 4), 4, 4), W.dtype)
    flat = W.reshape((F, taps))
    for f in range(F):
        for t in range(taps):
            tiles[f // 4, t // 4, f % 4, t % 4] = flat[f, t]
    return tiles


@njit(cache=True)
def _four_taps(table, t, count):
    """Where the input windows of taps t … t+3 start in the block: (their channels, their shifts (p·Wp + q)·count)."""
    return ((table[t, 0], table[t + 1, 0], table[t + 2, 0], table[t + 3, 0]),
            (table[t, 1] * count, table[t + 1, 1] * count, table[t + 2, 1] * count, table[t + 3, 1] * count))


@njit(cache=True)
def _correlate_filters(block, tiles, table, run, count, z):
    """The stride-1 outputs of a group of four filters (tiles = its weight tiles; a filter past the
    last has weights 0 and its output is never read), for a block of samples:

    z[i, (y·Wp + x)·count + b] = Σ_{c,p,q} W[f0 + i, c, p, q] · block[c, ((y + p)·Wp + x + q)·count + b]

    Output and input share the layout, so the shift by (p, q) is the same offset (p·Wp + q)·count
    for every output: each term is ONE contiguous loop over the whole block — a SIMD loop —
    and ``fma_4x4`` takes four filters × four taps (c, p, q) in one pass. The outputs at
    columns x ≥ Wp − K + 1 straddle a row edge: computed too, never read.
    """
    z0, z1, z2, z3 = z[0, :run], z[1, :run], z[2, :run], z[3, :run]
    for h in range(tiles.shape[0]):
        channels, shifts = _four_taps(table, 4 * h, count)
        fma_4x4(z0, z1, z2, z3, block, channels, shifts, tiles[h])


@njit(cache=True)
def _filter_gradients(dz, margin, x_c, c, table, run, count, sums, dW):
    """dW[f, c, p, q] += Σ_k dz[f, k] · x_c[k + (p·Wp + q)·count] for every filter f and tap (p, q) of
    channel c: ``dot_4x4`` takes four filters × four taps in one pass (the planes start at dz[f, margin];
    dz has a zero row for each filter number past the last, up to a multiple of four). ``table`` holds
    the taps of ONE channel (``tap_table(1, K, Wp)``); ``sums`` is (4, 4) scratch."""
    F, K = dW.shape[0], dW.shape[2]
    taps = K * K
    single = x_c.reshape((1, x_c.size))
    at_margin = (margin, margin, margin, margin)
    for f0 in range(0, F, 4):
        for t0 in range(0, taps, 4):
            sums[:] = 0
            _, shifts = _four_taps(table, t0, count)
            dot_4x4(dz, (f0, f0 + 1, f0 + 2, f0 + 3), at_margin, single, (0, 0, 0, 0), shifts, run, sums)
            for i in range(min(4, F - f0)):
                for j in range(min(4, taps - t0)):
                    dW[f0 + i, c, (t0 + j) // K, (t0 + j) % K] += sums[i, j]


@njit(cache=True)
def input_tiles(W):
    """W as 4 × 4 tiles for the input gradient: tiles[g, p, h, i, j] = W[f, 4g + i, p, q] for the term
    u = 4h + j = f·K + q (0 past the last channel or term)."""
    F, C, K = W.shape[0], W.shape[1], W.shape[2]
    terms = F * K
    tiles = np.zeros((-(-C // 4), K, -(-terms // 4), 4, 4), W.dtype)
    for c in range(C):
        for p in range(K):
            for u in range(terms):
                tiles[c // 4, p, u // 4, c % 4, u % 4] = W[u // K, c, p, u % K]
    return tiles


@njit(cache=True)
def _dz_term(margin, K, u, terms, count):
    """Where the dz window of term u = f·K + q lies: plane f, read q·count earlier (a term past the last:
    term 0, weight 0)."""
    u = u if u < terms else 0
    return u // K, margin - (u % K) * count


@njit(cache=True)
def _input_gradients(dz, margin, F, tiles, K, run, Wp, count, dx4):
    """dL/dx for a group of four input channels i (tiles = the group's weight tiles):

    dx4[i, p·Wp·count + k] += Σ_{f,q} W[f, c_i, p, q] · dz[f, margin + k − q·count]      for each row p

    The scatter dx[k + (p·Wp + q)·count] += W·dz[f, k] written as a gather, so that the terms add
    into the same dx element: ``fma_4x4`` takes four channels × four terms (f, q) in one pass. The
    ``margin`` ≥ (K−1)·count zeros before each plane stand for the dz[k − q·count] with k < q·count.
    """
    length, terms = run + (K - 1) * count, F * K
    for p in range(K):
        at = p * Wp * count
        y0, y1, y2, y3 = dx4[0, at:at + length], dx4[1, at:at + length], dx4[2, at:at + length], dx4[3, at:at + length]
        for h in range(tiles.shape[1]):
            f0, s0 = _dz_term(margin, K, 4 * h, terms, count)
            f1, s1 = _dz_term(margin, K, 4 * h + 1, terms, count)
            f2, s2 = _dz_term(margin, K, 4 * h + 2, terms, count)
            f3, s3 = _dz_term(margin, K, 4 * h + 3, terms, count)
            fma_4x4(y0, y1, y2, y3, dz, (f0, f1, f2, f3), (s0, s1, s2, s3), tiles[p, h])


@njit(cache=True)
def _bias_relu_plane(z, first, row_step, col_step, bias, relu, out, n, f):
    """out[n, f, i, j] = z[first + i·row_step + j·col_step] + bias (then ReLU if ``relu``): a conv with no
    pooling after it (arrays and indices, not views, as ``pool.pool_plane``)."""
    Ho, Wo = out.shape[2], out.shape[3]
    for i in range(Ho):
        for j in range(Wo):
            value = z[first + i * row_step + j * col_step] + bias
            out[n, f, i, j] = value if value > 0 or not relu else 0


@njit(cache=True)
def _conv_block_forward_chunk(x, W, U, b, stride, pad, relu, pool_size, pool_stride, out, switch, lo, hi):
    """Work items lo ≤ item < hi of the forward (``conv_items``): by Winograd's F(2 × 2, 5 × 5) when it applies
    (``takes_winograd``; U: its transformed weights), a pooling window at a time when ``uses_windows``, else a
    plane at a time (``_plane_forward``)."""
    if takes_winograd(x, W, stride, pad, pool_size, pool_stride):
        winograd_forward(x, U, b, pad, relu, out, switch, lo, hi)
    elif uses_windows(x, W, stride, pad, pool_size, pool_stride):
        window_forward(x, W, b, pad, relu, out, switch, lo, hi)
    else:
        _plane_forward(x, W, b, stride, pad, relu, pool_size, pool_stride, out, switch, lo, hi)


@njit(cache=True)
def takes_winograd(x, W, stride, pad, pool_size, pool_stride):
    """Whether the forward goes by Winograd's F(2 × 2, 5 × 5) (``winograd.uses_winograd``)."""
    return uses_winograd(x.shape[1], x.shape[2], x.shape[3], W.shape[2], stride, pad, pool_size, pool_stride)


@njit(cache=True)
def transformed_weights(x, W, stride, pad, pool_size, pool_stride):
    """The forward's Winograd weights U (``winograd.winograd_weights``) when it takes that path, else none: taken
    once for all the work items of a call."""
    if not takes_winograd(x, W, stride, pad, pool_size, pool_stride):
        return np.zeros((0, 0, 0, 4, 4), W.dtype)
    U = np.zeros(weights_shape(W.shape[0], W.shape[1]), W.dtype)
    winograd_weights(W, U)
    return U


@njit(cache=True)
def _plane_forward(x, W, b, stride, pad, relu, pool_size, pool_stride, out, switch, lo, hi):
    """Work items lo ≤ item < hi, item = (block of samples, group of four filters), with this thread's own scratch."""
    N, C = x.shape[0], x.shape[1]
    F, groups = W.shape[0], -(-W.shape[0] // 4)
    Hp, Wp, Ho, Wo = geometry(x, W, stride, pad)
    per_block = samples_per_block(N, Hp, Wp)
    block, z = scratch(C, per_block, Hp, Wp, x.dtype), scratch(4, per_block, Hp, Wp, x.dtype)
    tiles, table = weight_tiles(W), tap_table(C, W.shape[2], Wp)
    planes, plane_size = z.reshape(z.size), z.shape[1]
    loaded = -1
    for item in range(lo, hi):
        block_index, f0 = item // groups, 4 * (item % groups)
        n0 = block_index * per_block
        count = min(per_block, N - n0)
        if block_index != loaded:
            for c in range(C):
                load_channel(x, n0, count, c, pad, Hp, Wp, block[c])
            loaded = block_index
        run = run_length(count, Hp, Wp, W.shape[2])
        z[:, :run] = 0
        _correlate_filters(block, tiles[f0 // 4], table, run, count, z)
        row_step, col_step = stride * Wp * count, stride * count     # output (i, j) at stride s
        for f in range(f0, min(F, f0 + 4)):
            for s in range(count):
                first = (f - f0) * plane_size + s
                if pool_size > 0:
                    pool_plane(planes, first, row_step, col_step, Wo, b[f], relu, pool_size, pool_stride,
                               out, switch, n0 + s, f)
                else:
                    _bias_relu_plane(planes, first, row_step, col_step, b[f], relu, out, n0 + s, f)


@njit(cache=True)
def uses_patches(W):
    """Whether the backward takes the winners' patches (``conv_patches``: a patch of at least PATCH_MIN_TAPS
    numbers) rather than the whole planes."""
    return W.shape[1] * W.shape[2] * W.shape[3] >= PATCH_MIN_TAPS


@njit(cache=True)
def uses_windows(x, W, stride, pad, pool_size, pool_stride):
    """Whether the forward goes a pooling window at a time (``conv_patches.window_forward``: stride 1, 2 × 2
    windows every 2 pixels, a patch of at least WINDOW_MIN_TAPS numbers, and planes whose straddling
    columns — K − 1 of Wp — would be a quarter of the work or more) rather than a plane at a time."""
    K, Wp = W.shape[2], x.shape[3] + 2 * pad
    taps = W.shape[1] * K * K
    return stride == 1 and pool_size == 2 and pool_stride == 2 and taps >= WINDOW_MIN_TAPS and 4 * (K - 1) >= Wp


@njit(cache=True)
def conv_items(x, W, stride, pad, pool_size, pool_stride, backward):
    """Work items of a convolution over the samples of x: blocks of samples where the forward goes by Winograd
    (``winograd.tile_blocks``), samples where it takes the patches (forward ``uses_windows``, backward
    ``uses_patches``), else (block of samples, group of four filters) forward and (block of samples, group of
    four input channels) backward (the planes)."""
    if not backward and takes_winograd(x, W, stride, pad, pool_size, pool_stride):
        return tile_blocks(x, pad)
    if uses_patches(W) if backward else uses_windows(x, W, stride, pad, pool_size, pool_stride):
        return x.shape[0]
    Hp, Wp, _, _ = geometry(x, W, stride, pad)
    blocks = -(-x.shape[0] // samples_per_block(x.shape[0], Hp, Wp))
    return blocks * -(-(x.shape[1] if backward else W.shape[0]) // 4)


@njit(parallel=True, cache=True)
def conv_block_forward(x, W, b, stride, pad, relu, pool_size, pool_stride, out, switch, threads):
    """Conv + bias (+ ReLU) (+ max-pool, when pool_size > 0) for the whole batch.

    Threads: the work items (``conv_items``), one contiguous chunk per thread. Each thread owns a
    padded copy of its current block and a scratch conv plane that stays in cache (or its patches,
    a sample at a time); when pooled, the conv output never reaches memory.
    """
    items = conv_items(x, W, stride, pad, pool_size, pool_stride, False)
    U = transformed_weights(x, W, stride, pad, pool_size, pool_stride)
    chunks = min(threads, items)
    for chunk in prange(chunks):
        lo, hi = chunk_range(chunk, chunks, items)
        _conv_block_forward_chunk(x, W, U, b, stride, pad, relu, pool_size, pool_stride, out, switch, lo, hi)


@njit(cache=True)
def _conv_block_backward_chunk(dout, out, switch, x, W, stride, pad, relu, pool_size, pool_stride, dW, db, dx,
                               need_dx, lo, hi):
    """Work items lo ≤ item < hi of the backward (``conv_items``): add their share of dW and db into this
    thread's own copies ``dW``, ``db``; write their part of dx. The winners' patches when the patch is long
    enough (``uses_patches``), else the planes (``_plane_backward``)."""
    if uses_patches(W):
        patch_backward(dout, out, switch, x, W, stride, pad, relu, pool_size > 0, dW, db, dx, need_dx, lo, hi)
    else:
        _plane_backward(dout, out, switch, x, W, stride, pad, relu, pool_size, pool_stride, dW, db, dx, need_dx, lo, hi)


@njit(cache=True)
def _plane_backward(dout, out, switch, x, W, stride, pad, relu, pool_size, pool_stride, dW, db, dx, need_dx, lo, hi):
    """Work items lo ≤ item < hi, item = (block of samples, group of four input channels): add the
    item's share of dW[:, c] (and, from the item of the first group, of db) into this thread's own
    copies ``dW``, ``db``; write dx[block, c] for the group's channels, which no other item touches.

    dz, the gradient at the convolution's output for every filter, is rebuilt from the
    switches whenever the thread moves to a new block of samples.
    """
    N, C, F, K = x.shape[0], x.shape[1], W.shape[0], W.shape[2]
    groups = -(-C // 4)
    Hp, Wp, Ho, Wo = geometry(x, W, stride, pad)
    per_block = samples_per_block(N, Hp, Wp)
    x4, dx4 = scratch(4, per_block, Hp, Wp, x.dtype), scratch(4 if need_dx else 0, per_block, Hp, Wp, x.dtype)
    margin = (K - 1) * per_block                    # zeros before each dz plane (see _input_gradients)
    rows = -(-F // 4) * 4                           # zero planes up to a multiple of four filters (dot_4x4)
    dz, bias_grad = np.empty((rows, margin + per_block * Hp * Wp + SIMD_ROUND), x.dtype), np.zeros(F, x.dtype)
    table, sums, tiles = tap_table(1, K, Wp), np.zeros((4, 4), x.dtype), input_tiles(W)
    dz_planes, dz_size = dz.reshape(dz.size), dz.shape[1]
    loaded = -1
    for item in range(lo, hi):
        block_index, c0 = item // groups, 4 * (item % groups)
        n0 = block_index * per_block
        count = min(per_block, N - n0)
        if block_index != loaded:                 # (always at the first item: dz starts as np.empty)
            dz[:] = 0
            for f in range(F):
                bias_grad[f] = 0
                for s in range(count):
                    bias_grad[f] += unpool_plane(dout, out, switch, n0 + s, f, relu, pool_size, pool_stride, Wo,
                                                  dz_planes, f * dz_size + margin + s, stride * Wp * count, stride * count)
            loaded = block_index
        if c0 == 0:
            db += bias_grad
        run = run_length(count, Hp, Wp, K)
        for c in range(c0, min(C, c0 + 4)):
            load_channel(x, n0, count, c, pad, Hp, Wp, x4[c - c0])
            _filter_gradients(dz, margin, x4[c - c0], c, table, run, count, sums, dW)
        if need_dx:
            dx4[:] = 0
            _input_gradients(dz, margin, F, tiles[c0 // 4], K, run, Wp, count, dx4)
            for c in range(c0, min(C, c0 + 4)):
                store_channel(dx4[c - c0], n0, count, c, pad, Hp, Wp, dx)


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
def conv_block_backward(dout, out, switch, x, W, stride, pad, relu, pool_size, pool_stride, dW, db, dx, need_dx,
                        threads):
    """Backward of ``conv_block_forward``: writes dW, db and (if need_dx) dx.

    Threads: the work items (``conv_items``), one contiguous chunk per thread. Each thread sums into
    its own copy of dW and db; the copies are added at the end, so no two threads ever write the
    same number.
    """
    items = conv_items(x, W, stride, pad, pool_size, pool_stride, True)
    chunks = min(threads, items)
    dW_copies, db_copies = _zeroed_copies(chunks, dW.size, W.dtype), _zeroed_copies(chunks, db.size, W.dtype)
    for chunk in prange(chunks):
        lo, hi = chunk_range(chunk, chunks, items)
        _conv_block_backward_chunk(dout, out, switch, x, W, stride, pad, relu, pool_size, pool_stride,
                                   dW_copies[chunk].reshape(dW.shape), db_copies[chunk], dx, need_dx, lo, hi)
    _sum_copies(dW_copies, dW.reshape(-1))
    _sum_copies(db_copies, db)
