"""The layers of stage 8's fused step as device functions: one block, one group of samples, shared memory.

Every function here is called by ALL the threads of one block of ``kernels/fused_net_step.py``
with the row ``op`` of the layer table (``kernels/fused_net_table.py`` names its fields) and works
on the block's shared memory — ``floats`` (activations, gradients) and ``ints`` (switches, labels),
two views of the same bytes — for the block's ``n`` samples. Weights are read from the flat
parameter vector ``params`` in global memory (small enough to stay in the L2 cache); weight
gradients go to row ``group`` of ``partials``, the block's own row: nothing is added across blocks
here, so no two threads ever write one address and no atomics are needed.

Thread-to-data mapping: thread t of T takes the items t, t + T, t + 2T, … of a list, and the
caller synchronises the block after each function. Each item is ONE value written once, its
sum computed by one thread in a fixed order — so the results do not depend on T.

    window_forward           item (s, f, i, j) of the pooled output:
                                 out = ReLU(max_{pi,pj} z[s, f, i·ps + pi, j·ps + pj]),  switch = argmax
                             z = b[f] + Σ_{c,p,q} W[f, c, p, q]·x[s, c, ci·st + p − pad, cj·st + q − pad]
                             (or z = x for a row without convolution)
    window_backward_params   item (f, c, p, q) of dW, then f of db — the pooled form: only each window's
    _and_dz                  winner has a gradient, so
                                 dW[f, c, p, q] = Σ_s Σ_{i,j} g[s, f, i, j]·x[s, c, ci·st + p − pad, cj·st + q − pad]
                             with (ci, cj) the switch of window (i, j) and g = dL/dout masked by the ReLU;
                             then item (s, f, ci, cj) of dz = Σ of g over the windows (i, j) ∋ (ci, cj)
                             whose switch is (ci, cj) (several, when windows overlap)
    window_backward_data     item (s, c, y, x) of dL/dx: Σ_f Σ_{(ci, cj) whose window covers (y, x)} dz·W
    dense_forward            item (s, o):  y = b[o] + Σ_i x[s, i]·W[o, i]
    dense_backward           items (o, i) of dW, o of db, then (s, i) of dL/dx = Σ_o g[s, o]·W[o, i]
    softmax_loss             item s (one thread a sample): loss and dL/dlogits = (p − onehot)/B, or in
                             evaluation the logits, the loss and whether the answer is right
"""

from __future__ import annotations

import math

from numba import float32

from kernels.device import cuda
from kernels.fused_net_table import (C, DIN, DOUT, DZ, F, HC, HO, IN, K, NEED_DX, OUT, PAD, PARAM, POOL, PSTRIDE,
                                     RELU, STRIDE, SWITCH, WC, WO, H, W)
from kernels.launch import covering_windows

LOW_BITS = 0xFFFF


@cuda.jit(device=True)
def masked_gradient(op, floats, index):
    """dL/d(pre-ReLU output) at ``index`` of the row's output: dL/dout where the ReLU let it through, else 0."""
    if op[RELU] != 0 and floats[op[OUT] + index] <= float32(0.0):
        return float32(0.0)
    return floats[op[DOUT] + index]


@cuda.jit(device=True)
def window_value(op, floats, params, s, f, ci, cj):
    """z[s, f, ci, cj]: the convolution there plus its bias, or the input itself in a row without convolution."""
    channels, height, width, kernel = op[C], op[H], op[W], op[K]
    first = op[IN] + s * channels * height * width
    if kernel == 0:
        return floats[first + (f * height + ci) * width + cj]
    top, left = ci * op[STRIDE] - op[PAD], cj * op[STRIDE] - op[PAD]
    total = float32(0.0)
    for c in range(channels):
        weights = op[PARAM] + (f * channels + c) * kernel * kernel
        plane = first + c * height * width
        for p in range(kernel):
            y = top + p
            if 0 <= y < height:
                for q in range(kernel):
                    x = left + q
                    if 0 <= x < width:
                        total += params[weights + p * kernel + q] * floats[plane + y * width + x]
    return total + params[op[PARAM] + op[F] * channels * kernel * kernel + f]


