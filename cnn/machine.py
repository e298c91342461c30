"""Facts about the machine a result came from, recorded in every results file."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import sys
from importlib import metadata
from pathlib import Path

SIMULATOR_VARIABLE = "NUMBA_ENABLE_CUDASIM"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions(names=("numpy", "numba", "numba-cuda", "matplotlib", "mpi4py", "torch")) -> dict:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def machine_info() -> dict:
    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": package_versions(),
    }


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def runnable_threads() -> int | None:
    """Threads ready to run on the whole machine at this instant, the caller included (Linux: the
    "running/total" field of /proc/loadavg); None where the system does not say."""
    try:
        with open("/proc/loadavg") as loadavg:
            return int(loadavg.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


#: a machine whose 1-minute load average, as a measurement began, was above this many a core was busy
#: with other work: its times are inflated (the pictures and the tables say so, and ``cnn.bench.recorded`` publishes none)
BUSY_LOAD_PER_CORE = 0.5


def busy_note(machine: dict) -> str | None:
    """'busy: load 23.0 on 2 cores, times inflated' when the recorded load says the machine was busy, else None."""
    load, cores = machine.get("load_average"), machine.get("cores")
    if load and cores and load[0] > BUSY_LOAD_PER_CORE * cores:
        return f"busy: 1-minute load {load[0]:.1f} on {cores} cores, times inflated"
    return None


def nvidia_gpu_present() -> bool:
    """An NVIDIA driver that lists a GPU (Linux: /proc/driver/nvidia/gpus; elsewhere: nvidia-smi on PATH).

    Asked without importing numba, so the answer can still decide whether to turn the simulator on.
    """
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return any(gpus.iterdir())
    return sys.platform != "linux" and shutil.which("nvidia-smi") is not None


def use_cuda_simulator_unless_gpu() -> bool:
    """Turn Numba's CUDA simulator on when no GPU is present; True when it is on.

    A value of NUMBA_ENABLE_CUDASIM the user set is kept. Numba reads the variable once, when it is
    first imported, so this must run before anything imports numba.
    """
    if SIMULATOR_VARIABLE not in os.environ and not nvidia_gpu_present():
        os.environ[SIMULATOR_VARIABLE] = "1"
    return os.environ.get(SIMULATOR_VARIABLE, "0") not in ("", "0")
