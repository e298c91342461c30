"""The layers of stage 8's fused step as device functions: one block, one group of samples, shared memory.

Every function here is called by ALL the threads of one block of ``kernels/fused_net_step.py``
with the row ``op`` of the layer table (``kernels/fused_net_table.py`` names its fields) and works
on the block's shared memory — ``floats`` (activations, gradients) and ``ints`` (switches, labels),
two views of the same bytes — for the block's ``n`` samples. Weights are read from the flat
parameter vector ``params`` in global memory (small enough to stay in the L2 cache); weight
gradients go to row ``group`` of ``partials``, the block's own row: nothing is added across blocks
here, so no two threads ever write one address and no atomics are needed.

Thread-to-data mapping: thread t of T takes the items t, t + T, t + 2T, … of a list, and the
caller synchronises the block after each function. Each item computes up to ``BLOCK`` values
that share their inputs (register blocking: a value read once is used ``BLOCK`` times), each
value summed by one thread in a fixed order — so the results do not depend on T.

    window_forward      item (s, ⌊f/4⌋, i, j): for the 4 filters f … f + 3 at once,
                            out = ReLU(max_{pi,pj} z[s, f, i·ps + pi, j·ps + pj]),  switch = argmax,
                        z = b[f] + Σ_{c,p,q} W[f, c, p, q]·x[s, c, ci·st + p − pad, cj·st + q − pad]
                        (z = x itself for a row without convolution: item (s, f, i, j))
    relu_mask           item (s, o): g = dL/dout, zeroed where the ReLU was off (before the row's backward)
    window_backward     items (f, ⌊c/4⌋, p, q) of dW, f of db — the pooled form: only each window's
                        winner has a gradient, so for channels c … c + 3 at once
                            dW[f, c, p, q] = Σ_s Σ_{i,j} g[s, f, i, j]·x[s, c, ci·st + p − pad, cj·st + q − pad]
                        with (ci, cj) the switch of window (i, j); then items (s, ⌊c/4⌋, y, x) of dL/dx:
                            Σ_f Σ_{windows (i, j) whose winner (ci, cj) has (y, x) under its filter} g·W[f, c, p, q]
                        (a row without convolution: item (s, f, y, x), g summed over the windows (y, x) won)
    dense_forward       items (s, o, lane): a warp's 32 lanes share one dot product (coalesced rows of
                        W), then item (s, o) adds the 32 sums in order:  y = b[o] + Σ_i x[s, i]·W[o, i]
    dense_backward      dW row by row (thread t takes columns t, t + T, …), then items o of db and
                        (s, i) of dL/dx = Σ_o g[s, o]·W[o, i]
    softmax_loss        one thread a sample: loss and dL/dlogits = (p − onehot)/B, or in evaluation
                        the loss and the answer

Indices: every index into an array goes through ``at``, which makes it an unsigned number.
Numba lets a negative index count from the end, as Python does, and checks every signed index
for it — four to six instructions an access, in loops that do two or three accesses and one
multiply-add (``python -m cnn bench --static cuda-fused-net`` shows the difference). The indices
here are never negative, so the check is dropped.
"""

from __future__ import annotations

import math

from numba import float32, int32, uint64

from kernels.device import cuda
from kernels.fused_net_table import (C, DIN, DOUT, F, HC, HO, IN, K, LANES, NEED_DX, OUT, PAD, PARAM, POOL,
                                     PSTRIDE, RELU, STRIDE, SWITCH, WC, WO, H, W)
from kernels.launch import covering_windows, unravel4

LOW_BITS = 0xFFFF
BLOCK = 4                       # filters (forward) or channels (backward) an item computes at once
POSITIONS = 4                   # conv outputs of a pooling window computed at once (a 2 × 2 window)
TILE = POSITIONS * BLOCK        # multiply-adds a thread keeps going at once in the forward convolution


@cuda.jit(device=True)
def at(index):
    """``index`` as an unsigned array index: no check for negative values (module docstring)."""
    return uint64(index)


@cuda.jit(device=True)
def valid_taps(start, kernel, size):
    """(first, last + 1): the taps k < kernel of a window starting at ``start`` that fall inside 0 … size − 1."""
    return max(0, -start), min(kernel, size - start)


