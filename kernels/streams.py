"""Streams, events, and two counters that check what a training step does besides its arithmetic.

Stages 6 and 7 queue a step's kernels and copies on a CUDA *stream* of their own, so that a
second stream can copy finished gradients to the host while the next step computes:

- ``StreamLaunchCounter(stream)``: ``LaunchCounter`` that queues every kernel on ``stream``
  (``kernel[grid, block, stream](*args)``) and also counts the array arguments it passed — the
  host cost of a launch grows with them (~6.6 µs plus ~3.5 µs per array argument in numba-cuda,
  NVIDIA/numba-cuda#288).
- ``new_event(timing)``: a CUDA event. ``event.record(stream)`` marks a point in a stream,
  ``event.wait(stream)`` makes another stream wait for that point (the host does not wait),
  ``event.synchronize()`` makes the host wait. Events recorded with ``timing=True`` give
  milliseconds between them on a GPU; the simulator's events give none.
- ``AllocationCounter``: counts device (and pinned host) allocations while active — a stage
  that allocates nothing per step after warm-up shows 0.
- ``CopyCounter``: counts host↔device copies and their bytes while active.

Both counters patch the allocation/copy functions for the duration of a ``with`` block and
restore them after. On a GPU ``AllocationCounter`` patches the context's allocator, which every
allocation goes through; in the simulator (no allocator) it patches the public ``cuda.*``
allocation functions.
"""

from __future__ import annotations

from kernels.device import cuda, simulated
from kernels.launch import LaunchCounter

SIMULATED_ALLOCATORS = ("device_array", "device_array_like", "to_device", "pinned_array",
                        "pinned_array_like", "mapped_array", "managed_array")
GPU_ALLOCATORS = ("memalloc", "memhostalloc", "memallocmanaged")


def new_event(timing: bool = False):
    """A CUDA event; ``timing`` only on a GPU (the simulator's events take no arguments and time nothing)."""
    return cuda.event() if simulated() else cuda.event(timing=timing)


def device_array_class() -> type:
    """The class of ``cuda.device_array``'s arrays (the simulator has its own), found without allocating one."""
    arrays = cuda.cudadrv.devicearray
    return arrays.FakeCUDAArray if simulated() else arrays.DeviceNDArray


def is_device_array(value) -> bool:
    return hasattr(value, "copy_to_host") and hasattr(value, "shape")


def count_arrays(value) -> int:
    """Device arrays in a kernel argument: numba passes the arrays inside a tuple one by one, at the same cost."""
    if isinstance(value, tuple):
        return sum(map(count_arrays, value))
    return int(is_device_array(value))


class StreamLaunchCounter(LaunchCounter):
    """Counts launches (and their array arguments) and queues every kernel on ``stream``."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream
        self.array_args = 0

    def __call__(self, kernel, grid, block, *args) -> None:
        self.count += 1
        self.array_args += sum(map(count_arrays, args))
        kernel[grid, block, self.stream](*args)


class _Patches:
    """Replace attributes of objects for the length of a ``with`` block, then put the originals back."""

    def __init__(self):
        self.saved = []

    def wrap(self, owner, name, make_wrapper):
        if not hasattr(owner, name):
            return
        had_own = isinstance(owner, type) and name in owner.__dict__
        original = getattr(owner, name)
        self.saved.append((owner, name, original if had_own or not isinstance(owner, type) else None))
        setattr(owner, name, make_wrapper(original))

    def restore(self):
        for owner, name, original in reversed(self.saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.saved.clear()


class AllocationCounter:
    """``with AllocationCounter() as allocations: ...`` then ``allocations.count`` (and ``.calls``: by what)."""

    def __enter__(self):
        self.count, self.calls, self._patches = 0, [], _Patches()
        if simulated():
            owner, names = cuda, SIMULATED_ALLOCATORS
        else:
            owner, names = type(cuda.current_context()), GPU_ALLOCATORS
        for name in names:
            self._patches.wrap(owner, name, lambda original, name=name: self._counting(original, name))
        return self

    def _counting(self, original, name):
        def counted(*args, **kwargs):
            self.count += 1
            self.calls.append(name)
            return original(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        self._patches.restore()


class CopyCounter:
    """``with CopyCounter() as copies: ...`` then ``copies.to_device``, ``.to_host`` (counts) and ``.bytes_*``."""

    def __enter__(self):
        self.to_device = self.to_host = self.bytes_to_device = self.bytes_to_host = 0
        self._patches = _Patches()
        array_class = device_array_class()
        self._patches.wrap(array_class, "copy_to_device", self._counting_to_device)
        self._patches.wrap(array_class, "copy_to_host", self._counting_to_host)
        return self

    def _counting_to_device(self, original):
        def counted(array, source, *args, **kwargs):
            self.to_device += 1
            self.bytes_to_device += array.nbytes
            return original(array, source, *args, **kwargs)
        return counted

    def _counting_to_host(self, original):
        def counted(array, *args, **kwargs):
            self.to_host += 1
            self.bytes_to_host += array.nbytes
            return original(array, *args, **kwargs)
        return counted

    def __exit__(self, *exc):
        self._patches.restore()
