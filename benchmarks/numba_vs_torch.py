"""One training step on the CPU: stage ``numba-cpu`` against PyTorch's CPU build, on 1 and on all threads, with one core kept busy or not.

    python benchmarks/numba_vs_torch.py [--model lenet5] [--batch 64] [--repeats 60] [--threads 1,2]
                                        [--loaded] [--rows numba-cpu,numba-cpu-layers,torch-cpu,numpy]
                                        [--threading-layer omp] [--out results]
    python benchmarks/numba_vs_torch.py --versions aefc889,HEAD [--rounds 3] [--threads 1]

Timed in ONE process, on the same batches, from the same initial parameters: stage
``numba-cpu`` (each thread takes blocks of samples through the whole network: one parallel
region a phase; it uses only the cores that other work leaves free), ``numba-cpu-fixed`` (the
same, always on the row's thread count), ``numba-cpu-layers`` (the kernels spread over the
threads one layer at a time: the stage's first schedule, a barrier a layer), optionally ``numba-cpu-unfused``
(every layer its own kernel) and stage ``numpy``, and PyTorch. Every row runs at every thread
count of ``--threads`` (default 1 and all cores; Numba's and PyTorch's pools set alike). A step
is forward + backward + SGD-with-momentum update, float32. After a warm-up (which also compiles
the Numba kernels) the rows take turns, a few timed steps each, so that a change in machine
load hits all of them alike; each turn starts with an untimed step.

``--loaded`` starts a competing process that keeps one core busy (a Python busy loop) for the
whole measurement: what a laptop with other work running looks like, and what makes threads
that wait at a barrier for a descheduled one collapse. Without it the machine is as it is: the
1-minute load average in the file says whether other work ran. PyTorch runs with its own defaults (its
OpenMP threads spin while they wait); stage 3 asks for Numba's OpenMP layer with the passive wait
policy (``kernels/cpu/thread_pool.py``), but in one process the two share one OpenMP, PyTorch's (imported
first): the Numba rows run with its default policy too, and FreeCores counts Numba's own spinning threads
as other work (the ``numba-cpu`` row then mostly takes one thread; ``numba-cpu-fixed`` is the same-threads
comparison). ``--threading-layer`` picks Numba's layer by hand.

Reported per row: median, 10th and 90th percentile, minimum; the ratios numba-cpu / torch-cpu
at each thread count (below 1: Numba is faster), and each implementation's all-threads /
1-thread ratio (above 1: more threads made it slower). Writes
``<out>/numba_vs_torch-<model>-b<batch>-<no-competitor|loaded>-<host>-<date>.json`` (``--out``: default
``results/``, git-ignored; the committed runs are in benchmarks/results/) and prints a table.
``--versions`` measures what changes to the code bought instead: each commit's ``cnn/`` and
``kernels/`` are taken out with ``git archive`` into a temporary folder, and a fresh process per
version times stage ``numba-cpu`` (``--rounds`` rounds, the versions taking turns; the first
round, which compiles, is dropped), reporting the wall clock and the thread's CPU time a step.

Real MNIST batches for LeNet-5 when the data is found (``cnn.data.load_mnist``, no download);
random normal images otherwise (AlexNet-small always: the timing does not depend on pixel values).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 5e-4
REPOSITORY = Path(__file__).resolve().parent.parent
ROWS = ("numba-cpu", "numba-cpu-fixed", "numba-cpu-layers", "numba-cpu-unfused", "numpy", "torch-cpu")
BUSY_LOOP = "while True: pass"


def training_batches(net, batch: int, count: int, seed: int = 0):
    """``count`` (images float32, labels int64) batches: MNIST for a 28×28×1 network when found, else random normal."""
    from cnn import data

    rng = np.random.default_rng(seed)
    source = "random normal images"
    images = None
    if tuple(net.input_shape) == (1, 28, 28):
        try:
            mnist = data.load_mnist(download=False)
        except Exception as err:       # no data here: the timing does not depend on pixel values
            source += f" (MNIST not found: {str(err).splitlines()[0][:160]})"
        else:
            order = rng.permutation(len(mnist.train_images))[:batch * count]
            images = data.normalize(mnist.train_images[order], mnist.mean, mnist.std, np.float32)
            labels = mnist.train_labels[order].astype(np.int64)
            source = f"MNIST training images from {mnist.source}"
    if images is None:
        images = rng.normal(size=(batch * count, *net.input_shape)).astype(np.float32)
        labels = rng.integers(0, 10, batch * count)
    batches = [(images[k * batch:(k + 1) * batch], labels[k * batch:(k + 1) * batch]) for k in range(count)]
    return batches, source


def step_functions(net, params, batches, rows):
    """name -> function(k) that runs one training step on batch k, for each of ``rows``."""
    from cnn.stages import get_stage

    options = {"numba-cpu": ("numba-cpu", {}), "numba-cpu-fixed": ("numba-cpu", {"free_cores_only": False}),
               "numba-cpu-layers": ("numba-cpu", {"schedule": "layers"}),
               "numba-cpu-unfused": ("numba-cpu", {"fuse": False}), "numpy": ("numpy", {})}
    steps, stages = {}, {}
    for name in rows:
        if name == "torch-cpu":
            steps[name] = torch_step(net, params, batches)
            continue
        stage_name, keywords = options[name]
        stage = stages[name] = get_stage(stage_name)(net, np.float32, **keywords)
        stage.set_params(params)
        stage.set_momentum(np.zeros_like(params))
        steps[name] = lambda k, stage=stage: stage.train_step(*batches[k], LR, MOMENTUM, WEIGHT_DECAY)
    return steps, stages


def torch_step(net, params, batches):
    import torch

    from cnn.reference_torch import load_flat_params, sgd_optimizer, torch_model, torch_train_step

    model = torch_model(net)
    load_flat_params(model, params)
    optimizer = sgd_optimizer(model, LR, MOMENTUM, WEIGHT_DECAY)
    tensors = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    return lambda k: torch_train_step(model, optimizer, *tensors[k])


def set_threads(count: int) -> None:
    """Numba's and (when loaded) PyTorch's thread pools to ``count`` threads."""
    import numba

    numba.set_num_threads(count)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(count)


def time_in_turns(steps, thread_counts, batches: int, repeats: dict, warmup: int, per_turn: int = 3) -> dict:
    """Seconds per step for each (implementation, threads) row, ``per_turn`` timed steps at a time, taking turns.

    Taking turns, in a new random order each turn, spreads any change in machine load over all rows
    (a fixed order can lock onto the rhythm of another process's time slices); each turn starts with one
    untimed step, so that a thread pool left spinning by the previous row has gone quiet (and
    the new thread count is in place) before the clock starts.
    """
    rows = [(name, threads) for threads in thread_counts for name in steps]
    for name, threads in rows:
        set_threads(threads)
        for k in range(warmup):
            steps[name](k % batches)
    times = {row: [] for row in rows}
    k, shuffle = 0, np.random.default_rng(0)
    while any(len(times[row]) < repeats[row[0]] for row in rows):
        for index in shuffle.permutation(len(rows)):
            row = rows[index]
            name, threads = row
            if len(times[row]) >= repeats[name]:
                continue
            set_threads(threads)
            steps[name](k % batches)
            for _ in range(min(per_turn, repeats[name] - len(times[row]))):
                k += 1
                start = time.perf_counter()
                steps[name](k % batches)
                times[row].append(time.perf_counter() - start)
    return times


def summary(seconds: list) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()), "repeats": len(ms)}


def ratios(results: dict, thread_counts) -> dict:
    """numba-cpu / torch-cpu at each thread count, and each row's most-threads / 1-thread ratio (medians)."""
    out = {}
    for threads in thread_counts:
        numba_row, torch_row = results.get(f"numba-cpu@{threads}"), results.get(f"torch-cpu@{threads}")
        if numba_row and torch_row:
            out[f"numba_over_torch@{threads}"] = numba_row["median_ms"] / torch_row["median_ms"]
            out[f"numba_over_torch_of_minima@{threads}"] = numba_row["min_ms"] / torch_row["min_ms"]
    most = max(thread_counts)
    for name in ROWS:
        if f"{name}@1" in results and f"{name}@{most}" in results and most > 1:
            out[f"{name}: {most}_threads_over_1"] = results[f"{name}@{most}"]["median_ms"] / results[f"{name}@1"]["median_ms"]
    return out


def start_competitor():
    """A process that keeps one core busy until it is killed."""
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP])