@cuda.jit(device=True)
def window_forward(op, floats, ints, params, n, t, threads):
    filters, out_h, out_w, size, step = op[F], op[HO], op[WO], op[POOL], op[PSTRIDE]
    for item in range(t, n * filters * out_h * out_w, threads):
        j = item % out_w
        i = item // out_w % out_h
        f = item // (out_w * out_h) % filters
        s = item // (out_w * out_h * filters)
        best = float32(-math.inf)
        best_at = 0
        for pi in range(size):
            ci = i * step + pi
            for pj in range(size):
                cj = j * step + pj
                value = window_value(op, floats, params, s, f, ci, cj)
                if value > best:                        # the first maximum wins a tie, as in stage 1
                    best = value
                    best_at = (ci << 16) | cj
        if op[RELU] != 0:
            best = max(best, float32(0.0))
        floats[op[OUT] + item] = best
        ints[op[SWITCH] + item] = best_at


@cuda.jit(device=True)
def window_weight_gradient(op, floats, ints, n, item):
    """dW[f, c, p, q] (item < F·C·K²) or db[f] (the F items after), summed over the block's samples."""
    channels, height, width, kernel = op[C], op[H], op[W], op[K]
    plane_out = op[HO] * op[WO]
    weights = op[F] * channels * kernel * kernel
    is_bias = item >= weights
    f = item - weights if is_bias else item // (channels * kernel * kernel)
    c = item // (kernel * kernel) % channels
    p = item // kernel % kernel
    q = item % kernel
    total = float32(0.0)
    for s in range(n):
        outputs = s * op[F] * plane_out + f * plane_out
        inputs = op[IN] + (s * channels + c) * height * width
        for o in range(outputs, outputs + plane_out):
            g = masked_gradient(op, floats, o)
            if g == float32(0.0):
                continue
            if is_bias:
                total += g
                continue
            at = ints[op[SWITCH] + o]
            y = (at >> 16) * op[STRIDE] + p - op[PAD]
            x = (at & LOW_BITS) * op[STRIDE] + q - op[PAD]
            if 0 <= y < height and 0 <= x < width:
                total += g * floats[inputs + y * width + x]
    return total


@cuda.jit(device=True)
def routed_gradient(op, floats, ints, index):
    """dL/dz at ``index`` = (s, f, ci, cj) of the pre-pool plane: g summed over the windows it won."""
    out_h, out_w, conv_h, conv_w = op[HO], op[WO], op[HC], op[WC]
    cj = index % conv_w
    ci = index // conv_w % conv_h
    plane = index // (conv_w * conv_h)                  # s·F + f
    first_i, last_i = covering_windows(ci, op[POOL], op[PSTRIDE], out_h)
    first_j, last_j = covering_windows(cj, op[POOL], op[PSTRIDE], out_w)
    me = (ci << 16) | cj
    total = float32(0.0)
    for i in range(first_i, last_i + 1):
        for j in range(first_j, last_j + 1):
            o = (plane * out_h + i) * out_w + j
            if ints[op[SWITCH] + o] == me:
                total += masked_gradient(op, floats, o)
    return total


@cuda.jit(device=True)
def window_backward_params_and_dz(op, floats, ints, partials, group, n, t, threads):
    """Phase 1 of a WINDOW row's backward pass: its weight gradients, and dL/dz (straight into dL/dx when the
    row has no convolution)."""
    kernel = op[K]
    params = op[F] * op[C] * kernel * kernel + op[F] if kernel > 0 else 0
    routed = n * op[F] * op[HC] * op[WC] if op[NEED_DX] != 0 else 0
    target = op[DZ] if kernel > 0 else op[DIN]
    for item in range(t, params + routed, threads):
        if item < params:
            partials[group, op[PARAM] + item] = window_weight_gradient(op, floats, ints, n, item)
        else:
            floats[target + item - params] = routed_gradient(op, floats, ints, item - params)


