"""L-BFGS: the quasi-Newton method Sandblaster runs (Dean et al. 2012), on one batch per iteration.

Newton's step is −H·g with H the inverse of the Hessian. L-BFGS never forms H (n² numbers for n
parameters): it keeps the last m *curvature pairs*

    s_k = θ_{k+1} − θ_k          (how far the weights moved)
    y_k = g(θ_{k+1}) − g(θ_k)    (how much the gradient changed)

and applies to g the matrix H that the BFGS update builds from them,

    H_{k+1} = (I − ρ_k s_k y_kᵀ) H_k (I − ρ_k y_k s_kᵀ) + ρ_k s_k s_kᵀ,     ρ_k = 1 / (y_kᵀ s_k),

starting from H_0 = γ·I with γ = sᵀy / yᵀy of the newest pair, in O(m·n) by the *two-loop
recursion* (Nocedal & Wright, Algorithm 7.4; ``LBFGS.direction``)::

    q ← g
    for i = newest … oldest:   α_i ← ρ_i s_iᵀq;   q ← q − α_i y_i
    r ← γ·q
    for i = oldest … newest:   β ← ρ_i y_iᵀr;     r ← r + s_i (α_i − β)
    r = H·g

One iteration on a batch B (``LBFGS.step``; ``evaluate(θ)`` gives the mean loss and gradient of
B at θ — in Sandblaster the coordinator sums them from the workers' portions)::

    f, g = evaluate(θ)                              (plus λ/2·|θ|² and λ·θ: the weight decay)
    d = −H·g                                        (−g when no pair is kept yet, or d is no descent)
    t = 1   (with no pair yet: t = --lr, the SGD step, as there is no curvature to scale d)
    until f(θ + t·d) ≤ f + c₁·t·gᵀd   (Armijo's sufficient decrease; each trial another evaluate):
        t ← t / 2                     (give up after ``max_tries``: keep θ, forget the pairs)
    s = t·d,  y = g(θ + t·d) − g       both on B: the pair measures the curvature of one function
    keep the pair if sᵀy > 0           (else H would stop being positive definite)

Computing y on the same batch (Berahas, Nocedal & Takáč 2016's "multi-batch L-BFGS") is what
makes the stochastic version work: two gradients of different batches differ by their sampling
noise as much as by the curvature. Each iteration costs 1 + (trials) evaluations — two when the
first trial is accepted, as it usually is once pairs are kept.

The vectors are kept in float64 whatever the model's dtype: the dot products of the two loops
lose digits in float32. ``dense_inverse_hessian`` builds H by the update formula itself, the n×n
matrix the two loops avoid (for the tests and the notebook, on small n).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

ARMIJO_C1 = 1e-4          # the sufficient decrease asked of a trial: a tiny fraction of the predicted one
SHRINK = 0.5              # backtracking: halve the step after a failed trial
MAX_TRIES = 10            # trials before the line search gives up (the step is then 1/1024 of the first)


@dataclass
class StepReport:
    """What one iteration did: the loss at its start, the step length t (0: rejected), the
    evaluations it took (1 + trials) and whether its curvature pair was kept."""

    loss: float
    step_length: float
    evaluations: int
    pair_kept: bool


def with_weight_decay(evaluate, weight_decay: float):
    """``evaluate`` with λ/2·|θ|² added to the loss and λ·θ to the gradient (the objective L-BFGS minimises)."""
    if not weight_decay:
        return evaluate

    def decayed(params):
        loss, grad = evaluate(params)
        return loss + 0.5 * weight_decay * float(np.dot(params, params)), grad + weight_decay * params
    return decayed


class LBFGS:
    """θ and the last ``history`` curvature pairs; ``step(evaluate)`` is one iteration on one batch.

    Like the other optimizers it offers ``get_params`` and ``get_momentum`` (zeros: L-BFGS has no
    momentum) for a checkpoint, and ``pairs_as_rows`` / ``load_pairs`` carry its memory through one.
    """

    rule = "lbfgs"

    def __init__(self, params: np.ndarray, history: int = 10, first_step: float = 0.02, weight_decay: float = 0.0,
                 max_tries: int = MAX_TRIES):
        self.params = np.array(params, copy=True)
        self.pairs: deque[tuple[np.ndarray, np.ndarray, float]] = deque(maxlen=history)    # (s, y, ρ)
        self.first_step, self.weight_decay, self.max_tries = first_step, weight_decay, max_tries
        self.rejected = 0              # iterations whose line search gave up
        self.skipped_pairs = 0         # pairs dropped for sᵀy ≤ 0

    # -- the two-loop recursion -------------------------------------------------------------------
    def direction(self, grad: np.ndarray) -> np.ndarray:
        """H·g by the two-loop recursion (float64); the search direction is its negative."""
        q = np.asarray(grad, np.float64).copy()
        alphas = []
        for s, y, rho in reversed(self.pairs):
            alphas.append(rho * np.dot(s, q))
            q -= alphas[-1] * y
        if self.pairs:
            s, y, _ = self.pairs[-1]
            q *= np.dot(s, y) / np.dot(y, y)                  # H_0 = γ·I
        for (s, y, rho), alpha in zip(self.pairs, reversed(alphas)):
            beta = rho * np.dot(y, q)
            q += (alpha - beta) * s
        return q

    def remember(self, s: np.ndarray, y: np.ndarray) -> bool:
        """Keep the pair (s, y) if sᵀy > 0 (the curvature condition); the oldest drops out past m."""
        s, y = np.asarray(s, np.float64), np.asarray(y, np.float64)
        curvature = float(np.dot(s, y))
        if not curvature > 1e-10 * float(np.linalg.norm(s) * np.linalg.norm(y)):
            self.skipped_pairs += 1
            return False
        self.pairs.append((s, y, 1.0 / curvature))
        return True

    # -- one iteration ------------------------------------------------------------------------------
    def step(self, evaluate) -> StepReport:
        """One iteration: ``evaluate(θ)`` → (mean loss, mean gradient) of this iteration's batch."""
        objective = with_weight_decay(evaluate, self.weight_decay)
        loss, grad = objective(self.params)
        grad = np.asarray(grad, np.float64)
        direction = -self.direction(grad)
        slope = float(np.dot(grad, direction))
        if not slope < 0:                                    # not a descent direction: start afresh
            self.pairs.clear()
            direction, slope = -grad, -float(np.dot(grad, grad))
        length = 1.0 if self.pairs else self.first_step
        for trial in range(1, self.max_tries + 1):
            moved = (self.params + length * direction).astype(self.params.dtype)
            trial_loss, trial_grad = objective(moved)
            if trial_loss <= loss + ARMIJO_C1 * length * slope:
                kept = self.remember(moved.astype(np.float64) - self.params, np.asarray(trial_grad, np.float64) - grad)
                self.params = moved
                return StepReport(float(loss), length, 1 + trial, kept)
            length *= SHRINK
        self.rejected += 1
        self.pairs.clear()
        return StepReport(float(loss), 0.0, 1 + self.max_tries, False)

    # -- what a checkpoint holds --------------------------------------------------------------------
    def get_params(self) -> np.ndarray:
        return self.params.copy()

    def get_momentum(self) -> np.ndarray:
        return np.zeros_like(self.params)

    def pairs_as_rows(self) -> dict[str, np.ndarray]:
        """The memory as two arrays of rows (oldest first), for ``checkpoint.save``'s ``rows``."""
        size = len(self.params)
        return {"lbfgs_s": np.array([s for s, _, _ in self.pairs]).reshape(-1, size),
                "lbfgs_y": np.array([y for _, y, _ in self.pairs]).reshape(-1, size)}

    def load_pairs(self, rows: dict[str, np.ndarray]) -> None:
        self.pairs.clear()
        for s, y in zip(rows.get("lbfgs_s", ()), rows.get("lbfgs_y", ())):
            self.remember(s, y)


def dense_inverse_hessian(pairs, size: int) -> np.ndarray:
    """The n×n matrix H the two loops apply, built pair by pair with the BFGS update from H_0 = γ·I."""
    if not pairs:
        return np.eye(size)
    s_last, y_last, _ = pairs[-1]
    hessian_inverse = np.dot(s_last, y_last) / np.dot(y_last, y_last) * np.eye(size)
    identity = np.eye(size)
    for s, y, rho in pairs:
        left = identity - rho * np.outer(s, y)
        hessian_inverse = left @ hessian_inverse @ left.T + rho * np.outer(s, s)
    return hessian_inverse


def minimize_batches(params: np.ndarray, evaluate_batch, batches, history: int = 10, first_step: float = 0.02,
                     weight_decay: float = 0.0) -> tuple[LBFGS, list[StepReport]]:
    """One process: an L-BFGS iteration on each batch in turn; ``evaluate_batch(batch, θ)`` → (loss, grad).

    What Sandblaster computes with its workers, computed here alone: the tests compare the two.
    """
    optimizer = LBFGS(params, history, first_step, weight_decay)
    reports = [optimizer.step(lambda theta, batch=batch: evaluate_batch(batch, theta)) for batch in batches]
    return optimizer, reports
