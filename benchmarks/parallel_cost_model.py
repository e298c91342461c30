"""Parameter server against ring allreduce: the α-β model (cnn.parallel.costmodel) with α and β
measured on this machine's MPI, plotted for 2 to 1024 workers, next to measured exchanges.

    python benchmarks/parallel_cost_model.py            # after benchmarks/parallel_strategies.py
    python benchmarks/parallel_cost_model.py --ranks 2,4 --runs 5

1. ``python -m cnn.parallel.costmodel`` on 2, 3 and 4 ranks: a ping-pong between ranks 0 and 1,
   waited on as the strategies wait (``World.wait``), gives α (latency) and β (seconds per byte);
   the strategies' own exchanges (parameter server, ring, MPI's allreduce) are timed on vectors
   of LeNet-5's and AlexNet-small's size; and MPI's allreduce back to back, waited on through
   World.wait, MPI_Wait, with sleeps (as the first version waited) and blocking.
2. The model checked against those measurements at 2, 3 and 4 ranks (the ratio measured / model
   in the table), then extrapolated: time per step and bytes on the busiest link for P = 2 … 1024.
3. The measured points: the isolated exchanges at 2–4 ranks, and the communication phases of the
   4-rank training runs in benchmarks/results/parallel_strategies.json (if present).

Run it with no more ranks than cores where the machine has them (the script says how many cores it
saw; the JSON records them). Every measurement is repeated ``--runs`` times (default 3), the rank
counts taking turns, and the table gives the ratio measured / model as min–median–max over the
runs: one run's ratio is not a property of the exchange (on a shared 2-core machine back-to-back
runs gave 2.6× to 151×). The row from the training runs names the machine they ran on.

Writes benchmarks/results/parallel_cost_model.json and benchmarks/results/parallel_cost_model.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from cnn.model import get_network
from cnn.parallel import costmodel
from cnn.parallel.launch import environment, find_mpiexec, launcher_flags
from cnn.parallel.timing import AVERAGE, DISTRIBUTE, FETCH

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"lenet5": get_network("lenet5").num_params, "alexnet-small": get_network("alexnet-small").num_params,
          "ResNet-50 (for scale)": 25_557_032}
WORKERS = np.unique(np.round(np.logspace(np.log2(2), np.log2(1024), 60, base=2)).astype(int))


def measure(ranks: int, repeats: int) -> dict:
    """Run cnn.parallel.costmodel on ``ranks`` processes; its JSON."""
    mpiexec = find_mpiexec()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "costmodel.json"
        argv = [mpiexec, *launcher_flags(mpiexec, ranks, fault_tolerant=False), "-n", str(ranks), sys.executable,
                "-m", "mpi4py", "-m", "cnn.parallel.costmodel", "--out", str(out), "--repeats", str(repeats)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=environment())
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        print(done.stdout.strip(), flush=True)
        return json.loads(out.read_text())


def measured_in_training(path: Path) -> dict:
    """Communication per step of rank 0 in the 4-rank runs: parameter server and the two allreduces."""
    if not path.exists():
        return {}
    runs = {summary["run"]: summary for summary in json.loads(path.read_text())}
    found = {}
    used = [runs[name] for name in ("ps-sync", "allreduce-ring", "allreduce-mpi") if name in runs]
    machines = {(r.get("machine") or {}).get("cpu", "?") + f", {(r.get('machine') or {}).get('cores', '?')} cores"
                for r in used}
    found["machine"] = "; ".join(sorted(machines))      # where those runs were measured: said in the row
    if "ps-sync" in runs:
        b = runs["ps-sync"]["breakdown_s"]
        found["ps"] = {"ranks": runs["ps-sync"]["ranks"], "seconds": b.get(FETCH, 0) + b.get(DISTRIBUTE, 0)}
    for name, key in (("allreduce-ring", "ring"), ("allreduce-mpi", "mpi-allreduce")):
        if name in runs:
            found[key] = {"ranks": runs[name]["ranks"], "seconds": runs[name]["breakdown_s"].get(AVERAGE, 0)}
    return found


def model_table(alpha: float, beta: float) -> dict:
    table = {}
    for name, params in MODELS.items():
        nbytes = params * costmodel.FLOAT_BYTES
        table[name] = {"num_params": params, "workers": WORKERS.tolist(),
                       "ps_seconds": costmodel.ps_seconds(WORKERS, nbytes, alpha, beta).tolist(),
                       "ring_seconds": costmodel.ring_seconds(WORKERS, nbytes, alpha, beta).tolist(),
                       "ps_link_bytes": costmodel.ps_link_bytes(WORKERS, nbytes).tolist(),
                       "ring_link_bytes": costmodel.ring_link_bytes(WORKERS, nbytes).tolist()}
    return table


def comparison(alpha: float, beta: float, measurements: dict, training: dict) -> list[dict]:
    """Model against measurement at 2–4 ranks, for LeNet-5 (what the training runs use)."""
    rows, nbytes = [], MODELS["lenet5"] * costmodel.FLOAT_BYTES
    for ranks, measured in sorted(measurements.items()):
        exchange = measured["exchanges"]["lenet5"]
        rows.append({"ranks": ranks, "source": "isolated exchange",
                     "ps_model": float(costmodel.ps_seconds(ranks, nbytes, alpha, beta)), "ps_measured": exchange["ps"],
                     "ring_model": float(costmodel.ring_seconds(ranks, nbytes, alpha, beta)),
                     "ring_measured": exchange["ring"], "mpi_allreduce_measured": exchange["mpi-allreduce"]})
    if len(training) > 1:
        ranks = next(value for key, value in training.items() if key != "machine")["ranks"]
        rows.append({"ranks": ranks, "source": f"4-rank training run on {training['machine']} (rank 0's phases)",
                     "ps_model": float(costmodel.ps_seconds(ranks, nbytes, alpha, beta)),
                     "ps_measured": training.get("ps", {}).get("seconds"),
                     "ring_model": float(costmodel.ring_seconds(ranks, nbytes, alpha, beta)),
                     "ring_measured": training.get("ring", {}).get("seconds"),
                     "mpi_allreduce_measured": training.get("mpi-allreduce", {}).get("seconds")})
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, links) = plt.subplots(1, 2, figsize=(12, 4.8))
    for (name, curves), color in zip(result["model"].items(), ("C0", "C1", "C2")):
        times.plot(curves["workers"], np.array(curves["ps_seconds"]) * 1e3, color=color, label=f"{name}: parameter server")
        times.plot(curves["workers"], np.array(curves["ring_seconds"]) * 1e3, color=color, linestyle="--",
                   label=f"{name}: ring allreduce")
        links.plot(curves["workers"], np.array(curves["ps_link_bytes"]) / 1e6, color=color, label=f"{name}: server link")
        links.plot(curves["workers"], np.array(curves["ring_link_bytes"]) / 1e6, color=color, linestyle="--",
                   label=f"{name}: ring link")
    for row in result["comparison"]:
        marker = "o" if row["source"] == "isolated exchange" else "*"
        for key, color in (("ps_measured", "C0"), ("ring_measured", "C0")):
            if row[key]:
                times.plot(row["ranks"], row[key] * 1e3, marker=marker, color=color, markersize=9,
                           markerfacecolor="none" if key == "ring_measured" else color, linestyle="none")
    times.plot([], [], "ko", label="measured, LeNet-5 (● server, ○ ring): isolated")
    times.plot([], [], "k*", label="measured in the 4-rank training runs")
    mpi = result["alpha_beta"]
    times.set_title(f"time per step: α = {mpi['alpha'] * 1e6:.1f} µs, 1/β = {1 / mpi['beta'] / 1e9:.2f} GB/s (measured)")
    for axis, label in ((times, "communication per step (ms)"), (links, "bytes on the busiest link per step (MB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("workers P")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.25)
    times.legend(fontsize=7)
    links.legend(fontsize=7)
    links.set_title("2(P−1)·N through the server, 2(P−1)/P·N per ring link")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3,4", help="ranks to measure at (the model is checked at each)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3, help="jobs per rank count (taking turns), for min–median–max")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    out = RESULTS / "parallel_cost_model.json"
    if args.plot_only:
        result = json.loads(out.read_text())
    else:
        from cnn.machine import machine_info
        from cnn.parallel.launch import usable_cores

        ranks = [int(r) for r in args.ranks.split(",")]
        print(f"{usable_cores()} cores; measuring at {', '.join(map(str, ranks))} ranks"
              + (" (oversubscribed above the core count)" if max(ranks) > usable_cores() else ""), flush=True)
        training = measured_in_training(RESULTS / "parallel_strategies.json")
        runs = []
        for run in range(args.runs):                      # the rank counts take turns
            measurements = {r: measure(r, args.repeats) for r in ranks}
            first = measurements[min(measurements)]
            alpha, beta = first["pingpong"]["alpha"], first["pingpong"]["beta"]
            runs.append({"alpha": alpha, "beta": beta, "measurements": measurements,
                         "comparison": comparison(alpha, beta, measurements, training)})
        # the model is drawn with the median run's α and β; every run's ratios go into the table
        middle = sorted(runs, key=lambda run: run["alpha"])[len(runs) // 2]
        alpha, beta = middle["alpha"], middle["beta"]
        result = {"alpha_beta": {"alpha": alpha, "beta": beta, "from_ranks": min(ranks),
                                 "alphas": [run["alpha"] for run in runs], "betas": [run["beta"] for run in runs]},
                  "cores": usable_cores(), "machine": machine_info(), "runs": len(runs),
                  "measurements": {str(r): m for r, m in middle["measurements"].items()},
                  "waits": {str(r): m["waits"] for r, m in middle["measurements"].items()},
                  "comparison": middle["comparison"], "comparison_runs": [run["comparison"] for run in runs],
                  "model": model_table(alpha, beta)}
        RESULTS.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "parallel_cost_model.png")
    from cnn.parallel.report import cost_table, wait_table

    print(cost_table(result))
    print()
    print(wait_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
