"""A family of cases: what one test cell grades, split between the referee and the kernel.

Each assignment's tests are a dict of families, one per test cell, keyed by the cell's ``grade_id``
(``cnn/grading/assignments/a1_naive_conv.py`` …). A family has two halves:

- ``cases(rng, config)`` runs in the **referee** (a process the student's code cannot reach): it draws
  fresh random inputs and computes, with the library's reference, what the answers must be. Each
  ``Case`` keeps its ``judges`` there; only its ``inputs`` are sent to the kernel.
- ``run(inputs, *answers)`` runs in the **kernel**: it calls the student's function (or launches the
  kernel, or runs the ranks) on the inputs and returns what came out, as a dict of named outputs —
  values, and for the speed families the counts measured while it ran.

The referee judges the outputs (``close``, ``equal``, or a family's own judge) and prints a cs231n
line per comparison::

    forward, x (2, 3, 7, 7), W (4, 3, 3, 3), s=1 p=0   rel_error 3.1e-16  (should be < 1e-10)

``own_work`` says which of the answers must not use the course library, with exceptions
(``cnn.grading.authorship``); ``config(*answers)`` is what the kernel tells the referee before the
cases are made (assignment 10's tile size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from cnn.gradcheck import rel_error

#: the course library: what an answer may not call unless a family allows it — but for kernels.simulator,
#: which Numba's CUDA simulator itself calls at every device function of a simulated kernel
LIBRARY = (("cnn", False), ("cnn.*", False), ("kernels", False), ("kernels.*", False), ("kernels.simulator.*", True))


class Verdict(NamedTuple):
    ok: bool
    line: str = ""          # printed in the kernel, pass or fail
    message: str = ""       # why it failed: the test cell's error


@dataclass
class Case:
    """One call of the student's code: ``inputs`` go to the kernel, ``judges`` stay in the referee."""

    label: str
    inputs: dict
    judges: list = field(default_factory=list)

    def judge(self, outputs: dict) -> list[Verdict]:
        verdicts = []
        for judge in self.judges:
            verdicts.append(judge(outputs))
            if not verdicts[-1].ok:
                break
        return verdicts


@dataclass(frozen=True)
class OwnWork:
    """Which answers (by position in ``grade(family, *answers)``) must be the student's own work, and
    what of the course library they may use: ``rules`` of (pattern, allowed), the last match deciding.
    ``other_parts`` names the notebook's functions that are other parts' answers (``im2col`` for the
    convolution built on it): graded by their own tests, they are not followed into here."""

    answers: tuple = (0,)
    rules: tuple = LIBRARY
    other_parts: tuple = ()


@dataclass(frozen=True)
class Family:
    cases: Callable                     # referee: (rng, config) -> iterable of Case
    run: Callable                       # kernel: (inputs, *answers) -> dict of outputs
    own_work: OwnWork | None = OwnWork()
    config: Callable | None = None      # kernel: (*answers) -> dict sent to the referee before the cases
    sealed: bool = True                 # False for a cell that is not a test (a run the tests then judge)


def normal(rng, *shape, dtype=np.float64) -> np.ndarray:
    """Fresh standard-normal values (never zeros: a forgotten term would hide behind them)."""
    return rng.standard_normal(shape).astype(dtype)


def close(name: str, expected, tolerance: float, what: str):
    """A judge: output ``name`` within ``tolerance`` relative error of ``expected``, finite where it is."""
    expected = np.asarray(expected)

    def judge(outputs: dict) -> Verdict:
        got = outputs.get(name)
        if got is None:
            return Verdict(False, message=f"{what}: your function returned None (did it forget to return its result?)")
        try:
            got = np.asarray(got, dtype=np.float64)
        except (TypeError, ValueError):
            return Verdict(False, message=f"{what}: got {type(got).__name__}, expected numbers")
        if got.shape != expected.shape:
            return Verdict(False, message=f"{what}: shape {got.shape}, expected {expected.shape}")
        missing = ~np.isfinite(got) & np.isfinite(expected)    # rel_error alone would call NaN a perfect match
        if missing.any():
            return Verdict(False, message=f"{what}: {missing.sum()} of {got.size} values are NaN or infinite "
                                          f"(never written, or overflowed)")
        error = rel_error(got, expected)
        line = f"{what:<50} rel_error {error:.1e}  (should be < {tolerance:.0e})"
        return Verdict(bool(error < tolerance), line, f"{what}: relative error {error:.1e} is too large")
    return judge


def equal(name: str, expected, what: str, hint: str = ""):
    """A judge: output ``name`` exactly ``expected`` (integers: shapes, switches, counts)."""
    expected = np.asarray(expected)

    def judge(outputs: dict) -> Verdict:
        got = np.asarray(outputs.get(name))
        same = got.shape == expected.shape and np.array_equal(got, expected)
        shown = got.tolist() if got.size <= 8 else f"an array of shape {got.shape}"
        wanted = expected.tolist() if expected.size <= 8 else f"shape {expected.shape}"
        return Verdict(bool(same), f"{what:<50} right" if same else "", f"{what}: {shown}, expected {wanted}{hint}")
    return judge


def switches(name: str, planes, pooled, size: int, stride: int, tolerance: float, what: str):
    """A judge: max-pool switches (output ``name``), each the flat index h·W + w of its window's winner in its
    plane of ``planes`` (N, C, H, W), must point inside its own window at a value equal to the pooled
    maximum within ``tolerance``. Any maximum of a window is accepted: after a ReLU a window of negatives
    is all zeros, and a float32 kernel may pick either of two values that round alike."""
    planes, pooled = np.asarray(planes), np.asarray(pooled)
    height, width = planes.shape[2:]

    def judge(outputs: dict) -> Verdict:
        switch = np.asarray(outputs.get(name)).astype(np.int64)
        if switch.shape != pooled.shape:
            return Verdict(False, message=f"{what}: shape {switch.shape}, expected {pooled.shape}")
        rows, cols = np.divmod(switch, width)
        i, j = np.indices(switch.shape[2:])
        inside = (switch >= 0) & (rows >= i * stride) & (rows < i * stride + size) & (cols >= j * stride) & (cols < j * stride + size)
        if not inside.all():
            return Verdict(False, message=f"{what}: {np.sum(~inside)} of {switch.size} point outside their window (they "
                                          f"hold h·{width} + w, the winner's position in its {height}×{width} plane)")
        n, c = np.indices(switch.shape[:2])
        at_switch = planes[n[..., None, None], c[..., None, None], rows, cols]
        verdict = close("at", pooled, tolerance, f"value at the {what}")({"at": at_switch})
        return verdict._replace(message=f"{what}: some switches point at a value that is not the maximum of their "
                                        f"window ({verdict.message})") if not verdict.ok else verdict
    return judge