VERSION_STEP = r"""
import json, sys, time
import numba, numpy as np
from cnn.model import NETWORKS
from cnn.stages import get_stage
stage_class = get_stage("numba-cpu")     # first: importing stage 3 sets its wait policy before Numba's threads start
numba.set_num_threads(int(sys.argv[1]))
net, batch = NETWORKS[sys.argv[2]](), int(sys.argv[3])
rng = np.random.default_rng(0)
x = rng.normal(size=(batch, *net.input_shape)).astype(np.float32)
y = rng.integers(0, 10, batch)
stage = stage_class(net, np.float32).init("he", seed=0)
for _ in range(3):
    stage.train_step(x, y, 0.001)
wall, cpu = [], []
for _ in range(int(sys.argv[4])):
    started, started_cpu = time.perf_counter(), time.thread_time()
    stage.train_step(x, y, 0.001)
    wall.append(time.perf_counter() - started)
    cpu.append(time.thread_time() - started_cpu)
print(json.dumps({"wall_median_ms": float(np.median(wall) * 1e3), "wall_min_ms": float(min(wall) * 1e3),
                  "cpu_mean_ms": float(np.mean(cpu) * 1e3)}))
"""


def compare_versions(args) -> int:
    """Stage numba-cpu of each commit in ``args.versions``, a fresh process each, the versions taking turns."""
    import tempfile

    runs = {version: [] for version in args.versions}
    with tempfile.TemporaryDirectory() as folder:
        for version in args.versions:
            tree = Path(folder) / version.replace("/", "_")
            tree.mkdir()
            archive = subprocess.run(["git", "archive", version, "cnn", "kernels"], cwd=REPOSITORY,
                                     capture_output=True, check=False)
            if archive.returncode:
                print(f"--versions: git cannot read {version!r}: {archive.stderr.decode().strip()[:200]}",
                      file=sys.stderr)
                return 2
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        load_before = os.getloadavg()[0]
        for round_number in range(args.rounds + 1):          # round 0 compiles each version's kernels: dropped
            for version in args.versions:
                tree = Path(folder) / version.replace("/", "_")
                child = subprocess.run([sys.executable, "-c", VERSION_STEP, str(max(args.threads)), args.model,
                                        str(args.batch), str(args.repeats)], cwd=tree, capture_output=True,
                                       text=True, env=dict(os.environ, PYTHONPATH=str(tree)))
                if child.returncode:
                    print(f"--versions: {version} failed: {child.stderr.strip().splitlines()[-1][:300]}",
                          file=sys.stderr)
                    return 1
                if round_number:
                    runs[version].append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"numba-cpu, {args.model} batch {args.batch}, {max(args.threads)} thread(s), {args.repeats} steps a round, "
          f"{args.rounds} rounds; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    previous = None
    for version, rounds in runs.items():
        cpu = [r["cpu_mean_ms"] for r in rounds]
        line = (f"  {version:12s} CPU {min(cpu):.2f}-{np.median(cpu):.2f}-{max(cpu):.2f} ms/step (min-median-max), "
                f"wall median {np.median([r['wall_median_ms'] for r in rounds]):.2f} ms")
        if previous:
            ratio = [now / before for now, before in zip(cpu, previous)]
            line += f"; CPU x the previous, round by round: {min(ratio):.2f}-{np.median(ratio):.2f}-{max(ratio):.2f}"
        print(line)
        previous = cpu
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("lenet5", "alexnet-small"), default="lenet5")
    parser.add_argument("--batch", type=int, default=None, help="default: 64 for lenet5, 128 for alexnet-small")
    parser.add_argument("--repeats", type=int, default=60, help="steps timed per row (numpy: a third)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", default=None, help="thread counts, comma-separated (default: 1 and all cores)")
    parser.add_argument("--rows", default="numba-cpu,numba-cpu-fixed,numba-cpu-layers,torch-cpu,numpy",
                        help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--loaded", action="store_true", help="keep one core busy with another process meanwhile")
    parser.add_argument("--threading-layer", default=None, help="Numba's threading layer (omp, tbb, workqueue)")
    parser.add_argument("--out", type=Path, default=REPOSITORY / "results")
    parser.add_argument("--versions", default=None, help="commits to compare, comma-separated (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="with --versions: rounds of turns")
    args = parser.parse_args(argv)
    args.versions = [v.strip() for v in args.versions.split(",") if v.strip()] if args.versions else None
    args.rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    cores = os.cpu_count() or 1
    try:
        args.threads = sorted({int(t) for t in args.threads.split(",")}) if args.threads else sorted({1, cores})
    except ValueError:
        parser.error(f"--threads: expected whole numbers separated by commas, got {args.threads!r}")
    if args.batch is None:
        args.batch = 64 if args.model == "lenet5" else 128
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.versions:
        return compare_versions(args)
    if "torch-cpu" in args.rows:
        try:
            import torch  # noqa: F401  (first, so that PyTorch's OpenMP starts with its own defaults)
        except ImportError:
            from cnn.reference_torch import TORCH_MISSING
            print(TORCH_MISSING, file=sys.stderr)
            return 1
    import numba

    if args.threading_layer:
        numba.config.THREADING_LAYER = args.threading_layer
    from cnn.machine import machine_info
    from cnn.model import NETWORKS, init_params
    from kernels.cpu.thread_pool import thread_pool_facts

    if max(args.threads) > numba.config.NUMBA_NUM_THREADS:
        print(f"--threads: at most {numba.config.NUMBA_NUM_THREADS} on this machine (NUMBA_NUM_THREADS)",
              file=sys.stderr)
        return 2
    net = NETWORKS[args.model]()
    batches, source = training_batches(net, args.batch, 8)
    steps, stages = step_functions(net, init_params(net, "he", seed=0, dtype=np.float32), batches, args.rows)
    losses = {name: float(step(0)) for name, step in steps.items()}   # same parameters, same batch: they must agree
    repeats = {name: args.repeats for name in steps}
    if "numpy" in repeats:
        repeats["numpy"] = max(5, args.repeats // 3)

    competitor = start_competitor() if args.loaded else None
    try:
        time.sleep(0.5 if competitor else 0)
        load_before = os.getloadavg()
        times = time_in_turns(steps, args.threads, len(batches), repeats, args.warmup)
        load_after = os.getloadavg()
    finally:
        if competitor:
            competitor.kill()
            competitor.wait()

    results = {f"{name}@{threads}": summary(seconds) for (name, threads), seconds in times.items()}
    threads_used = {name: {str(count): phases for count, phases in sorted(stage.threads_used.items())}
                    for name, stage in stages.items() if getattr(stage, "threads_used", None)}
    record = {
        "benchmark": f"one {net.name} training step (forward + backward + SGD momentum update), float32, "
                     f"batch {args.batch}",
        "command": "python benchmarks/numba_vs_torch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": args.model, "batch": args.batch, "data": source,
        "loaded": bool(args.loaded),
        "competitor": f"one process running `{BUSY_LOOP}` (one core busy) for the whole measurement"
                      if args.loaded else None,
        "threads": {**thread_pool_facts(), "counts": args.threads,
                    "torch": "PyTorch's defaults (its OpenMP threads spin while waiting)",
                    **({"numba_openmp": "PyTorch's, imported first: Numba's threads ran with its default policy "
                                        "(spin, then sleep), not OMP_WAIT_POLICY above (kernels/cpu/thread_pool.py)"}
                       if "torch-cpu" in args.rows else {}),
                    "numba_cpu_used": threads_used,
                    "numba_cpu_used_note": "parallel regions the block-schedule rows ran with each thread count, all "
                                           "rows' turns together: numba-cpu uses only the cores other work leaves "
                                           "free (FreeCores), numba-cpu-fixed always the row's count"},
        "load_average_1min": {"before": load_before[0], "after": load_after[0],
                              "note": "every runnable process on the machine, the competitor included; more than "
                                      "the core count slows every row"},
        "first_step_loss": losses,
        "results": results,
        "ratios": ratios(results, args.threads),
        "machine": machine_info(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    state = "loaded" if args.loaded else "no-competitor"
    path = args.out / (f"numba_vs_torch-{args.model}-b{args.batch}-{state}-{socket.gethostname()}-"
                       f"{datetime.date.today().isoformat()}.json")
    from cnn.atomic import replaced_on_success

    with replaced_on_success(path) as temporary:
        temporary.write_text(json.dumps(record, indent=2) + "\n")

    print(f"{net.name}, batch {args.batch}, " + ("one core kept busy by another process" if competitor else
                                               "no competing process of ours (the machine as it is)"))
    for row, result in results.items():
        print(f"  {row:22s} {result['median_ms']:9.2f} ms/step  (p10 {result['p10_ms']:.2f}, "
              f"p90 {result['p90_ms']:.2f}, min {result['min_ms']:.2f}, n={result['repeats']})")
    for name, value in record["ratios"].items():
        print(f"  {name:40s} {value:.2f}")
    print(f"load average (1 min) before/after: {load_before[0]:.1f}/{load_after[0]:.1f} on {os.cpu_count()} cores; "
          f"Numba: {record['threads']['numba_threading_layer']}, "
          + ("on PyTorch's OpenMP (imported first: its default wait policy)" if "numba_openmp" in record["threads"]
             else f"OMP_WAIT_POLICY={record['threads']['OMP_WAIT_POLICY']}"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