# -- WINDOW rows: convolution (or none), max-pool, ReLU -----------------------------------------------
@cuda.jit(device=True)
def convolve(op, floats, params, s, f, count, tops, lefts, sums):
    """sums[k·BLOCK + r] = Σ_{c,p,q} W[f + r, c, p, q]·x[s, c, tops[k] + p, lefts[k] + q] for the POSITIONS
    conv outputs k and the BLOCK filters r (filters past f + count − 1 repeat it): a 4 × 4 tile of
    multiply-adds, each weight read once for the 4 positions and each input value once for the 4 filters.
    Taps in the padding read x[s, c, 0, 0] and count as 0."""
    channels, height, width, kernel = op[C], op[H], op[W], op[K]
    per_filter = channels * kernel * kernel
    weights = cuda.local.array(BLOCK, float32)
    for k in range(TILE):
        sums[k] = float32(0.0)
    for c in range(channels):
        plane = op[IN] + (s * channels + c) * height * width
        w = op[PARAM] + (f * channels + c) * kernel * kernel
        for p in range(kernel):
            for q in range(kernel):
                for r in range(BLOCK):
                    weights[r] = params[at(w + min(r, count - 1) * per_filter + p * kernel + q)]
                for k in range(POSITIONS):
                    y, x = tops[k] + p, lefts[k] + q
                    inside = 0 <= y < height and 0 <= x < width
                    value = floats[at(plane + y * width + x if inside else plane)]
                    value = value if inside else float32(0.0)
                    for r in range(BLOCK):
                        sums[k * BLOCK + r] += value * weights[r]


@cuda.jit(device=True)
def window_forward(op, floats, ints, params, n, t, threads):
    """Max-pooled (and ReLU'd) outputs and their switches: an item is BLOCK filters at one pooled position,
    its window's conv outputs computed POSITIONS at a time (a row without convolution: one value an item)."""
    filters, out_h, out_w, size, step = op[F], op[HO], op[WO], op[POOL], op[PSTRIDE]
    block = BLOCK if op[K] > 0 else 1
    groups = (filters + block - 1) // block
    sums = cuda.local.array(TILE, float32)
    tops = cuda.local.array(POSITIONS, int32)
    lefts = cuda.local.array(POSITIONS, int32)
    biases = cuda.local.array(BLOCK, float32)
    best = cuda.local.array(BLOCK, float32)
    best_at = cuda.local.array(BLOCK, int32)
    for item in range(t, n * groups * out_h * out_w, threads):
        s, group, i, j = unravel4(item, (n, groups, out_h, out_w))
        f = group * block
        count = min(block, filters - f)
        for r in range(BLOCK):
            biases[r] = params[at(op[PARAM] + filters * op[C] * op[K] * op[K] + f + min(r, count - 1))] \
                if op[K] > 0 else float32(0.0)
            best[r] = float32(-math.inf)
            best_at[r] = 0
        for first in range(0, size * size, POSITIONS):         # the window's positions, POSITIONS at a time
            for k in range(POSITIONS):
                position = min(first + k, size * size - 1)      # past the last: repeat it (a tie, never a win)
                ci, cj = i * step + position // size, j * step + position % size
                tops[k], lefts[k] = ci * op[STRIDE] - op[PAD], cj * op[STRIDE] - op[PAD]
                if op[K] == 0:
                    sums[k * BLOCK] = floats[at(op[IN] + ((s * filters + f) * op[H] + ci) * op[W] + cj)]
            if op[K] > 0:
                convolve(op, floats, params, s, f, count, tops, lefts, sums)
            for k in range(POSITIONS):
                position = min(first + k, size * size - 1)
                ci, cj = i * step + position // size, j * step + position % size
                for r in range(BLOCK):
                    value = sums[k * BLOCK + r] + biases[r]
                    if value > best[r]:                    # the first maximum wins a tie, as in stage 1
                        best[r] = value
                        best_at[r] = (ci << 16) | cj
        for r in range(BLOCK):                          # a static loop: the arrays stay in registers
            if r < count:
                o = ((s * filters + f + r) * out_h + i) * out_w + j
                floats[at(op[OUT] + o)] = max(best[r], float32(0.0)) if op[RELU] != 0 else best[r]
                ints[at(op[SWITCH] + o)] = best_at[r]


@cuda.jit(device=True)
def relu_mask(op, floats, n, t, threads):
    """dL/dout → dL/d(pre-ReLU output), in place: zero where the ReLU was off (y ≤ 0). Rows without ReLU skip it."""
    if op[RELU] == 0:
        return
    for o in range(t, n * op[F] * op[HO] * op[WO], threads):
        if floats[at(op[OUT] + o)] <= float32(0.0):
            floats[at(op[DOUT] + o)] = float32(0.0)


