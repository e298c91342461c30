"""``python -m cnn bench`` (the default mode): every stage's training step timed phase by phase.

What one run does::

    for every stage that can run here (CUDA stages only on a GPU; the others are listed as skipped):
        build it, initialise it with the same seed, warm it up (JIT compilation happens here)
        repeat a training step on real MNIST batches, timing each phase separately:
            load_batch (host→device) | forward | backward | update | fetch_loss (device→host)
        with stage.synchronize() around every phase; CUDA stages are timed with CUDA events,
        CPU stages with time.perf_counter
    images/s = batch / median step time;  speedup over the previous stage and over the first one
    optional reference rows: the identical network in PyTorch (CPU, and CUDA on a GPU)

A stage that is slow (stage 1 ``loops`` takes seconds per LeNet-5 step) is timed only as many
steps as ``--budget`` seconds allow (at least ``--min-steps``); the table says so.

The results file (``benchmarks/results/bench-MODEL-bBATCH-MACHINE-DEVICE-DATE.json``): the header of
``cnn.bench.results`` with ``"kind": "stages"``, then::

     "config": {model, batch_size, dtype, data, steps, warmup, min_steps, budget_s, seed, lr, momentum,
                weight_decay},
     "stages": [row, ...], "references": [row, ...],
     "skipped": [{"name", "reason"}], "failed": [{"name", "reason"}],
     "plots": {"speedup": path, "breakdown": path}

    row = {"name", "number" (course stage number, null for references), "kind": "stage"|"reference",
           "device": "cpu"|"cuda", "summary", "clock": "perf_counter"|"cuda-events",
           "warmup_steps", "first_step_ms" (includes JIT compilation), "timed_steps", "requested_steps",
           "limited_by_budget", "phases_ms": {phase: stats}, "step_ms": stats,
           "host_phases_ms" (CUDA only: perf_counter around the same phases),
           "images_per_s", "peak_host_rss_bytes", "device_bytes" (CUDA only),
           "launches_per_step" (0 on the CPU, null when a CUDA stage does not say),
           "back_to_back_ms": stats, "back_to_back_steps" (N steps with one synchronisation at the end,
           ``cnn.bench.back_to_back``; absent for a stage too slow for the budget),
           "graph_ms" (PyTorch on CUDA only: the step captured as one CUDA graph, replayed back to back),
           "speedup_vs_previous", "speedup_vs_first", "ratio_to_reference": {reference: t_ref / t_stage}}
    stats = {"median", "q1", "q3", "min", "max", "n"}   (milliseconds)
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cnn.bench.back_to_back import stage_back_to_back, torch_back_to_back
from cnn.bench.measure import (EventClock, clock_for, device_bytes_in_use, peak_rss_bytes, repetitions,
                               reset_peak_rss, simulator_on, summarize)
from cnn.bench.results import results_header, results_stem, workload, write_json
from cnn.bench.tables import markdown_table
from cnn.bench.workload import benchmark_batches, course_hyperparameters
from cnn.formatting import PHASES


class TorchRunner:
    """The identical network in PyTorch, cut into the same five phases as a Stage (reference rows)."""

    summary = "PyTorch, the same layers and SGD (what a user would otherwise use)"

    def __init__(self, net, dtype, device: str, flat_params, lr, momentum, weight_decay):
        import torch
        from cnn.reference_torch import load_flat_params, sgd_optimizer, torch_model

        self.torch, self.device = torch, device
        self.name = f"torch-{device}"
        self.model = torch_model(net, dtype)
        load_flat_params(self.model, flat_params)
        self.model.to(device)
        self.optimizer = sgd_optimizer(self.model, lr, momentum, weight_decay)

    def load_batch(self, images, labels):
        self.x = self.torch.from_numpy(np.ascontiguousarray(images)).to(self.device)
        self.y = self.torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(self.device)

    def forward(self):
        self.loss = self.torch.nn.functional.cross_entropy(self.model(self.x), self.y)

    def backward(self):
        self.optimizer.zero_grad(set_to_none=True)
        self.loss.backward()

    def update(self, lr, momentum, weight_decay):
        for group in self.optimizer.param_groups:
            group.update(lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.optimizer.step()

    def fetch_loss(self):
        return self.loss.item()

    def synchronize(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def train_step(self, images, labels, lr, momentum, weight_decay):
        self.load_batch(images, labels)
        self.forward()
        self.backward()
        self.update(lr, momentum, weight_decay)
        return self.fetch_loss()


def time_steps(runner, clock, batches, args, hyper) -> dict:
    """Warm up, then time each phase of as many steps as ``args.budget`` allows; the timing part of a row.

    The first warm-up step (JIT compilation) is not charged to the budget; the steady step time is
    taken from the last warm-up step.
    """
    warm_seconds = []
    for index in range(args.warmup):
        images, labels = batches[index % len(batches)]
        started = time.perf_counter()
        runner.train_step(images, labels, *hyper)
        runner.synchronize()
        warm_seconds.append(time.perf_counter() - started)
        if sum(warm_seconds[1:]) > args.budget / 4:
            break      # a slow stage: one more warm-up step would eat the time its timed steps need
    # the budget starts after the first step, which compiles whatever a JIT stage compiles
    seconds_left = args.budget - sum(warm_seconds[1:])
    steps = repetitions(warm_seconds[-1], seconds_left, args.steps, min(args.min_steps, args.steps))
    samples = {phase: [] for phase in PHASES}
    for step in range(steps):
        images, labels = batches[(len(warm_seconds) + step) % len(batches)]
        calls = {"load_batch": lambda: runner.load_batch(images, labels), "forward": runner.forward,
                 "backward": runner.backward, "update": lambda: runner.update(*hyper),
                 "fetch_loss": runner.fetch_loss}
        for phase in PHASES:
            samples[phase].append(clock.time(calls[phase]))
    row = {"clock": clock.name, "warmup_steps": len(warm_seconds), "first_step_ms": warm_seconds[0] * 1e3,
           "timed_steps": steps, "requested_steps": args.steps, "limited_by_budget": steps < args.steps,
           "phases_ms": {phase: summarize(values) for phase, values in samples.items()},
           "step_ms": summarize(np.sum([samples[phase] for phase in PHASES], axis=0))}
    if isinstance(clock, EventClock):
        host = np.reshape(clock.host_ms, (steps, len(PHASES)))
        row["host_phases_ms"] = {phase: summarize(host[:, i]) for i, phase in enumerate(PHASES)}
    row["images_per_s"] = len(batches[0][1]) / (row["step_ms"]["median"] / 1e3)
    return row


BACK_TO_BACK_SECONDS = 1.0     # steps a back-to-back run: about this long at the phase-timed step time


def back_to_back_steps(row: dict, args) -> int | None:
    """Steps of a back-to-back run (20-500), or None when 6 runs of 20 steps do not fit in the budget."""
    step_s = row["step_ms"]["median"] / 1e3
    if row["limited_by_budget"] or 6 * 20 * step_s > args.budget:
        return None
    return int(np.clip(BACK_TO_BACK_SECONDS / step_s, 20, 500))


def measure_stage(name: str, stage_class, net, batches, args, hyper) -> dict:
    """One row of the table: a fresh stage, initialised with the shared seed, timed phase by phase."""
    reset_peak_rss()
    device_before = device_bytes_in_use() if stage_class.device == "cuda" else None
    stage = stage_class(net, np.dtype(args.dtype)).init("he", args.seed)
    row = {"name": name, "kind": "stage", "device": stage_class.device, "summary": stage_class.summary}
    row.update(time_steps(stage, clock_for(stage_class.device, stage.synchronize), batches, args, hyper))
    steps = back_to_back_steps(row, args)
    if steps:
        row.update(stage_back_to_back(stage, batches, hyper, steps))
    row["peak_host_rss_bytes"] = peak_rss_bytes()
    if stage_class.device == "cuda":
        after = device_bytes_in_use()
        row["device_bytes"] = None if after is None or device_before is None else after - device_before
    row["launches_per_step"] = launches_per_step(stage)
    return row


def launches_per_step(stage) -> int | None:
    """Kernel launches of one training step: 0 on the CPU, the stage's own count on a GPU (None if it gives none)."""
    if stage.device != "cuda":
        return 0
    counter = getattr(stage, "launches_per_step", None)
    return int(counter()) if callable(counter) else None


