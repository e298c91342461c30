"""How cnn.parallel waits: the wake-up against MPI_Wait, and the core a waiting rank gives back.

    python benchmarks/parallel_waits.py                      # 2, 3, 4 ranks, 3 runs each
    python benchmarks/parallel_waits.py --ranks 2 --runs 5
    python benchmarks/parallel_waits.py --table-only --into docs/distributed.md

One MPI job per rank count and run, each measuring two things:

- *wake-up*: LeNet-5's gradient (44 427 floats) summed by ``MPI_Iallreduce``, waited on alternately
  through ``World.wait`` (spin 5 ms, then naps) and ``MPI_Wait``, 200 times each after a barrier:
  the ratio of the medians. An allreduce that nobody is late for ends within the spin, so the two
  should be equal (the goal: within 1.2×).
- *a straggler*: every rank computes a LeNet-5 step on 32 images (numpy), rank 1 then sleeps four
  times its compute (a 5× straggler), and all allreduce the gradient; each waiting rank's CPU time
  during its wait, as a share of the wait's wall time — once as the project waits (spin, then nap)
  and once spinning throughout (the previous version), the two taking turns step by step (the
  goal: under 20 % of the wall time).

Writes benchmarks/results/parallel_waits.json (the rank counts run are replaced, the others kept)
and prints the Markdown table docs/distributed.md shows (min–median–max over the runs). Ranks
beyond the cores share them: on such a machine read the CPU share, not the times.
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
    os.environ.setdefault(_variable, "1")
REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))
OUT = REPOSITORY / "benchmarks" / "results" / "parallel_waits.json"


def job(out: str, repeats: int, straggler_steps: int) -> None:
    """Inside mpiexec: the wake-up comparison, then the straggler steps; rank 0 writes the JSON."""
    import numpy as np
    from mpi4py import MPI

    from cnn.model import get_network
    from cnn.parallel import world as world_module
    from cnn.parallel.world import World
    from cnn.stages import get_stage

    world = World(MPI.COMM_WORLD, timeout=300)
    comm = world.comm
    net = get_network("lenet5")
    vector = np.random.default_rng(world.rank).standard_normal(net.num_params + 1).astype(np.float32)
    mpi_wait, waited, total = [], [], np.empty_like(vector)
    for _ in range(repeats):                               # the same call World.allreduce_sum makes
        comm.Barrier()
        started = time.perf_counter()
        comm.Iallreduce(vector, total, op=MPI.SUM).Wait()
        mpi_wait.append(time.perf_counter() - started)
        comm.Barrier()
        started = time.perf_counter()
        world.allreduce_sum(vector, "allreduce")
        waited.append(time.perf_counter() - started)
    stage = get_stage("numpy")(net).init("xavier", 0)
    images = np.random.default_rng(world.rank).standard_normal((32, 1, 28, 28)).astype(np.float32)
    labels = np.arange(32) % 10
    shares = {"spin, then nap": [], "spin throughout": []}
    spin = world_module.SPIN_SECONDS
    for step in range(straggler_steps + 1):
        for way in shares:
            world_module.SPIN_SECONDS = spin if way == "spin, then nap" else float("inf")
            comm.Barrier()
            started = time.perf_counter()
            _, grad = stage.loss_and_grad(images, labels)
            if world.rank == 1:
                time.sleep(4 * (time.perf_counter() - started))
            cpu, wall = time.process_time(), time.perf_counter()
            world.allreduce_sum(grad, "gradient")
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            if step and world.rank != 1:                 # the first step warms up
                shares[way].append(cpu / wall)
    world_module.SPIN_SECONDS = spin
    everyone = world.gather_objects({way: float(np.median(values)) for way, values in shares.items()})
    if world.rank == 0:
        waiting = [rank for rank in everyone if rank != 1]
        Path(out).write_text(json.dumps({
            "ranks": world.size, "repeats": repeats, "world_wait_us": float(np.median(waited)) * 1e6,
            "mpi_wait_us": float(np.median(mpi_wait)) * 1e6,
            "cpu_share": {way: float(np.median([everyone[r][way] for r in waiting])) for way in shares},
            "oversubscribed": world.oversubscribed}))


def measure(ranks: int, repeats: int, straggler_steps: int) -> dict:
    from cnn.parallel.launch import environment, find_mpiexec, launcher_flags

    mpiexec = find_mpiexec()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "waits.json"
        argv = [mpiexec, *launcher_flags(mpiexec, ranks, fault_tolerant=False), "-n", str(ranks), sys.executable,
                "-m", "mpi4py", __file__, "--job", str(out), "--repeats", str(repeats),
                "--straggler-steps", str(straggler_steps)]
        load = os.getloadavg()[0]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=environment())
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        return {**json.loads(out.read_text()), "load_average": [load, os.getloadavg()[0]]}


def table(result: dict) -> str:
    """The Markdown table of docs/distributed.md: per rank count, min–median–max over the runs."""
    from cnn.parallel.report import spread

    machine = result["machine"]
    loads = [load for runs in result["runs"].values() for run in runs for load in run["load_average"]]
    lines = [f"Measured on {machine.get('cpu', '?')} with {machine.get('usable_cores')} cores, "
             f"{min(len(runs) for runs in result['runs'].values())} runs per rank count at a 1-minute load average "
             f"of {min(loads):.1f}–{max(loads):.1f}. Each cell: min–median–max over the runs.", "",
             "| ranks | World.wait ÷ MPI_Wait (median allreduce) | World.wait, µs | MPI_Wait, µs | CPU while "
             "waiting for a 5× straggler: spin, then nap | spinning throughout | oversubscribed |",
             "|---|---|---|---|---|---|---|"]
    for ranks, runs in sorted(result["runs"].items(), key=lambda item: int(item[0])):
        lines.append(f"| {ranks} | {spread([r['world_wait_us'] / r['mpi_wait_us'] for r in runs], '{:.2f}', '×')} | "
                     f"{spread([r['world_wait_us'] for r in runs], '{:.0f}')} | "
                     f"{spread([r['mpi_wait_us'] for r in runs], '{:.0f}')} | "
                     f"{spread([100 * r['cpu_share']['spin, then nap'] for r in runs], '{:.0f}', ' %')} | "
                     f"{spread([100 * r['cpu_share']['spin throughout'] for r in runs], '{:.0f}', ' %')} | "
                     f"{'yes' if runs[0]['oversubscribed'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3,4")
    parser.add_argument("--runs", type=int, default=3, help="jobs per rank count, for min–median–max")
    parser.add_argument("--repeats", type=int, default=200, help="allreduces of each kind in a job")
    parser.add_argument("--straggler-steps", type=int, default=10)
    parser.add_argument("--into", default=None, help="also put the table into this Markdown file's "
                                                         "parallel-waits markers (docs/distributed.md)")
    parser.add_argument("--table-only", action="store_true", help="print (and --into) the table of the JSON")
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        job(args.job, args.repeats, args.straggler_steps)
        return 0
    if args.table_only:
        return publish(json.loads(OUT.read_text()), args.into)
    from cnn.machine import machine_info
    from cnn.parallel.launch import usable_cores

    result = json.loads(OUT.read_text()) if OUT.exists() else {"runs": {}}
    for ranks in [int(r) for r in args.ranks.split(",")]:
        result["runs"][str(ranks)] = []
    for run in range(args.runs):                           # the rank counts take turns
        for ranks in [int(r) for r in args.ranks.split(",")]:
            result["runs"][str(ranks)].append(measure(ranks, args.repeats, args.straggler_steps))
            print(f"{ranks} ranks, run {run + 1}: {result['runs'][str(ranks)][-1]}", flush=True)
    result["machine"] = {**machine_info(), "usable_cores": usable_cores()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    return publish(result, args.into)


def publish(result: dict, into: str | None) -> int:
    from cnn.parallel.report import replace_between_markers

    text = table(result)
    print(text)
    if into:
        replace_between_markers(into, "parallel-waits", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
