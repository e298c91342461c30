"""Softmax cross-entropy over a batch of logits, and its gradient, in one kernel.

Reference: ``cnn.stages.base.softmax_cross_entropy``:

    p = softmax(z) = exp(z − max z) / Σ exp(z − max z)
    L = −(1/N) Σ_n log p[n, y_n],        dL/dz = (p − onehot(y)) / N

Thread-to-data mapping: ONE block (the mean over the batch needs every row, and
``syncthreads`` only synchronises a block). Thread t owns rows n = t, t + T, t + 2T, …: it
writes those rows of ``dlogits`` and keeps the sum of their losses; the block then adds the
T partial losses in shared memory (``reduction.block_sum``) and thread 0 writes ``loss[0]``.
A batch has at most a few hundred rows of ~10 classes, so one block is plenty.
"""

from __future__ import annotations

import math

import numpy as np

from kernels.device import cuda
from kernels.launch import REDUCE_THREADS, launch, reduction_threads
from kernels.reduction import block_sum


@cuda.jit
def softmax_xent_kernel(logits, labels, loss, dlogits):
    partial = cuda.shared.array(REDUCE_THREADS, np.float32)
    t = cuda.threadIdx.x
    batch, classes = logits.shape[0], logits.shape[1]
    inv_batch = np.float32(1.0) / np.float32(batch)
    total = np.float32(0.0)
    for n in range(t, batch, cuda.blockDim.x):
        top = logits[n, 0]
        for k in range(1, classes):
            top = max(top, logits[n, k])
        sum_exp = np.float32(0.0)
        for k in range(classes):
            sum_exp += math.exp(logits[n, k] - top)
        log_sum = math.log(sum_exp)                      # log p[n, k] = z[n, k] − top − log_sum
        total -= logits[n, labels[n]] - top - log_sum
        for k in range(classes):
            p = math.exp(logits[n, k] - top - log_sum)
            if k == labels[n]:
                p -= np.float32(1.0)
            dlogits[n, k] = p * inv_batch
    partial[t] = total
    block_sum(partial, t)
    if t == 0:
        loss[0] = partial[0] * inv_batch


def softmax_xent(logits, labels, loss, dlogits, launch=launch):
    """loss[0] ← mean cross-entropy, dlogits ← its gradient; labels is an int32 device vector."""
    launch(softmax_xent_kernel, 1, reduction_threads(logits.shape[0]), logits, labels, loss, dlogits)