@cuda.jit(device=True)
def weight_gradient(op, floats, ints, n, f, c, count, p, q, sums):
    """sums[r] = dW[f, c + r, p, q] for r < count (the others repeat channel c + count − 1), summed over the
    block's samples and the windows of filter f: the gradient and the switch of a window are read once for
    the BLOCK channels."""
    channels, height, width, stride = op[C], op[H], op[W], op[STRIDE]
    plane_out, gradients, switches = op[HO] * op[WO], op[DOUT], op[SWITCH]
    down, right = p - op[PAD], q - op[PAD]
    for r in range(BLOCK):
        sums[r] = float32(0.0)
    for s in range(n):
        outputs = (s * op[F] + f) * plane_out
        inputs = op[IN] + (s * channels + c) * height * width
        for o in range(outputs, outputs + plane_out):
            g = floats[at(gradients + o)]
            if g == float32(0.0):
                continue
            won = ints[at(switches + o)]
            y = (won >> 16) * stride + down
            x = (won & LOW_BITS) * stride + right
            if 0 <= y < height and 0 <= x < width:
                for r in range(BLOCK):
                    sums[r] += g * floats[at(inputs + min(r, count - 1) * height * width + y * width + x)]


@cuda.jit(device=True)
def bias_gradient(op, floats, n, f):
    """db[f] = Σ_s Σ_{i,j} g[s, f, i, j]."""
    plane_out, gradients = op[HO] * op[WO], op[DOUT]
    total = float32(0.0)
    for s in range(n):
        outputs = (s * op[F] + f) * plane_out
        for o in range(outputs, outputs + plane_out):
            total += floats[at(gradients + o)]
    return total


@cuda.jit(device=True)
def conv_input_gradient(op, floats, ints, params, s, c, count, y, x, sums):
    """sums[r] = dL/dx[s, c + r, y, x] for r < count, from the pooling windows' winners alone: a winner is the
    only conv output of its window with a gradient (a quarter of them for 2×2 pools), so this reads a quarter
    of what the full transposed convolution would."""
    channels, filters, kernel, stride, pad = op[C], op[F], op[K], op[STRIDE], op[PAD]
    out_h, out_w, gradients, switches, first_w = op[HO], op[WO], op[DOUT], op[SWITCH], op[PARAM]
    first_ci, last_ci = covering_windows(y + pad, kernel, stride, op[HC])      # conv outputs that see (y, x)
    first_cj, last_cj = covering_windows(x + pad, kernel, stride, op[WC])
    first_i = covering_windows(first_ci, op[POOL], op[PSTRIDE], out_h)[0]       # windows that may hold them
    last_i = covering_windows(last_ci, op[POOL], op[PSTRIDE], out_h)[1]
    first_j = covering_windows(first_cj, op[POOL], op[PSTRIDE], out_w)[0]
    last_j = covering_windows(last_cj, op[POOL], op[PSTRIDE], out_w)[1]
    for r in range(BLOCK):
        sums[r] = float32(0.0)
    for f in range(filters):
        tap = first_w + (f * channels + c) * kernel * kernel + (y + pad) * kernel + x + pad  # W[f, c, p, q] + …
        for i in range(first_i, last_i + 1):
            for j in range(first_j, last_j + 1):
                o = ((s * filters + f) * out_h + i) * out_w + j
                g = floats[at(gradients + o)]
                won = ints[at(switches + o)]
                ci, cj = won >> 16, won & LOW_BITS
                if g != float32(0.0) and first_ci <= ci <= last_ci and first_cj <= cj <= last_cj:
                    w = tap - ci * stride * kernel - cj * stride
                    for r in range(BLOCK):
                        sums[r] += g * params[at(w + min(r, count - 1) * kernel * kernel)]


@cuda.jit(device=True)
def routed_gradient(op, floats, ints, index):
    """dL/dx at ``index`` = (s, f, y, x) of a row without convolution: g summed over the windows (y, x) won."""
    out_h, out_w, height, width = op[HO], op[WO], op[HC], op[WC]
    s, f, y, x = unravel4(index, (0, op[F], height, width))
    plane = s * op[F] + f
    first_i, last_i = covering_windows(y, op[POOL], op[PSTRIDE], out_h)
    first_j, last_j = covering_windows(x, op[POOL], op[PSTRIDE], out_w)
    me = (y << 16) | x
    total = float32(0.0)
    for i in range(first_i, last_i + 1):
        for j in range(first_j, last_j + 1):
            o = (plane * out_h + i) * out_w + j
            if ints[at(op[SWITCH] + o)] == me:
                total += floats[at(op[DOUT] + o)]
    return total


