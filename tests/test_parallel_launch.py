"""The launcher and the README: which MPI is installed and what it can do, the mpiexec flags a
laptop or a cluster needs, every README command run as printed, and the warning of a run that
learned nothing."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

from cnn.parallel import launch  # noqa: E402
from test_parallel import MPIEXEC, data_dir, run_parallel  # noqa: E402,F401

README = Path(__file__).resolve().parent.parent / "README.md"

# -- which MPI: version strings as each prints them (only Open MPI 5 is installed here) -------------

@pytest.mark.parametrize("text, flavour, version, recoverable", [
    ("mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/", "openmpi", (5, 0, 11), True),
    ("mpiexec (OpenRTE) 4.1.2\n\nReport bugs to http://www.open-mpi.org/community/help/", "openmpi", (4, 1, 2), False),
    ("mpirun (Open MPI) 4.1.6", "openmpi", (4, 1, 6), False),
    ("HYDRA build details:\n    Version:                                 4.2.0", "mpich", (4, 2, 0), True),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.9", "other", (2021, 9), False),
])
def test_the_mpi_version_and_whether_survivors_can_go_on(text, flavour, version, recoverable):
    mpi = launch.parse_mpi_version(text)
    assert (mpi.flavour, mpi.version) == (flavour, version)
    missing = launch.fault_tolerance_missing(mpi)
    assert (missing is None) == recoverable
    if flavour == "openmpi" and not recoverable:
        assert f"Open MPI {'.'.join(map(str, version))}" in missing and "from Open MPI 5.0" in missing
        assert "recoverable" in missing and "\n" not in missing


def test_open_mpi_4_gets_no_recoverable_flag_and_the_fault_tests_skip(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.2'\n")
    fake.chmod(0o755)
    flags = launch.launcher_flags(str(fake), 4, cores=2)
    assert flags == ["--oversubscribe", "--bind-to", "none"]
    assert launch.fault_tolerance_missing(launch.mpi_version(str(fake))).startswith("Open MPI 4.1.2 ends the whole job")


# -- the mpiexec flags ---------------------------------------------------------------------------------

def test_launch_flags_from_keywords():
    flags = launch.option_flags({"batch_size": 32, "resume": True, "progress": False, "split": None, "lr": 0.1})
    assert flags == ["--batch-size", "32", "--resume", "--no-progress", "--lr", "0.1"]
    argv = launch.command("allreduce", 4, epochs=1)
    assert argv[argv.index("-n") + 1] == "4" and argv[-4:] == ["--strategy", "allreduce", "--epochs", "1"]
    assert argv[argv.index("-m"):argv.index("-m") + 4] == ["-m", "mpi4py", "-m", "cnn.parallel"]


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")
def test_oversubscribe_only_when_ranks_outnumber_the_cores_and_no_hostfile(tmp_path):
    if launch.mpi_version(MPIEXEC).flavour != "openmpi":
        pytest.skip("the flags checked are Open MPI's")
    assert "--oversubscribe" in launch.launcher_flags(MPIEXEC, 4, cores=2)
    assert "--oversubscribe" not in launch.launcher_flags(MPIEXEC, 2, cores=2)
    hosts = tmp_path / "hosts"
    flags = launch.launcher_flags(MPIEXEC, 8, cores=2, hostfile=str(hosts))
    assert "--oversubscribe" not in flags and flags[flags.index("--hostfile") + 1] == str(hosts)


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")
def test_a_hostfile_reaches_mpiexec(data_dir, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    result = run_parallel("allreduce", 2, data_dir, tmp_path, limit_train=64, hostfile=str(hosts))
    assert result.summary is not None, result.stderr[-2000:]
    argv = result.command
    assert argv.index("--hostfile") < argv.index("-n") and "--hostfile" not in argv[argv.index("-n"):]


# -- the README's commands, as printed -------------------------------------------------------------------

def readme_launch_commands() -> list[str]:
    """The ``python -m cnn.parallel.launch`` lines of the README's distributed section."""
    text = README.read_text()
    section = text[text.index("## Distributed training over MPI"):]
    section = section[:section.index("\n## ", 1)]
    return [line.split("#")[0].strip() for line in section.splitlines()
            if line.startswith("python -m cnn.parallel.launch")]


