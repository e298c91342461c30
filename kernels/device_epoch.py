"""Kernels that let a whole epoch run on the device: each reads the step it is at from device memory.

Stage 7's ``device-epoch`` fix queues a training step with no value from the host in it: the
step index lives in a one-element device array ``counter``, and what changes from step to step
is looked up there, in vectors uploaded once an epoch:

    order[s·B + b]   the sample in row b of step s's batch (the epoch's shuffle)
    lrs[s]           the learning rate of step s (the schedule)
    loss_log[s]      written by the step: its mean loss; ``first_bad[0]`` = the first s whose loss
                     is NaN or infinite (−1 while there is none)

So the same queued kernels are right for every step — which is what lets ``cuda-graph`` record
them once and replay them (``kernels/step_graph.py``) — and the host only waits when it wants
the losses, every K steps.

Thread-to-data mapping:

- ``gather_step_batch_kernel``  ``kernels/gather.py``'s gather from the resident set, starting at
  order[counter·B]: thread k copies element d = k mod D of row b = k // D (D = C·H·W).
- ``sgd_scheduled_kernel``  thread k owns parameter k, as ``kernels/sgd.py`` with η = lrs[counter].
- ``finish_step_kernel``  ONE block: thread t adds up rows t, t + T, … of the per-row losses, the
  block adds the T partial sums in shared memory (``kernels/reduction.py``: a fixed order, so the
  result is reproducible),
  and thread 0 writes the mean into loss_log[counter], notes a non-finite loss, and advances the
  counter — the step's last kernel, so every earlier kernel of the step read the old value.
- ``score_rows_kernel``  thread n owns row n of a batch of logits: correct[n] = [argmax = label]
  and loss[n] = log Σ exp z − z[label] (the evaluation; ``sum_scores_kernel`` adds them up in one
  block, in a fixed order, so the host copies two numbers instead of the logits).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, float64

from kernels.device import cuda
from kernels.gather import gather_element
from kernels.launch import grid_1d, launch
from kernels.reduction import block_sum
from kernels.sgd import momentum_step

FINISH_THREADS = 256          # the block of finish_step_kernel and sum_scores_kernel (a power of two)


@cuda.jit
def gather_step_batch_kernel(images, labels, order, counter, batch_images, batch_labels):
    gather_element(images, labels, order, counter[0] * batch_images.shape[0], cuda.grid(1),
                   batch_images, batch_labels)


@cuda.jit
def sgd_scheduled_kernel(w, v, g, lrs, counter, momentum, weight_decay):
    k = cuda.grid(1)
    if k < w.size:
        momentum_step(w, v, k, g[k], lrs[counter[0]], momentum, weight_decay)


@cuda.jit
def finish_step_kernel(row_loss, counter, loss_log, first_bad):
    partial = cuda.shared.array(FINISH_THREADS, float64)
    t = cuda.threadIdx.x
    own = float64(0.0)
    for n in range(t, row_loss.size, cuda.blockDim.x):
        own += row_loss[n]
    partial[t] = own
    block_sum(partial, t)
    if t == 0:
        step = counter[0]
        mean = partial[0] / row_loss.size
        loss_log[step] = mean
        if not math.isfinite(mean) and first_bad[0] < 0:
            first_bad[0] = step
        counter[0] = step + 1


@cuda.jit
def score_rows_kernel(logits, labels, start, correct, loss):
    n = cuda.grid(1)
    if n < logits.shape[0]:
        label = labels[start + n]
        best = 0
        top = logits[n, 0]
        for k in range(1, logits.shape[1]):
            if logits[n, k] > top:
                top, best = logits[n, k], k
        sum_exp = float32(0.0)
        for k in range(logits.shape[1]):
            sum_exp += math.exp(logits[n, k] - top)
        correct[start + n] = 1 if best == label else 0
        loss[start + n] = top + math.log(sum_exp) - logits[n, label]


@cuda.jit
def sum_scores_kernel(correct, loss, count, totals):
    correct_sums = cuda.shared.array(FINISH_THREADS, float64)
    loss_sums = cuda.shared.array(FINISH_THREADS, float64)
    t = cuda.threadIdx.x
    own_correct, own_loss = float64(0.0), float64(0.0)
    for n in range(t, count, cuda.blockDim.x):
        own_correct += correct[n]
        own_loss += loss[n]
    correct_sums[t] = own_correct
    loss_sums[t] = own_loss
    block_sum(correct_sums, t)
    block_sum(loss_sums, t)
    if t == 0:
        totals[0] = correct_sums[0]
        totals[1] = loss_sums[0]


def gather_step_batch(images, labels, order, counter, batch_images, batch_labels, launch=launch):
    """batch_images[b] ← images[order[counter·B + b]] (rows of D floats), and the labels likewise."""
    launch(gather_step_batch_kernel, *grid_1d(batch_images.size), images, labels, order, counter,
           batch_images, batch_labels)


def sgd_scheduled(w, v, g, lrs, counter, momentum, weight_decay, launch=launch):
    """SGD with momentum at the learning rate lrs[counter] (read on the device)."""
    launch(sgd_scheduled_kernel, *grid_1d(w.size), w, v, g, lrs, counter,
           np.float32(momentum), np.float32(weight_decay))


def finish_step(row_loss, counter, loss_log, first_bad, launch=launch):
    """loss_log[counter] ← mean of ``row_loss``; first_bad noted; counter += 1."""
    launch(finish_step_kernel, 1, FINISH_THREADS, row_loss, counter, loss_log, first_bad)


def score_rows(logits, labels, start, correct, loss, launch=launch):
    """correct[start + n], loss[start + n] for the rows of ``logits`` (labels[start + n] are theirs)."""
    launch(score_rows_kernel, *grid_1d(logits.shape[0]), logits, labels, start, correct, loss)


def sum_scores(correct, loss, count, totals, launch=launch):
    """totals ← (Σ correct[:count], Σ loss[:count]), float64."""
    launch(sum_scores_kernel, 1, FINISH_THREADS, correct, loss, count, totals)
