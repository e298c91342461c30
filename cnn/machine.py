"""Facts about the machine a result came from, recorded in every results file."""

from __future__ import annotations

import os
import platform
import socket
import sys
from importlib import metadata


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
