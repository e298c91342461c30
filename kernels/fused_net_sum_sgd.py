"""Stage 8's second kernel: the groups' weight gradients added up in a fixed order, and the SGD step.

``kernels/fused_net_step.py`` leaves one row of partial sums a group of samples: partials[g, k]
is the gradient of weight k over group g's samples (already divided by the batch size). Here
thread k owns weight k:

    g_k = partials[0, k] + partials[1, k] + … + partials[G − 1, k]     (always this order)
    grad[k] = g_k
    v ← μ·v + (g_k + λ·w),   w ← w − η·v      with η = lrs[counter]  (only when ``update``)

— the update of ``cnn.stages.base.sgd_momentum_update``, by ``kernels/sgd.py``'s ``momentum_step``
(the one device function every SGD kernel of the course calls). Nothing is added with atomics, so the
same inputs give the same bits on every run, on every GPU: a run is reproducible.
Neighbouring threads read neighbouring weights of a row (coalesced).

With ``update`` False only ``grad`` is written (the stage's separate ``backward`` phase; its
``update`` phase is then ``kernels/sgd.py``).
"""

from __future__ import annotations

import numpy as np
from numba import float32

from kernels.device import cuda
from kernels.launch import grid_1d, launch
from kernels.sgd import momentum_step


@cuda.jit
def sum_sgd_kernel(partials, grad, w, v, lrs, counter, momentum, weight_decay, update):
    k = cuda.grid(1)
    if k < w.size:
        total = float32(0.0)
        for group in range(partials.shape[0]):
            total += partials[group, k]
        grad[k] = total
        if update:
            momentum_step(w, v, k, total, lrs[counter[0]], momentum, weight_decay)


def sum_sgd(partials, grad, w, v, lrs, counter, momentum, weight_decay, launch=launch):
    """grad ← Σ_g partials[g] (in order of g), then SGD with momentum at the learning rate lrs[counter]."""
    launch(sum_sgd_kernel, *grid_1d(w.size, 256), partials, grad, w, v, lrs, counter,
           np.float32(momentum), np.float32(weight_decay), True)


def sum_partials(partials, grad, w, v, lrs, counter, launch=launch):
    """grad ← Σ_g partials[g] (in order of g): the same kernel without the update."""
    launch(sum_sgd_kernel, *grid_1d(w.size, 256), partials, grad, w, v, lrs, counter,
           np.float32(0.0), np.float32(0.0), False)
