"""The instruments: clocks, statistics of their samples, a time budget, memory high-water marks.

- ``HostClock`` times a call with ``time.perf_counter``, the work synchronised before and after;
  ``EventClock`` times the device work a call queues, between two CUDA events (Numba's or
  PyTorch's), and keeps the host time of the same calls; ``clock_for(device)`` picks one.
- ``summarize`` turns samples into median, quartiles, min, max; ``repetitions`` says how many
  timed calls fit the time left.
- ``simulator_on``: under Numba's CUDA simulator kernels are Python threads, so no time is worth
  reporting and every timing mode refuses with ``SIMULATOR_REFUSAL``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

SIMULATOR_REFUSAL = ("the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1 or kernels.device.simulated()): "
                     "simulated kernels are Python threads and their timings mean nothing, so bench reports "
                     "none; unset NUMBA_ENABLE_CUDASIM and run again")


def simulator_on() -> bool:
    """True when Numba's CUDA simulator is (or would be) on: then no time is worth reporting."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return True
    try:
        from kernels.device import simulated
    except ImportError:
        return False
    return simulated()


def summarize(samples_ms) -> dict:
    """Median and spread of a list of times in milliseconds."""
    values = np.asarray(samples_ms, dtype=np.float64)
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return {"median": float(median), "q1": float(q1), "q3": float(q3),
            "min": float(values.min()), "max": float(values.max()), "n": int(values.size)}


class HostClock:
    """Milliseconds of a call by ``time.perf_counter``, with the work finished before and after."""

    name = "perf_counter"

    def __init__(self, synchronize=lambda: None):
        self.synchronize = synchronize

    def time(self, call) -> float:
        self.synchronize()
        started = time.perf_counter()
        call()
        self.synchronize()
        return (time.perf_counter() - started) * 1e3


class EventClock:
    """Milliseconds of the device work a call queues, by two CUDA events around it.

    ``new_event()`` makes an event with ``record()``, ``synchronize()`` and ``elapsed_ms(end)``;
    ``host_ms`` keeps the perf_counter time of the same calls.
    """

    name = "cuda-events"

    def __init__(self, new_event, synchronize):
        self.new_event, self.synchronize, self.host_ms = new_event, synchronize, []

    def time(self, call) -> float:
        start, end = self.new_event(), self.new_event()
        self.synchronize()
        started = time.perf_counter()
        start.record()
        call()
        end.record()
        end.synchronize()
        self.synchronize()
        self.host_ms.append((time.perf_counter() - started) * 1e3)
        return start.elapsed_ms(end)


class _NumbaEvent:
    def __init__(self):
        from numba import cuda

        self.event = cuda.event(timing=True)

    def record(self): self.event.record()
    def synchronize(self): self.event.synchronize()

    def elapsed_ms(self, end):
        from numba import cuda

        return cuda.event_elapsed_time(self.event, end.event)


class _TorchEvent:
    def __init__(self):
        import torch

        self.event = torch.cuda.Event(enable_timing=True)

    def record(self): self.event.record()
    def synchronize(self): self.event.synchronize()
    def elapsed_ms(self, end): return self.event.elapsed_time(end.event)


def clock_for(device: str, synchronize, events: str = "numba"):
    """CUDA events for device work, perf_counter for host work."""
    if device != "cuda":
        return HostClock(synchronize)
    return EventClock(_NumbaEvent if events == "numba" else _TorchEvent, synchronize)


def repetitions(seconds_per_call: float, seconds_left: float, wanted: int, minimum: int) -> int:
    """How many timed calls fit in the time left: between ``minimum`` and ``wanted``."""
    fit = int(seconds_left / seconds_per_call) if seconds_per_call > 0 else wanted
    return max(minimum, min(wanted, fit))


def reset_peak_rss() -> None:
    """Restart the kernel's high-water mark of this process's resident memory (Linux; else a no-op)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int | None:
    """Peak resident memory since the last ``reset_peak_rss`` (VmHWM), or of the whole process elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def device_bytes_in_use() -> int | None:
    """Bytes of GPU memory in use right now (total − free), or None without a GPU."""
    try:
        from numba import cuda

        free, total = cuda.current_context().get_memory_info()
    except Exception:
        return None
    return int(total - free)
