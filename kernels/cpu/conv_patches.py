"""A convolution computed from its patches: the forward of a wide layer a pooling window at a time, and the
backward from the patches pooling's winners select.

Max-pooling sends the gradient of each window to ONE position of the convolution's output — the
window's winner, its switch — so with 2 × 2 windows 3 numbers in 4 of dL/dz are zero, and the
plane kernels of ``conv_pool`` multiply them all the same. Here every nonzero term is taken alone,
as a sum of whole rows:

    dW[f]             += g · patch(h, w)     for each window of filter f, won at (h, w) with gradient g
    dx[patch(h, w)]   += Σ_f g_f · W[f]      for each position (h, w), over the filters whose window it won
    db[f]             += g

patch(h, w) is the C × K × K block of the zero-padded input under output (h, w): a row of stage 2's
im2col matrix. A sample at a time, the input is copied channels-last (``channels_last``: the C
numbers of a pixel side by side), so that a patch is K runs of K·C contiguous numbers, in (p, q, c)
order (W is put in the same order once a call: ``in_patch_order``). Then

    dW   for each filter, the patches its windows chose, four a pass (``add_runs``);
    dx   for each position, the filters whose windows chose it (``by_position``), and their rows of W
         added into that patch, four a pass.

A quarter of the multiply-adds (with 2 × 2 windows; a ReLU that passed nothing removes more, a
convolution without pooling is the same code with every position a window of one), in rows of
C·K·K numbers. But a gathered row costs a load for every multiply-add, where the plane kernels
keep their weights in registers, so the patches pay only when they are long: the stage takes them
when a patch holds at least ``PATCH_MIN_TAPS`` numbers (``conv_pool.uses_patches``). Measured for one
block of 8 samples, float32, one thread, when the rule was set (dW and dx; the first conv of a network
needs only dW; the patches always unfolded then, see below)::

    AlexNet-small conv 2 (32 -> 32 channels, 16 x 16)   planes 3.21 ms   patches 1.80 ms
    AlexNet-small conv 3 (32 -> 64 channels, 8 x 8)     planes 2.24 ms   patches 0.86 ms
    LeNet-5 conv 2 (6 -> 16 channels, 150 a patch)      planes 0.133     patches 0.122
    AlexNet-small conv 1 (3 -> 32, 75 a patch), dW      planes 0.77      patches 0.89   (below the line)
    LeNet-5 conv 1 (1 -> 6, 25 a patch), dW             planes 0.051     patches 0.135  (below the line)

Where the runs are long (K·C ≥ ``RUN_MIN_NUMBERS``: AlexNet-small's conv 2 and 3, 160 numbers), both are
read where they lie: dW from the channels-last input itself (20 × 20 × 32 numbers for conv 2: about L1),
and dx a kernel row p at a time, so that the rows W[:, p] it adds stay in L1 (20 KB). Where they are
short (LeNet-5's conv 2, 30 numbers), a pass over a run costs more than the run's sums, and the patches
go the long way: ``unfold`` copies the patch of every output position into one row of X first (the
rows of a whole sample, 16 × 16 × 800 numbers for conv 2, would stream from L2), dW adds rows of X, and
dx sums each position's v = Σ g_f · W[f] in one run and adds it back at its patch (``add_patch``).
Measured for one block of 8 samples, float32, one thread (dW and dx; the middle rows 8 to 32 channels in,
32 out, on 12 × 12 planes; 2026-11-28, 4 runs at load 0.3-1.4, medians of 20-60 calls a run, the three
taking turns; the two new ways as times the first, min-max of the runs)::

    K·C    layer                    first version (always unfolded)   unfolded      runs in place
     30    LeNet-5 conv 2           0.089-0.095 ms                    1.02-1.07x    1.24-1.27x
     40    8 channels               0.287-0.305                       0.98-1.00     1.32-1.35
     60    12 channels              0.420-0.437                       0.98-1.01     1.11-1.12
     80    16 channels              0.464-0.490                       0.99-1.02     1.01-1.02
    120    24 channels              0.679-0.741                       0.97-1.02     0.90-0.94
    160    32 channels              0.860-0.960                       1.00-1.02     0.81-0.84
    160    AlexNet-small conv 2     1.67-1.76                         0.93-1.00     0.77-0.80
    160    AlexNet-small conv 3     0.799-0.844                       0.98-1.03     0.85-0.90

(the same 8 samples each call, so in cache; over a whole batch, a block of 8 new samples a call, 4 runs:
AlexNet-small's conv 2 0.86-0.88-0.91x the first version, conv 3 0.88-0.95-0.97x, LeNet-5's conv 2 0.97-0.99x).
The passes run at 45-55 GFLOP/s even alone on numbers in L1 (``add_runs``: four loads and a load and a store
of y for four multiply-adds; 512-bit vectors measured no faster), about half the plane kernels' rate: what
pays here is skipping the three quarters of the gradient that pooling zeroes, not the speed of a pass.

Forward (``window_forward``), the same patches serve a conv of stride 1 followed by 2 × 2 max-pooling
every 2 pixels: one ``dot_4x4`` pass takes the patches of a pooling window's four corners against four
filters' rows — sixteen dot products of C·K·K numbers, their sums held in registers — and the window
is pooled straight from the sixteen sums. Unlike the plane kernels (``conv_pool``) it computes no
output that straddles a row edge, but it gathers its patches and ends every dot product in a
horizontal sum: it pays only where the planes waste much — K − 1 columns in Wp, a quarter or more —
on long patches (``conv_pool.uses_windows``). Measured for one block of 8 samples, float32, one
thread, the two taking turns (7 rounds; windows / planes, min-median-max; when the rule was set, and
again on 2026-11-28 after stage 3's reference-count changes, which sped the windows up more)::

                                                                when set          2026-11-28
    AlexNet-small conv 3 (32 -> 64 channels, 8 x 8, Wp 12)      0.82-0.82-0.83    0.73-0.74-0.75
    16 -> 32 channels, 12 x 12, pad 2 (Wp 16)                   0.88-0.88-0.90    0.97-0.98-0.99
    AlexNet-small conv 2 (32 -> 32 channels, 16 x 16, Wp 20)    1.07-1.08-1.08    0.94-0.95-0.97   (planes)
    16 -> 32 channels, 16 x 16, pad 2 (Wp 20)                   1.24-1.27-1.33    1.01-1.04-1.05   (planes)

AlexNet-small's conv 2 and 3 go by Winograd now (``winograd``: faster than both), so the rule, which
leaves ~5 % on conv 2's table, decides only for layers Winograd does not take.

Thread → data: the work items are samples; a call takes samples lo … hi−1, forward writes their pooled
outputs and switches; backward adds their dW and db into the copies it is given (each thread its own),
and dx[n] is written by the item of sample n alone.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu.layout import SAFE_FASTMATH, add_runs, dot_4x4, four_indices, geometry
from kernels.cpu.pool import first_max_of_four, gradient_reaching

PATCH_MIN_TAPS = 128     # C·K·K from which the backward takes the winners' patches (measured: see above)
RUN_MIN_NUMBERS = 96     # K·C from which the backward reads a patch's runs in place, not unfolded (see above)
WINDOW_MIN_TAPS = 256    # C·K·K from which a pooled conv's forward may go a window at a time (see above)


@njit(cache=True)
def channels_last(x_n, pad, Wp, x_cl, into):
    """One sample channels-last: x_cl[((pad + h)·Wp + pad + w)·C + c] = x_n[c, h, w] when ``into``, else back
    the other way (the border of x_cl is neither written nor read: what falls on it is dropped). Unsigned
    offsets, as in ``layout.load_channel``."""
    C, H, W = x_n.shape
    step = np.uint64(C)
    for c in range(C):
        for h in range(H):
            at = np.uint64(((pad + h) * Wp + pad) * C + c)
            for w in range(W):
                if into:
                    x_cl[at + np.uint64(w) * step] = x_n[c, h, w]
                else:
                    x_n[c, h, w] = x_cl[at + np.uint64(w) * step]


@njit(cache=True)
def unfold(x_cl, C, Wp, K, stride, Ho, Wo, X):
    """X[h·Wo + w, (p·K + q)·C + c] = padded input[c, h·stride + p, w·stride + q]: the patch under every output
    position, each one row, copied as K runs of K·C contiguous numbers (indexed in place, unsigned: no view,
    no reference count, no wraparound per run)."""
    KC = np.uint64(K * C)
    for h in range(Ho):
        for w in range(Wo):
            for p in range(np.uint64(K)):
                source = np.uint64(((h * stride) * Wp + w * stride) * C) + p * np.uint64(Wp * C)
                for k in range(KC):
                    X[h * Wo + w, p * KC + k] = x_cl[source + k]


@njit(cache=True)
def in_patch_order(W):
    """W as (F, K·K·C) rows in the order of a patch: Wt[f, (p·K + q)·C + c] = W[f, c, p, q]."""
    F, C, K = W.shape[0], W.shape[1], W.shape[2]
    Wt = np.empty((F, K * K * C), W.dtype)
    for f in range(F):
        for c in range(C):
            for p in range(K):
                for q in range(K):
                    Wt[f, (p * K + q) * C + c] = W[f, c, p, q]
    return Wt


@njit(cache=True)
def add_from_patch_order(dWt, dW):
    """dW[f, c, p, q] += dWt[f, (p·K + q)·C + c]: the inverse of ``in_patch_order``, added."""
    F, C, K = dW.shape[0], dW.shape[1], dW.shape[2]
    for f in range(F):
        for c in range(C):
            for p in range(K):
                for q in range(K):
                    dW[f, c, p, q] += dWt[f, (p * K + q) * C + c]


@njit(cache=True)
def winners(dout_n, out_n, switch_n, f, relu, pooled, Wo, rows, gs, first):
    """The nonzero terms of filter f's plane in one sample: rows[first + e] = the output position h·Wo + w its
    e-th window chose (every position when not pooled), gs[first + e] = the gradient it gets. Returns their
    count and the sum of all the gradient (the filter's db)."""
    count, total = 0, dout_n.dtype.type(0)
    for i in range(dout_n.shape[1]):
        for j in range(dout_n.shape[2]):
            g = gradient_reaching(dout_n[f, i, j], out_n[f, i, j], relu)
            total += g
            if g != 0:
                rows[first + count] = switch_n[f, i, j] if pooled else i * Wo + j
                gs[first + count] = g
                count += 1
    return count, total


@njit(cache=True)
def by_position(rows, gs, counts, windows, starts, filters, grads):
    """The terms of every filter f (rows[f·windows + e], gs[f·windows + e], e < counts[f]) regrouped by the
    position they chose: position k = h·Wo + w gets filters[starts[k]:starts[k + 1]] and their gradients
    grads[...]. Counted, summed and filled (a counting sort): no division, no search. ``starts`` has a number
    a position, plus one."""
    starts[:] = 0
    for f in range(counts.size):
        for e in range(f * windows, f * windows + counts[f]):
            starts[rows[e] + 1] += 1
    for k in range(1, starts.size):
        starts[k] += starts[k - 1]
    for f in range(counts.size):
        for e in range(f * windows, f * windows + counts[f]):
            at = starts[rows[e]]
            filters[at], grads[at] = f, gs[e]
            starts[rows[e]] = at + 1
    for k in range(starts.size - 1, 0, -1):       # the fill moved each start to the next one's: move them back
        starts[k] = starts[k - 1]
    starts[0] = 0


@njit(cache=True, fastmath=SAFE_FASTMATH)
def add_patch(x_cl, at, row_step, K, v):
    """The patch of x_cl whose first number is at ``at`` += v (K runs of K·C numbers, ``row_step`` apart).

    Indexed with unsigned integers: Numba then adds no wraparound for negative indices (which would keep the
    loop from SIMD) and, unlike views of each run, no atomic reference count per run (see ``layout.add_runs``)."""
    run = np.uint64(v.size // K)
    for p in range(np.uint64(K)):
        target, part = np.uint64(at) + p * np.uint64(row_step), p * run
        for k in range(run):
            x_cl[target + k] += v[part + k]


@njit(cache=True)
def patch_origins(Ho, Wo, stride, Wp, C):
    """origin[h·Wo + w] = where the patch under output (h, w) starts in the channels-last padded input."""
    origin = np.empty(Ho * Wo, np.int64)
    for h in range(Ho):
        for w in range(Wo):
            origin[h * Wo + w] = (h * stride * Wp + w * stride) * C
    return origin


@njit(cache=True)
def patch_backward(dout, out, switch, x, W, stride, pad, relu, pooled, dW, db, dx, need_dx, lo, hi):
    """Backward of conv + bias (+ ReLU) (+ max-pool when ``pooled``: its switches say where) for samples lo … hi−1
    from the winners' patches: adds into dW and db; writes dx[lo:hi] when ``need_dx``.

    A patch's K runs of K·C numbers are read where they lie in x_cl when they are long (K·C ≥ RUN_MIN_NUMBERS),
    else from the patch's row of X, one run of K·K·C numbers (``unfold``)."""
    F, C, K = W.shape[0], W.shape[1], W.shape[2]
    Hp, Wp, Ho, Wo = geometry(x, W, stride, pad)
    KC, KKC, windows = K * C, K * K * C, dout.shape[2] * dout.shape[3]
    unfolded = KC < RUN_MIN_NUMBERS
    runs, run, run_step = (1, KKC, 0) if unfolded else (K, KC, Wp * C)
    Wt, dWt = in_patch_order(W), np.zeros((F, KKC), W.dtype)
    Wt_flat, dWt_flat = Wt.reshape(Wt.size), dWt.reshape(dWt.size)
    x_cl, dx_cl = np.zeros(Hp * Wp * C, W.dtype), np.zeros(Hp * Wp * C, W.dtype)
    X, v = np.empty((Ho * Wo if unfolded else 0, KKC), W.dtype), np.empty(KKC, W.dtype)
    patches = X.reshape(X.size) if unfolded else x_cl
    origin = patch_origins(Ho, Wo, stride, Wp, C)
    rows, gs, at = np.empty(F * windows, np.int64), np.empty(F * windows, W.dtype), np.empty(F * windows, np.int64)
    counts, starts = np.empty(F, np.int64), np.empty(Ho * Wo + 1, np.int64)
    filters, grads = np.empty(F * windows, np.int64), np.empty(F * windows, W.dtype)
    for n in range(lo, hi):
        dout_n, out_n, switch_n = dout[n], out[n], switch[n]
        channels_last(x[n], pad, Wp, x_cl, True)
        if unfolded:
            unfold(x_cl, C, Wp, K, stride, Ho, Wo, X)
        for f in range(F):                  # dW[f] += g · patch, run by run, four windows a pass
            first = f * windows
            counts[f], total = winners(dout_n, out_n, switch_n, f, relu, pooled, Wo, rows, gs, first)
            db[f] += total
            for e in range(first, first + counts[f]):
                at[e] = rows[e] * KKC if unfolded else origin[rows[e]]
            for r in range(runs):
                add_runs(dWt_flat, f * KKC + r * run, gs, patches, at, r * run_step, first, first + counts[f], run)
        if not need_dx:
            continue
        by_position(rows, gs, counts, windows, starts, filters, grads)
        for e in range(starts[Ho * Wo]):
            filters[e] *= KKC               # where each filter's row starts in Wt_flat
        dx_cl[:] = 0
        if unfolded:                        # short runs: v = Σ g_f · W[f] a position, added back at its patch
            for k in range(Ho * Wo):
                if starts[k + 1] > starts[k]:
                    v[:] = 0
                    add_runs(v, 0, grads, Wt_flat, filters, 0, starts[k], starts[k + 1], KKC)
                    add_patch(dx_cl, origin[k], Wp * C, K, v)
        else:                               # long runs: kernel row p of every patch, W[:, p] staying in L1
            for p in range(K):
                for k in range(Ho * Wo):
                    if starts[k + 1] > starts[k]:
                        add_runs(dx_cl, origin[k] + p * run_step, grads, Wt_flat, filters, p * KC,
                                 starts[k], starts[k + 1], KC)
        channels_last(dx[n], pad, Wp, dx_cl, False)
    add_from_patch_order(dWt, dW)


@njit(cache=True)
def window_forward(x, W, b, pad, relu, out, switch, lo, hi):
    """Conv (stride 1) + bias (+ ReLU) + 2 × 2 max-pool every 2 pixels for samples lo … hi−1, a pooling window
    at a time: its four corners' patches · four filters' rows in one ``dot_4x4`` pass, pooled from the sums.

    out[n, f, i, j] = max over corners (a, b) of (patch(2i + a, 2j + b) · W[f]) + b[f]   (then ReLU)
    switch[n, f, i, j] = (2i + a)·Wo + 2j + b of the first maximum
    """
    F, C, K = W.shape[0], W.shape[1], W.shape[2]
    Hp, Wp, Ho, Wo = geometry(x, W, 1, pad)
    Wt = in_patch_order(W)
    x_cl, X = np.zeros(Hp * Wp * C, W.dtype), np.empty((Ho * Wo, K * K * C), W.dtype)
    sums, starts = np.zeros((4, 4), W.dtype), (0, 0, 0, 0)
    for n in range(lo, hi):
        channels_last(x[n], pad, Wp, x_cl, True)
        unfold(x_cl, C, Wp, K, 1, Ho, Wo, X)
        for i in range(out.shape[2]):
            for j in range(out.shape[3]):
                top = 2 * i * Wo + 2 * j                        # the window's corner (0, 0)
                corners = (top, top + 1, top + Wo, top + Wo + 1)
                for f0 in range(0, F, 4):
                    sums[:] = 0
                    dot_4x4(X, corners, starts, Wt, four_indices(f0, F), starts, X.shape[1], sums)
                    for k in range(min(4, F - f0)):          # row c of sums: corner c, column k: filter f0 + k
                        out[n, f0 + k, i, j], switch[n, f0 + k, i, j] = first_max_of_four(
                            sums[0, k], sums[1, k], sums[2, k], sums[3, k], top, Wo, b[f0 + k], relu)
