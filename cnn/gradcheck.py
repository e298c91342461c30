"""Checking gradients and comparing stages: the tools every test, notebook and assignment uses.

A backward pass is right when it agrees with the slope the loss really has. The central difference

    ∂L/∂θ_k ≈ (L(θ + h·e_k) − L(θ − h·e_k)) / 2h

has error O(h²), so in float64 with h = 1e-6 it matches a correct analytic gradient to about
1e-8 relative; a wrong one is off by O(1). Max-pool is not differentiable where two inputs of a
window tie: draw inputs from a continuous distribution so ties have probability zero.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def rel_error(a, b) -> float:
    """max|a − b| / max(max|a|, max|b|): 0 for equal arrays, ~1 for unrelated ones, and infinite when
    either holds a NaN or an infinity — an output a kernel never wrote (or broke) must never pass."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    scale = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
    return float(np.abs(a - b).max(initial=0.0) / scale) if scale > 0 else 0.0


def numerical_gradient(loss_of: Callable[[np.ndarray], float], values: np.ndarray,
                       indices=None, h: float = 1e-6) -> np.ndarray:
    """Central differences of ``loss_of(values)`` at the flat ``indices`` (all by default).

    ``values`` is perturbed in place and restored, so ``loss_of`` may close over it.
    """
    flat = values.reshape(-1)
    indices = range(flat.size) if indices is None else indices
    grad = np.zeros(flat.size, dtype=np.float64)
    for k in indices:
        saved = flat[k]
        flat[k] = saved + h
        loss_plus = loss_of(values)
        flat[k] = saved - h
        loss_minus = loss_of(values)
        flat[k] = saved
        grad[k] = (loss_plus - loss_minus) / (2 * h)
    return grad.reshape(values.shape)


def check_stage_gradients(stage, images, labels, h: float = 1e-6, max_per_group: int | None = None,
                          seed: int = 0) -> dict[str, float]:
    """Relative error of the stage's analytic gradient against central differences.

    Returns one entry per parameter tensor (``"layer 0 W"``) and one for the input images.
    ``max_per_group`` samples that many entries of each tensor (all if None).
    """
    rng = np.random.default_rng(seed)
    params = stage.get_params()
    _, analytic = stage.loss_and_grad(images, labels)
    input_grad = stage.input_grad.copy()

    def loss_at_params(p):
        stage.set_params(p)
        return stage.evaluate_loss(images, labels)

    errors = {}
    for slot in stage.net.param_layout():
        positions = np.arange(slot.offset, slot.offset + slot.size)
        if max_per_group and slot.size > max_per_group:
            positions = rng.choice(positions, max_per_group, replace=False)
        numeric = numerical_gradient(loss_at_params, params, positions, h)
        errors[f"layer {slot.layer} {slot.name}"] = rel_error(analytic[positions], numeric[positions])
    stage.set_params(params)

    pixels = images.copy()
    positions = np.arange(pixels.size)
    if max_per_group and pixels.size > max_per_group:
        positions = rng.choice(positions, max_per_group, replace=False)
    numeric = numerical_gradient(lambda x: stage.evaluate_loss(x, labels), pixels, positions, h)
    errors["input"] = rel_error(input_grad.reshape(-1)[positions], numeric.reshape(-1)[positions])
    stage.loss_and_grad(images, labels)   # leave the stage as we found it
    return errors
