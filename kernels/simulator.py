"""Numba's CUDA simulator without its lock convoy: a module's ``cuda`` swapped once a launch, not once a call.

The simulator runs a block as one Python thread per CUDA thread. Kernel code says ``cuda.threadIdx``,
so every call of a device function swaps the module global ``cuda`` of the function's module for the
launch's fake module, and swaps it back when the last thread leaves (numba-cuda 0.30,
``simulator.kernelapi.swapped_cuda_module``). Since NVIDIA/numba-cuda#690 (a race fixed: one thread
swapped the real module back under another) that bookkeeping takes a per-module lock on every call.
Stage 8's kernels make a device call for almost every array index, from 32+ threads: when the GIL
takes the CPU from the thread that holds the lock, every other thread queues on it, and each
hand-over waits for a GIL switch interval (5 ms). Measured on the 2-core development machine,
``tests/test_cuda_fused_net.py::test_training_steps_equal_numpy[pad2-pool2s1]`` took more than
200 s with the lock and 5 s without it; the whole file did not finish in 15 minutes with it (nor
the suite in CI's 90), and takes 84 s without.

Here a module's ``cuda`` is swapped at the first device call of a launch and swapped back when the
launch ends — every thread of a launch sees the same fake module, so none can restore it under
another, which is the race #690 fixed, without a lock on each call. ``install`` is called by
``kernels.device`` when the simulator is on; with a numba-cuda whose simulator is laid out
differently it leaves the simulator as it is.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_first_swap = threading.Lock()
_swapped: dict[int, tuple[dict, dict]] = {}     # id(module globals) -> (those globals, {name: real cuda})


def install() -> bool:
    """Put the once-a-launch swap into Numba's simulator; True when it is in place."""
    try:
        from numba.cuda.simulator import kernel as simulator
    except ImportError:
        return False
    launcher = getattr(simulator, "FakeCUDAKernel", None)
    if launcher is None or not hasattr(simulator, "swapped_cuda_module") or not hasattr(simulator, "_kernel_context"):
        return False
    if getattr(launcher, "_swaps_once_a_launch", False):
        return True
    locked_swap, call = simulator.swapped_cuda_module, launcher.__call__

    @contextmanager
    def swap_until_the_launch_ends(fn, fake_cuda_module):
        if fake_cuda_module is None:                  # a device function called from the host: as Numba does
            with locked_swap(fn, fake_cuda_module):
                yield
            return
        swap_module_globals(fn.__globals__, fake_cuda_module)
        yield

    def launch_then_restore(kernel, *args):
        if kernel._device or simulator._kernel_context is not None:
            return call(kernel, *args)
        try:
            return call(kernel, *args)
        finally:
            restore_module_globals()

    simulator.swapped_cuda_module = swap_until_the_launch_ends
    launcher.__call__ = launch_then_restore
    launcher._swaps_once_a_launch = True
    return True


def swap_module_globals(module_globals: dict, fake_cuda_module) -> None:
    """Every name bound to the real ``numba.cuda`` in ``module_globals`` rebound to the launch's fake module,
    once a launch (the lock is taken only by the first call from a module)."""
    if id(module_globals) in _swapped:
        return
    from numba import cuda

    with _first_swap:
        if id(module_globals) not in _swapped:
            real = {name: value for name, value in module_globals.items() if value is cuda}
            module_globals.update(dict.fromkeys(real, fake_cuda_module))
            _swapped[id(module_globals)] = (module_globals, real)


def restore_module_globals() -> None:
    """The real ``numba.cuda`` back in every module the launch swapped."""
    with _first_swap:
        while _swapped:
            module_globals, real = _swapped.popitem()[1]
            module_globals.update(real)