@cuda.jit(device=True)
def window_backward_data(op, floats, params, n, t, threads):
    """Phase 2 of a convolution row that needs dL/dx: the transposed convolution of dz (in DZ)."""
    channels, height, width, filters, kernel = op[C], op[H], op[W], op[F], op[K]
    conv_h, conv_w, stride, pad = op[HC], op[WC], op[STRIDE], op[PAD]
    for item in range(t, n * channels * height * width, threads):
        x = item % width
        y = item // width % height
        c = item // (width * height) % channels
        s = item // (width * height * channels)
        first_i, last_i = covering_windows(y + pad, kernel, stride, conv_h)
        first_j, last_j = covering_windows(x + pad, kernel, stride, conv_w)
        total = float32(0.0)
        for f in range(filters):
            dz = op[DZ] + (s * filters + f) * conv_h * conv_w
            weights = op[PARAM] + (f * channels + c) * kernel * kernel
            for ci in range(first_i, last_i + 1):
                p = y + pad - ci * stride
                for cj in range(first_j, last_j + 1):
                    total += floats[dz + ci * conv_w + cj] * params[weights + p * kernel + x + pad - cj * stride]
        floats[op[DIN] + item] = total


@cuda.jit(device=True)
def dense_forward(op, floats, params, n, t, threads):
    inputs, outputs = op[C], op[F]
    for item in range(t, n * outputs, threads):
        s = item // outputs
        o = item - s * outputs
        row = op[PARAM] + o * inputs
        x = op[IN] + s * inputs
        total = float32(0.0)
        for i in range(inputs):
            total += floats[x + i] * params[row + i]
        total += params[op[PARAM] + outputs * inputs + o]
        if op[RELU] != 0:
            total = max(total, float32(0.0))
        floats[op[OUT] + item] = total


@cuda.jit(device=True)
def dense_backward(op, floats, params, partials, group, n, t, threads):
    """A DENSE row's whole backward pass in one phase: dW, db into the partials, then dL/dx."""
    inputs, outputs = op[C], op[F]
    weights = outputs * inputs
    data = n * inputs if op[NEED_DX] != 0 else 0
    for item in range(t, weights + outputs + data, threads):
        total = float32(0.0)
        if item < weights:
            o = item // inputs
            i = item - o * inputs
            for s in range(n):
                total += masked_gradient(op, floats, s * outputs + o) * floats[op[IN] + s * inputs + i]
            partials[group, op[PARAM] + item] = total
        elif item < weights + outputs:
            for s in range(n):
                total += masked_gradient(op, floats, s * outputs + item - weights)
            partials[group, op[PARAM] + item] = total
        else:
            s = (item - weights - outputs) // inputs
            i = item - weights - outputs - s * inputs
            for o in range(outputs):
                total += masked_gradient(op, floats, s * outputs + o) * params[op[PARAM] + o * inputs + i]
            floats[op[DIN] + s * inputs + i] = total


@cuda.jit(device=True)
def softmax_loss(op, floats, label, s, batch, train):
    """Sample s's cross-entropy −log softmax(z)[label] from its logits (the last row's output); in training
    dL/dz = (softmax(z) − onehot(label)) / batch goes to the last row's gradient. Returns (loss, argmax)."""
    classes = op[F] * op[HO] * op[WO]
    logits = op[OUT] + s * classes
    top = floats[logits]
    best = 0
    for k in range(1, classes):
        if floats[logits + k] > top:
            top = floats[logits + k]
            best = k
    sum_exp = float32(0.0)
    for k in range(classes):
        sum_exp += math.exp(floats[logits + k] - top)
    log_sum = math.log(sum_exp)
    if train != 0:
        for k in range(classes):
            p = math.exp(floats[logits + k] - top - log_sum)
            if k == label:
                p -= float32(1.0)
            floats[op[DOUT] + s * classes + k] = p / float32(batch)
    return top + log_sum - floats[logits + label], best
