"""The committed measurements in ``benchmarks/results/``, found by what they hold.

README, docs/profiling.md, the stage docstrings and the notebooks quote GPU figures only through
these readers, never typed by hand. A reader asks for the newest file that holds what it needs —
"the newest GPU benchmark of LeNet-5 at batch 64 that timed stages ``cuda`` and ``numba-cpu``" —
so a later run that measures the same thing replaces the figures everywhere at the next
``python -m cnn bench --update-readme`` / ``--update-docs``, and a run that measured something
else (the second H100 session timed only stages 6-7) leaves the older figures in place.

Files (``cnn.bench.results``): ``bench-*`` and ``ablation-*`` (results JSON), ``memory-*`` (copies),
``ncu-*.csv`` (Nsight Compute, ``cnn.bench.nsight``), ``train-*`` (``python -m cnn train`` histories),
``probes-*.json`` (figures of small programs outside the repository, each with how it was measured),
``predict-h100-sm90.json`` (step times PREDICTED for the H100, never a measurement: ``predictions``).

From the committed directory, ``PUBLISHED_DIR`` (what README, docs/ and the notebooks publish), only
files measured on a quiet machine are read (``not_quiet``; a directory of one's own, ``--out``, is
read whole, and each of its tables says when its machine was busy): a file that records its machine's
1-minute load average is published when that load was at most ``cnn.machine.BUSY_LOAD_PER_CORE`` a core
as the measurement began (the pictures say "busy" by the same rule); a file from a GPU machine that records no load (a training history, the probes,
an Nsight Compute profile) is published, because that machine is lent to one session at a time and its
host runs nothing else; any other file is not. ``publication(out_dir)`` says which files were left
out and why, and ``--update-readme``/``--update-docs`` print it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cnn.bench.results import RESULTS_DIR, bench_results, load_results, run_tag


#: the committed results: the directory whose busy-machine files are never published
PUBLISHED_DIR = Path(__file__).resolve().parents[2] / RESULTS_DIR
#: the PREDICTED H100 step of every CUDA stage (``python -m cnn bench --predict``, ``cnn.bench.predict_report``)
PREDICTION_FILE, PREDICTED_DEVICE = "predict-h100-sm90.json", "NVIDIA H100 80GB HBM3"
#: the files the generated pages read, by name
PUBLISHED_PATTERNS = ("bench-*.json", "ablation-*.json", "memory-*.json", "train-*.json", "probes-*.json",
                      "ncu-*.csv")


def quiet_only(out_dir) -> bool:
    """True for the committed results directory, whose files on a busy machine are left out."""
    return Path(out_dir).resolve() == PUBLISHED_DIR.resolve()


def not_quiet(path, content) -> str | None:
    """Why the measurements of results file ``path`` (its parsed ``content``, ``{}`` for a CSV) are not
    published, in words; None when they are: its machine was quiet, or it is a GPU machine's file
    that records no load (see the module's docstring)."""
    from cnn.machine import busy_note

    machine = (content.get("machine") if isinstance(content, dict) else None) or {}
    if machine.get("load_average") and machine.get("cores"):
        busy = busy_note(machine)
        return f"the machine was {busy}" if busy else None
    if machine.get("gpu") or "nvidia" in Path(path).name:
        return None
    return "records no load average, so whether its machine was quiet is unknown"


def publication(out_dir=RESULTS_DIR) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(the files the generated pages may quote, [(a file left out, why)]), each list by name."""
    published, skipped = [], []
    for path in sorted({path for pattern in PUBLISHED_PATTERNS for path in Path(out_dir).glob(pattern)}):
        content = {}
        if path.suffix == ".json":
            try:
                content = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                skipped.append((path, f"not readable JSON ({err})"))
                continue
        reason = not_quiet(path, content) if quiet_only(out_dir) else None
        if reason is None:
            published.append(path)
        else:
            skipped.append((path, reason))
    return published, skipped


def publication_lines(out_dir=RESULTS_DIR) -> list[str]:
    """One line per file left out of the generated pages, with the reason."""
    return [f"skipped {path.name}: {reason}" for path, reason in publication(out_dir)[1]]


def quiet_bench_results(out_dir=RESULTS_DIR) -> list[tuple[Path, dict]]:
    """``cnn.bench.results.bench_results``, less the files measured on a busy machine where that counts
    (``quiet_only``), oldest first."""
    strict = quiet_only(out_dir)
    return [(path, result) for path, result in bench_results(out_dir) if not strict or not_quiet(path, result) is None]


def row(result: dict, name: str) -> dict | None:
    """The stage or reference row called ``name`` in a bench result, or None."""
    return next((r for r in result["stages"] + result["references"] if r["name"] == name), None)


def bench_with(model: str, batch: int, needs: dict, out_dir=RESULTS_DIR, gpu: bool = True, device: str = ""):
    """(path, result) of the newest bench file of ``model`` at ``batch`` (on a GPU, or not; on the GPU named
    ``device`` if given) in which every row named in ``needs`` exists and has the keys listed for it, e.g.
    {"cuda-tuned": ["back_to_back_ms"]}; None when no file does."""
    found = None
    for path, result in quiet_bench_results(out_dir):
        config = result["config"]
        if (config["model"], config["batch_size"], bool(result["machine"].get("gpu"))) != (model, batch, gpu):
            continue
        if device and gpu_name(result) != device:
            continue
        rows = {name: row(result, name) for name in needs}
        if all(rows[name] is not None and all(rows[name].get(key) for key in keys) for name, keys in needs.items()):
            found = (path, result)             # files come oldest first: the last match is the newest
    return found


def gpu_name(result: dict) -> str:
    """The GPU a results file was measured on ('NVIDIA H200'), '' for a CPU-only machine."""
    return ((result.get("machine") or {}).get("gpu") or {}).get("name", "")


def _json_files(out_dir, pattern: str) -> list[tuple[Path, dict]]:
    found, strict = [], quiet_only(out_dir)
    for path in Path(out_dir).glob(pattern):
        try:
            content = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not strict or not_quiet(path, content) is None:
            found.append((path, content))
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
        if parsed and (not quiet_only(out_dir) or not_quiet(path, {}) is None):
            found.append({"path": path, "stage": stage, "model": model, "batch": int(parsed.group(1)),
                          "device": parsed.group(2), "date": parsed.group(3), "tag": run_tag(path)})
    networks = list(NETWORKS)
    return sorted(found, key=lambda item: (item["date"], item["tag"] == "", networks.index(item["model"]),
                                           item["batch"]))


def predict_vs_measured(out_dir=RESULTS_DIR) -> tuple[Path, dict] | None:
    """(path, content) of the newest ``predict-vs-measured-*.json`` (``--predict --vs-measured``), or None."""
    found = _json_files(out_dir, "predict-vs-measured-*.json")
    return found[-1] if found else None


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


def predictions(model: str, batch: int, out_dir=RESULTS_DIR) -> list[dict]:
    """The PREDICTED H100 step times of ``model`` at ``batch`` that no measurement stands for: from the prediction
    file (``python -m cnn bench --predict``, ``cnn.bench.predict_report``; its "predicted" → "stages"), every
    CUDA stage whose code as it is now the H100 has not run — none of the measurements the file was checked
    against (its "calibration" → "steps") timed the whole stage with this checkout's kernels. Stage 8 is such
    a stage until an H100 runs it (an H200 did); stage 7 too, after the kernels its last measurement ran were
    changed.

    A stage is predicted as training runs it: as one CUDA graph where it replays one, else back to back.
    [{"stage", "ms", "timing", "device", "date", "commit", "path"}]; none without the file. A prediction is a
    computation, not a timing: the load of the machine that made it does not matter (no ``not_quiet``)."""
    path = Path(out_dir) / PREDICTION_FILE
    try:
        content = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    workload = lambda entry: (entry.get("model"), entry.get("batch", entry.get("batch_size")))  # noqa: E731
    measured_now = {point["stage"] for point in content.get("calibration", {}).get("steps", [])
                    if point.get("kind") == "bench" and workload(point) == (model, batch)
                    and point.get("fixes") is None and point.get("commit") is None}
    found = []
    for row in content.get("predicted", {}).get("stages", []):
        if workload(row) != (model, batch) or row["stage"] in measured_now:
            continue
        graph = row.get("graph_ms")
        found.append({"stage": row["stage"], "ms": float(graph or row["back_to_back_ms"]),
                      "timing": "as one CUDA graph" if graph else "back to back",
                      "device": content.get("device", PREDICTED_DEVICE), "date": str(content.get("created", ""))[:10],
                      "commit": content.get("commit"), "path": path})
    return found


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


def epoch_seconds(history: dict) -> tuple[float, float]:
    """(seconds of training of the first epoch, which compiles every kernel; of each later epoch, on average)
    of a ``python -m cnn train`` history."""
    epochs = history["epochs"]
    first = epochs[0]["train_seconds"]
    return first, (epochs[-1]["train_seconds"] - first) / max(1, len(epochs) - 1)


def run_in_name(path) -> str:
    """The device, date and commit tag a GPU results file's name holds: 'nvidia-h200, 2026-11-28' for
    'train-lenet5-cuda-tuned-10ep-nvidia-h200-2026-11-28.json' (', commit f5350bb' where tagged)."""
    found = re.search(r"(nvidia-.+?)-(\d{4}-\d{2}-\d{2})", Path(path).name)
    tag = run_tag(path)
    return (f"{found.group(1)}, {found.group(2)}" if found else Path(path).stem) + (f", commit {tag}" if tag else "")


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
