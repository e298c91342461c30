"""Stage 8's WINDOW rows — convolution, max-pool, ReLU — forward and backward, in one block's shared memory.

Called by ALL the threads of a block of ``kernels/fused_net_step.py``, like the functions of
``kernels/fused_net_layers.py`` (its docstring: shared memory, ``at``, the order of every sum).
What the layer table planned (``kernels/fused_net_table.py``) shapes every loop here: the input
of a convolution lies in shared memory with a zero border of PAD (so no tap is ever tested for
the padding), its weights are STAGED into shared memory before they are used, and a convolution
with too few items for the block's threads is SPLIT over its filter rows.

Forward, a convolution (``conv_forward``): an item is

    (s, slice, tile of FILTER_TILE = 8 filters, POSITIONS = 4 conv outputs of one pooling window)

and its inner loop (``accumulate_tile``) loads 4 inputs and 8 staged weights a tap to do 32
multiply-adds — a 4 × 8 register tile:

    sums[k, r] = Σ_{(c, p) of the slice's filter rows} Σ_q x[s, c, ci_k·st + p, cj_k·st + q]·W[f + r, c, p, q]

(ci_k, cj_k) is position k of the window (past its last position: the last again — a tie never
wins). Unsplit (one slice, a window of at most 4 positions), the item adds the bias, keeps the
largest value of each filter and where it was (the first wins a tie, as in stage 1), applies the
ReLU and writes the pooled output and its switch. Split, it writes its 32 sums to the scratch
and a second pass (``reduce_slices``, item (s, f, i, j)) adds the slices in order, then pools.
A thread's items are taken in rounds of T, so that when the weights are staged in several steps
every thread reaches every barrier.

Backward, after the ReLU was applied to dL/dout by whoever wrote it (``passed``): the pooled
form — only each window's winner has a gradient:

    dW[f, c, p, q + e] = Σ_s Σ_{windows w} g[s, f, w]·x[s, c, ci_w·st + p, cj_w·st + q + e]
        item (f, c, p, tile of TAP_TILE = 8 taps q + e): a window's gradient and switch read once for 8
        multiply-adds, the 8 inputs at 8 neighbouring words (one address, the rest immediate offsets);
        split into DW_PARTS parts of the windows when there are few items, the parts added in order
    db[f] = Σ_s Σ_w g[s, f, w]                                                                  item f
    dL/dx[s, c + r, y, x] = Σ_f Σ_{windows w whose winner's filter covers (y, x)} g[s, f, w]·W[f, c + r, p, q]
        item (s, tile of 8 channels, y, x); the weights staged DX_FILTERS filters at a time, channel-fastest
        so that the tile's 8 weights are 8 neighbouring words

A row without convolution (K = 0) is a max-pool (and ReLU) alone: item (s, f, i, j) forward, and
backward dL/dx = the gradient of every window (y, x) won (``routed_gradient``).
"""

from __future__ import annotations

import math

from numba import float32, int32

from kernels.device import cuda
from kernels.fused_net_layers import at, passed, split, stage_rows, tile_pitch
from kernels.fused_net_table import (CHANNEL_TILE, DIN, DOUT, DW_PARTS, DX_FILTERS, FILTER_TILE, HC, HO, IN, NEED_DX,
                                     OPAD, OUT, PAD, PARAM, POOL, POSITIONS, PSTRIDE, RELU, SLICES, STEP_ROWS, STRIDE,
                                     SWITCH, TAP_TILE, WC, WO, WORD, C, F, H, K, W)
from kernels.launch import covering_windows

CODE = 16                                   # a switch: the winner's row in the window · CODE + its column
LOW_BITS = CODE - 1
TILE = POSITIONS * FILTER_TILE              # multiply-adds a forward item keeps going at once


# -- where things are --------------------------------------------------------------------------------
@cuda.jit(device=True)
def write_output(op, floats, codes, s, f, i, j, best, code):
    """The pooled output (ReLU'd when the row has a ReLU) at (s, f, i, j), inside its zero border, and its switch:
    one byte, the winner's row a and column b inside its window, code = a·16 + b."""
    halo = op[OPAD]
    o = ((s * op[F] + f) * (op[HO] + 2 * halo) + i + halo) * (op[WO] + 2 * halo) + j + halo
    floats[at(op[OUT] + o)] = max(best, float32(0.0)) if op[RELU] != 0 else best
    codes[at(op[SWITCH] * WORD + ((s * op[F] + f) * op[HO] + i) * op[WO] + j)] = code


