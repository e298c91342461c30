"""Stage 8's first kernel: gather, forward, loss and backward of a group of samples, all in ONE block.

Block g owns samples g·S … g·S + S − 1 of the batch (S = the table's SAMPLES; the last group may
hold fewer). It walks the layer table (``kernels/fused_net_table.py``) with the device functions
of ``kernels/fused_net_window.py`` (convolution, pooling) and ``kernels/fused_net_layers.py``
(Dense rows, the loss), synchronising after each phase:

    borders      every buffer a convolution reads with padding is zeroed (its inside is written later)
    gather       its samples from the resident data set: row b of the batch is sample
                 order[position·B + g·S + b] (``kernels/gather.py``'s rule), into shared memory
    forward      row by row; every activation and pooling switch stays in shared memory, each
                 convolution's weights staged there before they are used
    loss         one thread a sample: loss → row_loss[g·S + s], dL/dlogits into shared memory
    backward     row by row in reverse; weight gradients → partials[g, :], activation gradients
                 in shared memory (two buffers taking turns)

Nothing but the losses and the block's row of weight-gradient partial sums is written to global
memory; the weights are only read. ``kernels/fused_net_sum_sgd.py`` adds the rows up in a fixed
order and takes the SGD step.

With ``train`` = 0 the same kernel evaluates: forward and loss only, and for each sample its
logits, its loss and whether its answer is right (``correct``) — ``predict`` and the test set.

Shared memory is *dynamic*: its size (the table's WORDS) is given at launch, as the fourth item
of the launch configuration, and three views of it are taken — float32 (activations, gradients,
weights), int32 (labels), uint8 (switches). ``BlockResources`` adds it to the stage's launcher, and
on a GPU raises the kernel's limit above the 48 KiB a kernel gets without asking (AlexNet-small
needs 214 KiB) with ``cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)``, which numba-cuda does not
wrap. ``THREADS`` (512, from the table) is what 128 registers a thread leave room for: an SM's
65,536 registers are split among its 4 schedulers, 4 warps of 128 · 32 each; any count that is a
multiple of 32 gives the same bits.
"""

from __future__ import annotations

import math

from numba import float32, int32, uint8

from kernels.device import cuda, simulated
from kernels.fused_net_layers import BATCH, at, dense_backward, dense_forward, softmax_loss
from kernels.fused_net_table import (DENSE, INPUT, INPUT_SIZE, KIND, LABELS, OPAD, OPS, OUT, PAD, PARTS, POISON,
                                     SAMPLES, SCRATCH, STAGE, THREADS, WINDOW, WORDS, C, F, H, HO, W, WO)
from kernels.fused_net_window import window_backward, window_forward
from kernels.launch import WARP, launch

H100_SHARED_LIMIT = 227 * 1024            # the most one block may ask for on an H100 (sm_90)


@cuda.jit(device=True)
def zero_fill(floats, start, count, t, threads):
    for k in range(t, count, threads):
        floats[at(start + k)] = float32(0.0)


@cuda.jit(device=True)
def zero_padded(table, floats, n, t, threads):
    """Every buffer stored with a zero border, whole (its inside is written later): the block's input when the
    first row pads, and each row's output that the next row's convolution pads (OPAD)."""
    first = table[1]
    if first[KIND] == WINDOW and first[PAD] > 0:
        zero_fill(floats, table[0, INPUT], n * first[C] * (first[H] + 2 * first[PAD]) * (first[W] + 2 * first[PAD]),
                  t, threads)
    for r in range(1, table[0, OPS] + 1):
        op = table[r]
        halo = op[OPAD]
        if halo > 0:
            zero_fill(floats, op[OUT], n * op[F] * (op[HO] + 2 * halo) * (op[WO] + 2 * halo), t, threads)


