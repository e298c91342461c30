"""The committed H100 measurements, each beside the prediction for the kernels that were measured.

Every measurement of a stage 4-7 training step in ``benchmarks/results`` becomes a *point*:

    bench-*        step_ms (phase by phase) and back_to_back_ms of every CUDA stage row
    ablation-*     each row: cuda-tuned with those fixes, steps back to back (as one CUDA graph with cuda-graph)
    ncu-*.csv      each kernel launch of a cuda-tuned step: Nsight Compute's gpu__time_duration
    probes-*.json  cuda-tuned (4 fixes) launched kernel by kernel, and as one CUDA graph

and is predicted from the static report of the kernels that were measured. Those of stages 4-6 and of
stage 7's first seven fixes are the same code today as in both sessions (``git diff f5350bb --
kernels/`` touches only the tiled products, the device epoch and the gather), so this checkout's report
stands for them; a measurement with ``tiled-conv`` is predicted from the report of commit
``SECOND_SESSION`` (``static_report.tree_at``), the kernels it measured — the second session's files
carry no commit, and Nsight Compute's grid sizes in its profiles are exactly the tiles that commit
chooses (its parent's differ). The first session's ``cuda-tuned`` is the first seven fixes
(``FIRST_SESSION_FIXES``: all it had). ``calibrate()`` fits
``predict_step.CALIBRATED`` to the points (least squares on log(predicted / measured), each
measured step weighing as much as all of one profile's kernels); ``points()`` states every error.

Reports are kept in ``results/static-sm90/reports/`` (git-ignored); the first run records and
compiles a few hundred kernels of three commits (minutes), later runs read them.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path

from cnn.bench import predict_step, recorded
from cnn.bench.nsight import read_launches
from cnn.bench.results import RESULTS_DIR, bench_results, run_tag
from cnn.bench.static_report import CACHE_DIR, ROOT, static_report, tree_at, tree_digest

SECOND_SESSION = "ecf7081"
REPORTS = CACHE_DIR / "reports"
PROBE_FIXES = "fused-loss,fewer-launches,smem-weights,launch-config"


FIRST_SESSION_FIXES = "resident-data,pinned-buffers,overlap-copies,fused-loss,fewer-launches,smem-weights,launch-config"


def measured_at(path, fixes: str | None, recorded_commit: str | None = None) -> str | None:
    """The commit whose kernels a measurement is predicted from (None: this checkout's). A file that names
    its commit (every file written since the second session) is predicted from that commit's kernels;
    the two sessions' files from this checkout's, unless the second session's ran tiled-conv."""
    if recorded_commit:
        commit = recorded_commit.rstrip("+")
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return None if head.stdout.strip().startswith(commit) or commit.startswith(head.stdout.strip() or "-") \
            else commit
    second = not run_tag(path)
    tiled = fixes is None or "tiled-conv" in fixes
    return SECOND_SESSION if second and tiled else None


def report_for(stage: str, model: str, batch: int, fixes: str | None, commit: str | None) -> dict:
    """The static report of ``stage`` (with ``fixes``) at ``commit`` (None: this checkout), kept on disk."""
    key = hashlib.sha256(json.dumps([stage, model, batch, fixes, commit]).encode()).hexdigest()[:20]
    path = REPORTS / f"{key}.json"
    tree = tree_at(commit) if commit else ROOT
    if path.exists():
        kept = json.loads(path.read_text())
        if commit is not None or kept.get("digest") == tree_digest(tree, kept.get("kernel_modules") or ["-"]):
            return kept                                   # (an older commit's kernels never change)
    report = static_report(stage, model, batch, fixes, tree)
    REPORTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report, "digest": tree_digest(tree, report.get("kernel_modules"))}))
    return report


