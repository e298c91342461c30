"""The one place that imports Numba's CUDA module; every kernel does ``from kernels.device import cuda``.

Numba-CUDA (NVIDIA's ``numba-cuda`` package, which takes over ``numba.cuda`` once installed)
is in maintenance mode; its successor imports as ``from numba_cuda_mlir import cuda``.
Switching the whole course to it is a change to the import line below.

Two questions the rest of the code asks about the machine:

- ``simulated()``: is Numba's CUDA simulator on (``NUMBA_ENABLE_CUDASIM=1``, read when
  numba is first imported)? Kernels then run as Python threads, ~130 µs per thread, with
  ``kernels.simulator``'s fix for the simulator's lock convoy put in place.
- ``gpu_unavailable_reason()``: None when the kernels can run (a real GPU, or the simulator),
  else one line saying why not and how to try them anyway.
"""

from __future__ import annotations

from numba import config
from numba import cuda

from kernels import simulator

__all__ = ["cuda", "simulated", "gpu_unavailable_reason"]

SIMULATOR_HINT = ("to try the kernels without a GPU run a tiny job in the simulator (it takes minutes): "
                  "NUMBA_ENABLE_CUDASIM=1 python -m cnn train --stage cuda-fused --limit-train 8 --limit-test 8 "
                  "--epochs 1 --batch-size 8")


def simulated() -> bool:
    """True when Numba's CUDA simulator runs the kernels instead of a GPU."""
    return bool(config.ENABLE_CUDASIM)


if simulated():
    simulator.install()


def gpu_unavailable_reason() -> str | None:
    """None when kernels can run here (a real GPU, or the simulator); else one line: why, and what to try."""
    if simulated():
        return None
    try:
        if cuda.is_available():
            return None
    except Exception as err:   # a broken driver or toolkit: say so in one line
        return f"the CUDA driver could not be used ({type(err).__name__}: {err}); {SIMULATOR_HINT}"
    return f"no CUDA GPU found (numba.cuda.is_available() is False); {SIMULATOR_HINT}"
