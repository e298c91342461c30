"""A whole training step, one block of samples at a time: each thread takes its blocks through the WHOLE network.

The per-layer kernels (``conv_pool``, ``dense``) spread ONE layer over the threads, so a LeNet-5
step is a dozen parallel regions, each ending at a barrier where every thread waits for the
slowest. On a busy machine one thread is often descheduled for a time slice (milliseconds) and,
at every barrier, the others wait for it. Here the work item is a block of ``BLOCK_SAMPLES``
samples, and one thread takes its block through every layer — forward, loss, backward — with the
block's activations staying in that core's cache and its convolutions' weight gradient summed into the
block's own copy. One parallel region a phase: a descheduled thread delays only its own blocks, once.
(Stage 8 takes the same idea to the GPU: one thread block runs the whole network for its samples.)

Thread → data: worker w of ``workers`` takes the contiguous range of blocks ``chunk_range(w)``;
block k holds samples k·BLOCK_SAMPLES … (k+1)·BLOCK_SAMPLES − 1 (the last may be shorter) and owns
row k of ``grad_copies`` (the convolutions' parameters, which come first in the flat vector). The
gradient is then Σ_k grad_copies[k], added in block order, and the dense layers' dW and db, taken once
for the whole batch (``gather_gradient``): the same numbers, bit for bit, on any number of threads.

The network arrives as a *program*: one row of integers per kernel call (the ``FIELD`` columns
below), built by ``cnn.stages.s3_numba_cpu.block_program``. Activations live in flat buffers, one
segment per program row: segment s holds the row's output for the whole batch, sample n at
N·SEGMENT_START + n·(C·H·W). ``grads`` has the same layout and holds dL/d(each output);
``switches`` too, for the pooled rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.conv_pool import _conv_block_backward_chunk, _conv_block_forward_chunk, conv_items
from kernels.cpu.layout import SAFE_FASTMATH, add_dot_products, add_product, chunk_range
from kernels.cpu.pool import maxpool_backward_kernel, maxpool_kernel
from kernels.cpu.winograd import uses_winograd, weights_shape, weights_size, winograd_weights

BLOCK_SAMPLES = 8      # samples a thread takes through the whole network at a time (fixed: results do not
                       # depend on the thread count); LeNet-5 batch 64 makes 8 blocks, 4 per thread on 2 cores

# the kinds of program rows
CONV, RELU, MAXPOOL, DENSE = 0, 1, 2, 3
# the columns of a program row
(KIND, IN_START, OUT_START, C_IN, H_IN, W_IN, C_OUT, H_OUT, W_OUT, W_AT, B_AT,
 KERNEL, STRIDE, PAD, APPLY_RELU, POOL_SIZE, POOL_STRIDE) = range(17)
FIELDS = 17


@njit(cache=True)
def _segment(buffer, start, size, batch, n0, n1):
    """Samples n0 … n1−1 of the segment that starts at batch·start (size numbers a sample), flat."""
    return buffer[batch * start + n0 * size:batch * start + n1 * size]


@njit(cache=True)
def _input_of(row, images, acts, batch, n0, n1):
    """The row's input for samples n0 … n1−1, as (samples, C, H, W): the images, or an earlier row's output."""
    shape = (n1 - n0, row[C_IN], row[H_IN], row[W_IN])
    if row[IN_START] < 0:
        return images[n0:n1].reshape(shape)
    return _segment(acts, row[IN_START], row[C_IN] * row[H_IN] * row[W_IN], batch, n0, n1).reshape(shape)


@njit(cache=True)
def _output_of(row, buffer, batch, n0, n1):
    """The row's output segment of ``buffer`` (acts, grads or switches) for samples n0 … n1−1, as (samples, C, H, W)."""
    size = row[C_OUT] * row[H_OUT] * row[W_OUT]
    return _segment(buffer, row[OUT_START], size, batch, n0, n1).reshape((n1 - n0, row[C_OUT], row[H_OUT], row[W_OUT]))