def step_points(out_dir=RESULTS_DIR) -> list[dict]:
    """The bench and ablation steps: {"label", "model", "batch", "stage", "fixes", "commit", "mode", "graph",
    "measured_ms", "file", "kind"}."""
    found = []
    for path, result in bench_results(out_dir):
        if not result["machine"].get("gpu"):
            continue
        model, batch = result["config"]["model"], result["config"]["batch_size"]
        for row in result["stages"]:
            if not str(row["name"]).startswith("cuda"):
                continue
            fixes = FIRST_SESSION_FIXES if row["name"] == "cuda-tuned" and run_tag(path) else None
            base = {"model": model, "batch": batch, "stage": row["name"], "fixes": fixes,
                    "commit": measured_at(path, fixes, result.get("commit")) if row["name"] == "cuda-tuned"
                    else measured_at(path, "", result.get("commit")),
                    "file": path.name, "kind": "bench"}
            found.append({**base, "label": f"{row['name']}, phase by phase", "mode": "phase_by_phase", "graph": False,
                          "measured_ms": row["step_ms"]["median"]})
            if row.get("back_to_back_ms"):
                graph = row["name"] == "cuda-tuned" and row.get("launches_per_step") == 1
                found.append({**base, "label": f"{row['name']}, back to back", "mode": "back_to_back",
                              "graph": graph, "measured_ms": row["back_to_back_ms"]["median"]})
    for path, result in recorded.ablations(out_dir):
        for row in result["rows"]:
            fixes = ",".join(row["fixes"]) or "none"
            found.append({"model": result["model"], "batch": result["batch_size"], "stage": "cuda-tuned",
                          "fixes": fixes, "commit": measured_at(path, fixes, result.get("commit")), "file": path.name,
                          "kind": "ablation",
                          "label": f"ablation: {row['variant']}", "mode": "back_to_back",
                          "graph": "cuda-graph" in row["fixes"], "measured_ms": row["median_ms"]})
    return found


def predict_point(point: dict, constants: dict, copies: dict) -> float:
    report = report_for(point["stage"], point["model"], point["batch"], point["fixes"], point["commit"])
    if point["mode"] == "phase_by_phase":
        return sum(predict_step.phase_by_phase_ms(report, constants, copies).values())
    return predict_step.back_to_back_ms(report, constants, copies, point["graph"])


def kernel_points(out_dir=RESULTS_DIR) -> list[dict]:
    """Each profiled kernel launch matched, in order, to the launch the report records (phase by phase)."""
    found = []
    for profile in recorded.ncu_profiles(out_dir):
        fixes = FIRST_SESSION_FIXES if run_tag(profile["path"]) else None
        commit = measured_at(profile["path"], fixes)
        report = report_for("cuda-tuned", profile["model"], profile["batch"], fixes, commit)
        ops = [op for op in report["phase_by_phase"] if "copy" not in op]
        launches = read_launches(profile["path"])
        step = [launch for launch in launches][:len(ops)]
        for op, launch in zip(ops, step):
            kernel = report["kernels"][op["kernel"]]
            if kernel["function"] != launch["kernel"]:
                continue
            found.append({"model": profile["model"], "batch": profile["batch"], "commit": commit,
                          "file": profile["path"].name, "kernel": kernel["function"], "report": report, "op": op,
                          "measured_us": launch["time_ns"] / 1e3})
    return found


def errors(constants: dict, steps: list[dict], kernels: list[dict], copies: dict) -> tuple[list, list]:
    step_errors = [math.log(predict_point(p, constants, copies) / p["measured_ms"]) for p in steps]
    kernel_errors = [math.log(predict_step.kernel_us(p["report"]["kernels"][p["op"]["kernel"]], p["op"], constants)["us"]
                              / p["measured_us"]) for p in kernels]
    return step_errors, kernel_errors


def loss(constants: dict, steps, kernels, copies) -> float:
    """Mean squared log error: the steps, and the kernels (all of them together weigh as much as 4 steps)."""
    step_errors, kernel_errors = errors(constants, steps, kernels, copies)
    kernel_weight = 4 / max(1, len(kernel_errors))
    return (sum(e * e for e in step_errors) + kernel_weight * sum(e * e for e in kernel_errors)) / (len(step_errors) + 4)


def calibrate(start: dict | None = None, rounds: int = 6, progress=print) -> dict:
    """``CALIBRATED`` fitted by coordinate search in log space (each constant ×/÷ a shrinking factor)."""
    steps, kernels, copies = step_points(), kernel_points(), predict_step.measured_copies()
    constants = dict(start or predict_step.CALIBRATED)
    best = loss(constants, steps, kernels, copies)
    factor = 2.0
    for _ in range(rounds):
        for name in constants:
            for scale in (factor, 1 / factor):
                trial = {**constants, name: constants[name] * scale}
                value = loss(trial, steps, kernels, copies)
                while value < best:
                    constants, best = trial, value
                    trial = {**constants, name: constants[name] * scale}
                    value = loss(trial, steps, kernels, copies)
        factor = math.sqrt(factor)
        if progress:
            progress(f"loss {best:.4f}: " + ", ".join(f"{k} {v:.3g}" for k, v in constants.items()))
    return constants
