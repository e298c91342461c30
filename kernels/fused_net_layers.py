"""Stage 8's fused step, the parts every row shares: shared-memory helpers, the DENSE rows and the loss.

Every function here is called by ALL the threads of one block of ``kernels/fused_net_step.py``
with the row ``op`` of the layer table (``kernels/fused_net_table.py`` names its fields) and works
on the block's shared memory — ``floats`` (activations, gradients, staged weights) and ``ints``
(switches, labels), two views of the same bytes — for the block's ``n`` samples. Weight gradients
go to row ``group`` of ``partials``, the block's own row: nothing is added across blocks here, so
no two threads ever write one address and no atomics are needed. The WINDOW rows (convolution,
pooling) are in ``kernels/fused_net_window.py``.

Thread-to-data mapping: thread t of T takes the items t, t + T, t + 2T, … of a list, and the
caller synchronises the block after each function. Each value is summed by one thread in a fixed
order, so the results do not depend on T.

    stage_rows          weights copied into shared memory: warp w copies rows w, w + warps, … of a
                        block of weights, its 32 lanes 32 neighbouring weights at a time (coalesced)
    dense_forward       items (s, o, lane): a warp's 32 lanes share one dot product (coalesced rows of
                        W), then item (s, o) adds the 32 sums in order:  y = b[o] + Σ_i x[s, i]·W[o, i]
    dense_backward      weights k = (o, i) of dW = Σ_s g[s, o]·x[s, i] (thread t takes k = t, t + T, …),
                        then items o of db and (s, i) of dL/dx = Σ_o g[s, o]·W[o, i]
    softmax_loss        one thread a sample: loss and dL/dlogits = (p − onehot)/B, or in evaluation
                        the loss and the answer

The ReLU of a row is applied to its gradient by whoever writes that gradient: dL/dx of the next
row (``passed``: the gradient goes through where the row's output is positive) or the loss for
the last row — so no phase of its own masks it.

Indices: every index into an array goes through ``at``, which makes it an unsigned number.
Numba lets a negative index count from the end, as Python does, and checks every signed index
for it — four to six instructions an access, in loops that do two or three accesses and one
multiply-add (``python -m cnn bench --static cuda-fused-net`` shows the difference). The indices
here are never negative, so the check is dropped. Inner loops are ``while index < end`` loops:
Numba's ``range`` keeps a count it tests and decrements in every iteration, even after the
compiler unrolls the loop (3 to 5 instructions each time), where a ``while`` over an index lets it
unroll with one test every 4 to 16 iterations — the dense dot product went from 8 instructions a
multiply-add to 4. A table field read inside a loop may be a global load every iteration, so the
fields an inner loop needs are read into variables before it.
"""

from __future__ import annotations

import math

from numba import float32, int32, int64, uint32, uint64

from kernels.device import cuda
from kernels.fused_net_table import C, DIN, DOUT, F, HO, IN, IN_RELU, LANES, NEED_DX, OUT, PARAM, RELU, WO

WARP = 32
BATCH = 4                       # pieces of weights a lane loads before it stores them (stage_rows)
SCRATCH_PITCH = LANES + 1       # a Dense output's LANES partial sums, one word apart from the next output's:
                                # the thread adding them up and its 31 neighbours read 32 different banks


@cuda.jit(device=True)
def at(index):
    """``index`` as an unsigned array index: no check for negative values (module docstring)."""
    return uint64(index)


