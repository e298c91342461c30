"""The committed measurements in ``benchmarks/results/``, found by what they hold.

README, docs/profiling.md, the stage docstrings and the notebooks quote GPU figures only through
these readers, never typed by hand. A reader asks for the newest file that holds what it needs —
"the newest GPU benchmark of LeNet-5 at batch 64 that timed stages ``cuda`` and ``numba-cpu``" —
so a later run that measures the same thing replaces the figures everywhere at the next
``python -m cnn bench --update-readme`` / ``--update-docs``, and a run that measured something
else (the second H100 session timed only stages 6-7) leaves the older figures in place.

Files (``cnn.bench.results``): ``bench-*`` and ``ablation-*`` (results JSON), ``memory-*`` (copies),
``ncu-*.csv`` (Nsight Compute, ``cnn.bench.nsight``), ``train-*`` (``python -m cnn train`` histories),
``probes-*.json`` (figures of small programs outside the repository, each with how it was measured).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cnn.bench.results import RESULTS_DIR, bench_results, load_results, run_tag


def row(result: dict, name: str) -> dict | None:
    """The stage or reference row called ``name`` in a bench result, or None."""
    return next((r for r in result["stages"] + result["references"] if r["name"] == name), None)


def bench_with(model: str, batch: int, needs: dict, out_dir=RESULTS_DIR, gpu: bool = True):
    """(path, result) of the newest bench file of ``model`` at ``batch`` (on a GPU, or not) in which every
    row named in ``needs`` exists and has the keys listed for it, e.g. {"cuda-tuned": ["back_to_back_ms"]};
    None when no file does."""
    found = None
    for path, result in bench_results(out_dir):
        config = result["config"]
        if (config["model"], config["batch_size"], bool(result["machine"].get("gpu"))) != (model, batch, gpu):
            continue
        rows = {name: row(result, name) for name in needs}
        if all(rows[name] is not None and all(rows[name].get(key) for key in keys) for name, keys in needs.items()):
            found = (path, result)             # files come oldest first: the last match is the newest
    return found


def _json_files(out_dir, pattern: str) -> list[tuple[Path, dict]]:
    found = []
    for path in Path(out_dir).glob(pattern):
        try:
            found.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(found, key=lambda item: str(item[1].get("created", "")))


def ablation_with(model: str, batch: int, variant: str, out_dir=RESULTS_DIR):
    """(path, result) of the newest ablation of ``model`` at ``batch`` that has a row ``variant``, or None."""
    found = None
    for path, result in _json_files(out_dir, "ablation-*.json"):
        if (result.get("model"), result.get("batch_size")) == (model, batch) and \
                any(r["variant"] == variant for r in result["rows"]):
            found = (path, load_results(path))
    return found


def ablation_row(result: dict, variant: str) -> dict:
    return next(r for r in result["rows"] if r["variant"] == variant)


def ablations(out_dir=RESULTS_DIR) -> list[tuple[Path, dict]]:
    """Every ablation file, oldest first."""
    return _json_files(out_dir, "ablation-*.json")


def ncu_profiles(out_dir=RESULTS_DIR) -> list[dict]:
    """Every Nsight Compute CSV: {"path", "stage", "model", "batch", "device", "date", "tag"}, oldest first.

    Names: ``ncu-STAGE-MODEL-bBATCH-DEVICE-DATE[-TAG].csv``; the stage is one of the registry's names.
    Of one day's profiles, a tagged one is the older (see ``training_runs``); then by network, as
    ``cnn.model.NETWORKS`` lists them.
    """
    from cnn.model import NETWORKS
    from cnn.stages import stage_names

    found = []
    for path in Path(out_dir).glob("ncu-*.csv"):
        stage = next((name for name in sorted(stage_names(), key=len, reverse=True)
                      if path.name.startswith(f"ncu-{name}-")), None)
        rest = path.name[len(f"ncu-{stage}-"):] if stage else ""
        model = next((name for name in NETWORKS if rest.startswith(f"{name}-b")), None)
        parsed = re.match(r"b(\d+)-(.+)-(\d{4}-\d{2}-\d{2})", rest[len(f"{model}-"):]) if model else None
        if parsed:
            found.append({"path": path, "stage": stage, "model": model, "batch": int(parsed.group(1)),
                          "device": parsed.group(2), "date": parsed.group(3), "tag": run_tag(path)})
    networks = list(NETWORKS)
    return sorted(found, key=lambda item: (item["date"], item["tag"] == "", networks.index(item["model"]),
                                           item["batch"]))


def probes(out_dir=RESULTS_DIR) -> tuple[Path, dict] | None:
    """(path, content) of the newest probes file, or None."""
    found = _json_files(out_dir, "probes-*.json")
    return found[-1] if found else None


def probe(name: str, out_dir=RESULTS_DIR) -> float:
    """The value of one probe figure (its unit is in the file)."""
    recorded = probes(out_dir)
    if recorded is None or name not in recorded[1]["figures"]:
        raise ValueError(f"no probe figure {name!r} in {out_dir}/probes-*.json")
    return recorded[1]["figures"][name]["value"]


def memory_result(out_dir=RESULTS_DIR, gpu: bool = True):
    """(path, result) of the newest copy measurement on a GPU (or without one), or None."""
    found = [(path, result) for path, result in _json_files(out_dir, "memory-*.json")
             if bool((result.get("machine") or {}).get("gpu")) == gpu]
    return found[-1] if found else None


def copy_point(result: dict, curve: str, nbytes: int) -> dict:
    """The point of ``curve`` ("H→D pinned", …) at ``nbytes``: {"bytes", "latency_ms": stats, "gb_per_s"}."""
    return next(point for point in result["curves"][curve] if point["bytes"] == nbytes)


def training_runs(stage: str, out_dir=RESULTS_DIR) -> list[tuple[Path, dict]]:
    """(path, history) of every ``python -m cnn train`` history of ``stage`` on a GPU (``nvidia`` in its
    name), oldest first. Histories carry no creation time: the date in the name orders them, and of one
    day's runs a tagged one is the older (``cnn.bench.results``: the tag keeps it beside a newer run)."""
    found = []
    for path, history in _json_files(out_dir, f"train-*-{stage}-*.json"):
        date = re.search(r"\d{4}-\d{2}-\d{2}", path.name)
        if date and "nvidia" in path.name and history.get("config", {}).get("stage") == stage:
            found.append(((date.group(0), run_tag(path) == "", path.name), path, history))
    return [(path, history) for _, path, history in sorted(found, key=lambda item: item[0])]


def training_run(stage: str, out_dir=RESULTS_DIR):
    """(path, history) of the newest GPU training history of ``stage``, or None."""
    found = training_runs(stage, out_dir)
    return found[-1] if found else None


def when(path, result: dict) -> str:
    """'NVIDIA H100 80GB HBM3, 2026-11-23 03:04' and the commit when the name carries one."""
    gpu = (result.get("machine") or {}).get("gpu")
    device = gpu["name"] if gpu else f"{result['machine']['cpu']} (no GPU)"
    created = str(result.get("created", ""))
    commit = run_tag(path) or result.get("commit")
    return f"{device}, {created[:10]} {created[11:16]}".rstrip() + (f", commit {commit}" if commit else "")