@njit(cache=True)
def _weights(row, params):
    """(W, b) of a conv or dense row, views into the flat vector (dense: W is (out, in))."""
    F, C = row[C_OUT], row[C_IN]
    if row[KIND] == CONV:
        size = F * C * row[KERNEL] * row[KERNEL]
        W = params[row[W_AT]:row[W_AT] + size].reshape((F, C, row[KERNEL], row[KERNEL]))
    else:
        size = F * C * row[H_IN] * row[W_IN]
        W = params[row[W_AT]:row[W_AT] + size].reshape((F, C * row[H_IN] * row[W_IN], 1, 1))
    return W, params[row[B_AT]:row[B_AT] + F]


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _dense_forward(x, W, b, relu, y):
    """y[n, o] = Σ_i x[n, i]·W[o, i] + b[o] (then ReLU) for the block's samples: sixteen dot products
    (four samples × four rows of W) a pass (``add_dot_products``)."""
    for n in range(x.shape[0]):
        y[n] = b
    add_dot_products(y, x, W)
    if relu:
        for n in range(y.shape[0]):
            for o in range(y.shape[1]):
                y[n, o] = y[n, o] if y[n, o] > 0 else 0


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _dense_input_gradient(dy, W, dx):
    """dx = dy·W for the block's samples (``add_product``: four samples of dx by four rows of W a pass). The
    layer's dW and db wait for the whole batch (``gather_gradient``)."""
    dx[:] = 0
    add_product(dx, dy, W)


@njit(cache=True)
def _relu_gate(dy, y):
    """dy ← dy where y > 0, else 0 (in place: the gradient arriving at a ReLU's output, taken to its input)."""
    for k in range(dy.size):
        dy[k] = dy[k] if y[k] > 0 else 0


@njit(cache=True)
def _softmax_cross_entropy(logits, labels, batch, dlogits):
    """For the block's rows: dlogits = (softmax(z) − onehot(y)) / batch; returns Σ_n −log softmax(z_n)[y_n]."""
    total = 0.0
    for n in range(logits.shape[0]):
        top = np.float64(logits[n].max())
        norm = 0.0
        for k in range(logits.shape[1]):
            norm += np.exp(np.float64(logits[n, k]) - top)
        total += np.log(norm) - (logits[n, labels[n]] - top)
        for k in range(logits.shape[1]):
            p = np.exp(np.float64(logits[n, k]) - top) / norm
            dlogits[n, k] = (p - (1.0 if k == labels[n] else 0.0)) / batch
    return total


@njit(cache=True)
def _winograd_rows(program, params, forward):
    """The Winograd weights (``winograd.winograd_weights``) of every conv row whose forward goes that way, once a
    step for all the blocks, in one flat vector; and where each row's start (−1: none; none at all for a call
    without a forward pass)."""
    starts, size = np.full(program.shape[0], -1, np.int64), 0
    for index in range(program.shape[0] if forward else 0):
        row = program[index]
        if row[KIND] == CONV and uses_winograd(row[C_IN], row[H_IN], row[W_IN], row[KERNEL], row[STRIDE], row[PAD],
                                               row[POOL_SIZE], row[POOL_STRIDE]):
            starts[index] = size
            size += weights_size(row[C_OUT], row[C_IN])
    prepared = np.zeros(size, params.dtype)
    for index in range(program.shape[0]):
        if starts[index] >= 0:
            W, _ = _weights(program[index], params)
            winograd_weights(W, _winograd_of(program[index], prepared, starts[index]))
    return prepared, starts


@njit(cache=True)
def _winograd_of(row, prepared, start):
    """The row's Winograd weights in ``prepared`` (from ``start``; none when start < 0)."""
    if start < 0:
        return prepared[:0].reshape((0, 0, 0, 4, 4))
    return prepared[start:start + weights_size(row[C_OUT], row[C_IN])].reshape(weights_shape(row[C_OUT], row[C_IN]))


@njit(cache=True)
def _forward_row(row, U, params, images, acts, switches, batch, n0, n1):
    """One program row's forward pass for samples n0 … n1−1 (U: its Winograd weights, if it has any)."""
    x, out = _input_of(row, images, acts, batch, n0, n1), _output_of(row, acts, batch, n0, n1)
    kind, relu = row[KIND], row[APPLY_RELU] == 1
    if kind == CONV:
        W, b = _weights(row, params)
        if row[POOL_SIZE] > 0:
            switch = _output_of(row, switches, batch, n0, n1)
        else:
            switch = np.empty((n1 - n0, row[C_OUT], 0, 0), np.int64)
        _conv_block_forward_chunk(x, W, U, b, row[STRIDE], row[PAD], relu, row[POOL_SIZE], row[POOL_STRIDE],
                                  out, switch, 0,
                                  conv_items(x, W, row[STRIDE], row[PAD], row[POOL_SIZE], row[POOL_STRIDE], False))
    elif kind == DENSE:
        W, b = _weights(row, params)
        _dense_forward(x.reshape((n1 - n0, -1)), W.reshape((W.shape[0], -1)), b, relu, out.reshape((n1 - n0, -1)))
    elif kind == RELU:
        flat_x, flat_out = x.reshape(-1), out.reshape(-1)
        for k in range(flat_x.size):
            flat_out[k] = flat_x[k] if flat_x[k] > 0 else 0
    else:
        maxpool_kernel(x, row[POOL_SIZE], row[POOL_STRIDE], out, _output_of(row, switches, batch, n0, n1))