def measure_reference(device: str, net, batches, args, hyper) -> dict:
    """A PyTorch row: the same initial parameters, data and phases as the stages."""
    from cnn.model import init_params

    reset_peak_rss()
    flat = init_params(net, "he", args.seed, np.dtype(args.dtype))
    runner = TorchRunner(net, np.dtype(args.dtype), device, flat, *hyper)
    torch = runner.torch
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row = {"name": runner.name, "kind": "reference", "device": device,
           "summary": f"{runner.summary}; torch {torch.__version__}, {torch.get_num_threads()} threads"}
    row.update(time_steps(runner, clock_for(device, runner.synchronize, events="torch"), batches, args, hyper))
    steps = back_to_back_steps(row, args)
    if steps:
        row.update(torch_back_to_back(runner, batches, hyper, steps))
    row["peak_host_rss_bytes"] = peak_rss_bytes()
    if device == "cuda":
        row["device_bytes"] = int(torch.cuda.max_memory_allocated())
    row["launches_per_step"] = None
    return row


# The child imports PyTorch before anything of the course, so its OpenMP is its own and starts with its own defaults.
REFERENCE_CHILD = """import torch, pickle, sys
from cnn.bench.step_timing import measure_reference
with open(sys.argv[1], "rb") as inputs:
    row = measure_reference(*pickle.load(inputs))
with open(sys.argv[2], "wb") as outputs:
    pickle.dump(row, outputs)
"""