def test_the_readme_launches_through_the_launcher():
    commands = readme_launch_commands()
    assert len(commands) >= 3
    assert all(" -n " in command for command in commands)


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")
@pytest.mark.parametrize("index", range(3))
def test_every_readme_command_runs_as_printed_on_two_cores(index, data_dir, tmp_path):
    """Each command exactly as printed, with flags appended (the last of a flag wins) only to make it
    small: the tiny dataset, its batch size, two epochs. It must start (no "not enough slots", the
    launcher adds --oversubscribe where the ranks outnumber the cores) and run every step. (Whether
    the defaults learn MNIST is benchmarks/parallel_strategies.py's business: the table's Downpour
    and Hogwild rows run on them.)"""
    command = readme_launch_commands()[index]
    argv = shlex.split(command)[3:]                  # after "python -m cnn.parallel.launch"
    small = ["--data-dir", str(data_dir), "--limit-test", "64", "--batch-size", "8", "--epochs", "2",
             "--no-progress", "--summary", str(tmp_path / "summary.json"), "--checkpoint", str(tmp_path / "run.npz")]
    done = subprocess.run([sys.executable, "-m", "cnn.parallel.launch", *argv, *small], capture_output=True,
                          text=True, timeout=300, env=launch.environment())
    assert "not enough slots" not in done.stderr
    mpiexec_line = done.stdout.splitlines()[0]
    ranks = int(argv[argv.index("-n") + 1])
    assert ("--oversubscribe" in mpiexec_line) == (ranks > launch.usable_cores())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] in ("completed", "did not learn"), command + "\n" + done.stderr[-2000:]
    assert done.returncode == (0 if summary["status"] == "completed" else 1), done.stderr[-2000:]
    assert summary["history"]["epochs"][-1]["epoch"] == 2


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")
def test_a_run_that_learned_nothing_warns_instead_of_completing(data_dir, tmp_path):
    result = run_parallel("allreduce", 2, data_dir, tmp_path, limit_train=64, lr=1e-9)
    assert result.returncode == 1
    assert result.summary["status"] == "did not learn"
    assert re.search(r"warning: test accuracy \d+\.\d+% is chance level", result.stderr)
    assert "completed" not in result.stdout.splitlines()[-1]


@pytest.mark.parametrize("argv, momentum, lr", [
    (["--strategy", "downpour"], 0.5, 0.01),          # Adagrad on the server: its first step moves every weight by lr
    (["--strategy", "downpour", "--server-rule", "adagrad"], 0.5, 0.01),
    (["--strategy", "downpour", "--server-rule", "sgd"], 0.5, 0.05),   # stale gradients already act as momentum
    (["--strategy", "hogwild"], 0.5, 0.05),
    (["--strategy", "downpour", "--momentum", "0.9", "--lr", "0.01"], 0.9, 0.01),   # given flags win
    (["--strategy", "allreduce"], 0.9, 0.02),         # the synchronous ones keep cnn.train's
])
def test_asynchronous_strategies_default_to_settings_that_converge(argv, momentum, lr):
    from cnn.parallel.cli import build_parser, settings_from_args

    args, _, _ = settings_from_args(build_parser().parse_args(argv))
    assert (args.momentum, args.lr) == (momentum, lr)


@pytest.mark.parametrize("argv, warmup", [
    (["--strategy", "allreduce", "--epochs", "1"], 0.25),       # one epoch: the warmup is its first quarter
    (["--strategy", "allreduce", "--epochs", "2"], 0.5),
    (["--strategy", "allreduce", "--epochs", "10"], 1.0),       # the usual one epoch when the run is long
    (["--strategy", "allreduce", "--epochs", "1", "--warmup-epochs", "2"], 2.0),    # given: as given
])
def test_the_default_warmup_is_clipped_to_a_quarter_of_the_run(argv, warmup):
    from cnn.parallel.cli import build_parser, settings_from_args

    args, _, _ = settings_from_args(build_parser().parse_args(argv))
    assert args.warmup_epochs == warmup


def test_every_variable_a_remote_rank_needs_is_forwarded_with_x():
    env = {"CNN_DATA_DIR": "/data", "CNN_FAST": "1", "NUMBA_ENABLE_CUDASIM": "1", "OMP_NUM_THREADS": "1",
           "HOME": "/root", "PATH": "/bin"}
    from cnn.parallel import hosts

    assert hosts.forwarded(env) == ["CNN_DATA_DIR", "CNN_FAST", "NUMBA_ENABLE_CUDASIM", "OMP_NUM_THREADS"]
    if MPIEXEC is not None and launch.mpi_version(MPIEXEC).flavour == "openmpi":
        argv = launch.command("allreduce", 2, env=env)
        assert argv[argv.index("CNN_DATA_DIR") - 1] == "-x" and "HOME" not in argv
        assert argv.index("CNN_DATA_DIR") < argv.index("-n")


def test_host_differences_are_one_line_each_naming_the_host():
    from cnn.parallel import hosts

    here = {"host": "a", "python": "/venv/bin/python", "python_version": "3.11.7", "package": "/src/cnn",
            "package_digest": "1111", "env": {"CNN_DATA_DIR": "/data"},
            "data": {"directory": "/data/mnist", "digest": "aaaa"}}
    reports = {0: here, 1: here,
               2: {**here, "host": "b", "env": {}, "data": {"problem": "MNIST: not found in /src/data"}},
               3: {**here, "host": "c", "package_digest": "2222", "python_version": "3.10.1"},
               4: {"host": "d", "missing": "no interpreter /venv/bin/python: ..."}}
    lines = hosts.problems(reports)
    assert lines == [
        "host b (rank 2): no dataset: MNIST: not found in /src/data (CNN_DATA_DIR is set for rank 0, not there: "
        "forward it — python -m cnn.parallel.launch does, with plain mpiexec add -x CNN_DATA_DIR)",
        "host c (rank 3): Python 3.10.1 at /venv/bin/python, rank 0 runs 3.11.7: install the same environment on "
        "every host",
        "host c (rank 3): another cnn package (/src/cnn, digest 2222) than rank 0's (/src/cnn, 1111): every host "
        "needs the same checkout (a shared filesystem, or the same commit at the same path)",
        "host d (rank 4): no interpreter /venv/bin/python: ..."]
    assert all("\n" not in line for line in lines)
    assert hosts.problems({0: here, 1: here}) == []
