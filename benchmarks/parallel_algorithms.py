"""The measurements behind the algorithms of docs/distributed.md, on MNIST (a subset: short runs).

    CNN_DATA_DIR=/work/shared/data python benchmarks/parallel_algorithms.py            # all four, 3 repeats
    CNN_DATA_DIR=/work/shared/data python benchmarks/parallel_algorithms.py --only overlap straggler --repeats 5
    python -m cnn.parallel.report --algorithms benchmarks/results/parallel_algorithms.json --into docs/distributed.md

- ``staleness``: Downpour (4 ranks: a server, 3 replicas) with the server's rule SGD with momentum
  or Adagrad, fetching every 1, 4, 16 steps: final test accuracy and loss, staleness.
- ``straggler``: EASGD round-robin against async, 4 ranks, worker rank 1 made 3× slower
  (``--slow-rank 1 --slow-down 3``): each worker's ms a step, and how far each had got when the
  first one finished.
- ``overlap``: the allreduce after the backward pass against the one overlapped with it
  (``--overlap``), at 2, 3 and 4 ranks, the two alternating step by step *inside one MPI job* so
  that whatever else the machine does slows both alike; medians and their ratio.
- ``model-split``: the per-layer cost probe at three batch sizes, and model parallelism with the
  first version's cut (after Flatten) against the cut the probe balances for a micro-batch of 8
  images, each at 1, 4 and 8 micro-batches of a batch of 32 — all six alternating step by step
  inside one 2-rank MPI job: the median step and each rank's median compute.

Every section runs ``--repeats`` times (default 3), its configurations taking turns within each
repeat, so that the tables give each figure as min–median–max over the repeats with the load
average each repeat saw; a finding is what holds across the spread. ``--limit-train`` shrinks the
runs where the machine is too loaded for the full size (the tables say which size they ran).

Each section's results go into benchmarks/results/parallel_algorithms.json (the other sections are
kept), with the machine, its cores and its load average: on a machine with fewer cores than ranks
the times show where the time goes, not a cluster's speed — the tables say so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")     # as the ranks have it: the probe times what a rank computes
REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))
RESULTS = REPOSITORY / "benchmarks" / "results"
OUT = RESULTS / "parallel_algorithms.json"
SECTIONS = ("staleness", "straggler", "overlap", "model-split")
SUBSET = dict(limit_train=9600, limit_test=2000, batch_size=32, init="xavier", epochs=1)


def machine() -> dict:
    from cnn.machine import machine_info
    from cnn.parallel.launch import usable_cores

    return {**machine_info(), "usable_cores": usable_cores(), "load_average": list(os.getloadavg())}


def run(strategy: str, ranks: int, **options) -> dict:
    from cnn.parallel.launch import launch

    with tempfile.TemporaryDirectory() as scratch:
        done = launch(strategy, ranks, summary=str(Path(scratch) / "summary.json"), timeout=3600, progress=False,
                      checkpoint=str(Path(scratch) / "run.npz"), **{**SUBSET, **options})
    if done.summary is None:
        raise RuntimeError(f"{strategy} {options}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return done.summary


def staleness() -> list[dict]:
    rows = []
    for rule in ("sgd", "adagrad"):
        for n_fetch in (1, 4, 16):
            summary = run("downpour", 4, server_rule=rule, n_fetch=n_fetch)
            rows.append({"rule": rule, "n_fetch": n_fetch, "lr": summary["config"]["lr"],
                         "momentum": summary["config"]["momentum"], "accuracy": summary["final_test_accuracy"],
                         "loss": summary["final_test_loss"], "staleness": summary["staleness"],
                         "steps_per_replica": summary["steps"], "status": summary["status"]})
            print(f"downpour {rule} n-fetch {n_fetch}: {rows[-1]['accuracy']:.2%}, loss {rows[-1]['loss']:.3f}", flush=True)
    return rows


def straggler() -> list[dict]:
    rows = []
    for mode in ("round-robin", "async"):
        summary = run("easgd", 4, easgd_mode=mode, tau=1, slow_rank=1, slow_down=3, momentum=0.5)
        rows.append({"mode": mode, "step_ms": {rank: phases["step"] * 1e3
                                              for rank, phases in summary["breakdown_per_rank"].items() if rank != "0"},
                     "steps": summary["steps"], "train_seconds": summary["train_wall_seconds"],
                     "steps_when_first_worker_finished": summary.get("steps_when_first_worker_finished"),
                     "staleness": summary.get("staleness"), "staleness_mean_per_worker":
                         summary.get("staleness_mean_per_worker"), "accuracy": summary["final_test_accuracy"]})
        print(f"easgd {mode}: ms a step per worker {rows[-1]['step_ms']}", flush=True)
    return rows


def overlap(repeats: int = 40) -> list[dict]:
    rows = []
    for ranks in (2, 3, 4):
        rows.append(mpi_job(ranks, "--overlap-job", repeats))
        print(f"overlap, {ranks} ranks: {rows[-1]}", flush=True)
    return rows


def overlap_job(out: str, repeats: int) -> None:
    """Inside mpiexec: plain and overlapped steps alternating, each from a common start (a barrier)."""
    import numpy as np
    from mpi4py import MPI

    from cnn.model import get_network
    from cnn.parallel.allreduce import Allreduce, OverlappedAllreduce
    from cnn.parallel.optimizers import HostSGD
    from cnn.parallel.synchronous import TAIL
    from cnn.parallel.timing import AVERAGE, COMPUTE, PhaseTimer
    from cnn.parallel.world import World
    from cnn.stages import get_stage
    from cnn.train import TrainConfig, load_dataset

    world = World(MPI.COMM_WORLD, timeout=300)
    config = TrainConfig(limit_train=SUBSET["limit_train"], limit_test=10, progress=False)
    train_x, train_y, _, _ = load_dataset(config)
    net = get_network("lenet5")
    stage = get_stage("numpy")(net).init("xavier", 0)
    opt = HostSGD(world.broadcast(stage.get_params(), "initial weights"), config)
    timer = PhaseTimer(world.rank)
    ways = {"plain": Allreduce(world, timer, "mpi"), "overlapped": OverlappedAllreduce(world, timer, net)}
    message = np.zeros(net.num_params + TAIL, np.float32)         # [gradient | loss | stop flag]
    steps, waits = {name: [] for name in ways}, {name: [] for name in ways}
    batch = SUBSET["batch_size"]
    for repeat in range(repeats + 2):
        for name, exchange in ways.items():
            rows = slice((repeat * world.size + world.rank) * batch % (len(train_x) - batch), None)
            images, labels = train_x[rows][:batch], train_y[rows][:batch]
            world.wait([world.comm.Ibarrier()], "barrier")
            timer.end_step()                                       # the step starts now
            with timer.phase(COMPUTE):
                exchange.compute(stage, images, labels, message)
            exchange(message, opt, 0.01)
            stage.set_params(opt.params)
            record = timer.end_step()
            if repeat >= 2:                                        # two warm-up rounds
                steps[name].append(record["step"])
                waits[name].append(record.get(AVERAGE, 0.0))
    if world.rank == 0:
        median = {name: float(np.median(values)) for name, values in steps.items()}
        wait = {name: float(np.median(values)) for name, values in waits.items()}
        Path(out).write_text(json.dumps({"ranks": world.size, "repeats": repeats, "step_s": median, "wait_s": wait,
                                         "step_ratio": median["overlapped"] / median["plain"],
                                         "oversubscribed": world.oversubscribed}))


def model_split(repeats: int = 30) -> dict:
    from cnn.model import get_network
    from cnn.parallel import partition
    from cnn.stages import get_stage

    net = get_network("lenet5")
    costs = {batch: partition.measure_costs(net, get_stage("numpy"), batch) for batch in (32, 8, 4)}
    balanced = str(partition.balanced_partition(net, costs[8]))       # one cut for every M: only M changes
    configs = [(cut, micro_batches) for cut in ("7", balanced) for micro_batches in (1, 4, 8)]
    runs = mpi_job(2, "--model-split-job", repeats, json.dumps(configs))["runs"]
    for row in runs:
        row["asked"] = "after Flatten" if row["split"] == "7" else "balanced"
        print(f"model-parallel cut {row['split']}, {row['micro_batches']} micro-batches: {row['step_ms']:.1f} ms a step",
              flush=True)
    best = {str(batch): str(partition.balanced_partition(net, value)) for batch, value in costs.items()}
    return {"layers": [type(layer).__name__ for layer in net.layers], "repeats": repeats,
            "costs_s": {str(batch): value.as_json() for batch, value in costs.items()}, "balanced": best, "runs": runs}


def mpi_job(ranks: int, job: str, repeats: int, extra: str = "") -> dict:
    """Run this script's ``job`` under mpiexec on ``ranks`` ranks; rank 0's JSON result."""
    from cnn.parallel.launch import environment, find_mpiexec, launcher_flags

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        mpiexec = find_mpiexec()
        argv = [mpiexec, *launcher_flags(mpiexec, ranks, fault_tolerant=False), "-n", str(ranks), sys.executable,
                "-m", "mpi4py", __file__, job, str(out), "--steps", str(repeats)] + (["--configs", extra] if extra else [])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, env=environment())
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        return json.loads(out.read_text())


def model_split_job(out: str, repeats: int, configs: list) -> None:
    """Inside mpiexec (2 ranks): model-parallel steps of every (cut, micro-batches) in turn, each from a
    common start (a barrier), ``repeats`` rounds; medians of the step and of each rank's compute."""
    import numpy as np
    from mpi4py import MPI

    from cnn.parallel import partition
    from cnn.parallel.common import ParallelOptions, Run
    from cnn.parallel.model_parallel import Flow, Side
    from cnn.parallel.timing import COMPUTE
    from cnn.parallel.world import World
    from cnn.train import TrainConfig

    world = World(MPI.COMM_WORLD, timeout=300)
    config = TrainConfig(limit_train=32 * (repeats + 2), limit_test=10, batch_size=32, progress=False, init="xavier")
    run = Run(config, ParallelOptions(strategy="model-parallel"), world, 1, {})
    params = run.initial_params(run.make_stage())
    setups = {}
    for cut, micro_batches in configs:
        if cut not in setups:
            front, back = partition.pieces(run.net, partition.parse_split(cut, run.net))
            side = Side(run, front if world.rank == 0 else back)
            side.load(params, np.zeros_like(params))
            setups[cut] = (side, Flow(run, partition.parse_split(cut, run.net), front, back))
    steps, compute = {tuple(c): [] for c in configs}, {tuple(c): [] for c in configs}
    for repeat in range(repeats + 2):
        for cut, micro_batches in configs:
            side, flow = setups[cut]
            bounds = np.linspace(0, config.batch_size, micro_batches + 1).astype(np.int64)
            world.wait([world.comm.Ibarrier()], "barrier")
            run.timer.end_step()                                   # the step starts now
            side.begin_batch()
            (flow.front_step if world.rank == 0 else flow.back_step)(side, repeat, bounds)
            side.update(0.01, config)
            record = run.timer.end_step()
            if repeat >= 2:                                        # two warm-up rounds
                steps[cut, micro_batches].append(record["step"])
                compute[cut, micro_batches].append(record.get(COMPUTE, 0.0))
    medians = {key: float(np.median(values)) for key, values in compute.items()}
    everyone = world.gather_objects({f"{cut}|{m}": value for (cut, m), value in medians.items()})
    if world.rank == 0:
        rows = [{"split": cut, "micro_batches": m, "step_ms": float(np.median(steps[cut, m])) * 1e3,
                 "compute_ms": {str(rank): everyone[rank][f"{cut}|{m}"] * 1e3 for rank in (0, 1)}}
                for cut, m in steps]
        Path(out).write_text(json.dumps({"runs": rows}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each section, for min–median–max")
    parser.add_argument("--limit-train", type=int, default=SUBSET["limit_train"],
                        help="training images of the staleness and straggler runs")
    parser.add_argument("--overlap-job", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-split-job", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--configs", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None, help="steps of each kind in one job (overlap: 40, "
                                                                  "model split: 30)")
    args = parser.parse_args(argv)
    if args.overlap_job:
        overlap_job(args.overlap_job, args.steps)
        return 0
    if args.model_split_job:
        model_split_job(args.model_split_job, args.steps, [tuple(c) for c in json.loads(args.configs)])
        return 0
    SUBSET["limit_train"] = args.limit_train
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    sections = {"staleness": staleness, "straggler": straggler, "overlap": lambda: overlap(args.steps or 40),
                "model-split": lambda: model_split(args.steps or 30)}
    for name in args.only:
        started, runs = time.time(), []
        for repeat in range(args.repeats):
            load = os.getloadavg()[0]
            runs.append({"results": sections[name](), "load_average": [load, os.getloadavg()[0]]})
            print(f"{name}: repeat {repeat + 1} of {args.repeats} done", flush=True)
        results[name] = {"runs": runs, "machine": machine(), "seconds": time.time() - started,
                         "limit_train": args.limit_train}
        OUT.write_text(json.dumps(results, indent=1))
    from cnn.parallel.report import algorithm_tables

    print(algorithm_tables(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