@njit(cache=True)
def _backward_row(row, params, images, acts, switches, grads, grad_copy, input_grad, batch, n0, n1):
    """One program row's backward pass for samples n0 … n1−1: dL/d(its input) into ``grads`` (or into
    ``input_grad`` for the first row, when that is not empty), its dW and db added into ``grad_copy``."""
    x, out = _input_of(row, images, acts, batch, n0, n1), _output_of(row, acts, batch, n0, n1)
    dout = _output_of(row, grads, batch, n0, n1)
    first = row[IN_START] < 0
    need_dx = not first or input_grad.size > 0
    if first:
        dx = input_grad[n0:n1] if input_grad.size > 0 else x
    else:
        dx = _input_of(row, images, grads, batch, n0, n1)
    kind, relu = row[KIND], row[APPLY_RELU] == 1
    if kind == CONV:
        W, _ = _weights(row, params)
        dW, db = _weights(row, grad_copy)
        if row[POOL_SIZE] > 0:
            switch = _output_of(row, switches, batch, n0, n1)
        else:
            switch = np.empty((n1 - n0, row[C_OUT], 0, 0), np.int64)
        _conv_block_backward_chunk(dout, out, switch, x, W, row[STRIDE], row[PAD], relu, row[POOL_SIZE], row[POOL_STRIDE],
                                   dW, db, dx, need_dx, 0,
                                   conv_items(x, W, row[STRIDE], row[PAD], row[POOL_SIZE], row[POOL_STRIDE], True))
    elif kind == DENSE:
        W, _ = _weights(row, params)
        dy = dout.reshape((n1 - n0, -1))
        if relu:
            _relu_gate(dy.reshape(-1), out.reshape(-1))      # in place: gather_gradient reads the gated dy too
        if need_dx:
            _dense_input_gradient(dy, W.reshape((W.shape[0], -1)), dx.reshape((n1 - n0, -1)))
    elif kind == RELU:
        if need_dx:
            flat_dx, flat_dout, flat_out = dx.reshape(-1), dout.reshape(-1), out.reshape(-1)
            for k in range(flat_dx.size):
                flat_dx[k] = flat_dout[k] if flat_out[k] > 0 else 0
    elif need_dx:
        maxpool_backward_kernel(dout, _output_of(row, switches, batch, n0, n1), row[POOL_SIZE], row[POOL_STRIDE], dx)


@njit(cache=True)
def _run_block(program, prepared, prepared_at, params, images, labels, acts, switches, grads, grad_copy, input_grad,
               batch, n0, n1, forward, backward):
    """Samples n0 … n1−1 through the whole network: forward (and the loss, when there are labels), then
    backward. Returns the block's summed loss (0 without labels or without a forward pass). ``prepared``,
    ``prepared_at``: the step's Winograd weights (``_winograd_rows``)."""
    loss = 0.0
    last = program[program.shape[0] - 1]
    if forward:
        for index in range(program.shape[0]):
            _forward_row(program[index], _winograd_of(program[index], prepared, prepared_at[index]), params, images,
                         acts, switches, batch, n0, n1)
        if labels.size > 0:
            logits = _output_of(last, acts, batch, n0, n1).reshape((n1 - n0, -1))
            dlogits = _output_of(last, grads, batch, n0, n1).reshape((n1 - n0, -1))
            loss = _softmax_cross_entropy(logits, labels[n0:n1], batch, dlogits)
    if backward:
        grad_copy[:] = 0
        for index in range(program.shape[0] - 1, -1, -1):
            _backward_row(program[index], params, images, acts, switches, grads, grad_copy, input_grad, batch, n0, n1)
    return loss