@cuda.jit(device=True)
def window_position(op, m):
    """(a, b): the row and column inside a pooling window of its position m (row-major; past the last: the last)."""
    size = op[POOL]
    return split(min(m, size * size - 1), size)


@cuda.jit(device=True)
def conv_geometry(op, item):
    """(s, slice, filter tile, position group, i, j) of forward item ``item``, the pooled position (i, j) fastest:
    the 32 lanes of a warp share their weights."""
    groups = (op[POOL] * op[POOL] + POSITIONS - 1) // POSITIONS
    tiles = (op[F] + FILTER_TILE - 1) // FILTER_TILE
    rest, window = split(item, op[HO] * op[WO])
    rest, group = split(rest, groups)
    rest, tile = split(rest, tiles)
    s, part = split(rest, op[SLICES])
    i, j = split(window, op[WO])
    return s, part, tile, group, i, j


@cuda.jit(device=True)
def unravel(index, shape):
    """(a, b, c, d) of the element at flat C-order ``index`` of a 4-D ``shape`` (``kernels.launch.unravel4`` in 32-bit
    divisions: ``split``)."""
    index, d = split(index, shape[3])
    index, c = split(index, shape[2])
    a, b = split(index, shape[1])
    return a, b, c, d


# -- WINDOW rows with a convolution: forward ------------------------------------------------------------
@cuda.jit(device=True)
def accumulate_tile(floats, x, w, rows, p, kernel, in_w, channel_skip, d1, d2, d3, pitch, sums):
    """The inner loop: sums[k·FILTER_TILE + r] += x(position k, tap)·w(tap, r) over ``rows`` filter rows (c, p) of
    ``kernel`` taps q each — 4 input loads and 8 weight loads feed 32 multiply-adds.

    ``x``: the word of the input under tap (c, p, 0) of position 0; position k reads d_k words further.
    ``w``: the staged weight (this row, tap 0, the tile's first filter); the next tap is ``pitch`` words on.
    After a row, x moves down one input row; after the last row of a channel, to row 0 of the next one."""
    for _ in range(rows):
        end = x + kernel
        while x < end:
            x0 = floats[at(x)]
            x1 = floats[at(x + d1)]
            x2 = floats[at(x + d2)]
            x3 = floats[at(x + d3)]
            for r in range(FILTER_TILE):
                weight = floats[at(w + r)]
                sums[r] += x0 * weight
                sums[FILTER_TILE + r] += x1 * weight
                sums[2 * FILTER_TILE + r] += x2 * weight
                sums[3 * FILTER_TILE + r] += x3 * weight
            x += 1
            w += pitch
        x += in_w - kernel
        p += 1
        if p == kernel:
            p = 0
            x += channel_skip


