"""How stage 3's threads wait between parallel regions: Numba's OpenMP layer with the passive wait policy.

At the end of a parallel region OpenMP's threads, by default, spin for a while before they sleep,
so that the next region starts without waking anyone. On a machine whose cores are all busy —
a laptop with a browser open, or the course's 2-core development machine shared by other jobs —
a spinning thread takes the core from the thread everyone is waiting for, region after region:
the stage's first version (a parallel region per layer) measured 82 and 12 ms a LeNet-5 step on
2 threads against 5 ms on 1 (two rounds, load 3.3) while a competing process kept one core busy. With
``OMP_WAIT_POLICY=passive`` a waiting thread sleeps at once; waking it costs a few microseconds
a region, and stage 3 now opens one region per phase (``kernels/cpu/network.py``).

Measured on the development machine (2 cores, heavily loaded: 1-minute load 27), the cost of
launching an empty parallel region (``prange(2)``) on 2 threads, 2000 launches a round, best and
median of 5 rounds, one process per layer:

    omp, default (spinning)     63 µs (median 164)
    omp, passive               8.7 µs (median 8.7)
    workqueue                  127 µs (median 154)

The whole step of the first version (a region per layer) with a competing process keeping one
core busy, ms on 2 threads against 1, two rounds, one process a layer, load 3.3-3.6:

    omp, default (spinning)     82.2, 12.4  against 5.1, 4.6
    omp, passive                 5.1,  4.6  against 4.8, 4.6
    workqueue                    5.4,  5.3  against 7.4, 9.7
    tbb                          4.6,  4.9  against 4.7, 4.5

(``tbb`` needs ``pip install tbb`` and, inside a virtual environment, the library on the
loader's path: not a dependency worth a student's setup.) ``benchmarks/numba_vs_torch.py
--loaded`` measures the whole step under load with each layer (``--threading-layer``).

What is set here is only a preference: a value the user gave (``OMP_WAIT_POLICY``,
``NUMBA_THREADING_LAYER``) is kept, and where Numba has no OpenMP layer it falls back to the
next in the list. OpenMP reads the wait policy when it starts — at Numba's first parallel
launch — so this runs when ``kernels.cpu`` is imported, before any of its kernels runs.

PyTorch in the same process brings an OpenMP of its own, and the two meet: one library name
(libgomp.so.1), loaded once, so both run on whichever OpenMP was loaded first, with the policy it
started with. After Numba's, PyTorch's many short parallel regions wake sleeping threads again and
again: its LeNet-5 step measured 5.5-6.2 ms that way against 3.2-3.6 ms with its own defaults (batch
64, 2 threads, 3 processes each, quiet 2-core machine). Before Numba's, Numba's threads spin (PyTorch's
default): a numba-cpu step on 2 threads measured 1.27-1.33 ms against 1.49-1.58 ms passive — the price
of sleeping, two wake-ups a step — and ``FreeCores`` counts the spinning threads as other work and
takes one thread. So ``python -m cnn bench`` times PyTorch in a process of its own, started without
this policy (``other_openmp_defaults``); ``benchmarks/numba_vs_torch.py``, one process by design,
imports PyTorch first and says that its Numba rows ran on PyTorch's spinning OpenMP.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import numba

WAIT_POLICY = "passive"
LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


policy_set_here = False     # whether OMP_WAIT_POLICY is ours, not the user's


def launched_layer() -> str | None:
    """Numba's threading layer once its threads run (a parallel kernel or ``numba.set_num_threads`` started
    them), else None."""
    try:
        return numba.threading_layer()
    except ValueError:             # "Threading layer is not initialized"
        return None


def prefer_passive_openmp() -> None:
    """Ask for the OpenMP layer, its threads sleeping while they wait (unless the user chose otherwise).

    Too late once Numba's threads run: OpenMP read its wait policy when they started. Then say so, in one
    line — the stage still computes the same numbers, but its threads spin, and ``FreeCores`` counts them
    as other work (how a benchmark of this course once ran the stage on one thread without knowing)."""
    global policy_set_here
    policy_set_here = "OMP_WAIT_POLICY" not in os.environ
    if policy_set_here and launched_layer() is not None:
        warnings.warn("kernels.cpu was imported after Numba's threads started (numba.set_num_threads or a "
                      "parallel kernel ran first): they keep OpenMP's default wait policy, spinning, not stage 3's "
                      "passive one; import kernels.cpu (or cnn.stages.s3_numba_cpu) first", stacklevel=2)
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = LAYER_PRIORITY


@contextmanager
def other_openmp_defaults():
    """Our wait policy out of the environment meanwhile (a user's stays): for starting a process that loads an
    OpenMP of its own (the bench's PyTorch reference), which then starts with its own defaults — or, in this
    process, for importing PyTorch before Numba's first parallel launch."""
    saved = os.environ.pop("OMP_WAIT_POLICY", None) if policy_set_here else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved


def thread_pool_facts() -> dict:
    """What a results file records about the threads: Numba's layer (once launched), the count, the wait policy."""
    return {"numba_threading_layer": launched_layer() or "not yet launched", "numba_threads": numba.get_num_threads(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset: spin, then sleep)")}
