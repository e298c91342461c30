"""The results files: what every one of them starts with, their names, writing and reading them.

Every file ``python -m cnn bench`` writes (``results/KIND-MACHINE-DEVICE-DATE.json``, or
``benchmarks/results/`` when told ``--out-dir benchmarks/results``; a
benchmark's or an ablation's KIND carries its workload, ``bench-lenet5-b64``) starts with the same
header, ``results_header(kind)``::

    {"schema": "cnn-bench/1", "kind": "stages" | "op" | "memory" | "ablation" | "ring-timeline",
     "created": ISO time, "command": "python -m cnn bench ...",
     "commit": the repository's commit, "+" when files differed from it (null outside a git checkout),
     "machine": {host, cpu, cores, platform, python, packages{...}, gpu{name, ...} or null,
                 load_average: [1, 5, 15 min] as the measurement began},
     ...}

and the rest of each kind is described where it is measured (``step_timing``, ``ops``,
``transfers``, ``ablation``, ``timeline``).

Two runs of one day on one machine are told apart by a tag after the date, the commit they
measured: ``bench-lenet5-b64-…-nvidia-h100-80gb-hbm3-2026-11-23-f5350bb.json`` is the first H100
session, the same name without a tag the second (``run_tag``). ``shown_results`` picks the files
README shows.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import sys
from pathlib import Path

from cnn.bench.measure import simulator_on

SCHEMA = "cnn-bench/1"
#: The committed results, which README and docs/ quote: written only when a command is told ``--out-dir benchmarks/results``
RESULTS_DIR = Path("benchmarks/results")
#: Where a command's results files and plots go unless told otherwise (git-ignored: a user's run never lands in a commit)
USER_RESULTS_DIR = Path("results")


def results_header(kind: str) -> dict:
    """The first keys of every results file: schema, kind, when, the command that wrote it, the machine."""
    return {"schema": SCHEMA, "kind": kind, "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": command_line(), "commit": git_commit(), "machine": machine_record()}


def git_commit() -> str | None:
    """The short commit of the checkout this runs from, with "+" when tracked files differ from it; None
    outside a git checkout (a results file then says only when it was made)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+" if changed else "") if commit else None


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
    record["load_average"] = load_average()
    return record