@njit(parallel=True, cache=True)
def run_blocks(program, params, images, labels, acts, switches, grads, grad_copies, block_losses, input_grad,
               forward, backward, threads):
    """Every block of the batch through the network, ONE parallel region: worker w takes blocks
    chunk_range(w, workers, blocks), each from the first layer to the last (and back, if ``backward``).

    Writes acts (and switches) forward, block_losses[k] (the summed loss of block k) when there are
    labels, and backward grads and grad_copies[k] (block k's convolution dW, db); ``input_grad`` (dL/d images)
    when it is not empty.
    """
    batch = images.shape[0]
    blocks = -(-batch // BLOCK_SAMPLES)
    workers = min(threads, blocks)
    prepared, prepared_at = _winograd_rows(program, params, forward)
    for worker in prange(workers):
        first, end = chunk_range(worker, workers, blocks)
        for block in range(first, end):
            n0, n1 = block * BLOCK_SAMPLES, min(batch, (block + 1) * BLOCK_SAMPLES)
            loss = _run_block(program, prepared, prepared_at, params, images, labels, acts, switches, grads,
                              grad_copies[block], input_grad, batch, n0, n1, forward, backward)
            if forward:
                block_losses[block] = loss


@njit(cache=True)
def dense_items(program):
    """Work items of the dense layers' weight gradients: four output rows of one dense program row each."""
    items = 0
    for index in range(program.shape[0]):
        if program[index, KIND] == DENSE:
            items += -(-program[index, C_OUT] // 4)
    return items


@njit(cache=True)
def _dense_item(program, item):
    """(program row, first output row) of dense work item ``item``."""
    for index in range(program.shape[0]):
        if program[index, KIND] == DENSE:
            groups = -(-program[index, C_OUT] // 4)
            if item < groups:
                return index, 4 * item
            item -= groups
    return -1, 0


@njit(cache=True, fastmath=SAFE_FASTMATH)
def _dense_weight_rows(row, images, acts, grads, grad, batch, o0):
    """Rows o0 … o0+3 of a dense row's dW = dYᵀ·X and db = Σ_n dY over the WHOLE batch, written into ``grad``:
    four rows of dW by four samples a pass (``add_product``), the samples in order."""
    x = _input_of(row, images, acts, batch, 0, batch).reshape((batch, -1))
    dy = _output_of(row, grads, batch, 0, batch).reshape((batch, -1))
    dW, db = _weights(row, grad)
    o1 = min(o0 + 4, db.size)
    rows = dW.reshape((db.size, -1))[o0:o1]
    rows[:] = 0
    add_product(rows, dy[:, o0:o1].T, x)
    for o in range(o0, o1):
        total = dy.dtype.type(0)
        for n in range(batch):
            total += dy[n, o]
        db[o] = total


@njit(parallel=True, cache=True)
def gather_gradient(program, images, acts, grads, grad_copies, grad, threads):
    """The step's gradient, in a second, short parallel region:

    grad[i] = Σ_k grad_copies[k, i]   for the parameters the blocks summed (the convolutions': i < split,
                                      first in the vector), k in block order
    dW = dYᵀ·X, db = Σ_n dY           for each dense row, over the whole batch (from the activations and the
                                      gated gradients the blocks left in ``acts`` and ``grads``)

    A dense layer's weights are a large matrix read for a few samples: summed per block of 8, its dW was
    zeroed, added into and summed again for every block. Taken once for the batch, a LeNet-5 b64 step
    measured 0.93-0.97x the CPU time on one thread, 0.92-1.02x on two (wall 1.61 -> 1.51 ms; AlexNet-small
    b128 0.96-0.98x; fresh processes taking turns, 3-4 rounds, load 0.7-1.0; stage 3's docstring). Worker w takes a
    contiguous range of i and of the dense work items (four output rows each): every number has one
    writer and a fixed order of additions, so the gradient is the same, bit for bit, on any number of threads.
    """
    batch, split = images.shape[0], grad_copies.shape[1]
    items = dense_items(program)
    workers = min(threads, max(1, split // 4096, items))
    for worker in prange(workers):
        lo, hi = chunk_range(worker, workers, split)
        total = grad[lo:hi]
        total[:] = grad_copies[0, lo:hi]
        for block in range(1, grad_copies.shape[0]):      # block by block: a contiguous SIMD add, in order for each i
            share = grad_copies[block, lo:hi]
            for i in range(total.size):
                total[i] += share[i]
        first, end = chunk_range(worker, workers, items)
        for item in range(first, end):
            index, o0 = _dense_item(program, item)
            _dense_weight_rows(program[index], images, acts, grads, grad, batch, o0)
