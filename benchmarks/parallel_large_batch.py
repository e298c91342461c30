"""Large batches (seed 003, Goyal et al. 2017): final accuracy against the global batch, with and
without the linear scaling rule and gradual warmup.

    CNN_DATA_DIR=/work/shared/data python benchmarks/parallel_large_batch.py

``allreduce`` on 4 ranks, Xavier initialisation, the first 30 000 training images; the global batch
B = 4 × per-worker batch grows from 32 to 2048 at a fixed number of epochs (so a larger batch means
fewer steps). Three learning-rate rules, with k = B / 32 and a base rate η for batch 32:

- ``no scaling``: η whatever the batch                               (--schedule constant)
- ``linear scaling``: k·η from the first step                         (--schedule warmup --warmup-epochs 0)
- ``linear scaling + warmup``: from η up to k·η over the first half epoch, batch by batch

and two base rates, 0.02 (the default of ``cnn train``) and 0.005: the rule can only work while k·η
stays below the largest rate the network trains at, and LeNet-5 without batch normalisation
reaches that limit long before ResNet-50 did in Goyal et al.

``--seeds 0,1,2`` runs every point once per seed (the initial weights and the order of the images
differ): the plot shows each point's median with its min–max as a bar, and the tables in
docs/distributed.md quote min–median–max; with one seed a point is one run, and says so.

Writes benchmarks/results/parallel_large_batch.json (one record per run). A partial sweep — other
``--base-lrs``, ``--per-worker-batches`` or ``--seeds`` — *merges* into it: its records replace
those of the same point (base rate, batch, rule, seed, epochs, images) and every other point is
kept. Then benchmarks/results/parallel_large_batch.png (final test accuracy against B, one line per
rule, one panel per base rate).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cnn.parallel.launch import launch

RESULTS = Path(__file__).resolve().parent / "results"
RANKS, BASE_BATCH = 4, 32
RULES = {
    "no scaling": lambda k: {"schedule": "constant"},
    "linear scaling": lambda k: {"schedule": "warmup", "lr_scale": k, "warmup_epochs": 0},
    "linear scaling + warmup": lambda k: {"schedule": "warmup", "lr_scale": k, "warmup_epochs": 0.5},
}


def sweep(base_lr: float, per_worker_batches, epochs: int, limit_train: int | None, seed: int = 0) -> list[dict]:
    records = []
    for per_worker in per_worker_batches:
        global_batch = RANKS * per_worker
        k = global_batch / BASE_BATCH
        for rule, settings in RULES.items():
            started = time.time()
            done = launch("allreduce", RANKS, timeout=3600, epochs=epochs, batch_size=per_worker, lr=base_lr, init="xavier",
                          limit_train=limit_train, progress=False, checkpoint=str(RESULTS / "large-batch.npz"),
                          seed=seed, **settings(k))
            summary = done.summary or {}
            record = {"base_lr": base_lr, "global_batch": global_batch, "per_worker_batch": per_worker, "rule": rule,
                      "seed": seed, "epochs": epochs, "limit_train": limit_train,
                      "k": k, "final_lr": base_lr * (k if rule != "no scaling" else 1),
                      "status": summary.get("status", f"exit {done.returncode}"),
                      "final_test_accuracy": summary.get("final_test_accuracy"),
                      "epoch_accuracy": [e["test_accuracy"] for e in summary.get("history", {}).get("epochs", [])],
                      "steps": summary.get("steps"), "train_wall_seconds": summary.get("train_wall_seconds")}
            records.append(record)
            print(f"η={base_lr:g} B={global_batch:5d} {rule:<24} {record['status']:<10} accuracy {record['final_test_accuracy']} "
                  f"({time.time() - started:.0f} s)", flush=True)
    (RESULTS / "large-batch.npz").unlink(missing_ok=True)
    return records


def plot(records: list[dict], path: Path, epochs: int, limit_train: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import numpy as np

    records = [r for r in records if r.get("epochs", epochs) == epochs and r.get("limit_train", limit_train) == limit_train]
    base_lrs = sorted({r["base_lr"] for r in records}, reverse=True)
    figure, axes = plt.subplots(1, len(base_lrs), figsize=(6.5 * len(base_lrs), 4.5), sharey=True, squeeze=False)
    for axis, base_lr in zip(axes[0], base_lrs):
        for rule in RULES:
            points = {}
            for r in records:
                if r["rule"] == rule and r["base_lr"] == base_lr:
                    points.setdefault(r["global_batch"], []).append(100 * (r["final_test_accuracy"] or 0.0))
            batches = sorted(points)
            median = [float(np.median(points[b])) for b in batches]
            low = [m - min(points[b]) for m, b in zip(median, batches)]
            high = [max(points[b]) - m for m, b in zip(median, batches)]
            axis.errorbar(batches, median, yerr=[low, high], marker="o", capsize=3,
                          label=f"{rule} ({min(len(v) for v in points.values())} run(s) a point)" if points else rule)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("global batch B (4 workers × per-worker batch)")
        axis.set_title(f"base rate η = {base_lr:g} at B = {BASE_BATCH}; scaled: η·B/{BASE_BATCH}")
        axis.grid(True, alpha=0.3)
        axis.legend()
    axes[0][0].set_ylabel(f"test accuracy after {epochs} epochs of {limit_train} images (%)")
    figure.suptitle("LeNet-5, MNIST, allreduce on 4 ranks (11 %: collapsed to one class)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def point_key(record: dict, args) -> tuple:
    """What makes two records the same point of the sweep (a record from before seeds were kept: seed 0)."""
    return (record["base_lr"], record["global_batch"], record["rule"], record.get("seed", 0),
            record.get("epochs", args.epochs), record.get("limit_train", args.limit_train))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-lrs", default="0.02,0.005")
    parser.add_argument("--per-worker-batches", default="8,32,128,512")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--limit-train", type=int, default=30000)
    parser.add_argument("--seeds", default="0", help="one run per seed and point: 0,1,2 for a spread")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON")
    args = parser.parse_args(argv)
    out = RESULTS / "parallel_large_batch.json"
    result = json.loads(out.read_text()) if out.exists() else {"runs": []}
    if not args.plot_only:
        base_lrs = [float(lr) for lr in args.base_lrs.split(",")]
        batches = [int(b) for b in args.per_worker_batches.split(",")]
        new = [record for seed in (int(s) for s in args.seeds.split(",")) for lr in base_lrs
               for record in sweep(lr, batches, args.epochs, args.limit_train, seed)]
        done = {point_key(r, args) for r in new}
        runs = [r for r in result["runs"] if point_key(r, args) not in done] + new
        result = {"ranks": RANKS, "base_batch": BASE_BATCH, "epochs": args.epochs, "limit_train": args.limit_train,
                  "runs": runs}
        RESULTS.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    plot(result["runs"], RESULTS / "parallel_large_batch.png", result["epochs"], result["limit_train"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