@cuda.jit(device=True)
def window_backward(op, floats, ints, params, partials, group, n, t, threads):
    """A WINDOW row's backward pass in one phase (after ``relu_mask``): dW and db into the partials, and dL/dx."""
    filters, channels, kernel, height, width = op[F], op[C], op[K], op[H], op[W]
    blocks = (channels + BLOCK - 1) // BLOCK
    weights = filters * blocks * kernel * kernel + filters if kernel > 0 else 0
    data = (n * blocks if kernel > 0 else n * channels) * height * width if op[NEED_DX] != 0 else 0
    sums = cuda.local.array(BLOCK, float32)
    for item in range(t, weights + data, threads):
        if item >= weights:
            index = item - weights
            if kernel == 0:
                floats[at(op[DIN] + index)] = routed_gradient(op, floats, ints, index)
                continue
            s, c, y, x = unravel4(index, (n, blocks, height, width))
            c *= BLOCK
            count = min(BLOCK, channels - c)
            conv_input_gradient(op, floats, ints, params, s, c, count, y, x, sums)
            for r in range(BLOCK):
                if r < count:
                    floats[at(op[DIN] + ((s * channels + c + r) * height + y) * width + x)] = sums[r]
        elif item >= weights - filters:
            f = item - (weights - filters)
            partials[group, at(op[PARAM] + filters * channels * kernel * kernel + f)] = bias_gradient(op, floats, n, f)
        else:
            f, c, p, q = unravel4(item, (filters, blocks, kernel, kernel))
            c *= BLOCK
            count = min(BLOCK, channels - c)
            weight_gradient(op, floats, ints, n, f, c, count, p, q, sums)
            for r in range(BLOCK):
                if r < count:
                    partials[group, at(op[PARAM] + ((f * channels + c + r) * kernel + p) * kernel + q)] = sums[r]


# -- DENSE rows ---------------------------------------------------------------------------------------
@cuda.jit(device=True)
def dense_forward(op, floats, params, scratch, n, t, threads):
    """Two phases: item (s, o, lane) adds x[s, i]·W[o, i] over i = lane, lane + LANES, … into the scratch (the
    LANES threads of a warp read LANES neighbouring weights of row o at once); then item (s, o) adds its
    LANES sums in order, the bias, and applies the ReLU."""
    inputs, outputs, w = op[C], op[F], op[PARAM]
    for item in range(t, n * outputs * LANES, threads):
        lane = item % LANES
        s = item // (LANES * outputs)
        row = w + (item // LANES - s * outputs) * inputs
        x = op[IN] + s * inputs
        total = float32(0.0)
        for i in range(lane, inputs, LANES):
            total += floats[at(x + i)] * params[at(row + i)]
        floats[at(scratch + item)] = total
    cuda.syncthreads()
    for item in range(t, n * outputs, threads):
        total = float32(0.0)
        for lane in range(LANES):
            total += floats[at(scratch + item * LANES + lane)]
        total += params[at(w + outputs * inputs + item % outputs)]
        floats[at(op[OUT] + item)] = max(total, float32(0.0)) if op[RELU] != 0 else total


@cuda.jit(device=True)
def dense_backward(op, floats, params, partials, group, n, t, threads):
    """A DENSE row's backward pass in one phase (after ``relu_mask``): dW row by row (thread t takes columns
    t, t + T, …), then db and dL/dx as items."""
    inputs, outputs, gradients, x, w = op[C], op[F], op[DOUT], op[IN], op[PARAM]
    for o in range(outputs):
        for i in range(t, inputs, threads):
            total = float32(0.0)
            for s in range(n):
                total += floats[at(gradients + s * outputs + o)] * floats[at(x + s * inputs + i)]
            partials[group, at(w + o * inputs + i)] = total
    data = n * inputs if op[NEED_DX] != 0 else 0
    for item in range(t, outputs + data, threads):
        total = float32(0.0)
        if item < outputs:
            for s in range(n):
                total += floats[at(gradients + s * outputs + item)]
            partials[group, at(w + outputs * inputs + item)] = total
        else:
            s = (item - outputs) // inputs
            i = item - outputs - s * inputs
            for o in range(outputs):
                total += floats[at(gradients + s * outputs + o)] * params[at(w + o * inputs + i)]
            floats[at(op[DIN] + s * inputs + i)] = total


# -- the loss ---------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def softmax_loss(op, floats, label, s, batch, train):
    """Sample s's cross-entropy −log softmax(z)[label] from its logits (the last row's output); in training
    dL/dz = (softmax(z) − onehot(label)) / batch goes to the last row's gradient. Returns (loss, argmax)."""
    classes = op[F] * op[HO] * op[WO]
    logits = op[OUT] + s * classes
    top = floats[at(logits)]
    best = 0
    for k in range(1, classes):
        if floats[at(logits + k)] > top:
            top = floats[at(logits + k)]
            best = k
    sum_exp = float32(0.0)
    for k in range(classes):
        sum_exp += math.exp(floats[at(logits + k)] - top)
    log_sum = math.log(sum_exp)
    if train != 0:
        for k in range(classes):
            p = math.exp(floats[at(logits + k)] - top - log_sum)
            if k == label:
                p -= float32(1.0)
            floats[at(op[DOUT] + s * classes + k)] = p / float32(batch)
    return top + log_sum - floats[at(logits + label)], best
