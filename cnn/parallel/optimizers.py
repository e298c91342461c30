"""The update rules a server, a coordinator or a synchronous rank applies to host vectors.

Each rule holds θ and one vector of state the size of θ, and offers what a stage offers a
checkpoint — ``get_params``, ``get_momentum`` (the state vector, whatever it is), ``set_momentum``
— plus ``step(grad, lr)``:

- ``sgd`` (``HostSGD``), SGD with momentum μ and L2 weight decay λ (PyTorch's convention, as
  ``cnn.stages.base.sgd_momentum_update``)::

      v ← μ·v + (g + λ·θ);    θ ← θ − η·v

- ``adagrad`` (``HostAdagrad``), Duchi, Hazan & Singer (2011), Downpour's rule in Dean et al.
  (2012): every parameter gets its own rate, the base rate divided by the root of the sum of
  all the squared gradients it has seen::

      g ← g + λ·θ;    G ← G + g²;    θ ← θ − η·g / (√G + ε)

  A parameter that has had large gradients moves less, one that has had few keeps moving. Dean
  et al. credit it for Downpour's robustness to stale gradients: a stale gradient that points the
  wrong way is damped on exactly the parameters that have already been moving a lot.

``SERVER_RULES`` maps the ``--server-rule`` names to the classes; ``server_optimizer`` builds one.
"""

from __future__ import annotations

import numpy as np

from cnn.stages.base import sgd_momentum_update

ADAGRAD_EPSILON = 1e-10           # PyTorch's default: only keeps a never-touched parameter from dividing by 0


class HostSGD:
    """θ and the momentum v as host vectors, stepped with ``cnn.stages.base.sgd_momentum_update``."""

    rule = "sgd"

    def __init__(self, params: np.ndarray, config):
        self.params = np.array(params, copy=True)
        self.velocity = np.zeros_like(self.params)
        self.momentum, self.weight_decay = config.momentum, config.weight_decay

    def step(self, grad: np.ndarray, lr: float) -> None:
        sgd_momentum_update(self.params, self.velocity, grad, lr, self.momentum, self.weight_decay)

    def get_params(self) -> np.ndarray:
        return self.params.copy()

    def get_momentum(self) -> np.ndarray:
        return self.velocity.copy()

    def set_momentum(self, state: np.ndarray) -> None:
        self.velocity[...] = state


class HostAdagrad:
    """θ and G, the per-parameter sum of squared gradients; ``get_momentum`` hands out G."""

    rule = "adagrad"

    def __init__(self, params: np.ndarray, config, epsilon: float = ADAGRAD_EPSILON):
        self.params = np.array(params, copy=True)
        self.sum_squares = np.zeros_like(self.params)
        self.weight_decay, self.epsilon = config.weight_decay, epsilon

    def step(self, grad: np.ndarray, lr: float) -> None:
        """G ← G + g²;  θ ← θ − η·g / (√G + ε), with g = grad + λ·θ."""
        grad = grad + self.weight_decay * self.params
        self.sum_squares += grad * grad
        self.params -= lr * grad / (np.sqrt(self.sum_squares) + self.epsilon)

    def get_params(self) -> np.ndarray:
        return self.params.copy()

    def get_momentum(self) -> np.ndarray:
        return self.sum_squares.copy()

    def set_momentum(self, state: np.ndarray) -> None:
        self.sum_squares[...] = state


SERVER_RULES = {"sgd": HostSGD, "adagrad": HostAdagrad}
"""The update rules a server can apply, by name (``--server-rule``)."""


def server_optimizer(params: np.ndarray, config, rule: str = "sgd"):
    """The optimizer a parameter server, coordinator or synchronous rank steps with."""
    if rule not in SERVER_RULES:
        raise ValueError(f"unknown server rule {rule!r}; choose one of {', '.join(SERVER_RULES)}")
    return SERVER_RULES[rule](params, config)
