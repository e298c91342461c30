"""``python -m cnn bench``: every stage timed on the same network and data, phase by phase.

What one run does (the default mode)::

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

Other modes (one at a time)::

    --op conv-forward      every stage's version of one operation, checked against stage loops, then timed
    --memory               host↔device copy latency and bandwidth against size (host memcpy without a GPU)
    --profile STAGE        host profile (cProfile, or pyinstrument) and per-kernel device times on a GPU
    --compare A.json B..   several results files side by side (e.g. a laptop CPU and a GPU)
    --update-readme [J..]  rewrite the table between the bench-table markers of README.md
    --demo                 the ``make demo`` job: benchmark, train the fastest stage, draw the pictures

Under Numba's CUDA simulator every timing mode refuses to run: simulated kernels are Python
threads, and their times mean nothing.

The results file (``benchmarks/results/bench-MACHINE-DEVICE-DATE.json``)::

    {"schema": "cnn-bench/1", "kind": "stages", "created": ISO time, "command": "python -m cnn bench ...",
     "machine": {host, cpu, cores, platform, python, packages{...}, gpu{name, ...} or null, load_average},
     "config": {model, batch_size, dtype, data, steps, warmup, min_steps, budget_s, seed, lr, momentum,
                weight_decay},
     "stages": [row, ...], "references": [row, ...],
     "skipped": [{"name", "reason"}], "failed": [{"name", "reason"}],
     "plots": {"speedup": path, "breakdown": path}}

    row = {"name", "number" (course stage number, null for references), "kind": "stage"|"reference",
           "device": "cpu"|"cuda", "summary", "clock": "perf_counter"|"cuda-events",
           "warmup_steps", "first_step_ms" (includes JIT compilation), "timed_steps", "requested_steps",
           "limited_by_budget", "phases_ms": {phase: stats}, "step_ms": stats,
           "host_phases_ms" (CUDA only: perf_counter around the same phases),
           "images_per_s", "peak_host_rss_bytes", "device_bytes" (CUDA only),
           "launches_per_step" (0 on the CPU, null when a CUDA stage does not say),
           "speedup_vs_previous", "speedup_vs_first", "ratio_to_reference": {reference: t_ref / t_stage}}
    stats = {"median", "q1", "q3", "min", "max", "n"}   (milliseconds)

``--memory`` writes ``memory-MACHINE-DEVICE-DATE.json``: the same header with "kind": "memory" and
"curves": {name: [{"bytes", "latency_ms": stats, "gb_per_s"}, ...]}; ``--op OP`` writes
``op-OP-MACHINE-DEVICE-DATE.json``: "kind": "op", "op", "inputs", "launches_per_step": {stage: n},
"rows": [{"name", "device", "time_ms": stats, "calls_per_sample", "speedup_vs_reference",
"kernel_ms" (GPU only)}].
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np

SCHEMA = "cnn-bench/1"
PHASES = ("load_batch", "forward", "backward", "update", "fetch_loss")
PHASE_LABELS = {"load_batch": "host→device", "forward": "forward", "backward": "backward",
                "update": "update", "fetch_loss": "device→host"}
OPS = ("conv-forward", "conv-backward", "relu-forward", "relu-backward",
       "maxpool-forward", "maxpool-backward", "dense-forward", "dense-backward")
OP_OUTPUT_NAMES = {"conv-forward": ("y",), "conv-backward": ("dx", "dW", "db"), "relu-forward": ("y",),
                   "relu-backward": ("dx",), "maxpool-forward": ("y", "argmax"), "maxpool-backward": ("dx",),
                   "dense-forward": ("y",), "dense-backward": ("dx", "dW", "db")}
RESULTS_DIR = Path("benchmarks/results")
PICTURES_DIR = Path("results")
README_START, README_END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
#: max |got − expected| / max |expected| allowed when an op is checked against stage loops
OP_TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
SIMULATOR_REFUSAL = ("the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1 or kernels.device.simulated()): "
                     "simulated kernels are Python threads and their timings mean nothing, so bench reports "
                     "none; unset NUMBA_ENABLE_CUDASIM and run again")


# == command line ==============================================================================

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``python -m cnn bench``."""
    from cnn.cli import count, positive_float, positive_int
    from cnn.model import NETWORKS

    add = parser.add_argument
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--op", choices=OPS, help="check and time every stage's version of one operation")
    mode.add_argument("--memory", action="store_true", help="host↔device copy latency and bandwidth")
    mode.add_argument("--profile", metavar="STAGE", help="host profile and per-kernel device times of one stage")
    mode.add_argument("--compare", nargs="+", metavar="JSON", help="plot several results files side by side")
    mode.add_argument("--update-readme", nargs="*", metavar="JSON", default=None,
                      help="rewrite README's bench table from results files (default: newest per machine)")
    mode.add_argument("--curves", nargs="+", metavar="JSON",
                      help="learning curves from histories written by python -m cnn train")
    mode.add_argument("--demo", action="store_true",
                      help="benchmark, train the fastest stage one epoch, draw every picture (make demo)")
    mode.add_argument("--census", action="store_true",
                      help="launches, copies, allocations per step of cuda-ring and cuda-tuned (simulator too)")
    mode.add_argument("--ablation", action="store_true",
                      help="time cuda-ring and each fix of cuda-tuned on its own (GPU only)")
    mode.add_argument("--timeline", action="store_true",
                      help="how much of cuda-ring's gradient copies hides under compute (GPU only)")
    add("--stages", default=None, help="comma-separated stages (default: all registered)")
    add("--model", choices=list(NETWORKS), default="lenet5")
    add("--batch-size", type=positive_int, default=64)
    add("--dtype", choices=("float32", "float64"), default="float32")
    add("--data", choices=("real", "random"), default="real",
        help="real: the model's dataset (MNIST for lenet5); random: Gaussian images, random labels")
    add("--data-dir", default=None, help="directory holding the dataset (default $CNN_DATA_DIR, data/)")
    add("--steps", type=positive_int, default=20, help="timed steps per stage (fewer if --budget runs out)")
    add("--warmup", type=positive_int, default=3, help="untimed steps first (JIT compilation, caches)")
    add("--min-steps", type=positive_int, default=3, help="timed steps even when a stage exceeds --budget")
    add("--budget", type=positive_float, default=30.0, help="seconds per stage before steps are cut")
    add("--seed", type=int, default=0)
    add("--reference", choices=("auto", "none"), default="auto",
        help="auto: PyTorch rows when torch is importable (pip install -e '.[bench]')")
    add("--out", default=str(RESULTS_DIR), help="where results files and plots go")
    add("--pictures-dir", default=str(PICTURES_DIR), help="--demo: where the learning pictures go")
    add("--readme", default="README.md", help="--update-readme: the file holding the markers")
    add("--no-plots", dest="plots", action="store_false")
    add("--demo-curve-steps", type=count, default=200, help="--demo: steps of each stage's learning curve")
    add("--reduced", action="store_true",
        help="--census: on the networks' narrow copies (same counts, smaller bytes; fast in the simulator)")
    add("--ablation-steps", type=positive_int, default=50, help="--ablation: training steps per timed call")
    add("--slots", type=positive_int, default=2, help="--timeline: gradient slots in cuda-ring's ring")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m cnn bench``; returns the exit status."""
    if args.update_readme is not None:
        return cmd_update_readme(args)
    if args.compare:
        return cmd_compare(args)
    if args.curves:
        return cmd_curves(args)
    if args.census:
        from cnn.bench.census import cmd_census
        return cmd_census(args)
    check_arguments(args)
    if simulator_on():
        raise ValueError(SIMULATOR_REFUSAL)
    if args.op:
        return cmd_op(args)
    if args.memory:
        return cmd_memory(args)
    if args.profile:
        return cmd_profile(args)
    if args.demo:
        return cmd_demo(args)
    if args.ablation:
        from cnn.bench.ablation import cmd_ablation
        return cmd_ablation(args)
    if args.timeline:
        from cnn.bench.timeline import cmd_timeline
        return cmd_timeline(args)
    return cmd_stages(args)


def check_arguments(args) -> None:
    """Raise ValueError (one line) for flag values argparse cannot check alone."""
    from cnn.stages import stage_names

    selected_stages(args.stages)
    if args.profile is not None and args.profile not in stage_names():
        raise ValueError(f"--profile: unknown stage {args.profile!r}; choose from {', '.join(stage_names())}")
    if args.min_steps > args.steps:
        raise ValueError(f"--min-steps {args.min_steps} is more than --steps {args.steps}")


def simulator_on() -> bool:
    """True when Numba's CUDA simulator is (or would be) on: then no time is worth reporting."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return True
    try:
        from kernels.device import simulated
    except ImportError:
        return False
    return simulated()


