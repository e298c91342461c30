"""Shared by the whole suite: the CUDA-simulator switch and the ``gpu`` skip rule.

- Numba reads NUMBA_ENABLE_CUDASIM once, when it is first imported, so this sets it at import
  time, before any test module imports numba: the CUDA kernels then run in Numba's simulator.
  A value the user set is kept, and on a machine with an NVIDIA GPU it is left unset, so the
  kernels run on the GPU (force that with NUMBA_ENABLE_CUDASIM=0 pytest ...).
- Tests marked ``gpu`` (full-size checks) are skipped, with the reason, unless a real GPU runs them.
"""

import pytest

from cnn.machine import use_cuda_simulator_unless_gpu

use_cuda_simulator_unless_gpu()


def _real_gpu_missing() -> str | None:
    """None when the kernels run on a real GPU, else why the ``gpu`` tests are skipped."""
    try:
        from kernels.device import gpu_unavailable_reason, simulated
    except ImportError as err:
        return f"numba-cuda cannot be imported ({err})"
    if simulated():
        return "the CUDA simulator is on; run full-size checks on a GPU with NUMBA_ENABLE_CUDASIM=0 pytest -m gpu"
    return gpu_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    reason = _real_gpu_missing() if gpu_items else None
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
