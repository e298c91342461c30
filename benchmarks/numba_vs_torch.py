"""One LeNet-5 training step on the CPU: stage ``numba-cpu`` against PyTorch's CPU build.

    python benchmarks/numba_vs_torch.py [--batch 64] [--repeats 60] [--threads N]

Timed in ONE process, on the same batches, from the same initial parameters: stage
``numba-cpu``, the same stage with fusion switched off (``fuse=False``: what fusing
conv + ReLU + pool buys), stage ``numpy``, and PyTorch. Numba's and PyTorch's thread
pools are both set to ``--threads`` (default: Numba's default, the number of cores).
A step is forward + backward + SGD-with-momentum update, float32. After a warm-up
(which also compiles the Numba kernels) the implementations take turns, a few timed
steps each, so that a change in machine load hits all of them alike. Reported per
step: median, 10th and 90th percentile, minimum; and the ratio numba-cpu / torch-cpu of
the medians (below 1: Numba is faster) and of the minima (less sensitive to other load).

Writes benchmarks/results/numba_vs_torch-<host>-<date>.json and prints a Markdown line.
Real MNIST batches when the data is found (``cnn.data.load_mnist``, no download); random
normal images otherwise, with a note in the results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import numba
import numpy as np

from cnn.machine import machine_info
from cnn.model import init_params, lenet5
from cnn.reference_torch import TORCH_MISSING, load_flat_params, sgd_optimizer, torch_model, torch_train_step
from cnn.stages import get_stage

LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 5e-4
RESULTS = Path(__file__).resolve().parent / "results"


def training_batches(batch: int, count: int, seed: int = 0):
    """``count`` (images float32, labels int64) batches of MNIST, or random ones; and where they came from."""
    from cnn import data

    try:
        mnist = data.load_mnist(download=False)
    except Exception as err:       # no data here: the timing does not depend on pixel values
        rng = np.random.default_rng(seed)
        images = rng.normal(size=(batch * count, 1, 28, 28)).astype(np.float32)
        labels = rng.integers(0, 10, batch * count)
        source = f"random normal images (MNIST not found: {str(err).splitlines()[0][:160]})"
    else:
        order = np.random.default_rng(seed).permutation(len(mnist.train_images))[:batch * count]
        images = data.normalize(mnist.train_images[order], mnist.mean, mnist.std, np.float32)
        labels = mnist.train_labels[order].astype(np.int64)
        source = f"MNIST training images from {mnist.source}"
    batches = [(images[k * batch:(k + 1) * batch], labels[k * batch:(k + 1) * batch]) for k in range(count)]
    return batches, source


def step_functions(net, params, batches):
    """name -> function(k) that runs one training step on batch k."""
    import torch

    steps = {}
    stages = {"numba-cpu": get_stage("numba-cpu")(net, np.float32),
              "numba-cpu-unfused": get_stage("numba-cpu")(net, np.float32, fuse=False),
              "numpy": get_stage("numpy")(net, np.float32)}
    for name, stage in stages.items():
        stage.set_params(params)
        stage.set_momentum(np.zeros_like(params))
        steps[name] = lambda k, stage=stage: stage.train_step(*batches[k], LR, MOMENTUM, WEIGHT_DECAY)
    model = torch_model(net)
    load_flat_params(model, params)
    optimizer = sgd_optimizer(model, LR, MOMENTUM, WEIGHT_DECAY)
    tensors = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    steps["torch-cpu"] = lambda k: torch_train_step(model, optimizer, *tensors[k])
    return steps


def first_losses(steps) -> dict:
    """Loss of the first step of each (same parameters, same batch): they must agree."""
    return {name: float(step(0)) for name, step in steps.items()}


def time_in_turns(steps, batches: int, repeats: dict, warmup: int, per_turn: int = 5) -> dict:
    """Seconds per step for each implementation, ``per_turn`` timed steps at a time, taking turns.

    Taking turns spreads any change in machine load over all of them; each turn starts with
    one untimed step, so that a thread pool left spinning by the previous implementation
    (Numba's OpenMP, PyTorch's, OpenBLAS's) has gone quiet before the clock starts.
    """
    for name, step in steps.items():
        for k in range(warmup):
            step(k % batches)
    times = {name: [] for name in steps}
    k = 0
    while any(len(times[name]) < repeats[name] for name in steps):
        for name, step in steps.items():
            if len(times[name]) >= repeats[name]:
                continue
            step(k % batches)
            for _ in range(min(per_turn, repeats[name] - len(times[name]))):
                k += 1
                start = time.perf_counter()
                step(k % batches)
                times[name].append(time.perf_counter() - start)
    return times


def summary(seconds: list) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()), "repeats": len(ms)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=60, help="steps timed per implementation (numpy: a third)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=numba.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print(TORCH_MISSING, file=sys.stderr)
        return 1

    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    net = lenet5()
    batches, source = training_batches(args.batch, 8)
    steps = step_functions(net, init_params(net, "he", seed=0, dtype=np.float32), batches)
    losses = first_losses(steps)
    load_before = os.getloadavg()
    repeats = {name: args.repeats for name in steps}
    repeats["numpy"] = max(5, args.repeats // 3)
    times = time_in_turns(steps, len(batches), repeats, args.warmup)

    results = {name: summary(seconds) for name, seconds in times.items()}
    ratio = results["numba-cpu"]["median_ms"] / results["torch-cpu"]["median_ms"]
    record = {
        "benchmark": "one LeNet-5 training step (forward + backward + SGD momentum update), float32",
        "command": "python benchmarks/numba_vs_torch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "batch": args.batch, "data": source,
        "threads": {"numba": numba.get_num_threads(), "torch": torch.get_num_threads(),
                    "numba_threading_layer": numba.threading_layer()},
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0],
                              "note": "other processes on the machine; more than the core count slows every row"},
        "first_step_loss": losses,
        "results": results,
        "ratio_numba_over_torch": ratio,
        "ratio_numba_over_torch_of_minima": results["numba-cpu"]["min_ms"] / results["torch-cpu"]["min_ms"],
        "ratio_numpy_over_torch": results["numpy"]["median_ms"] / results["torch-cpu"]["median_ms"],
        "ratio_fused_over_unfused": results["numba-cpu"]["median_ms"] / results["numba-cpu-unfused"]["median_ms"],
        "machine": machine_info(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"numba_vs_torch-{socket.gethostname()}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")

    for name, result in results.items():
        print(f"{name:18s} {result['median_ms']:8.2f} ms/step  (p10 {result['p10_ms']:.2f}, "
              f"p90 {result['p90_ms']:.2f}, min {result['min_ms']:.2f}, n={result['repeats']})")
    print(f"\n| LeNet-5 step, batch {args.batch}, {args.threads} threads | numba-cpu "
          f"{results['numba-cpu']['median_ms']:.2f} ms | torch-cpu {results['torch-cpu']['median_ms']:.2f} ms | "
          f"numpy {results['numpy']['median_ms']:.2f} ms | numba/torch = {ratio:.2f} "
          f"(of minima {record['ratio_numba_over_torch_of_minima']:.2f}) | "
          f"numba fused/unfused = {record['ratio_fused_over_unfused']:.2f} |")
    print(f"load average (1 min) before/after: {load_before[0]:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