@cuda.jit(device=True)
def split(index, size):
    """(index // size, index % size) of a non-negative index below 2³¹, divided in 32 bits: Numba divides in 64,
    and a 64-bit division carries a test and a call to a 70-instruction routine."""
    quotient = int64(uint32(index) // uint32(size))
    return quotient, index - quotient * size


@cuda.jit(device=True)
def tile_pitch(count, tile):
    """``count`` rounded up to whole tiles, plus one: the words between two taps of a staged weight block."""
    return (count + tile - 1) // tile * tile + 1


@cuda.jit(device=True)
def stage_rows(floats, params, outer, inner, length, source, source_outer, source_inner, target, target_outer,
               target_step, t, threads):
    """Copy weights into shared memory, transposed: for every row (a, b) of ``outer`` × ``inner`` rows and every
    e < length,

        floats[target + a·target_outer + b + e·target_step] = params[source + a·source_outer + b·source_inner + e]

    Warp w copies rows w, w + warps, … in pieces of 32 weights: its 32 lanes read 32 consecutive weights of
    a row (one coalesced load) and store them ``target_step`` words apart — an odd step, so 32 different
    banks. A lane loads ``BATCH`` pieces before it stores any: the warp waits for memory once a batch."""
    lane, warp, warps = int32(t % WARP), int32(t // WARP), int32(threads // WARP)
    rows = int32(outer * inner)
    row, e = warp, lane                                           # this lane's next piece: row (a, b), weight e
    a, b = split(row, inner)
    values = cuda.local.array(BATCH, float32)
    places = cuda.local.array(BATCH, int32)
    while row < rows:                                             # in 32-bit arithmetic: see the module docstring
        for k in range(BATCH):
            inside = row < rows and e < length
            values[k] = params[at(int32(source + a * source_outer + b * source_inner + e) if inside else source)]
            places[k] = int32(target + a * target_outer + b + e * target_step) if inside else -1
            e = int32(e + WARP)
            if e >= length:                                       # on to this warp's next row
                e = lane
                row = int32(row + warps)
                a, b = split(row, inner)
        for k in range(BATCH):
            if places[k] >= 0:
                floats[at(places[k])] = values[k]


@cuda.jit(device=True)
def passed(op, floats, index):
    """Whether the input at word ``index`` of the row's input buffer went through the ReLU of the row that made
    it (always, when that row has no ReLU): the gradient flows back only there."""
    return op[IN_RELU] == 0 or floats[at(op[IN] + index)] > float32(0.0)


# -- DENSE rows ---------------------------------------------------------------------------------------
@cuda.jit(device=True)
def dense_forward(op, floats, params, scratch, n, t, threads):
    """Two phases: item (s, o, lane) adds x[s, i]·W[o, i] over i = lane, lane + LANES, … into the scratch (the
    LANES threads of a warp read LANES neighbouring weights of row o at once); then item (s, o) adds its
    LANES sums in order, the bias, and applies the ReLU."""
    inputs, outputs, w = op[C], op[F], op[PARAM]
    for item in range(t, n * outputs * LANES, threads):
        lane = item % LANES
        pair = item // LANES                                # s·outputs + o
        s = split(pair, outputs)[0]
        x = op[IN] + s * inputs + lane
        weight = w + (pair - s * outputs) * inputs + lane
        total = float32(0.0)
        end = x + inputs - lane
        while x < end:
            total += floats[at(x)] * params[at(weight)]
            x += LANES
            weight += LANES
        floats[at(scratch + pair * SCRATCH_PITCH + lane)] = total
    cuda.syncthreads()
    for pair in range(t, n * outputs, threads):
        total = float32(0.0)
        for lane in range(LANES):
            total += floats[at(scratch + pair * SCRATCH_PITCH + lane)]
        total += params[at(w + outputs * inputs + pair % outputs)]
        floats[at(op[OUT] + pair)] = max(total, float32(0.0)) if op[RELU] != 0 else total


@cuda.jit(device=True)
def dense_backward(op, floats, params, partials, group, n, t, threads):
    """A DENSE row's backward pass in one phase: dW (thread t takes the weights t, t + T, … of the o·inputs + i
    numbering, its (o, i) advanced without a division), then db and dL/dx as items."""
    inputs, outputs, gradients, w, x = op[C], op[F], op[DOUT], op[PARAM], op[IN]
    o, i = split(t, inputs)
    jump_o, jump_i = split(threads, inputs)
    k, end = t, outputs * inputs
    while k < end:
        total = floats[at(gradients + o)] * floats[at(x + i)]
        for s in range(1, int32(n)):
            total += floats[at(gradients + s * outputs + o)] * floats[at(x + s * inputs + i)]
        partials[group, at(w + k)] = total
        k += threads
        i += jump_i
        o += jump_o
        if i >= inputs:
            i -= inputs
            o += 1
    data = n * inputs if op[NEED_DX] != 0 else 0
    for item in range(t, outputs + data, threads):
        total = float32(0.0)
        if item < outputs:
            for s in range(n):
                total += floats[at(gradients + s * outputs + item)]
            partials[group, at(w + outputs * inputs + item)] = total
        else:
            index = item - outputs                           # s·inputs + i
            s = split(index, inputs)[0]
            g = gradients + s * outputs
            weight = w + index - s * inputs
            end = g + outputs
            while g < end:
                total += floats[at(g)] * params[at(weight)]
                g += 1
                weight += inputs
            floats[at(op[DIN] + index)] = total if passed(op, floats, index) else float32(0.0)


# -- the loss ---------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def softmax_loss(op, floats, label, s, batch, train):
    """Sample s's cross-entropy −log softmax(z)[label] from its logits (the last row's output); in training
    dL/dz = (softmax(z) − onehot(label)) / batch goes to the last row's gradient (zero where its own ReLU,
    if it has one, was off). Returns (loss, argmax)."""
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
            z = floats[at(logits + k)]
            p = math.exp(z - top - log_sum)
            if k == label:
                p -= float32(1.0)
            on = op[RELU] == 0 or z > float32(0.0)
            floats[at(op[DOUT] + s * classes + k)] = p / float32(batch) if on else float32(0.0)
    return top + log_sum - floats[at(logits + label)], best
