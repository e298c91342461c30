"""Two things the assignments' kernel side needs from Numba: which loops run in parallel, and silence.

- ``parallel_loops`` lists the ``prange`` loops Numba really compiled to run in parallel (assignment 9);
- ``hide_performance_warnings``: a warning on stderr costs a test cell its points in nbgrader.

The comparisons themselves (relative errors, switches) are the referee's: ``cnn.grading.family``.
"""

from __future__ import annotations

import linecache
import warnings

from cnn.grading.bytecode import python_function


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
