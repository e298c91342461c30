"""The last dense layer, softmax, cross-entropy and its gradient in ONE kernel (stage 7's ``fused-loss`` fix).

Reference: ``cnn.stages.s1_loops.dense_forward`` followed by ``cnn.stages.base.softmax_cross_entropy``:

    z = x · Wᵀ + b                                   (logits, N × classes)
    p = softmax(z),   L_n = −log p[n, y_n],          dL/dz = (p − onehot(y)) / N

Stages 4–6 run it as three launches (product, bias, ``softmax_xent``) with the logits making a
round trip through device memory between them. Here block n owns row n of the batch:

- thread k < classes computes logit z[n, k] = b[k] + Σ_i x[n, i] · W[k, i] into shared memory
  (and into ``logits``, which ``predict`` and the tests read);
- after one ``syncthreads`` every thread reads the row's max and Σ exp from shared memory
  (classes ≤ ``MAX_CLASSES``: a few dozen reads, no second synchronisation);
- thread k writes dlogits[n, k] = (p[n, k] − [k = y_n]) / N, and thread 0 writes the row's
  loss L_n to ``row_loss[n]``.

The mean L = (1/N) Σ_n L_n is taken on the host when the loss is fetched (N floats instead of
1 — a batch is a few hundred rows): the batch mean needs every row, and a reduction across
blocks would cost another launch or atomics into a buffer zeroed by yet another.
"""

from __future__ import annotations

import math

import numpy as np

from kernels.device import cuda
from kernels.launch import WARP, blocks_for, launch

MAX_CLASSES = 128


@cuda.jit
def dense_softmax_xent_kernel(x, w, b, labels, logits, dlogits, row_loss):
    row_logits = cuda.shared.array(MAX_CLASSES, np.float32)
    n, k = cuda.blockIdx.x, cuda.threadIdx.x
    classes, features = w.shape[0], w.shape[1]
    if k < classes:
        total = b[k]
        for i in range(features):
            total += x[n, i] * w[k, i]
        row_logits[k] = total
        logits[n, k] = total
    cuda.syncthreads()
    top = row_logits[0]
    for m in range(1, classes):
        top = max(top, row_logits[m])
    sum_exp = np.float32(0.0)
    for m in range(classes):
        sum_exp += math.exp(row_logits[m] - top)
    log_sum = math.log(sum_exp)                           # log p[n, m] = z[n, m] − top − log_sum
    label = labels[n]
    if k < classes:
        p = math.exp(row_logits[k] - top - log_sum)
        if k == label:
            p -= np.float32(1.0)
        dlogits[n, k] = p / np.float32(logits.shape[0])
    if k == 0:
        row_loss[n] = top + log_sum - row_logits[label]


def check_classes(classes: int) -> None:
    if classes > MAX_CLASSES:
        raise ValueError(f"dense_softmax_xent: {classes} classes, at most {MAX_CLASSES} fit one block's shared row")


def dense_softmax_xent(x, w, b, labels, logits, dlogits, row_loss, launch=launch):
    """logits, dlogits (N, classes) and row_loss (N,) from x (N, features): one block per row."""
    check_classes(w.shape[0])
    launch(dense_softmax_xent_kernel, x.shape[0], blocks_for(w.shape[0], WARP) * WARP,
           x, w, b, labels, logits, dlogits, row_loss)
