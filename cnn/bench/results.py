"""The results files: what every one of them starts with, their names, writing and reading them.

Every file ``python -m cnn bench`` writes (``benchmarks/results/KIND-MACHINE-DEVICE-DATE.json``)
starts with the same header, ``results_header(kind)``::

    {"schema": "cnn-bench/1", "kind": "stages" | "op" | "memory" | "ablation" | "ring-timeline",
     "created": ISO time, "command": "python -m cnn bench ...",
     "machine": {host, cpu, cores, platform, python, packages{...}, gpu{name, ...} or null, load_average},
     ...}

and the rest of each kind is described where it is measured (``step_timing``, ``ops``,
``transfers``, ``ablation``, ``timeline``).
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
RESULTS_DIR = Path("benchmarks/results")


def results_header(kind: str) -> dict:
    """The first keys of every results file: schema, kind, when, the command that wrote it, the machine."""
    return {"schema": SCHEMA, "kind": kind, "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": command_line(), "machine": machine_record()}


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
    record["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return record


def command_line() -> str:
    program = Path(sys.argv[0]).name
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