@cuda.jit(device=True)
def load_samples(table, floats, ints, images, labels, order, start, n, t, threads):
    """The block's n samples and labels into shared memory: element d = (c, y, x) of sample order[start + b] goes
    to (c, y + pad, x + pad) of the first row's padded input. Thread t copies d = t, t + T, …, its (c, y, x)
    advanced without a division, BATCH elements loaded before any is stored (one wait for memory a batch)."""
    per_sample = table[0, INPUT_SIZE]
    first = table[1]
    pad = first[PAD] if first[KIND] == WINDOW else 0
    height, width = first[H], first[W]
    in_h, in_w = height + 2 * pad, width + 2 * pad
    jump_c, jump_y, jump_x = threads // (height * width), threads % (height * width) // width, threads % width
    values = cuda.local.array(BATCH, float32)
    places = cuda.local.array(BATCH, int32)
    for b in range(n):
        source = order[start + b]
        if t == 0:
            ints[at(table[0, LABELS] + b)] = labels[source]
        inputs = table[0, INPUT] + b * (per_sample // (height * width)) * in_h * in_w
        d, c, y, x = t, t // (height * width), t % (height * width) // width, t % width
        while d < per_sample:
            for k in range(BATCH):
                values[k] = images[source, min(d, per_sample - 1)]
                places[k] = inputs + (c * in_h + y + pad) * in_w + x + pad if d < per_sample else -1
                d += threads
                c, y, x = c + jump_c, y + jump_y, x + jump_x
                if x >= width:
                    x -= width
                    y += 1
                if y >= height:
                    y -= height
                    c += 1
            for k in range(BATCH):
                if places[k] >= 0:
                    floats[at(places[k])] = values[k]


@cuda.jit(device=True)
def write_logits(op, floats, logits, first, s):
    """Evaluation: sample s's logits (the last row's output) to row first + s of ``logits``."""
    classes = logits.shape[1]
    for k in range(classes):
        logits[first + s, k] = floats[at(op[OUT] + s * classes + k)]


@cuda.jit
def fused_net_step_kernel(table, params, images, labels, order, position, batch, train,
                          partials, row_loss, logits, correct):
    floats = cuda.shared.array(0, float32)
    ints = cuda.shared.array(0, int32)
    codes = cuda.shared.array(0, uint8)
    t, threads, group = cuda.threadIdx.x, cuda.blockDim.x, cuda.blockIdx.x
    first = group * table[0, SAMPLES]
    n = min(table[0, SAMPLES], batch - first)
    scratch, stage, parts = table[0, SCRATCH], table[0, STAGE], table[0, PARTS]
    if table[0, POISON] != 0:                 # tests: shared memory starts as NaN, so a read before a write shows
        for k in range(t, table[0, WORDS], threads):
            floats[k] = float32(math.nan)
        cuda.syncthreads()
    zero_padded(table, floats, n, t, threads)
    cuda.syncthreads()
    load_samples(table, floats, ints, images, labels, order, position[0] * batch + first, n, t, threads)
    cuda.syncthreads()
    rows = table[0, OPS]
    for r in range(1, rows + 1):
        op = table[r]
        if op[KIND] == WINDOW:
            window_forward(op, floats, codes, params, n, t, threads, scratch, stage)
        else:
            dense_forward(op, floats, params, scratch, n, t, threads)
        cuda.syncthreads()
    if t < n:
        label = ints[at(table[0, LABELS] + t)]
        loss, answer = softmax_loss(table[rows], floats, label, t, batch, train)
        row_loss[first + t] = loss
        if train == 0:
            correct[first + t] = float32(1.0) if answer == label else float32(0.0)
            write_logits(table[rows], floats, logits, first, t)
    if train == 0:
        return
    cuda.syncthreads()
    for r in range(rows, 0, -1):
        op = table[r]
        if op[KIND] == DENSE:
            dense_backward(op, floats, params, partials, group, n, t, threads)
        else:
            window_backward(op, floats, codes, params, partials, group, n, t, threads, stage, parts)
        cuda.syncthreads()


class BlockResources:
    """``kernel`` launched through any of the course's launchers with ``nbytes`` of dynamic shared memory:
    ``launch(BlockResources(kernel, nbytes), grid, block, *args)`` queues kernel[grid, block, stream, nbytes].

    On a GPU, the first launch with given argument types compiles the kernel and asks the driver for two
    things numba-cuda does not wrap: room for more than the 48 KiB of dynamic shared memory a kernel gets
    without asking, and how many threads a block can have with the registers the compiler gave each
    thread (more threads than that and the launch fails). A block gets no more than those: the results do
    not depend on the block size."""

    compiled: dict = {}                      # (kernel, argument types) -> threads a block can have

    def __init__(self, kernel, nbytes: int):
        self.kernel, self.nbytes = kernel, nbytes

    def __getitem__(self, config):
        grid, block, stream = (*config, 0) if len(config) == 2 else config

        def launch_with(*args):
            threads = block if simulated() else min(block, self.most_threads(args))
            self.kernel[grid, threads, stream, self.nbytes](*args)
        return launch_with

    def most_threads(self, args) -> int:
        types = tuple(self.kernel.typeof_pyval(arg) for arg in args)
        key = (self.kernel, types)
        if key not in BlockResources.compiled:
            from numba.cuda.cudadrv.driver import binding, driver
            function = self.kernel.compile(types)._codelibrary.get_cufunc()
            attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attribute, shared_memory_limit(), function.handle, function.device.id)
            BlockResources.compiled[key] = function.attrs.maxthreads // WARP * WARP
        return BlockResources.compiled[key]


def shared_memory_limit() -> int:
    """Bytes of shared memory one block may ask for on this GPU (the simulator: an H100's 227 KiB)."""
    if simulated():
        return H100_SHARED_LIMIT
    return cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN


def fused_net_step(plan, params, images, labels, order, position, batch, partials, row_loss, threads=THREADS,
                   launch=launch):
    """Training: row_loss[:batch] and partials[g] (the weight gradients of group g) for the batch
    order[position·B …]; ``plan`` from ``TableBuilder.plan``, its table on the device as ``plan.table``."""
    groups = -(-batch // plan.samples)
    launch(BlockResources(fused_net_step_kernel, plan.shared_bytes), groups, threads, plan.table, params, images,
           labels, order, position, batch, 1, partials, row_loss, partials, row_loss)


def fused_net_scores(plan, params, images, labels, order, position, count, logits, row_loss, correct,
                     threads=THREADS, launch=launch):
    """Evaluation of ``count`` samples: logits, row_loss and correct (1.0 or 0.0) of each."""
    groups = -(-count // plan.samples)
    launch(BlockResources(fused_net_step_kernel, plan.shared_bytes), groups, threads, plan.table, params, images,
           labels, order, position, count, 0, logits, row_loss, logits, correct)
