"""One compiled pass over flat vectors: ReLU, its backward, and the SGD-with-momentum update."""

from __future__ import annotations

from numba import njit


@njit(cache=True)
def relu_kernel(x, y):
    """y = max(x, 0) on flat arrays (memory-bound: one thread is enough at these sizes)."""
    for k in range(x.size):
        y[k] = x[k] if x[k] > 0 else 0


@njit(cache=True)
def relu_backward_kernel(dy, y, dx):
    """dx = dy where y > 0, else 0, on flat arrays."""
    for k in range(dy.size):
        dx[k] = dy[k] if y[k] > 0 else 0


@njit(cache=True)
def sgd_momentum_kernel(params, velocity, grad, lr, momentum, weight_decay):
    """``cnn.stages.base.sgd_momentum_update`` in one pass over the flat vectors, no temporaries:

    v ← μ·v + (g + λ·θ)
    θ ← θ − η·v
    """
    for k in range(params.size):
        velocity[k] = velocity[k] * momentum + grad[k] + weight_decay * params[k]
        params[k] -= lr * velocity[k]
