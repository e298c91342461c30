"""SGD with momentum and L2 weight decay on the flat parameter vector, in place.

Reference: ``cnn.stages.base.sgd_momentum_update`` (PyTorch's convention):

    v ← μ·v + (g + λ·w)
    w ← w − η·v

Thread-to-data mapping: thread k owns parameter k — it reads w[k], v[k], g[k] and writes
v[k], w[k]. The learning rate, momentum and weight decay arrive as float32 so that the
arithmetic stays in float32 (a Python float would make it float64).
"""

from __future__ import annotations

import numpy as np

from kernels.device import cuda
from kernels.launch import grid_1d, launch


@cuda.jit(device=True)
def momentum_step(w, v, k, g, lr, momentum, weight_decay):
    """The update of parameter k with gradient g — the one copy of the formula, for every kernel that takes
    the step (this module's, ``kernels/device_epoch.py``'s, ``kernels/fused_net_sum_sgd.py``'s)."""
    velocity = momentum * v[k] + g + weight_decay * w[k]
    v[k] = velocity
    w[k] -= lr * velocity


@cuda.jit
def sgd_momentum_kernel(w, v, g, lr, momentum, weight_decay):
    k = cuda.grid(1)
    if k < w.size:
        momentum_step(w, v, k, g[k], lr, momentum, weight_decay)


def sgd_momentum(w, v, g, lr, momentum, weight_decay, launch=launch):
    """One update of the flat device vectors w (parameters) and v (velocity) with gradient g."""
    launch(sgd_momentum_kernel, *grid_1d(w.size), w, v, g,
           np.float32(lr), np.float32(momentum), np.float32(weight_decay))