def measure_reference_apart(device: str, net, batches, args, hyper) -> dict:
    """``measure_reference`` in a Python process of its own.

    In this process PyTorch would share Numba's OpenMP (one library name, loaded once), which stage 3
    starts with the passive wait policy (``kernels/cpu/thread_pool.py``): PyTorch's CPU step measured
    5.5-6.2 ms that way against 3.2-3.6 ms on its own (LeNet-5 b64, 2 threads). Apart, each is timed as
    its users run it. The inputs and the row travel as pickles in temporary files.
    """
    from kernels.cpu.thread_pool import other_openmp_defaults

    with tempfile.TemporaryDirectory() as folder:
        inputs, outputs = Path(folder) / "inputs.pickle", Path(folder) / "row.pickle"
        inputs.write_bytes(pickle.dumps((device, net, batches, args, hyper)))
        with other_openmp_defaults():
            child = subprocess.run([sys.executable, "-c", REFERENCE_CHILD, str(inputs), str(outputs)],
                                   capture_output=True, text=True)
        if child.returncode != 0:
            last = (child.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"the PyTorch reference process failed: {last}")
        row = pickle.loads(outputs.read_bytes())
    row["process"] = "its own (PyTorch imported first, its OpenMP defaults)"
    return row


def reference_devices() -> tuple[list[str], str | None]:
    """PyTorch devices to measure, and why there are none (or only the CPU)."""
    try:
        import torch
    except ImportError:
        return [], "PyTorch is not installed (pip install -e '.[bench]')"
    if torch.cuda.is_available() and not simulator_on():
        return ["cpu", "cuda"], None
    return ["cpu"], "torch.cuda.is_available() is False (no GPU, or a CPU-only build of PyTorch)"


def add_speedups(rows: list[dict], references: list[dict]) -> None:
    """speedup_vs_previous = t(previous stage) / t(stage); speedup_vs_first = t(first stage) / t(stage);
    ratio_to_reference[r] = t(r) / t(stage): above 1, the stage is faster than reference r."""
    first = rows[0]["step_ms"]["median"] if rows else None
    previous = None
    for row in rows:
        step = row["step_ms"]["median"]
        row["speedup_vs_previous"] = previous / step if previous else None
        row["speedup_vs_first"] = first / step
        row["ratio_to_reference"] = {ref["name"]: ref["step_ms"]["median"] / step for ref in references}
        previous = step
    for ref in references:
        step = ref["step_ms"]["median"]
        ref["speedup_vs_previous"] = None
        ref["speedup_vs_first"] = first / step if first else None
        ref["ratio_to_reference"] = {other["name"]: other["step_ms"]["median"] / step for other in references}


