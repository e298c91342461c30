"""Shared by the whole suite: the CUDA-simulator switch and the ``gpu`` skip rule.

- Numba reads NUMBA_ENABLE_CUDASIM once, when it is first imported, so this sets it at import
  time, before any test module imports numba: the CUDA kernels then run in Numba's simulator.
  A value the user set is kept, and on a machine with an NVIDIA GPU it is left unset, so the
  kernels run on the GPU (force that with NUMBA_ENABLE_CUDASIM=0 pytest ...).
- Tests marked ``gpu`` (full-size checks) are skipped, with the reason, unless a real GPU runs them.
- Ctrl-C as a terminal delivers it: a shell without job control (a script's ``make test &``, ``nohup``)
  starts its background commands with SIGINT ignored, and Python then installs no KeyboardInterrupt
  handler, in the suite or in the processes it starts; the polite-stop tests would test that instead.
  The suite puts Python's own handler back.
- ``real_mnist``: the directory holding the real MNIST, from ``$CNN_DATA_DIR``, else ``data/`` of this
  checkout (where ``make demo`` fetches it), else ``../shared/data`` beside the checkout (where CI keeps a
  copy); the test is skipped, saying where it looked, when none holds it. Never downloads.
"""

import os
import signal
from pathlib import Path

import pytest

from cnn.machine import use_cuda_simulator_unless_gpu

use_cuda_simulator_unless_gpu()
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


CHECKOUT = Path(__file__).resolve().parents[1]


def real_mnist_places() -> list[Path]:
    """Where the tests look for the real MNIST, in order."""
    places = [Path(os.environ["CNN_DATA_DIR"])] if os.environ.get("CNN_DATA_DIR") else []
    return places + [CHECKOUT / "data", CHECKOUT.parent / "shared" / "data"]


@pytest.fixture(scope="session")
def real_mnist() -> Path:
    """The directory holding MNIST's four .gz files (whether they are MNIST is for the test to check); skips without one."""
    from cnn.data import MNIST_FILES

    for base in real_mnist_places():
        for directory in (base, base / "mnist"):
            if all((directory / f"{name}.gz").is_file() for name in MNIST_FILES):
                return directory
    pytest.skip(f"real MNIST not on disk: looked in {', '.join(map(str, real_mnist_places()))}")