@cuda.jit(device=True)
def accumulate_step(op, floats, stage, item, step, sums):
    """Item ``item``'s tap sums over the filter rows of its slice that staging step ``step`` brought in (the item
    decoded again each step: nothing but its sums stays in registers while the weights are staged)."""
    s, part, tile, group, i, j = conv_geometry(op, item)
    kernel, stride, pool_step = op[K], op[STRIDE], op[PSTRIDE]
    in_h, in_w = op[H] + 2 * op[PAD], op[W] + 2 * op[PAD]
    step_rows = op[STEP_ROWS]
    first = part * (op[C] * kernel // op[SLICES]) + step * step_rows          # its first filter row (c, p)
    c, p = split(first, kernel)
    a0, b0 = window_position(op, group * POSITIONS)
    a1, b1 = window_position(op, group * POSITIONS + 1)
    a2, b2 = window_position(op, group * POSITIONS + 2)
    a3, b3 = window_position(op, group * POSITIONS + 3)
    top, left = (i * pool_step + a0) * stride + p, (j * pool_step + b0) * stride
    x = op[IN] + ((s * op[C] + c) * in_h + top) * in_w + left
    d1 = ((a1 - a0) * in_w + b1 - b0) * stride
    d2 = ((a2 - a0) * in_w + b2 - b0) * stride
    d3 = ((a3 - a0) * in_w + b3 - b0) * stride
    pitch = tile_pitch(op[F], FILTER_TILE)
    w = stage + part * step_rows * kernel * pitch + tile * FILTER_TILE
    accumulate_tile(floats, x, w, step_rows, p, kernel, in_w, (in_h - kernel) * in_w, d1, d2, d3, pitch, sums)


@cuda.jit(device=True)
def pool_tile(op, floats, codes, params, s, tile, i, j, sums):
    """An unsplit item's end: bias, the largest of the window's positions for each filter (the first wins a tie),
    ReLU; the pooled outputs and switches of the tile's filters."""
    filters = op[F]
    f = tile * FILTER_TILE
    biases = op[PARAM] + filters * op[C] * op[K] * op[K] + f
    places = cuda.local.array(POSITIONS, int32)
    for k in range(POSITIONS):
        a, b = window_position(op, k)
        places[k] = a * CODE + b
    for r in range(FILTER_TILE):
        if f + r < filters:
            bias = params[at(biases + r)]
            best, best_at = float32(-math.inf), 0
            for k in range(POSITIONS):
                value = sums[k * FILTER_TILE + r] + bias
                if value > best:
                    best, best_at = value, places[k]
            write_output(op, floats, codes, s, f + r, i, j, best, best_at)


@cuda.jit(device=True)
def store_tile(op, floats, scratch, item, sums):
    """A split item's end: its 32 sums to the scratch, sum e = k·FILTER_TILE + r at scratch + (⌊item/windows⌋·TILE
    + e)·windows + (item mod windows) — neighbouring items, neighbouring words."""
    windows = op[HO] * op[WO]
    base = scratch + (item // windows) * TILE * windows + item % windows
    for e in range(TILE):
        floats[at(base + e * windows)] = sums[e]


@cuda.jit(device=True)
def reduce_slices(op, floats, codes, params, scratch, n, t, threads):
    """After a split convolution: item (s, f, i, j) adds each window position's slices in slice order, then bias,
    max-pool and ReLU as ``pool_tile`` does."""
    filters, size, slices = op[F], op[POOL], op[SLICES]
    windows = op[HO] * op[WO]
    groups = (size * size + POSITIONS - 1) // POSITIONS
    tiles = (filters + FILTER_TILE - 1) // FILTER_TILE
    part_words = tiles * groups * TILE * windows                  # from one slice's sums to the next slice's
    for item in range(t, n * filters * windows, threads):
        rest, window = split(item, windows)
        s, f = split(rest, filters)
        i, j = split(window, op[WO])
        tile = f // FILTER_TILE
        first = scratch + ((s * slices * tiles + tile) * groups * TILE + f - tile * FILTER_TILE) * windows + window
        bias = params[at(op[PARAM] + filters * op[C] * op[K] * op[K] + f)]
        best, best_at = float32(-math.inf), 0
        for m in range(int32(size * size)):
            group, k = m // POSITIONS, m % POSITIONS
            total = float32(0.0)
            sums = first + (group * TILE + k * FILTER_TILE) * windows
            end = sums + slices * part_words
            while sums < end:
                total += floats[at(sums)]
                sums += part_words
            value = total + bias
            if value > best:
                a, b = split(m, size)
                best, best_at = value, a * CODE + b
        write_output(op, floats, codes, s, f, i, j, best, best_at)


@cuda.jit(device=True)
def stage_forward(op, floats, params, stage, step, t, threads):
    """Staging step ``step``: filter rows step·STEP_ROWS … of every slice, every filter, as
    stage[((slice·STEP_ROWS + row)·K + q)·pitch + f] — a tap's filters side by side."""
    kernel, rows = op[K], op[C] * op[K]
    step_rows = op[STEP_ROWS]
    pitch = tile_pitch(op[F], FILTER_TILE)
    stage_rows(floats, params, op[SLICES], op[F], step_rows * kernel, op[PARAM] + step * step_rows * kernel,
               rows // op[SLICES] * kernel, rows * kernel, stage, step_rows * kernel * pitch, pitch, t, threads)


@cuda.jit(device=True)
def conv_forward(op, floats, codes, params, n, t, threads, scratch, stage):
    """A convolution row's forward pass: items in rounds of T (see the module docstring), then, when split,
    the pass that adds the slices."""
    groups = (op[POOL] * op[POOL] + POSITIONS - 1) // POSITIONS
    items = n * op[SLICES] * ((op[F] + FILTER_TILE - 1) // FILTER_TILE) * groups * op[HO] * op[WO]
    steps = op[C] * op[K] // op[SLICES] // op[STEP_ROWS]
    split = op[SLICES] > 1 or groups > 1
    sums = cuda.local.array(TILE, float32)
    if steps == 1:
        stage_forward(op, floats, params, stage, 0, t, threads)
        cuda.syncthreads()
    for first in range(0, items, threads):
        item = first + t
        for e in range(TILE):
            sums[e] = float32(0.0)
        for step in range(steps):
            if steps > 1:                          # every thread, item or not: the staging area is the block's
                cuda.syncthreads()
                stage_forward(op, floats, params, stage, step, t, threads)
                cuda.syncthreads()
            if item < items:
                accumulate_step(op, floats, stage, item, step, sums)
        if item < items:
            if split:
                store_tile(op, floats, scratch, item, sums)
            else:
                s, _, tile, _, i, j = conv_geometry(op, item)
                pool_tile(op, floats, codes, params, s, tile, i, j, sums)
    if split:
        cuda.syncthreads()
        reduce_slices(op, floats, codes, params, scratch, n, t, threads)


# -- WINDOW rows without a convolution: forward ---------------------------------------------------------
@cuda.jit(device=True)
def pool_forward(op, floats, codes, n, t, threads):
    """Item (s, f, i, j): the largest input of the window (first wins a tie), ReLU'd when the row has a ReLU."""
    size, step, height, width = op[POOL], op[PSTRIDE], op[H], op[W]
    for item in range(t, n * op[F] * op[HO] * op[WO], threads):
        s, f, i, j = unravel(item, (n, op[F], op[HO], op[WO]))
        plane = op[IN] + (s * op[F] + f) * height * width
        best, best_at = float32(-math.inf), 0
        for a in range(size):
            for b in range(size):
                ci, cj = i * step + a, j * step + b
                value = floats[at(plane + ci * width + cj)]
                if value > best:
                    best, best_at = value, a * CODE + b
        write_output(op, floats, codes, s, f, i, j, best, best_at)


@cuda.jit(device=True)
def window_forward(op, floats, codes, params, n, t, threads, scratch, stage):
    """A WINDOW row's forward pass: its pooled (and ReLU'd) outputs and their switches."""
    if op[K] > 0:
        conv_forward(op, floats, codes, params, n, t, threads, scratch, stage)
    else:
        pool_forward(op, floats, codes, n, t, threads)


# -- WINDOW rows: backward ----------------------------------------------------------------------------------
@cuda.jit(device=True)
def weight_gradient(op, floats, codes, n, f, c, p, q, first, count, sums):
    """sums[e] = dW[f, c, p, q + e] for e < TAP_TILE (taps q + e ≥ K are computed and never written), summed over
    the block's samples and windows first … first + count − 1 of filter f: a window's gradient and switch read
    once for 8 multiply-adds, the 8 inputs at 8 neighbouring words (one address). ``corner`` follows the
    windows: the input under tap (p, q) of each window's first conv output."""
    in_h, in_w, stride, step, out_w = op[H] + 2 * op[PAD], op[W] + 2 * op[PAD], op[STRIDE], op[PSTRIDE], op[WO]
    windows = op[HO] * out_w
    gradients, switches = op[DOUT], op[SWITCH] * WORD
    next_row = (step * in_w - out_w * step) * stride          # from past a row of windows to the next row's first
    top, left = split(first, out_w)
    for e in range(TAP_TILE):
        sums[e] = float32(0.0)
    for s in range(int32(n)):
        o = (s * op[F] + f) * windows + first
        corner = op[IN] + ((s * op[C] + c) * in_h + p + top * step * stride) * in_w + q + left * step * stride
        end = o + count
        column = int32(left)
        while o < end:
            g = floats[at(gradients + o)]
            if g != float32(0.0):
                code = int32(codes[at(switches + o)])
                x = corner + ((code >> 4) * in_w + (code & LOW_BITS)) * stride
                for e in range(TAP_TILE):
                    sums[e] += g * floats[at(x + e)]
            o += 1
            corner += step * stride
            column = int32(column + 1)
            if column == out_w:
                column = int32(0)
                corner += next_row


@cuda.jit(device=True)
def bias_gradient(op, floats, n, f):
    """db[f] = Σ_s Σ_{i,j} g[s, f, i, j]."""
    windows = op[HO] * op[WO]
    total = float32(0.0)
    for s in range(int32(n)):
        o = op[DOUT] + (s * op[F] + f) * windows
        end = o + windows
        while o < end:
            total += floats[at(o)]
            o += 1
    return total


@cuda.jit(device=True)
def stage_backward(op, floats, params, stage, step, t, threads):
    """Filters step·DX_FILTERS …, every channel, as stage[(f·K² + tap)·pitch + c] — a tap's channels side by side."""
    taps = op[K] * op[K]
    pitch = tile_pitch(op[C], CHANNEL_TILE)
    stage_rows(floats, params, op[DX_FILTERS], op[C], taps, op[PARAM] + step * op[DX_FILTERS] * op[C] * taps,
               op[C] * taps, taps, stage, taps * pitch, pitch, t, threads)


@cuda.jit(device=True)
def conv_weight_gradients(op, floats, codes, params, partials, group, n, t, threads, stage, parts):
    """Items (part, f, c, p, tile of taps) of dW and f of db: into the partials, or, when dW is split, each part's
    sums into the ``parts`` region (``add_weight_parts`` adds them). Meanwhile, when dL/dx needs the weights
    and they fit in one staging step, every thread stages its share of them (the staging area is idle)."""
    filters, channels, kernel = op[F], op[C], op[K]
    tiles, split_in = (kernel + TAP_TILE - 1) // TAP_TILE, op[DW_PARTS]
    weights = filters * channels * kernel * kernel
    items = split_in * filters * channels * kernel * tiles
    windows = op[HO] * op[WO]
    if op[NEED_DX] != 0 and op[DX_FILTERS] == filters:
        stage_backward(op, floats, params, stage, 0, t, threads)
    sums = cuda.local.array(TAP_TILE, float32)
    for item in range(t, items + filters, threads):
        if item >= items:
            f = item - items
            partials[group, at(op[PARAM] + weights + f)] = bias_gradient(op, floats, n, f)
            continue
        rest, tile = split(item, tiles)
        part, f, c, p = unravel(rest, (split_in, filters, channels, kernel))
        first, last = part * windows // split_in, (part + 1) * windows // split_in
        q = tile * TAP_TILE
        weight_gradient(op, floats, codes, n, f, c, p, q, first, last - first, sums)
        w = ((f * channels + c) * kernel + p) * kernel + q
        for e in range(TAP_TILE):
            if q + e < kernel:
                if split_in == 1:
                    partials[group, at(op[PARAM] + w + e)] = sums[e]
                else:
                    floats[at(parts + part * weights + w + e)] = sums[e]


@cuda.jit(device=True)
def add_weight_parts(op, floats, partials, group, t, threads, parts):
    """A split dW: weight w = the sum of its DW_PARTS parts, in part order, into the partials."""
    weights = op[F] * op[C] * op[K] * op[K]
    for w in range(t, weights, threads):
        total = float32(0.0)
        place, end = parts + w, parts + op[DW_PARTS] * weights
        while place < end:
            total += floats[at(place)]
            place += weights
        partials[group, at(op[PARAM] + w)] = total


@cuda.jit(device=True)
def accumulate_input_gradient(op, floats, codes, stage, s, c, y, x, first_f, first_i, last_i, first_j, last_j, sums):
    """sums[r] += Σ over the staged filters f and the windows (i, j) of dL/dx's sum (module docstring) for the
    8 channels c + r at input pixel (y, x): a window counts when its winner's filter covers the pixel."""
    kernel, stride, step, filters, out_h, out_w = op[K], op[STRIDE], op[PSTRIDE], op[F], op[HO], op[WO]
    gradients, switches = op[DOUT], op[SWITCH] * WORD
    down, right = int32(y + op[PAD]), int32(x + op[PAD])       # the pixel in the padded input's coordinates
    pitch = tile_pitch(op[C], CHANNEL_TILE)
    for staged in range(op[DX_FILTERS]):
        w = stage + staged * kernel * kernel * pitch + c
        for i in range(int32(first_i), int32(last_i + 1)):
            o = ((s * filters + first_f + staged) * out_h + i) * out_w + first_j
            end = o + last_j - first_j + 1
            top = int32(down - i * step * stride)              # the pixel's row under window (i, ·)'s first output
            left = int32(right - first_j * step * stride)
            while o < end:
                g = floats[at(gradients + o)]
                code = int32(codes[at(switches + o)])
                p = int32(top - (code >> 4) * stride)             # the winner's tap over the pixel, if any
                q = int32(left - (code & LOW_BITS) * stride)
                if g != float32(0.0) and 0 <= p < kernel and 0 <= q < kernel:
                    tap = w + (p * kernel + q) * pitch
                    for r in range(CHANNEL_TILE):
                        sums[r] += g * floats[at(tap + r)]
                o += 1
                left = int32(left - step * stride)


@cuda.jit(device=True)
def conv_input_gradients(op, floats, codes, params, n, t, threads, stage):
    """Items (s, channel tile, y, x) of dL/dx in rounds of T, the weights staged DX_FILTERS filters a step; each
    value through the ReLU of the row before (``passed``), into DIN."""
    channels, height, width, pad = op[C], op[H], op[W], op[PAD]
    tiles = (channels + CHANNEL_TILE - 1) // CHANNEL_TILE
    items = n * tiles * height * width
    steps = op[F] // op[DX_FILTERS]
    in_h, in_w = height + 2 * pad, width + 2 * pad
    sums = cuda.local.array(CHANNEL_TILE, float32)
    cuda.syncthreads()                             # the weights staged by conv_weight_gradients, when one step
    for first in range(0, items, threads):
        item = first + t
        s, tile, y, x = unravel(min(item, items - 1), (n, tiles, height, width))
        c = tile * CHANNEL_TILE
        first_ci, last_ci = covering_windows(y + pad, op[K], op[STRIDE], op[HC])      # conv outputs that see y
        first_cj, last_cj = covering_windows(x + pad, op[K], op[STRIDE], op[WC])
        first_i = covering_windows(first_ci, op[POOL], op[PSTRIDE], op[HO])[0]       # windows that may hold them
        last_i = covering_windows(last_ci, op[POOL], op[PSTRIDE], op[HO])[1]
        first_j = covering_windows(first_cj, op[POOL], op[PSTRIDE], op[WO])[0]
        last_j = covering_windows(last_cj, op[POOL], op[PSTRIDE], op[WO])[1]
        for r in range(CHANNEL_TILE):
            sums[r] = float32(0.0)
        for step in range(steps):
            if steps > 1:
                cuda.syncthreads()
                stage_backward(op, floats, params, stage, step, t, threads)
                cuda.syncthreads()
            if item < items:
                accumulate_input_gradient(op, floats, codes, stage, s, c, y, x, step * op[DX_FILTERS], first_i,
                                          last_i, first_j, last_j, sums)
        if item < items:
            for r in range(CHANNEL_TILE):
                if c + r < channels:
                    padded = ((s * channels + c + r) * in_h + y + pad) * in_w + x + pad
                    value = sums[r] if passed(op, floats, padded) else float32(0.0)
                    floats[at(op[DIN] + ((s * channels + c + r) * height + y) * width + x)] = value


@cuda.jit(device=True)
def routed_gradient(op, floats, codes, index):
    """dL/dx at ``index`` = (s, f, y, x) of a row without convolution: g summed over the windows (y, x) won."""
    out_h, out_w, height, width, step = op[HO], op[WO], op[HC], op[WC], op[PSTRIDE]
    s, f, y, x = unravel(index, (0, op[F], height, width))
    plane = s * op[F] + f
    first_i, last_i = covering_windows(y, op[POOL], step, out_h)
    first_j, last_j = covering_windows(x, op[POOL], step, out_w)
    total = float32(0.0)
    for i in range(first_i, last_i + 1):
        for j in range(first_j, last_j + 1):
            o = (plane * out_h + i) * out_w + j
            if codes[at(op[SWITCH] * WORD + o)] == (y - i * step) * CODE + x - j * step:
                total += floats[at(op[DOUT] + o)]
    return total


@cuda.jit(device=True)
def window_backward(op, floats, codes, params, partials, group, n, t, threads, stage, parts):
    """A WINDOW row's backward pass: dW and db into the partials, then dL/dx (masked by the ReLU of the row
    before) into DIN; a row without convolution routes the gradient to the windows' winners."""
    if op[K] == 0:
        if op[NEED_DX] != 0:
            for index in range(t, n * op[C] * op[H] * op[W], threads):
                floats[at(op[DIN] + index)] = routed_gradient(op, floats, codes, index) \
                    if passed(op, floats, index) else float32(0.0)
        return
    conv_weight_gradients(op, floats, codes, params, partials, group, n, t, threads, stage, parts)
    if op[DW_PARTS] > 1:
        cuda.syncthreads()
        add_weight_parts(op, floats, partials, group, t, threads, parts)
    if op[NEED_DX] != 0:
        conv_input_gradients(op, floats, codes, params, n, t, threads, stage)