def load_average() -> list[float] | None:
    """The machine's load averages over 1, 5 and 15 minutes (None where the OS has none): taken as a measurement
    begins, it says how much other work shared the cores (``cnn.bench.recorded`` publishes only quiet runs)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def command_line() -> str:
    """The command that made a results file, as a reader would type it; from a notebook (whose kernel's own
    command, ``ipykernel_launcher -f kernel.json``, says nothing), the notebook's name where Jupyter tells it
    (``JPY_SESSION_NAME``: Jupyter's server and ``notebooks/execute.py`` set it), else "from a notebook"."""
    program = Path(sys.argv[0]).name
    if program.startswith("ipykernel"):
        notebook = os.environ.get("JPY_SESSION_NAME")
        return f"from the notebook {Path(notebook).name}" if notebook else "from a notebook"
    prefix = ["python -m cnn"] if program in ("__main__.py", "cnn") else [sys.argv[0]]
    return " ".join(prefix + [shlex.quote(arg) for arg in sys.argv[1:]])


def slug(text: str) -> str:
    """'Intel(R) Xeon(R) CPU @ 2.2GHz' -> 'intel-xeon-cpu-2-2ghz'."""
    text = re.sub(r"\((r|tm)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:48] or "unknown"


def workload(model: str, batch_size: int) -> str:
    """``MODEL-bBATCH``, the part of a results file's name that keeps two workloads of one day apart."""
    return f"{model}-b{batch_size}"


def results_stem(kind: str, machine: dict, created: str) -> str:
    """``KIND-MACHINE-DEVICE-DATE``: e.g. bench-lenet5-b64-intel-xeon-processor-cpu-2025-11-22
    (a benchmark's kind carries its ``workload``)."""
    device = slug(machine["gpu"]["name"]) if machine.get("gpu") else "cpu"
    return f"{kind}-{slug(machine['cpu'])}-{device}-{created[:10]}"


def write_json(path: Path, result: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def write_results(out_dir, prefix: str, result: dict) -> Path:
    """``result`` as ``out_dir/PREFIX-MACHINE-DEVICE-DATE.json``; the path."""
    return write_json(Path(out_dir) / f"{results_stem(prefix, result['machine'], result['created'])}.json", result)


def load_results(path) -> dict:
    """A results file written by ``python -m cnn bench``; a wrong file is one ValueError line naming it."""
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


def run_tag(path) -> str:
    """The tag after the date in a results file's name ('f5350bb'), or '' when it has none (files written
    since carry their commit inside, ``"commit"``)."""
    found = re.search(r"-\d{4}-\d{2}-\d{2}-([0-9a-f]{7,40})\.(json|csv|log)$", Path(path).name)
    return found.group(1) if found else ""


def bench_results(out_dir) -> list[tuple[Path, dict]]:
    """Every readable bench (``kind: stages``) results file in ``out_dir``, oldest first."""
    found = []
    for path in sorted(Path(out_dir).glob("bench-*.json")):
        try:
            result = load_results(path)
        except ValueError:
            continue
        if result.get("kind") == "stages":
            found.append((path, result))
    return sorted(found, key=lambda item: item[1]["created"])


def result_group(result: dict) -> str:
    """What two results must share to be runs of the same measurement: machine, device and workload."""
    config = result.get("config", {})
    return results_stem(f"bench-{workload(config.get('model'), config.get('batch_size'))}", result["machine"], "")


def row_names(result: dict) -> set[str]:
    return {row["name"] for row in result["stages"] + result["references"]}


def shown_results(out_dir, runs=None) -> list[Path]:
    """The bench files README shows: for each machine, device and workload the newest run, and every
    older run that measured a stage or reference no newer run did (the first H100 session timed
    stages 2-7, the second only stages 6-7 after new fixes: both are shown).

    ``runs``: the (path, result) pairs to choose among, oldest first (default: every bench file of ``out_dir``).
    ``cnn.bench.readme.published_results`` passes the quiet ones only, so that a newer run measured on a busy
    machine, which is not published, never hides an older quiet run of the same rows.

    In order: machines without a GPU first, then by network (as ``cnn.model.NETWORKS`` lists them) and
    batch size, each group oldest first.
    """
    from cnn.model import NETWORKS

    def order(runs):
        machine, config = runs[0][1]["machine"], runs[0][1]["config"]
        networks = list(NETWORKS)
        return (bool(machine.get("gpu")), networks.index(config["model"]) if config["model"] in networks
                else len(networks), config["batch_size"])

    groups: dict[str, list[tuple[Path, dict]]] = {}
    for path, result in bench_results(out_dir) if runs is None else runs:
        groups.setdefault(result_group(result), []).append((path, result))
    shown = []
    for runs in groups.values():
        newer: set[str] = set()
        kept = []
        for path, result in reversed(runs):                      # newest first
            if not kept or row_names(result) - newer:
                kept.append(path)
            newer |= row_names(result)
        shown.append((order(runs), kept[::-1]))
    return [path for _, paths in sorted(shown, key=lambda item: item[0]) for path in paths]


def newest_results(out_dir) -> list[Path]:
    """The newest bench results file of each machine/device and workload in ``out_dir``."""
    newest = {}
    for path in sorted(Path(out_dir).glob("bench-*.json")):
        try:
            result = load_results(path)
        except ValueError:
            continue
        config = result.get("config", {})
        key = results_stem(f"bench-{workload(config.get('model'), config.get('batch_size'))}", result["machine"], "")
        if key not in newest or result["created"] > newest[key][1]["created"]:
            newest[key] = (path, result)
    return [path for path, _ in sorted(newest.values(), key=lambda item: item[1]["created"])]