# == the machine ===============================================================================

def gpu_info() -> dict | None:
    """Name, compute capability and memory of the current CUDA GPU, or None without one."""
    from cnn.stages import cuda_unavailable_reason

    if simulator_on() or cuda_unavailable_reason() is not None:
        return None
    from numba import cuda

    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
    free, total = cuda.current_context().get_memory_info()
    info = {"name": name, "compute_capability": list(device.compute_capability), "memory_bytes": int(total)}
    try:
        info["cuda_runtime"] = ".".join(map(str, cuda.runtime.get_version()))
    except Exception:   # an older or newer numba-cuda without this call: the name is enough
        pass
    return info


def machine_record() -> dict:
    from cnn.machine import machine_info

    record = machine_info()
    record["gpu"] = gpu_info()
    record["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return record


def command_line() -> str:
    program = Path(sys.argv[0]).name
    prefix = ["python -m cnn"] if program in ("__main__.py", "cnn") else [sys.argv[0]]
    return " ".join(prefix + [shlex.quote(arg) for arg in sys.argv[1:]])


def slug(text: str) -> str:
    """'Intel(R) Xeon(R) CPU @ 2.2GHz' -> 'intel-xeon-cpu-2-2ghz'."""
    text = re.sub(r"\((r|tm)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:48] or "unknown"


def results_stem(kind: str, machine: dict, created: str) -> str:
    """``KIND-MACHINE-DEVICE-DATE``: e.g. bench-intel-xeon-processor-cpu-2025-11-22."""
    device = slug(machine["gpu"]["name"]) if machine.get("gpu") else "cpu"
    return f"{kind}-{slug(machine['cpu'])}-{device}-{created[:10]}"


def write_json(path: Path, result: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load_results(path) -> dict:
    """A results file written by this module; a wrong file is one ValueError line naming it."""
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such results file") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON results file ({err})") from None
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a bench results file (no \"schema\": \"{SCHEMA}\")")
    return result


# == statistics, clocks, memory ================================================================

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


def repetitions(seconds_per_call: float, seconds_left: float, wanted: int, minimum: int) -> int:
    """How many timed calls fit in the time left: between ``minimum`` and ``wanted``."""
    fit = int(seconds_left / seconds_per_call) if seconds_per_call > 0 else wanted
    return max(minimum, min(wanted, fit))


# == data ======================================================================================

def course_hyperparameters() -> tuple[float, float, float]:
    """(lr, momentum, weight decay) of the course's default training recipe (cnn.train.TrainConfig)."""
    from cnn.train import TrainConfig

    defaults = TrainConfig()
    return defaults.lr, defaults.momentum, defaults.weight_decay


def benchmark_batches(net, args, count: int = 8) -> tuple[list, str]:
    """``count`` (images, labels) batches of ``args.batch_size`` and a description of where they came from."""
    dtype, size = np.dtype(args.dtype), args.batch_size
    if args.data == "random":
        rng = np.random.default_rng(args.seed)
        images = rng.standard_normal((count * size, *net.input_shape)).astype(dtype)
        labels, source = rng.integers(0, net.num_classes, count * size), "random"
    else:
        images, labels, source = _real_images(args.model, args.data_dir, count * size, dtype)
    if len(images) < size:
        raise ValueError(f"{source}: {len(images)} training images, fewer than one batch of {size}")
    return [(images[i:i + size], labels[i:i + size]) for i in range(0, len(images) - size + 1, size)], source


def _real_images(model: str, data_dir, count: int, dtype):
    """The first ``count`` training images of the model's dataset, normalised, with their labels."""
    from cnn import data
    from cnn.train import DATASET_OF_MODEL

    name = DATASET_OF_MODEL.get(model)
    if name is None:
        raise ValueError(f"model {model!r} has no dataset of its own; use --data random")
    dataset = data.load_mnist(data_dir) if name == "mnist" else data.load_cifar10(data_dir)
    images = data.normalize(dataset.train_images[:count], dataset.mean, dataset.std, dtype)
    return images, dataset.train_labels[:count].astype(np.int64), f"{name} ({dataset.source})"


# == the stage benchmark =======================================================================

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


def measure_stage(name: str, stage_class, net, batches, args, hyper) -> dict:
    """One row of the table: a fresh stage, initialised with the shared seed, timed phase by phase."""
    reset_peak_rss()
    device_before = device_bytes_in_use() if stage_class.device == "cuda" else None
    stage = stage_class(net, np.dtype(args.dtype)).init("he", args.seed)
    row = {"name": name, "kind": "stage", "device": stage_class.device, "summary": stage_class.summary}
    row.update(time_steps(stage, clock_for(stage_class.device, stage.synchronize), batches, args, hyper))
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
    row["peak_host_rss_bytes"] = peak_rss_bytes()
    if device == "cuda":
        row["device_bytes"] = int(torch.cuda.max_memory_allocated())
    row["launches_per_step"] = None
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
        raise ValueError(f"--stages: unknown stage {', '.join(unknown) or repr(spec)}; choose from {', '.join(names)}")
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
    result = {"schema": SCHEMA, "kind": "stages", "created": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": command_line(), "machine": machine_record(),
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
            row = measure_reference(device, net, batches, args, hyper)
        except Exception as err:
            result["failed"].append({"name": f"torch-{device}", "reason": f"{type(err).__name__}: {err}"})
            continue
        row["number"] = None
        result["references"].append(row)


def save_benchmark(result: dict, out_dir, plots: bool = True) -> Path:
    """Write the results JSON (and its two plots) under ``out_dir``; return the JSON's path."""
    out_dir = Path(out_dir)
    stem = results_stem("bench", result["machine"], result["created"])
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


# == the table =================================================================================

def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "—"
    for limit, digits in ((100, 0), (10, 1), (1, 2)):
        if ms >= limit:
            return f"{ms:,.{digits}f}"
    return f"{ms:.3f}"


def fmt_factor(factor: float | None) -> str:
    if factor is None:
        return "—"
    if factor >= 100:
        return f"{factor:,.0f}×"
    return f"{factor:.1f}×" if factor >= 10 else f"{factor:.2f}×"


def fmt_mib(size: int | None) -> str:
    return "—" if size is None else f"{size / 2**20:,.0f}"


def _spread(stats: dict) -> str:
    """Half the interquartile range, as a percentage of the median."""
    return f"±{50 * (stats['q3'] - stats['q1']) / stats['median']:.0f}%" if stats["median"] else ""


def table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the results table (stages, then references)."""
    rows, refs = result["stages"], result["references"]
    first = rows[0]["name"] if rows else "first"
    device_memory = any(row.get("device_bytes") is not None for row in rows + refs)
    header = ["#", "stage", "step ms (median, IQR/2)", *(PHASE_LABELS[p] for p in PHASES), "images/s",
              "× previous", f"× {first}", *(f"× {ref['name']}" for ref in refs), "launches/step",
              "peak RSS MiB", *(["device MiB"] if device_memory else []), "timed steps"]
    cells = []
    for row in rows + refs:
        cells.append([
            str(row["number"]) if row.get("number") else "ref",
            row["name"] if row["kind"] == "stage" else f"{row['name']} (reference)",
            f"{fmt_ms(row['step_ms']['median'])} {_spread(row['step_ms'])}",
            *(fmt_ms(row["phases_ms"][phase]["median"]) for phase in PHASES),
            f"{row['images_per_s']:,.0f}" if row["images_per_s"] >= 10 else f"{row['images_per_s']:.2f}",
            fmt_factor(row.get("speedup_vs_previous")), fmt_factor(row.get("speedup_vs_first")),
            *(fmt_factor(row["ratio_to_reference"].get(ref["name"])) for ref in refs),
            "—" if row.get("launches_per_step") is None else str(row["launches_per_step"]),
            fmt_mib(row.get("peak_host_rss_bytes")),
            *([fmt_mib(row.get("device_bytes"))] if device_memory else []),
            f"{row['timed_steps']}" + ("*" if row["limited_by_budget"] else "")])
    return header, cells


def machine_line(result: dict) -> str:
    machine, config = result["machine"], result["config"]
    gpu = machine.get("gpu")
    packages = ", ".join(f"{name} {version}" for name, version in machine.get("packages", {}).items())
    return (f"{machine['cpu']} ({machine['cores']} cores), GPU: {gpu['name'] if gpu else 'none'}; "
            f"{config['model']}, batch {config['batch_size']}, {config['dtype']}, "
            f"data: {config['data'].split(' (')[0]}; "
            f"{result['created'][:10]}; {packages}")


def markdown_table(result: dict) -> str:
    """The results table in Markdown, with the notes a reader needs under it."""
    header, cells = table_rows(result)
    widths = [max(len(line[i]) for line in [header] + cells) for i in range(len(header))]
    lines = ["| " + " | ".join(text.ljust(width) for text, width in zip(line, widths)) + " |"
             for line in [header] + cells]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines + [""] + [f"- {note}" for note in table_notes(result)])


def table_notes(result: dict) -> list[str]:
    config = result["config"]
    notes = [f"Measured on {machine_line(result)}.",
             f"Times per training step in ms (median of the timed steps; CUDA stages by CUDA events, CPU stages "
             f"by perf_counter, with synchronize() around every phase). × columns: how many times faster than "
             f"that row (above 1 = faster). Peak RSS: the process's resident-memory high-water mark while the "
             f"stage ran (interpreter, libraries and data included). Command: `{result['command']}`."]
    load, cores = result["machine"].get("load_average"), result["machine"].get("cores") or 1
    if load and load[0] > 0.5 * cores:
        notes.append(f"The machine was busy with other work (load average {load[0]:.1f} on {cores} cores at the "
                     f"start): these times are inflated.")
    for row in result["stages"] + result["references"]:
        if row["limited_by_budget"]:
            notes.append(f"\\* {row['name']}: only {row['timed_steps']} of {row['requested_steps']} steps timed "
                         f"({row['warmup_steps']} warm-up): a step takes {fmt_ms(row['step_ms']['median'])} ms, "
                         f"and the budget is {config['budget_s']:g} s per stage.")
        if row["first_step_ms"] > 10 * row["step_ms"]["median"] + 100:
            notes.append(f"{row['name']}: the first (untimed) step took {row['first_step_ms'] / 1e3:,.1f} s "
                         f"(JIT compilation, allocations).")
    for entry in result["skipped"]:
        notes.append(f"Skipped {entry['name']}: {entry['reason']}")
    for entry in result["failed"]:
        notes.append(f"FAILED {entry['name']}: {entry['reason']}")
    return notes


# == README ====================================================================================

def readme_block(results: list[tuple[Path, dict]], readme: Path) -> str:
    """The generated text between the markers: per results file, the table and its plots."""
    files = " ".join(str(path) for path, _ in results)
    parts = [README_START,
             f"<!-- generated by `python -m cnn bench --update-readme {files}`; do not edit by hand -->"]
    for path, result in results:
        parts += ["", table_title(result), "", markdown_table(result)]
        images = [f"![{kind} plot]({Path(os.path.relpath(plot, readme.parent)).as_posix()})"
                  for kind, plot in result.get("plots", {}).items() if Path(plot).exists()]
        if images:
            parts += ["", " ".join(images)]
    parts += ["", README_END]
    return "\n".join(parts)


def table_title(result: dict) -> str:
    gpu = result["machine"].get("gpu")
    return f"**{result['machine']['cpu']}" + (f" + {gpu['name']}**" if gpu else "** (no GPU)")


def replace_between_markers(text: str, block: str, source: str) -> str:
    """``text`` with everything from the start marker to the end marker replaced by ``block``."""
    starts, ends = text.count(README_START), text.count(README_END)
    if starts != 1 or ends != 1:
        raise ValueError(f"{source}: needs exactly one {README_START} and one {README_END} line "
                         f"(found {starts} and {ends})")
    start, end = text.index(README_START), text.index(README_END)
    if end < start:
        raise ValueError(f"{source}: {README_END} comes before {README_START}")
    return text[:start] + block + text[end + len(README_END):]


def newest_results(out_dir) -> list[Path]:
    """The newest bench results file of each machine/device in ``out_dir``."""
    newest = {}
    for path in sorted(Path(out_dir).glob("bench-*.json")):
        try:
            result = load_results(path)
        except ValueError:
            continue
        key = results_stem("bench", result["machine"], "")
        if key not in newest or result["created"] > newest[key][1]["created"]:
            newest[key] = (path, result)
    return [path for path, _ in sorted(newest.values(), key=lambda item: item[1]["created"])]


def update_readme(readme, json_paths) -> Path:
    readme = Path(readme)
    if not readme.exists():
        raise ValueError(f"{readme}: no such file (--readme names the file holding {README_START})")
    results = [(Path(path), load_results(path)) for path in json_paths]
    text = readme.read_text()
    readme.write_text(replace_between_markers(text, readme_block(results, readme), str(readme)))
    return readme


def cmd_update_readme(args) -> int:
    paths = args.update_readme or newest_results(args.out)
    if not paths:
        raise ValueError(f"no bench-*.json results in {args.out}; run python -m cnn bench first")
    readme = update_readme(args.readme, paths)
    print(f"{readme}: bench table regenerated from {', '.join(map(str, paths))}")
    return 0


# == several machines side by side =============================================================

def cmd_compare(args) -> int:
    from cnn import plots as pictures

    results = [load_results(path) for path in args.compare]
    stages = [r for r in results if r["kind"] == "stages"]
    if len(stages) != len(results):
        raise ValueError("--compare takes stage benchmark files (bench-*.json), not memory or other results")
    print(compare_table(results))
    if args.plots:
        labels = "_vs_".join(results_stem("", r["machine"], r["created"]).strip("-") for r in results)
        path = Path(args.out) / f"compare-{labels}.png"[:200]
        pictures.compare_plot(results, save_to=path)
        print(f"plot: {path}")
    return 0


def compare_label(result: dict) -> str:
    gpu = result["machine"].get("gpu")
    return f"{gpu['name'] if gpu else result['machine']['cpu']} ({result['created'][:10]})"


def compare_table(results: list[dict]) -> str:
    """images/s of every stage (rows) on every machine (columns)."""
    names = []
    for result in results:
        for row in result["stages"] + result["references"]:
            if row["name"] not in names:
                names.append(row["name"])
    header = ["stage", *(f"images/s, {compare_label(r)}" for r in results)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        cells = []
        for result in results:
            row = next((r for r in result["stages"] + result["references"] if r["name"] == name), None)
            cells.append("—" if row is None else f"{row['images_per_s']:,.1f}")
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines)


def cmd_curves(args) -> int:
    """Learning curves of the given training histories, labelled by their stage, in one picture."""
    from cnn import plots as pictures

    histories = {}
    for path in args.curves:
        history = pictures.load(path)
        if "steps" not in history:
            raise ValueError(f"{path}: not a training history (no \"steps\"); python -m cnn train writes them")
        label = history.get("config", {}).get("stage") or Path(path).stem
        histories[label if label not in histories else f"{label} ({Path(path).stem})"] = history
    path = Path(args.pictures_dir) / "learning-curves.png"
    pictures.learning_curves(histories, save_to=path)
    print(f"plot: {path}")
    return 0


# == one operation, every stage (the llm.c dev/cuda pattern) ====================================

class OpCandidate:
    """One stage's version of the operations: its Ops, and how to wait for (and time) its work."""

    def __init__(self, name: str, ops, device: str = "cpu", synchronize=lambda: None, stage=None):
        self.name, self.ops, self.device, self.synchronize, self.stage = name, ops, device, synchronize, stage


def op_candidates(names: list[str], net, dtype, progress=print) -> list[OpCandidate]:
    """Stages among ``names`` that can run here and expose ``ops``; the others are said to be skipped."""
    from cnn.stages import StageUnavailable, get_stage

    candidates = []
    for name in names:
        try:
            stage_class = get_stage(name)
        except StageUnavailable as err:
            progress(f"  {name:<12} skipped: {str(err).split(';')[0]}")
            continue
        ops = getattr(stage_class, "ops", None)
        if ops is None:
            progress(f"  {name:<12} skipped: the stage has no per-operation functions (no `ops`)")
            continue
        if np.dtype(dtype) not in [np.dtype(d) for d in stage_class.dtypes]:
            progress(f"  {name:<12} skipped: it does not support {np.dtype(dtype).name}")
            continue
        stage = stage_class(net, dtype)
        candidates.append(OpCandidate(name, ops, stage_class.device, stage.synchronize, stage))
    return candidates


def launches_of(candidates: list[OpCandidate], batches, seed: int = 0) -> dict:
    """{stage: kernel launches per training step}; a CUDA stage runs one step first to count them."""
    counts = {}
    for candidate in candidates:
        if candidate.device == "cuda" and candidate.stage is not None:
            candidate.stage.init("he", seed).train_step(*batches[0], *course_hyperparameters())
        counts[candidate.name] = launches_per_step(candidate.stage) if candidate.stage is not None else None
    return counts


def _op_layer(net, op: str):
    """The layer an op is benchmarked on: the one of its kind doing the most work; with its input shape."""
    from cnn.model import Conv, Dense, MaxPool, ReLU

    kind = {"conv": Conv, "relu": ReLU, "maxpool": MaxPool, "dense": Dense}[op.split("-")[0]]
    shapes = net.activation_shapes()
    found = [(index, layer) for index, layer in enumerate(net.layers) if isinstance(layer, kind)]
    if not found:
        raise ValueError(f"--op {op}: network {net.name!r} has no {kind.__name__} layer")

    def work(item):
        index, layer = item
        return int(np.prod(shapes[index])) * max(1, sum(int(np.prod(s)) for s in layer.param_shapes().values()))
    index, layer = max(found, key=work)
    return layer, shapes[index], shapes[index + 1]


def op_inputs(op: str, net, batch: int, dtype, reference_ops, seed: int = 0) -> tuple[tuple, str]:
    """Fresh random arguments for ``op`` at the shapes of the network's busiest layer of that kind.

    Inputs that come from another op (the ReLU output, the pooling argmax) are made by the reference.
    """
    rng = np.random.default_rng(seed)
    layer, in_shape, out_shape = _op_layer(net, op)

    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)
    x, dy = normal(batch, *in_shape), normal(batch, *out_shape)
    if op.startswith("conv"):
        fan_in = layer.in_channels * layer.kernel ** 2
        W = normal(layer.out_channels, layer.in_channels, layer.kernel, layer.kernel) * dtype.type(np.sqrt(2 / fan_in))
        args = ((x, W, normal(layer.out_channels), layer.stride, layer.pad) if op == "conv-forward"
                else (dy, x, W, layer.stride, layer.pad))
        described = f"x {x.shape}, W {W.shape}, stride {layer.stride}, pad {layer.pad}"
    elif op.startswith("dense"):
        W = normal(layer.out_features, layer.in_features) * dtype.type(np.sqrt(2 / layer.in_features))
        args = (x, W, normal(layer.out_features)) if op == "dense-forward" else (dy, x, W)
        described = f"x {x.shape}, W {W.shape}"
    elif op.startswith("relu"):
        args = (x,) if op == "relu-forward" else (dy, reference_ops.relu_forward(x))
        described = f"x {x.shape}"
    else:
        size, stride = layer.size, layer.stride
        if op == "maxpool-forward":
            args = (x, size, stride)
        else:
            args = (dy, reference_ops.maxpool_forward(x, size, stride)[1], x.shape, size, stride)
        described = f"x {x.shape}, window {size}, stride {stride}"
    return args, f"{described}, {dtype.name}"


def _to_host(value):
    return value.copy_to_host() if hasattr(value, "copy_to_host") else np.asarray(value)


def _as_outputs(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def compare_outputs(op: str, got, expected, dtype) -> str | None:
    """None when ``got`` matches ``expected``, else one line saying where and by how much it does not.

    Float outputs: max |got − expected| / max |expected| ≤ OP_TOLERANCE[dtype] (float32 sums in another
    order differ in the last bits, float64 ones far less); integer outputs (argmax) must be equal.
    """
    got, expected = _as_outputs(got), _as_outputs(expected)
    names = OP_OUTPUT_NAMES[op]
    if len(got) != len(expected):
        return f"returned {len(got)} outputs, the reference {len(expected)} ({', '.join(names)})"
    tolerance = OP_TOLERANCE[np.dtype(dtype).name]
    for name, value, ref in zip(names, got, expected):
        value, ref = _to_host(value), np.asarray(ref)
        if value.shape != ref.shape:
            return f"output {name}: shape {value.shape}, expected {ref.shape}"
        if ref.dtype.kind in "iu":
            wrong = np.argwhere(value != ref)
            if wrong.size:
                where = tuple(int(i) for i in wrong[0])
                return (f"output {name}: {len(wrong)} of {ref.size} entries differ, first at {where}: "
                        f"got {value[where]}, expected {ref[where]}")
            continue
        error = np.abs(value.astype(np.float64) - ref)
        scale = max(float(np.abs(ref).max()), np.finfo(np.float64).tiny)
        if not np.all(np.isfinite(value)) or error.max() / scale > tolerance:
            where = tuple(int(i) for i in np.unravel_index(np.nanargmax(np.where(np.isfinite(error), error, np.inf)),
                                                           error.shape))
            return (f"output {name}: max relative error {np.nanmax(error) / scale:.2e} > tolerance {tolerance:g}, "
                    f"worst at {where}: got {value[where]:.6g}, expected {ref[where]:.6g}")
    return None


def check_op(op: str, candidates: list[OpCandidate], reference: OpCandidate, args: tuple, dtype) -> dict:
    """Run every candidate once on copies of ``args``; {name: None or the mismatch line}."""
    function = op.replace("-", "_")
    expected = getattr(reference.ops, function)(*_copies(args))
    verdicts = {}
    for candidate in candidates:
        implementation = getattr(candidate.ops, function, None)
        if implementation is None:
            verdicts[candidate.name] = "the stage does not provide this op"
            continue
        try:
            got = implementation(*_copies(args))
            candidate.synchronize()
        except Exception as err:
            verdicts[candidate.name] = f"raised {type(err).__name__}: {err}"
            continue
        verdicts[candidate.name] = compare_outputs(op, got, expected, dtype)
    return verdicts


def _copies(args: tuple) -> tuple:
    """Fresh copies of the array arguments, so an op that writes into its inputs cannot spoil the next one."""
    return tuple(arg.copy() if isinstance(arg, np.ndarray) else arg for arg in args)


def time_op(op: str, candidate: OpCandidate, args: tuple, settings) -> dict:
    """Milliseconds per call of one stage's op, budget-limited like the stages.

    A sample times enough back-to-back calls to last about a millisecond (a clock read costs about
    as much as a 5 µs op), divided by their number. On a GPU, ``kernel_ms`` adds the device time of
    the kernels alone, without the copies a host wrapper makes (CUDA events around each launch).
    """
    function = getattr(candidate.ops, op.replace("-", "_"))
    clock = clock_for(candidate.device, candidate.synchronize)
    inputs = _copies(args)

    def calls(count):
        return lambda: [function(*inputs) for _ in range(count)]
    first = clock.time(calls(1)) / 1e3       # warm-up (compiles if it must)
    second = clock.time(calls(1)) / 1e3
    per_sample = int(min(1000, max(1, 1e-3 / max(second, 1e-9))))
    samples = repetitions(max(second * per_sample, 1e-7), settings.budget - first - second, settings.steps * 2,
                          min(settings.min_steps, settings.steps))
    row = {"time_ms": summarize([clock.time(calls(per_sample)) / per_sample for _ in range(samples)]),
           "calls_per_sample": per_sample}
    if candidate.device == "cuda" and gpu_info() is not None:
        with KernelTimer() as timer:
            calls(per_sample)()
        row["kernel_ms"] = sum(ms for _, _, ms in timer.summary()) / per_sample
    return row


def op_benchmark(op: str, candidates: list[OpCandidate], reference: OpCandidate, args: tuple, dtype,
                 settings, progress=print) -> tuple[bool, list[dict]]:
    """Validate every candidate against the reference, then (only if all pass) time them; (ok, rows)."""
    verdicts = check_op(op, candidates, reference, args, dtype)
    failures = {name: why for name, why in verdicts.items() if why is not None}
    for name, why in failures.items():
        progress(f"  {name:<12} MISMATCH: {why}")
    if failures:
        progress(f"{op}: {len(failures)} stage(s) disagree with stage {reference.name}; no timings reported")
        return False, []
    progress(f"  all {len(candidates)} stage(s) match stage {reference.name}; timing ...")
    rows = [{"name": c.name, "device": c.device, **time_op(op, c, args, settings)} for c in candidates]
    reference_ms = next((r["time_ms"]["median"] for r in rows if r["name"] == reference.name), None)
    for row in rows:
        median = row["time_ms"]["median"]
        row["speedup_vs_reference"] = reference_ms / median if reference_ms and median else None
        clock = "cuda-events" if row["device"] == "cuda" else "perf_counter"
        kernels = f"; kernels alone {fmt_ms(row['kernel_ms'])} ms" if "kernel_ms" in row else ""
        copies = " (host wrapper: includes its copies)" if row["device"] == "cuda" else ""
        progress(f"  {row['name']:<12} ok  {fmt_ms(median):>9} ms {_spread(row['time_ms']):>5}  "
                 f"{fmt_factor(row['speedup_vs_reference']):>8} vs {reference.name}  "
                 f"({row['time_ms']['n']} samples of {row['calls_per_sample']} calls, {clock}){copies}{kernels}")
    return True, rows


def cmd_op(args) -> int:
    from cnn.model import get_network
    from cnn.stages import get_stage

    net, dtype = get_network(args.model), np.dtype(args.dtype)
    reference = OpCandidate("loops", get_stage("loops").ops)
    op_args, described = op_inputs(args.op, net, args.batch_size, dtype, reference.ops, args.seed)
    print(f"{args.op} on {described} (the busiest such layer of {net.name}); reference: stage loops")
    candidates = op_candidates(selected_stages(args.stages), net, dtype)
    ok, rows = op_benchmark(args.op, candidates, reference, op_args, dtype, args)
    if not ok:
        return 1
    random_args = argparse.Namespace(**{**vars(args), "data": "random"})
    launches = launches_of(candidates, benchmark_batches(net, random_args)[0], args.seed)
    print(f"kernel launches per training step of {net.name} (what fusion removes): "
          + ", ".join(f"{name} {'—' if count is None else count}" for name, count in launches.items()))
    result = {"schema": SCHEMA, "kind": "op", "op": args.op, "inputs": described, "launches_per_step": launches,
              "created": datetime.datetime.now().isoformat(timespec="seconds"), "command": command_line(),
              "machine": machine_record(), "rows": rows}
    path = write_json(Path(args.out) / f"{results_stem('op-' + args.op, result['machine'], result['created'])}.json",
                      result)
    print(f"results: {path}")
    return 0


# == host↔device transfers =====================================================================

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
    result = {"schema": SCHEMA, "kind": "memory", "created": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": command_line(), "machine": machine_record(), "curves": curves, "plots": {}}
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


# == profile of one stage ======================================================================

class KernelTimer:
    """While active, puts two CUDA events around every Numba kernel launch: per-kernel device times.

    The events sit on the default stream, so a kernel's time includes the launch gap when the GPU
    was idle before it; for kernels of a few microseconds read it as an upper bound.
    """

    def __enter__(self):
        from numba import cuda
        from numba.cuda import dispatcher

        self.records, self._class = [], dispatcher._LaunchConfiguration
        self._original, timer = self._class.__call__, self

        def timed_launch(configuration, *kernel_args):
            start, end = cuda.event(timing=True), cuda.event(timing=True)
            start.record()
            result = timer._original(configuration, *kernel_args)
            end.record()
            kernel = getattr(configuration.dispatcher, "py_func", configuration.dispatcher)
            timer.records.append((getattr(kernel, "__name__", str(kernel)), start, end))
            return result
        self._class.__call__ = timed_launch
        return self

    def __exit__(self, *exc):
        self._class.__call__ = self._original

    def summary(self) -> list[tuple[str, int, float]]:
        """(kernel, launches, total ms), the most expensive first."""
        from numba import cuda

        cuda.synchronize()
        totals = {}
        for name, start, end in self.records:
            launches, total = totals.get(name, (0, 0.0))
            totals[name] = (launches + 1, total + cuda.event_elapsed_time(start, end))
        return sorted(((name, n, ms) for name, (n, ms) in totals.items()), key=lambda item: -item[2])


def host_profile(call, top: int = 25) -> str:
    """Text of a host profile of ``call()``: pyinstrument when installed, else cProfile (by cumulative time)."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(call)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
        return "host profile (cProfile, by cumulative time):\n" + text.getvalue()
    profiler = Profiler()
    profiler.start()
    call()
    profiler.stop()
    return "host profile (pyinstrument):\n" + profiler.output_text(unicode=True)


def profile_stage(name: str, net, batches, args) -> str:
    """The report of ``--profile``: host profile of training steps, then per-kernel device times."""
    from cnn.stages import cuda_unavailable_reason, get_stage

    stage_class = get_stage(name)
    stage = stage_class(net, np.dtype(args.dtype)).init("he", args.seed)
    hyper = course_hyperparameters()
    started = time.perf_counter()
    for images, labels in batches[:2]:
        stage.train_step(images, labels, *hyper)
    steps = repetitions((time.perf_counter() - started) / 2, args.budget, args.steps, 1)

    def steps_call():
        for step in range(steps):
            stage.train_step(*batches[step % len(batches)], *hyper)
    lines = [f"stage {name}: {steps} training steps of {net.name}, batch {len(batches[0][1])}",
             host_profile(steps_call)]
    if stage_class.device != "cuda":
        lines.append(f"per-kernel device times: stage {name} runs on the CPU, it launches no kernels")
    elif cuda_unavailable_reason():
        lines.append(f"per-kernel device times: only on a GPU ({cuda_unavailable_reason()})")
    else:
        with KernelTimer() as timer:
            steps_call()
        lines.append(kernel_table(timer.summary(), steps))
    return "\n".join(lines)


def kernel_table(summary, steps: int) -> str:
    total = sum(ms for _, _, ms in summary) or 1.0
    lines = [f"per-kernel device times (CUDA events around each launch, {steps} steps):",
             f"{'kernel':<40} {'launches/step':>13} {'ms/step':>9} {'µs/launch':>10} {'share':>6}"]
    for name, launches, ms in summary:
        lines.append(f"{name:<40} {launches / steps:>13.1f} {ms / steps:>9.3f} {1e3 * ms / launches:>10.1f} "
                     f"{ms / total:>6.1%}")
    return "\n".join(lines)


def cmd_profile(args) -> int:
    from cnn.model import get_network

    net = get_network(args.model)
    batches, _ = benchmark_batches(net, args)
    print(profile_stage(args.profile, net, batches, args))
    return 0


# == the demo (make demo) ======================================================================

def class_probabilities(logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis: p = exp(z − max z) / Σ exp(z − max z)."""
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


class SnapshotStage:
    """Wraps a stage for ``cnn.train.train`` and records predictions on fixed images at chosen steps.

    Everything else is the wrapped stage's own: ``train`` cannot tell the difference.
    """

    def __init__(self, stage, images: np.ndarray, at_steps):
        self._stage, self._images, self._at = stage, images, set(at_steps)
        self.steps_done, self.snapshots = 0, {}

    def __getattr__(self, name):
        return getattr(self._stage, name)

    def snapshot(self, label) -> np.ndarray:
        self.snapshots[label] = class_probabilities(self._stage.predict(self._images).astype(np.float64))
        return self.snapshots[label]

    def train_step(self, *args, **kwargs):
        loss = self._stage.train_step(*args, **kwargs)
        self.steps_done += 1
        if self.steps_done in self._at:
            self.snapshot(self.steps_done)
        return loss


def fastest_stage(result: dict) -> str:
    if not result["stages"]:
        raise ValueError("no stage could be benchmarked, so there is none to train")
    return max(result["stages"], key=lambda row: row["images_per_s"])["name"]


def train_with_snapshots(stage_name: str, data, grid_images, args, snapshot_step: int = 50, epochs: int = 1):
    """Train ``stage_name`` for ``epochs`` with the course's recipe, snapshotting predictions on ``grid_images``.

    Snapshots: before training (0), after ``snapshot_step`` steps, after the last epoch ("end").
    """
    from cnn.model import get_network
    from cnn.stages import get_stage
    from cnn.train import TrainConfig, train

    steps_per_epoch = len(data[0]) // args.batch_size
    config = TrainConfig(model=args.model, stage=stage_name, epochs=epochs, batch_size=args.batch_size,
                         seed=args.seed, dtype=args.dtype, eval_every=max(1, min(25, steps_per_epoch // 20)),
                         eval_subset=1000, progress=False)
    stage = get_stage(stage_name)(get_network(args.model), np.dtype(args.dtype)).init(config.init, args.seed)
    watched = SnapshotStage(stage, grid_images, [snapshot_step])
    watched.snapshot(0)
    history = train(config, data, stage=watched)
    watched.snapshot("end")
    return history, watched.snapshots, stage


def learning_curve_runs(result: dict, data, args, steps: int, max_seconds: float = 120.0, progress=print) -> dict:
    """``steps`` steps of every benchmarked stage with the same seed; stages too slow for it are said to be skipped."""
    from cnn.train import TrainConfig, train

    histories = {}
    train_x, train_y, test_x, test_y = data
    limited = (train_x[:steps * args.batch_size], train_y[:steps * args.batch_size], test_x, test_y)
    for row in result["stages"]:
        estimate = row["step_ms"]["median"] * steps / 1e3
        if estimate > max_seconds:
            progress(f"learning curves: skipped {row['name']}: {steps} steps would take ~{estimate / 60:.0f} min "
                     f"({fmt_ms(row['step_ms']['median'])} ms per step)")
            continue
        config = TrainConfig(model=args.model, stage=row["name"], epochs=1, batch_size=args.batch_size,
                             seed=args.seed, dtype=args.dtype, eval_every=max(1, steps // 10), eval_subset=500,
                             progress=False)
        progress(f"learning curves: {steps} steps of stage {row['name']} ...")
        histories[row["name"]] = train(config, limited)
    return histories


def grid_indices(labels: np.ndarray, count: int = 12) -> np.ndarray:
    """``count`` test images, each class in turn (0, 1, …, 9, 0, …), the first of each not yet taken."""
    chosen = []
    classes = np.unique(labels)
    for turn in range(count):
        wanted = classes[turn % len(classes)]
        candidates = [i for i in np.flatnonzero(labels == wanted) if i not in chosen]
        chosen.append(int(candidates[0]))
    return np.array(chosen)


def demo(args, data=None, progress=print) -> dict:
    """The ``make demo`` job; returns where everything went and the final test accuracy.

    ``data`` = (train_x, train_y, test_x, test_y) normalised; by default ``args.model``'s dataset
    (MNIST for LeNet-5). Pictures show the normalised images: imshow rescales each one, so they
    look exactly like the raw pixels.
    """
    from cnn.model import get_network
    from cnn.train import DATASET_OF_MODEL, TrainConfig, load_dataset

    started = time.perf_counter()
    net = get_network(args.model)
    if data is None:
        data = load_dataset(TrainConfig(model=args.model, dtype=args.dtype, data_dir=args.data_dir))
    progress(f"data: {len(data[0])} training and {len(data[2])} test images")
    size = args.batch_size
    batches = [(data[0][i:i + size], data[1][i:i + size]) for i in range(0, 8 * size, size)]
    result = benchmark(args, net, batches, data_source=DATASET_OF_MODEL[args.model], progress=progress)
    json_path = save_benchmark(result, args.out, plots=True)
    progress("\n" + markdown_table(result) + "\n")

    stage_name = fastest_stage(result)
    lr, momentum, decay = course_hyperparameters()
    progress(f"training stage {stage_name} (the fastest here) for one epoch: lr {lr:g}, momentum {momentum:g}, "
             f"weight decay {decay:g}, batch {size} ...")
    indices = grid_indices(data[3])
    history, snapshots, stage = train_with_snapshots(stage_name, data, data[2][indices], args)
    curves = (learning_curve_runs(result, data, args, args.demo_curve_steps, progress=progress)
              if args.demo_curve_steps else {})
    paths = {"results": str(json_path), **result["plots"],
             **demo_pictures(args, net, data, indices, stage_name, history, snapshots, stage, curves)}
    seconds = time.perf_counter() - started
    accuracy = history["final_test_accuracy"]
    progress("\n".join(f"{key:<12} {path}" for key, path in paths.items()))
    progress(f"final test accuracy of stage {stage_name} after one epoch: {accuracy:.2%}; demo took {seconds:.0f} s")
    return {"paths": paths, "final_test_accuracy": accuracy, "stage": stage_name, "seconds": seconds,
            "result": result}


def demo_pictures(args, net, data, indices, stage_name, history, snapshots, stage, curves) -> dict:
    """Write the demo's histories and pictures to ``args.pictures_dir``; {picture: path}."""
    from cnn import plots as pictures

    out = Path(args.pictures_dir)
    write_json(out / f"demo-history-{stage_name}.json", history)
    steps = history["epochs"][-1]["step"]
    titles = {0: "before training", 50: "after 50 steps", "end": f"after 1 epoch ({steps} steps)"}
    paths = {"digits": out / "digits-learning.png", "filters": out / "filters.png",
             "epoch_curve": out / f"learning-curve-{stage_name}.png"}
    pictures.digit_grid(data[2][indices], data[3][indices],
                        [(titles[key], probabilities) for key, probabilities in snapshots.items()],
                        save_to=paths["digits"],
                        title=f"{net.name}, stage {stage_name}: its predictions on test digits as it learns")
    pictures.filters_and_feature_maps(net, stage.get_params(), data[2][indices[0]], save_to=paths["filters"])
    pictures.learning_curves({stage_name: history}, save_to=paths["epoch_curve"],
                             title=f"stage {stage_name}: one epoch of {net.name}")
    if curves:
        paths["curves"] = out / "learning-curves.png"
        pictures.learning_curves(curves, save_to=paths["curves"],
                                 title=f"{args.demo_curve_steps} steps of every fast stage, same seed")
        for name, run in curves.items():
            write_json(out / f"demo-curve-{name}.json", run)
    return {key: str(path) for key, path in paths.items()}


#: LeNet-5 after one epoch of MNIST with the course's recipe must reach this, or the demo fails
DEMO_MIN_ACCURACY = 0.97


def cmd_demo(args) -> int:
    if args.data != "real":
        raise ValueError("--demo trains on the real dataset; leave out --data random")
    report = demo(args)
    if args.model == "lenet5" and report["final_test_accuracy"] < DEMO_MIN_ACCURACY:
        print(f"python -m cnn bench --demo: test accuracy {report['final_test_accuracy']:.2%} after one epoch is "
              f"below the {DEMO_MIN_ACCURACY:.0%} LeNet-5 reaches with the course's recipe", file=sys.stderr)
        return 1
    return 0
