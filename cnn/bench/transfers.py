"""``python -m cnn bench --memory``: host↔device copy latency and bandwidth against size.

On a GPU: host→device and device→host, from pageable (``np.empty``) and from pinned
(``cuda.pinned_array``) host memory, each timed with CUDA events. Without one: host memcpy,
labelled as the CPU analogue. Writes ``memory-MACHINE-DEVICE-DATE.json``: the header of
``cnn.bench.results`` with ``"kind": "memory"`` and "curves": {name: [{"bytes", "latency_ms": stats,
"gb_per_s"}, ...]}, and its plot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cnn.bench.measure import HostClock, clock_for, repetitions, summarize
from cnn.bench.results import results_header, results_stem, write_json
from cnn.formatting import fmt_ms

TRANSFER_SIZES = tuple(2 ** k for k in range(10, 29, 2))      # 1 KiB .. 256 MiB


def time_copies(copy, nbytes: int, clock, budget_s: float, steps: int) -> dict:
    """Latency (median ms) and bandwidth (GB/s) of one copy of ``nbytes``."""
    first = clock.time(copy) / 1e3
    calls = repetitions(max(first, 1e-7), budget_s, steps, 3)
    stats = summarize([clock.time(copy) for _ in range(calls)])
    return {"bytes": nbytes, "latency_ms": stats, "gb_per_s": nbytes / (stats["median"] / 1e3) / 1e9}


def host_copy_curves(sizes=TRANSFER_SIZES, budget_s: float = 1.0, steps: int = 20) -> dict:
    """The CPU analogue when there is no GPU: one host buffer copied into another (np.copyto)."""
    curve = []
    for nbytes in sizes:
        source, target = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        curve.append(time_copies(lambda: np.copyto(target, source), nbytes, HostClock(), budget_s, steps))
    return {"host memcpy (CPU analogue, no GPU)": curve}


def device_copy_curves(sizes=TRANSFER_SIZES, budget_s: float = 1.0, steps: int = 20) -> dict:
    """Host→device and device→host copies from pageable (np.empty) and pinned (cuda.pinned_array) memory."""
    from numba import cuda

    curves = {name: [] for name in ("H→D pageable", "H→D pinned", "D→H pageable", "D→H pinned")}
    clock = clock_for("cuda", cuda.synchronize)
    for nbytes in sizes:
        device = cuda.device_array(nbytes, np.uint8)
        for memory, host in (("pageable", np.ones(nbytes, np.uint8)), ("pinned", cuda.pinned_array(nbytes, np.uint8))):
            host[...] = 1
            curves[f"H→D {memory}"].append(time_copies(lambda: device.copy_to_device(host), nbytes, clock,
                                                       budget_s, steps))
            curves[f"D→H {memory}"].append(time_copies(lambda: device.copy_to_host(host), nbytes, clock,
                                                       budget_s, steps))
        del device
    return curves


def cmd_memory(args) -> int:
    from cnn import plots as pictures
    from cnn.stages import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        print(f"no GPU, so no host↔device transfers to time ({reason.split(';')[0]}); "
              "timing host memcpy instead, labelled as the CPU analogue")
        curves = host_copy_curves()
    else:
        curves = device_copy_curves()
    result = {**results_header("memory"), "curves": curves, "plots": {}}
    stem = results_stem("memory", result["machine"], result["created"])
    if args.plots:
        result["plots"]["transfers"] = str(Path(args.out) / f"{stem}.png")
        pictures.transfer_plot(result, save_to=result["plots"]["transfers"])
    path = write_json(Path(args.out) / f"{stem}.json", result)
    for name, curve in curves.items():
        small, large = curve[0], curve[-1]
        print(f"{name:<36} latency {fmt_ms(small['latency_ms']['median'])} ms at {small['bytes']:,} B; "
              f"{large['gb_per_s']:.1f} GB/s at {large['bytes'] / 2**20:,.0f} MiB")
    print(f"results: {path}" + "".join(f"\nplot: {p}" for p in result["plots"].values()))
    return 0
