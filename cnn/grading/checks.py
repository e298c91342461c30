"""What the test cells of the assignments check, besides traffic: numbers, own work, switches, threads.

- ``check`` prints one line per comparison, cs231n style, so the student sees at once how far off an
  answer is, then fails with a message naming what was compared::

      dx, x (2, 3, 7, 7), s=2 p=1                    rel_error 3.1e-16  (should be < 1e-10)

- ``written_by_you`` refuses a function whose source calls the library's version of itself;
- ``check_switches`` accepts max-pool switches that point at any maximum of their window;
- ``parallel_loops`` lists the ``prange`` loops Numba really compiled to run in parallel;
- ``hide_performance_warnings``: a warning on stderr costs a test cell its points in nbgrader.
"""

from __future__ import annotations

import inspect
import linecache
import warnings

import numpy as np

from cnn.gradcheck import rel_error
from cnn.grading.traffic import python_function


def check(what: str, got, expected, tolerance: float) -> None:
    """Print the relative error of ``got`` against ``expected``; fail when it is too large.

    Returns nothing on purpose: nbgrader takes a number left as a test cell's last value for its score.
    """
    if got is None:
        raise AssertionError(f"{what}: your function returned None (did it forget to return its result?)")
    got = np.asarray(got)
    assert got.shape == np.shape(expected), f"{what}: shape {got.shape}, expected {np.shape(expected)}"
    missing = ~np.isfinite(got) & np.isfinite(expected)     # rel_error alone would call NaN a perfect match
    assert not missing.any(), (f"{what}: {missing.sum()} of {got.size} values are NaN or infinite "
                               f"(never written, or overflowed)")
    error = rel_error(got, expected)
    print(f"{what:<50} rel_error {error:.1e}  (should be < {tolerance:.0e})")
    assert error < tolerance, f"{what}: relative error {error:.1e} is too large"


def python_source(function) -> str:
    """The source of a function, of the Python function behind a Numba dispatcher, or of a CUDA kernel."""
    return inspect.getsource(python_function(function))


def written_by_you(function, *library_names: str) -> None:
    """Fail when the function's source mentions the library's own version of what it should compute."""
    source = python_source(function)
    used = [name for name in library_names if name in source]
    name = getattr(function, "__name__", "the function")
    assert not used, f"{name} uses {', '.join(used)}: write it yourself"


def check_switches(what: str, switch, plane, pooled, size: int, stride: int) -> None:
    """Max-pool switches: each must point, as the flat index h·W + w of ``plane`` (N, C, H, W), inside its
    window at a value equal to the pooled output. Any maximum of a window is accepted (ties included:
    after a ReLU, a window of negatives has many zeros)."""
    switch = np.asarray(switch)
    assert switch.shape == np.shape(pooled), f"{what}: shape {switch.shape}, expected {np.shape(pooled)}"
    width = plane.shape[3]
    rows, cols = np.divmod(switch, width)
    i, j = np.indices(switch.shape[2:])
    inside = (rows >= i * stride) & (rows < i * stride + size) & (cols >= j * stride) & (cols < j * stride + size)
    assert inside.all(), (f"{what}: {np.mean(~inside):.0%} of the switches point outside their window "
                          f"(they hold h·{width} + w, the winner's position in its {plane.shape[2]}×{width} plane)")
    n, c = np.indices(switch.shape[:2])
    at_switch = plane[n[..., None, None], c[..., None, None], rows, cols]
    wrong = ~np.isclose(at_switch, pooled, rtol=1e-12, atol=0)
    assert not wrong.any(), f"{what}: {np.mean(wrong):.0%} of the switches point at a value that is not the maximum"
    print(f"{what:<50} every switch points at its window's maximum")


def parallel_loops(dispatcher) -> list[str]:
    """The source lines of the ``prange`` loops that Numba compiled as parallel loops, over every
    signature an ``@njit(parallel=True)`` function has been compiled for (call it first).

    A ``prange`` in a function compiled without ``parallel=True`` runs as a plain ``range`` and is not
    listed; nor are the parallel loops Numba makes of whole-array expressions (``np.zeros``, ``a + b``)
    or inside its own functions (``a.sum()``).
    """
    source_file = python_function(dispatcher).__code__.co_filename
    lines = []
    for signature in getattr(dispatcher, "signatures", ()):
        diagnostics = dispatcher.overloads[signature].metadata.get("parfor_diagnostics")
        for parfor in getattr(diagnostics, "initial_parfors", None) or ():
            if parfor.loc.filename != source_file:     # Numba's own parallel loops (inside arr.sum(), …)
                continue
            text = linecache.getline(parfor.loc.filename, parfor.loc.line).strip()
            if "prange" in text:
                lines.append(text)
    return lines


def hide_performance_warnings() -> None:
    """Silence Numba's performance warnings for the rest of the session.

    nbgrader gives a test cell no points when it writes anything to stderr, and Numba warns there
    about performance: a grid too small to fill a GPU (every launch of a test's tiny shapes on a real
    GPU), ``parallel=True`` with no loop it could parallelise. The tests grade performance themselves,
    with a message that says what to change, so a correct answer must not lose points to a warning.
    """
    from numba.core.errors import NumbaPerformanceWarning

    warnings.simplefilter("ignore", NumbaPerformanceWarning)
    try:                                     # numba-cuda has its own class; absent without numba-cuda
        from numba.cuda.core.errors import NumbaPerformanceWarning as CudaPerformanceWarning
    except ImportError:
        return
    warnings.simplefilter("ignore", CudaPerformanceWarning)