def selected_stages(spec: str | None) -> list[str]:
    from cnn.stages import stage_names

    names = stage_names()
    if spec is None:
        return names
    chosen = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown or not chosen:
        raise ValueError(f"--stage: unknown stage {', '.join(unknown) or repr(spec)}; choose from {', '.join(names)}")
    return chosen


def benchmark(args, net=None, batches=None, data_source="random", progress=print) -> dict:
    """Run the stage benchmark and return the results dict (schema in the module docstring).

    ``net`` and ``batches`` default to ``args.model`` and its dataset; tests pass a tiny network.
    """
    from cnn.model import get_network
    from cnn.stages import REGISTRY, StageUnavailable, get_stage

    net = net or get_network(args.model)
    if batches is None:
        batches, data_source = benchmark_batches(net, args)
    hyper = course_hyperparameters()
    result = {**results_header("stages"),
              "config": {"model": net.name, "batch_size": len(batches[0][1]), "dtype": args.dtype,
                         "data": data_source, "steps": args.steps, "warmup": args.warmup,
                         "min_steps": args.min_steps, "budget_s": args.budget, "seed": args.seed,
                         "lr": hyper[0], "momentum": hyper[1], "weight_decay": hyper[2]},
              "stages": [], "references": [], "skipped": [], "failed": [], "plots": {}}
    order = list(REGISTRY)
    for name in selected_stages(args.stages):
        try:
            stage_class = get_stage(name)
        except StageUnavailable as err:
            reason = str(err).split("; ")[0]       # the why, without the hint to try the simulator
            result["skipped"].append({"name": name, "reason": reason})
            progress(f"skipped {name}: {reason}")
            continue
        if np.dtype(args.dtype) not in [np.dtype(d) for d in stage_class.dtypes]:
            result["skipped"].append({"name": name, "reason": f"it does not support {args.dtype}"})
            continue
        progress(f"timing stage {name} ...")
        try:
            row = measure_stage(name, stage_class, net, batches, args, hyper)
        except Exception as err:     # one broken stage must not hide the others' numbers
            result["failed"].append({"name": name, "reason": f"{type(err).__name__}: {err}"})
            progress(f"FAILED {name}: {type(err).__name__}: {err}")
            continue
        row["number"] = order.index(name) + 1
        result["stages"].append(row)
    _measure_references(result, args, net, batches, hyper, progress)
    add_speedups(result["stages"], result["references"])
    result["machine"]["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return result


def _measure_references(result, args, net, batches, hyper, progress):
    if args.reference == "none":
        return
    devices, reason = reference_devices()
    if reason:
        result["skipped"].append({"name": "torch-cuda" if devices else "torch", "reason": reason})
    for device in devices:
        progress(f"timing reference torch-{device} ...")
        try:
            row = measure_reference_apart(device, net, batches, args, hyper)
        except Exception as err:
            result["failed"].append({"name": f"torch-{device}", "reason": f"{type(err).__name__}: {err}"})
            continue
        row["number"] = None
        result["references"].append(row)


def save_benchmark(result: dict, out_dir, plots: bool = True) -> Path:
    """Write the results JSON (and its two plots) under ``out_dir``; return the JSON's path."""
    out_dir = Path(out_dir)
    config = result["config"]
    stem = results_stem(f"bench-{workload(config['model'], config['batch_size'])}", result["machine"], result["created"])
    if plots and result["stages"]:
        from cnn import plots as pictures

        result["plots"] = {
            "speedup": str(out_dir / f"{stem}-speedup.png"),
            "breakdown": str(out_dir / f"{stem}-breakdown.png")}
        pictures.speedup_plot(result, save_to=result["plots"]["speedup"])
        pictures.breakdown_plot(result, save_to=result["plots"]["breakdown"])
    return write_json(out_dir / f"{stem}.json", result)


def cmd_stages(args) -> int:
    result = benchmark(args)
    path = save_benchmark(result, args.out, args.plots)
    print()
    print(markdown_table(result))
    print(f"\nresults: {path}" + "".join(f"\n{kind}: {plot}" for kind, plot in result["plots"].items()))
    return 1 if result["failed"] else 0
