"""Fault injection: does a training run lose work when it is killed or stopped, the disk fills, a path is
read-only or vanishes, or a second run writes the same checkpoint?

    python benchmarks/fault_injection.py                  # writes benchmarks/results/fault_injection.json
    python benchmarks/fault_injection.py --as-user-too --page docs/benchmarks.md --readme README.md
                                                          # as root: again as nobody; the table, README's line
    python benchmarks/fault_injection.py --render-only --page docs/benchmarks.md --readme README.md
                                                          # the two blocks again from the results file
    python benchmarks/fault_injection.py --quick --results /tmp/f.json    # what the test suite runs

Every scenario runs the real code (``cnn.train``, ``cnn.guard``, ``cnn.checkpoint``, ``python -m cnn train``'s
``main``) on LeNet-5-sized checkpoints and a tiny dataset, a few seconds each:

kill -9 while writing      a child writes checkpoints back to back (each state's parameters filled
                           with its number) and is killed at a random moment; the checkpoint must
                           load and be the last acknowledged state or the one being written
kill -9 while training     a child trains with a checkpoint every step and is killed at a random
                           moment; the run resumed from its checkpoint must end bit-identical to
                           an uninterrupted run
disk full                  a size-limited tmpfs (mounted where this machine allows it, else a
                           simulated ENOSPC): too small from the start (refused before training),
                           or filled mid-run (one line; the previous checkpoint intact, no
                           temporary, the history saved somewhere named)
read-only paths            --checkpoint / --out in a read-only directory or under a file (refused
                           before training, one line, exit 2), a file system gone read-only mid-run
two concurrent writers     two runs on one checkpoint (one refused in one line); the lock of a
                           run killed -9 (never blocks); two writers bypassing the lock with a
                           reader loading all the while (never a damaged file)
SIGINT / SIGTERM           sent at a random moment to a ``python -m cnn train`` in a forked child: it
                           stops in one line (exit 130 / 143) with the checkpoint of that step and
                           its history; --resume must end bit-identical to an uninterrupted run
folder read-only mid-run   as the second epoch begins: as root a read-only bind mount of the
                           checkpoint folder, as an ordinary user (root's trial switches to
                           ``nobody`` in a forked child) chmod 0555: one line, exit 1, the first
                           epoch's checkpoint intact, the history where the line says
folder removed mid-run     rm -r of the checkpoint folder as the second epoch begins: one line
                           (the lock is no longer this run's), the history where it says
a symlink                  to the checkpoint or to its folder: refused while a run holds the real
                           checkpoint; alone, written through, the link still a link
a plain .npy               given to evaluate and to train --resume: one line, the file untouched
a run that explodes        a good epoch, then --lr 3 with a checkpoint every step: the checkpoint
                           kept must have a test loss within cnn.guard.SANE_FACTOR of the best seen

A trial *fails* when the behaviour differs from the above (a traceback, more than one line, a
damaged or missing file, a temporary left); it *loses work* when something acknowledged as written
— a checkpoint whose write had returned, the history of a run that stopped — is gone afterwards.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")     # before numpy: forked children share no BLAS threads
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import errno  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from cnn import checkpoint as checkpoints  # noqa: E402
from cnn.atomic import replaced_on_success, stale_temporaries  # noqa: E402
from cnn.data import write_idx  # noqa: E402
from cnn.data.synthetic import corner_digits  # noqa: E402
from cnn.model import get_network  # noqa: E402
from cnn.stages import get_stage  # noqa: E402
from cnn.train import CheckpointWriteFailed, TrainConfig, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "fault_injection.json"
#: the full table (docs/benchmarks.md) and README's one-line summary, each between its two marker lines
TABLE_MARKERS = ("<!-- fault-injection:start -->", "<!-- fault-injection:end -->")
SUMMARY_MARKERS = ("<!-- fault-injection-summary:start -->", "<!-- fault-injection-summary:end -->")
TABLE_PAGE, TABLE_ANCHOR = ROOT / "docs" / "benchmarks.md", "reliability-fault-injection"
LENET5_PARAMS = get_network("lenet5").num_params


# -- the bookkeeping ---------------------------------------------------------------------------

@dataclass
class Scenario:
    name: str
    how: str = ""                       # real tmpfs, chmod, simulated ...
    trials: int = 0
    failures: list = field(default_factory=list)       # one line per failed trial
    lost: int = 0                       # trials in which acknowledged work was gone afterwards

    def trial(self, problem: str | None = None, lost: bool = False) -> None:
        self.trials += 1
        if problem:
            self.failures.append(problem)
        self.lost += bool(lost)

    def row(self) -> dict:
        return {"scenario": self.name, "how": self.how, "trials": self.trials, "failures": len(self.failures),
                "lost_work": self.lost, "failure_lines": self.failures[:5]}


# -- processes, file systems, data -------------------------------------------------------------

def forked(function, *args) -> tuple[int, int]:
    """Run ``function(*args, ack=...)`` in a forked child; (pid, read end of the pipe it acks on).

    ``ack(text)`` writes one line to the parent; an exception is acked as "error: ..." (the child
    exits 1). The child never returns into the parent's code: it leaves by os._exit.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                function(*args, ack=lambda text: os.write(write, f"{text}\n".encode()))
        except BaseException as err:        # noqa: BLE001 — everything is reported to the parent
            os.write(write, f"error: {type(err).__name__}: {err}\n".encode()[:8000])
            code = 1
        os._exit(code)
    os.close(write)
    return pid, read


def acks_of(pid: int, read: int) -> list[str]:
    """Wait for the child; every line it acked."""
    os.waitpid(pid, 0)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    return b"".join(chunks).decode().splitlines()


def kill_at(pid: int, seconds: float) -> None:
    time.sleep(seconds)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def tmpfs(size: int, read_only: bool = False):
    """A fresh tmpfs of ``size`` bytes (None where this machine does not let us mount one)."""
    directory = Path(tempfile.mkdtemp(prefix="faults-tmpfs-"))
    options = f"size={size},mode=0755" + (",ro" if read_only else "")
    mounted = (os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True).returncode == 0)
    try:
        yield directory if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)


def tiny_data():
    """Random 28×28 images whose class is written into a corner's brightness (LeNet-5 learns it)."""
    return corner_digits(n_train=96, n_test=32)


def tiny_idx_dir(directory: Path) -> Path:
    """The same kind of data as four IDX files, for runs through the command line."""
    rng = np.random.default_rng(0)
    for prefix, count in (("train", 64), ("t10k", 32)):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = rng.integers(0, 50, (count, 28, 28)).astype(np.uint8)
        images[:, :8, :8] += labels[:, None, None] * 20
        write_idx(directory / f"{prefix}-images-idx3-ubyte", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte", labels)
    return directory


def config(path: Path | None, **overrides) -> TrainConfig:
    settings = dict(model="lenet5", stage="numpy", epochs=2, batch_size=16, lr=0.02, progress=False,
                    checkpoint=str(path) if path else None)
    settings.update(overrides)
    return TrainConfig(**settings)


def quiet_train(*args, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):
        return train(*args, **kwargs)


def cli(*argv) -> tuple[int, str, str]:
    """``python -m cnn ARGV`` in this process: (exit code, stdout, stderr)."""
    from cnn.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
        except BaseException as exc:      # noqa: BLE001 — a traceback is a failed trial, not a crash here
            code, err = "traceback", io.StringIO(f"{type(exc).__name__}: {exc}")
    return code, out.getvalue(), err.getvalue()


def one_line_refusal(code, out: str, err: str, fragment: str) -> str | None:
    """None if a run was refused before training in one line containing ``fragment``; else the problem."""
    lines = err.strip().splitlines()
    if code != 2 or len(lines) != 1 or fragment not in err:
        return f"exit {code}, stderr {err.strip()[:200]!r}"
    if "epoch 1" in out:
        return "refused only after training"
    return None


def temporaries_in(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.tmp"))


# -- scenario 1: kill -9 while writing checkpoints ---------------------------------------------

def save_marked(path: Path, state: int, writer: int = 0) -> None:
    """A valid checkpoint in which every number says ``state`` and ``writer`` (0 or 1): every parameter
    ±state (+ for writer 0), every momentum its negative, epoch ``state``, batch ``writer``, and a
    history of ``state`` steps."""
    params = np.full(LENET5_PARAMS, state * (1 - 2 * writer), np.float32)
    history = {"steps": [[step, 0.0, 0.02, 0.0] for step in range(state)], "evals": [], "epochs": [],
               "train_seconds": 0.0}
    checkpoints.save_checkpoint(path, params, -params, config(None, epochs=10**9), state, writer,
                                np.random.default_rng(state).bit_generator.state, history)


def holds_marked(saved: dict) -> bool:
    """Whether a loaded checkpoint is whole: every number says the same state and writer (``save_marked``)."""
    state, sign = saved["epoch"], 1 - 2 * saved["batch"]
    return bool(np.all(saved["params"] == sign * state) and np.all(saved["momentum"] == -sign * state)
                and len(saved["history"]["steps"]) == state)


def write_states_forever(path: Path, ack) -> None:
    """Write checkpoints 1, 2, 3, ... (``save_marked``); ack each."""
    for state in range(1, 10**9):
        save_marked(path, state)
        ack(state)


def kill_while_writing(trials: int, scratch: Path) -> Scenario:
    scenario = Scenario("kill -9 at a random moment while checkpoints are written", "SIGKILL")
    temporaries_left = 0
    for trial in range(trials):
        path = scratch / f"kill-write-{trial}" / "ck.npz"
        path.parent.mkdir()
        pid, read = forked(write_states_forever, path)
        kill_at(pid, random.uniform(0.0, 0.25))
        acked = [int(line) for line in acks_of(pid, read) if line.isdigit()]
        last = acked[-1] if acked else 0
        temporaries_left += len(stale_temporaries(path))
        if not path.exists():
            scenario.trial(f"trial {trial}: no checkpoint after {last} acknowledged" if last else None, lost=last > 0)
            continue
        try:
            saved = checkpoints.load_checkpoint(path)
        except ValueError as err:
            scenario.trial(f"trial {trial}: {err}", lost=True)
            continue
        state, whole = saved["epoch"], holds_marked(saved)
        problem = None if whole and state in (last, last + 1) else (
            f"trial {trial}: checkpoint holds state {state} (whole: {whole}), last acknowledged {last}")
        scenario.trial(problem, lost=state < last)
        with checkpoints.CheckpointLock(path):       # the next writer removes what kill -9 left
            pass
        if stale_temporaries(path):
            scenario.trial(f"trial {trial}: the next writer left a killed writer's temporary")
    scenario.how = f"SIGKILL; {temporaries_left} temporaries left by the kills, all removed by the next writer"
    return scenario


# -- scenario 2: kill -9 while training, then resume ------------------------------------------

def train_acking_checkpoints(settings: TrainConfig, data, ack) -> None:
    import cnn.guard

    save = cnn.guard.save_checkpoint

    def save_and_ack(path, params, momentum, config_, epoch, batch, *rest):
        save(path, params, momentum, config_, epoch, batch, *rest)
        ack(f"{epoch} {batch}")
    cnn.guard.save_checkpoint = save_and_ack        # this forked child's copy only
    train(settings, data)
    ack("done")


def kill_while_training(trials: int, scratch: Path) -> Scenario:
    scenario = Scenario("kill -9 at a random moment while training, then --resume", "SIGKILL")
    data = tiny_data()
    reference_stage = get_stage("numpy")(get_network("lenet5")).init("he", 0)
    started = time.perf_counter()
    quiet_train(config(scratch / "reference.npz", checkpoint_every=1), data, stage=reference_stage)
    duration = time.perf_counter() - started
    for trial in range(trials):
        path = scratch / f"kill-train-{trial}" / "ck.npz"
        settings = config(path, checkpoint_every=1)
        pid, read = forked(train_acking_checkpoints, settings, data)
        kill_at(pid, random.uniform(0.1, 0.9) * duration + 0.05)
        lines = acks_of(pid, read)
        acked = [tuple(map(int, line.split())) for line in lines if line[0].isdigit()]
        errors = [line for line in lines if line.startswith("error")]
        if errors:
            scenario.trial(f"trial {trial}: the run failed before it was killed: {errors[0]}")
            continue
        position = None
        if path.exists():
            try:
                saved = checkpoints.load_checkpoint(path)
                position = (saved["epoch"], saved["batch"])
            except ValueError as err:
                scenario.trial(f"trial {trial}: {err}", lost=True)
                continue
        lost = bool(acked) and (position is None or position < acked[-1])
        stage = get_stage("numpy")(get_network("lenet5")).init("he", 0)   # as the killed run began
        try:
            quiet_train(config(path, checkpoint_every=1, resume=True), data, stage=stage)
        except Exception as err:            # noqa: BLE001
            scenario.trial(f"trial {trial}: resume failed: {type(err).__name__}: {err}", lost=True)
            continue
        same = np.array_equal(stage.get_params(), reference_stage.get_params())
        scenario.trial(None if same and not lost else
                       f"trial {trial}: resumed from {position}, last acknowledged {acked[-1:]}, bit-identical: {same}",
                       lost=lost)
    return scenario


# -- scenario 3: disk full ---------------------------------------------------------------------

class AtEpoch:
    """Wraps a stage: when epoch ``epoch`` (0-based) begins, ``fault()`` runs (a file fills the disk, the
    checkpoint folder goes read-only or away)."""

    def __init__(self, stage, epoch: int, fault):
        self.stage, self.epoch, self.fault, self.began = stage, epoch, fault, 0

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def begin_epoch(self, *args, **kwargs):
        if self.began == self.epoch:
            self.fault()
        self.began += 1
        return self.stage.begin_epoch(*args, **kwargs)


def fill_leaving(directory: Path, free: int):
    def fill():
        room = shutil.disk_usage(directory).free - free
        with open(directory / "filler", "wb") as handle:
            handle.write(bytes(max(room, 0)))
    return fill


@contextlib.contextmanager
def failing_write(number: int, code: int = errno.ENOSPC):
    """A simulated write failure: the ``number``-th checkpoint write writes part of the file, then fails
    with ``code`` (ENOSPC: a full disk; EROFS: a file system remounted read-only after an error)."""
    original, calls = np.savez, [0]

    def savez(handle, **arrays):
        calls[0] += 1
        if calls[0] == number:
            handle.write(b"PK" + bytes(1000))
            raise OSError(code, os.strerror(code))
        return original(handle, **arrays)
    np.savez = savez
    try:
        yield
    finally:
        np.savez = original


def stopped_run_keeps_everything(directory: Path, run, expect_epoch_batch) -> tuple[str | None, bool]:
    """Run ``run()``, which must stop with CheckpointWriteFailed; (problem or None, work lost?)."""
    path = directory / "ck.npz"
    try:
        run()
        return "the run did not notice the failed write", True
    except CheckpointWriteFailed as err:
        message = str(err)
        history_file, where = checkpoints.save_history(err.history, directory / "history.json")
    except Exception as err:                # noqa: BLE001
        return f"{type(err).__name__}: {err}", True
    saved = checkpoints.load_checkpoint(path) if path.exists() else None
    intact = saved is not None and (saved["epoch"], saved["batch"]) == expect_epoch_batch
    history_ok = history_file is not None and len(json.loads(history_file.read_text())["steps"]) > 0
    if history_file is not None and history_file.parent != directory:
        history_file.unlink()
    problems = [text for bad, text in (("\n" in message, "message is more than one line"),
                                       (not intact, f"previous checkpoint not intact: {saved and saved['epoch']}"),
                                       (bool(temporaries_in(directory)), "a temporary was left"),
                                       (not history_ok, f"history not saved: {where}")) if bad]
    return ("; ".join(problems) or None), not (intact and history_ok)


def disk_full(scratch: Path) -> Scenario:
    scenario = Scenario("disk full")
    data = tiny_data()
    with tmpfs(256 << 10) as small:
        if small is not None:
            scenario.how = "tmpfs of 256 KiB and 2 MiB"
            code, out, err = cli("train", "--checkpoint", str(small / "ck.npz"), "--out", str(scratch / "h.json"),
                                 "--data-dir", str(tiny_idx_dir(scratch / "idx")), "--epochs", "1")
            scenario.trial(one_line_refusal(code, out, err, "free on its file system"))
    for fail_at_epoch, every in ((1, 0), (1, 2), (2, 3)):
        with tmpfs(2 << 20) as disk:
            stage = get_stage("numpy")(get_network("lenet5")).init("he", 0)
            if disk is not None:
                wrapped = AtEpoch(stage, fail_at_epoch, fill_leaving(disk, 8 << 10))
                settings = config(disk / "ck.npz", epochs=3, checkpoint_every=every)
                expected = (fail_at_epoch, 0)           # the epoch-end checkpoint before the disk filled
                problem, lost = stopped_run_keeps_everything(disk, lambda: quiet_train(settings, data, stage=wrapped),
                                                             expected)
            else:
                scenario.how = "simulated ENOSPC (no tmpfs could be mounted here)"
                directory = scratch / f"enospc-{fail_at_epoch}-{every}"
                settings = config(directory / "ck.npz", epochs=3, checkpoint_every=0)
                with failing_write(fail_at_epoch + 1):
                    problem, lost = stopped_run_keeps_everything(
                        directory, lambda: quiet_train(settings, data, stage=stage), (fail_at_epoch, 0))
            scenario.trial(problem, lost)
    return scenario


# -- scenario 4: read-only paths ---------------------------------------------------------------

@contextlib.contextmanager
def read_only_directory(scratch: Path):
    """(directory, how): a read-only tmpfs as root where allowed, else a chmod 0555 directory (not
    read-only to root: then None)."""
    with tmpfs(1 << 20, read_only=True) as mounted:
        if mounted is not None:
            yield mounted, "read-only tmpfs"
            return
    directory = scratch / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        yield (directory, "chmod 0555") if os.geteuid() != 0 else (None, "")
    finally:
        directory.chmod(0o755)


def read_only_paths(scratch: Path) -> Scenario:
    scenario = Scenario("read-only paths")
    data_dir = tiny_idx_dir(scratch / "idx-ro")
    a_file = scratch / "a-file"
    a_file.write_text("not a directory")
    run = ("--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "16")
    cases = [(("--checkpoint", str(a_file / "ck.npz"), "--out", str(scratch / "h1.json")), "is a file, not a directory"),
             (("--out", str(a_file / "h.json")), "is a file, not a directory"),
             (("--checkpoint", str(scratch), "--out", str(scratch / "h0.json")), "is a directory")]
    with read_only_directory(scratch) as (read_only, how):
        if read_only is not None:
            cases += [(("--checkpoint", str(read_only / "ck.npz"), "--out", str(scratch / "h2.json")), "cannot write"),
                      (("--out", str(read_only / "h.json")), "cannot write")]
        scenario.how = how or "not available to root without mounting: the file/directory cases only"
        for arguments, fragment in cases:
            scenario.trial(one_line_refusal(*cli("train", *arguments, *run), fragment))
    # A file system that goes read-only mid-run (as ext4 does after an error, errors=remount-ro). A
    # tmpfs cannot be remounted read-only under the run: its lock file is open for writing.
    directory = scratch / "goes-read-only"
    settings = config(directory / "ck.npz", epochs=3)
    with failing_write(2, errno.EROFS):
        scenario.trial(*stopped_run_keeps_everything(directory, lambda: quiet_train(settings, tiny_data()), (1, 0)))
    scenario.how += "; a simulated EROFS mid-run"
    return scenario


# -- scenario 5: two concurrent writers ---------------------------------------------------------

def train_and_report(settings: TrainConfig, data, ack) -> None:
    try:
        train(settings, data)
        ack("done")
    except ValueError as err:
        ack(f"refused: {err}")


def hold_lock(path: Path, ack) -> None:
    with checkpoints.CheckpointLock(path):
        ack("held")
        time.sleep(60)


def write_states(path: Path, writer: int, count: int, ack) -> None:
    for state in range(1, count + 1):
        save_marked(path, state, writer)
    ack("done")


def read_while_written(path: Path, seconds: float, ack) -> None:
    loads = damaged = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if not path.exists():
            continue
        try:
            saved = checkpoints.load_checkpoint(path)
            loads += 1
            damaged += not holds_marked(saved)
        except ValueError:
            damaged += 1
    ack(f"{loads} {damaged}")


def concurrent_writers(trials: int, scratch: Path) -> Scenario:
    scenario = Scenario("two concurrent writers of one checkpoint",
                        "two runs started together; the lock of a run killed -9; two writers bypassing the lock "
                        "while a reader loads")
    data = tiny_data()
    for trial in range(trials):                   # two runs started together: one is refused
        path = scratch / f"two-runs-{trial}" / "ck.npz"
        children = [forked(train_and_report, config(path, epochs=3), data) for _ in range(2)]
        results = sorted(acks_of(pid, read)[-1] for pid, read in children)
        refused_ok = (results[0] == "done" and results[1].startswith("refused: ")
                      and "another run (pid" in results[1])
        ends = checkpoints.load_checkpoint(path)["epoch"] == 3 if path.exists() else False
        scenario.trial(None if (refused_ok or results == ["done", "done"]) and ends else
                       f"trial {trial}: {results}, checkpoint complete: {ends}", lost=not ends)
    for trial in range(trials):                   # the lock of a run killed -9 never blocks
        path = scratch / f"stale-{trial}" / "ck.npz"
        path.parent.mkdir()
        pid, read = forked(hold_lock, path)
        while not Path(f"{path}.lock").exists() or not Path(f"{path}.lock").read_text():
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        acks_of(pid, read)
        try:
            with checkpoints.CheckpointLock(path):
                scenario.trial()
        except ValueError as err:
            scenario.trial(f"trial {trial}: a dead run's lock blocked: {err}")
    for trial in range(trials):                   # writers that bypass the lock never damage the file
        path = scratch / f"bypass-{trial}" / "ck.npz"
        path.parent.mkdir()
        writers = [forked(write_states, path, writer, 40) for writer in (0, 1)]
        reader = forked(read_while_written, path, 1.0)
        crashed = [line for pid, read in writers for line in acks_of(pid, read) if line != "done"]
        loads, damaged = map(int, acks_of(*reader)[-1].split())
        scenario.trial(None if not crashed and damaged == 0 and not temporaries_in(path.parent) else
                       f"trial {trial}: writers {crashed}, {damaged} of {loads} loads damaged", lost=damaged > 0)
    return scenario


# -- scenario 6: issue 26's faults ----------------------------------------------------------------

@contextlib.contextmanager
def stages_wrapped_by(wrap):
    """Within the block, the stages ``cnn.train`` builds (``python -m cnn train`` run in this process too)
    are trained as ``wrap(stage)``, the stage once initialised: a wrapper that injects a fault."""
    import cnn.train

    real_get_stage = cnn.train.get_stage

    class Built:
        def __init__(self, build):
            self.build = build

        def __call__(self, *args, **kwargs):
            self.stage = self.build(*args, **kwargs)
            return self

        def init(self, *args, **kwargs):
            return wrap(self.stage.init(*args, **kwargs))
    cnn.train.get_stage = lambda name: Built(real_get_stage(name))
    try:
        yield
    finally:
        cnn.train.get_stage = real_get_stage


def faulty_stages(epoch: int, fault):
    """Stages that run ``fault()`` when epoch ``epoch`` (0-based) begins."""
    return stages_wrapped_by(lambda stage: AtEpoch(stage, epoch, fault))


def history_named(message: str) -> Path | None:
    """The file a one-line message says the history is in ("...; history in P", "... the history is in P")."""
    match = re.search(r"history (?:is )?in (\S+)$", message.strip())
    return Path(match.group(1)) if match else None


def train_arguments(idx: Path, checkpoint: Path, epochs: int, *extra) -> tuple[str, ...]:
    return ("train", "--data-dir", str(idx), "--epochs", str(epochs), "--batch-size", "16", "--checkpoint",
            str(checkpoint), "--out", str(checkpoint.with_suffix(".json")), "--no-progress", *extra)


def folder_fault_run(scratch: Path, fault, epoch: int) -> tuple[int, str]:
    """``python -m cnn train`` (3 epochs of 4 steps) with its checkpoint and history in scratch/run, and
    ``fault(folder)`` as epoch ``epoch`` (0-based) begins: (exit code, stderr)."""
    idx = tiny_idx_dir(scratch / "idx")
    with faulty_stages(epoch, lambda: fault(scratch / "run")):
        code, _, err = cli(*train_arguments(idx, scratch / "run" / "ck.npz", 3))
    return code, err


def judge_folder_fault(scratch: Path, code, err: str, expect: str, epoch: int, kept: bool) -> tuple[str | None, bool]:
    """The run must stop with exit 1 and one line saying ``expect``, the history of all its steps (to the
    end of epoch ``epoch``) where that line says and no temporary; ``kept``: the checkpoint written before
    the fault still there. (problem, work lost)."""
    run, history = scratch / "run", history_named(err)
    history_ok = (history is not None and history.is_file()
                  and len(json.loads(history.read_text())["steps"]) == 4 * (epoch + 1))
    intact = not kept or checkpoints.load_checkpoint(run / "ck.npz")["epoch"] == epoch
    if history is not None and history.parent != run:
        history.unlink(missing_ok=True)
    problems = [text for bad, text in ((code != 1 or len(err.strip().splitlines()) != 1 or expect not in err,
                                        f"exit {code}, stderr {err.strip()[:200]!r}"),
                                       (not history_ok, f"no history where the line says ({history})"),
                                       (not intact, "the first epoch's checkpoint is gone"),
                                       (run.is_dir() and bool(temporaries_in(run)), "a temporary was left")) if bad]
    return ("; ".join(problems) or None), not (history_ok and intact)


def bind_read_only(folder: Path) -> None:
    """Make ``folder`` read-only under the running process, as root: a read-only bind mount of itself."""
    for options in (["--bind"], ["-o", "remount,bind,ro"]):
        subprocess.run(["mount", *options, str(folder), str(folder)], check=True, capture_output=True)


def can_bind_mount(scratch: Path) -> bool:
    probe = scratch / "probe"
    probe.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    try:
        bind_read_only(probe)
    except subprocess.CalledProcessError:
        return False
    subprocess.run(["umount", str(probe)], capture_output=True)
    return True


def ordinary_user() -> tuple[int, int] | None:
    """(uid, gid) of the ordinary user ``nobody`` that root's trials switch to, or None."""
    import grp
    import pwd

    try:
        uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return None
    for group in ("nogroup", "nobody"):
        with contextlib.suppress(KeyError):
            return uid, grp.getgrnam(group).gr_gid
    return None


def as_user(uid: int, gid: int, function, *args, ack) -> None:
    """In a forked child: become ``uid``:``gid`` with no other groups (as ``setpriv --reuid --regid
    --clear-groups`` would), run ``function(*args)`` and ack its result as JSON."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    ack(json.dumps(function(*args)))


def read_only_mid_run(epochs: tuple[int, ...], scratch: Path) -> Scenario:
    """The checkpoint folder goes read-only as each of ``epochs`` begins: as root a read-only bind mount, as
    an ordinary user chmod 0555 (root's trials run as ``nobody`` in a forked child)."""
    scenario, hows = Scenario("checkpoint folder read-only mid-run"), []
    if can_bind_mount(scratch / "mount"):
        hows.append("root: mount --bind + remount,bind,ro")
        for epoch in epochs:
            place = scratch / f"as-root-{epoch}"
            try:
                code, err = folder_fault_run(place, bind_read_only, epoch)
            finally:
                subprocess.run(["umount", str(place / "run")], capture_output=True)
            scenario.trial(*judge_folder_fault(place, code, err, "Read-only file system", epoch, kept=True))
    user = (os.geteuid(), os.getegid()) if os.geteuid() != 0 else ordinary_user()
    for epoch in epochs if user is not None else ():
        place = Path(tempfile.mkdtemp(prefix="faults-user-"))     # outside root's private scratch
        os.chown(place, *user)
        try:
            if os.geteuid() == 0:
                pid, read = forked(as_user, *user, folder_fault_run, place, lambda run: run.chmod(0o555), epoch)
                lines = acks_of(pid, read)
                code, err = json.loads(lines[-1]) if lines and not lines[-1].startswith("error") else (lines, "")
            else:
                code, err = folder_fault_run(place, lambda run: run.chmod(0o555), epoch)
            (place / "run").chmod(0o755)
            scenario.trial(*judge_folder_fault(place, code, err, "Permission denied", epoch, kept=True))
        finally:
            shutil.rmtree(place, ignore_errors=True)
    if user is not None:
        hows.append(f"{'user nobody (setuid in a child)' if os.geteuid() == 0 else 'an ordinary user'}: chmod 0555")
    scenario.how = "; ".join(hows)
    return scenario


def folder_removed_mid_run(epochs: tuple[int, ...], scratch: Path) -> Scenario:
    scenario = Scenario("checkpoint folder removed mid-run", "rm -r of the folder as an epoch begins")
    for epoch in epochs:
        place = scratch / str(epoch)
        code, err = folder_fault_run(place, shutil.rmtree, epoch)
        scenario.trial(*judge_folder_fault(place, code, err, "is no longer the lock this run took", epoch, kept=False))
    return scenario


def symlinked_checkpoints(scratch: Path) -> Scenario:
    """A link to the checkpoint, or to its folder, is the same checkpoint: refused while a run holds the
    real one; written through (the link stays a link) when alone."""
    scenario = Scenario("a symlink to a checkpoint or its folder", "a run through the link while another holds the "
                        "checkpoint; a run through the link alone")
    idx, real = tiny_idx_dir(scratch / "idx"), scratch / "real" / "ck.npz"
    cli(*train_arguments(idx, real, 1))
    (scratch / "link.npz").symlink_to(real)
    (scratch / "linked").symlink_to(real.parent, target_is_directory=True)
    for epochs, alias in enumerate((scratch / "link.npz", scratch / "linked" / "ck.npz"), start=2):
        with checkpoints.CheckpointLock(real):
            code, out, err = cli(*train_arguments(idx, alias, epochs, "--resume"))
        scenario.trial(one_line_refusal(code, out, err, f"another run (pid {os.getpid()})"))
        code, out, err = cli(*train_arguments(idx, alias, epochs, "--resume"))
        written = checkpoints.load_checkpoint(real)["epoch"] == epochs
        links = (scratch / "link.npz").is_symlink() and (scratch / "linked").is_symlink()
        stray = sorted(path.name for path in real.parent.iterdir() if path.suffix in (".lock", ".tmp"))
        scenario.trial(None if code == 0 and written and links and stray == [] else
                       f"through {alias}: exit {code}, written {written}, links kept {links}, left {stray}",
                       lost=not written)
    return scenario


def plain_array_as_checkpoint(scratch: Path) -> Scenario:
    scenario = Scenario("a plain .npy array given as a checkpoint", "evaluate and train --resume")
    idx, array = tiny_idx_dir(scratch / "idx"), scratch / "weights.npy"
    np.save(array, np.zeros(LENET5_PARAMS, np.float32))
    before = array.read_bytes()
    for arguments in (("evaluate", "--checkpoint", str(array)), train_arguments(idx, array, 1, "--resume")):
        problem = one_line_refusal(*cli(*arguments), "is a single .npy array")
        scenario.trial(problem or (None if array.read_bytes() == before else "the file was changed"))
    return scenario


def exploding_run(scratch: Path) -> Scenario:
    """A good epoch, then --lr 3 with a checkpoint every step: the checkpoint kept must not have exploded."""
    from cnn.guard import SANE_FACTOR
    from cnn.train import evaluate, load_dataset

    scenario = Scenario("a run that explodes (a good epoch, then --lr 3)",
                        f"the checkpoint kept: test loss within {SANE_FACTOR:g} × the best seen")
    idx, path = tiny_idx_dir(scratch / "idx"), scratch / "ck.npz"
    cli(*train_arguments(idx, path, 1))
    code, out, err = cli(*train_arguments(idx, path, 6, "--resume", "--lr", "3", "--checkpoint-every", "1"))
    saved = checkpoints.load_checkpoint(path)
    stage = get_stage("numpy")(get_network("lenet5"))
    stage.set_params(saved["params"])
    _, _, test_x, test_y = load_dataset(TrainConfig(data_dir=str(idx), progress=False))
    with np.errstate(all="ignore"):
        loss = evaluate(stage, test_x, test_y)[1]
    best = min([epoch["test_loss"] for epoch in saved["history"]["epochs"]] + [np.log(10)])
    sane = loss <= max(SANE_FACTOR * best, np.log(10))
    problem = one_line_refusal(code, out, err, "training diverged") if code != 1 else None
    if code != 1 or len(err.strip().splitlines()) != 1 or not sane:
        problem = problem or f"exit {code}, kept a checkpoint of test loss {loss:.3g} (best {best:.3g}): {err[:150]!r}"
    scenario.trial(problem, lost=not sane)
    return scenario


def train_acking_exit(arguments, ack) -> None:
    code, _, err = cli(*arguments)
    ack(json.dumps([code, err]))


def signal_while_training(trials: int, scratch: Path) -> Scenario:
    """SIGINT or SIGTERM at a random moment of a ``python -m cnn train`` in a forked child; then --resume."""
    scenario = Scenario("SIGINT or SIGTERM at a random moment while training, then --resume")
    stopped = 0
    idx = tiny_idx_dir(scratch / "idx")
    started = time.perf_counter()
    cli(*train_arguments(idx, scratch / "reference.npz", 3))
    duration, reference = time.perf_counter() - started, checkpoints.load_checkpoint(scratch / "reference.npz")
    for trial in range(trials):
        signum = (signal.SIGINT, signal.SIGTERM)[trial % 2]
        path = scratch / f"stop-{trial}" / "ck.npz"
        pid, read = forked(train_acking_exit, train_arguments(idx, path, 3))
        time.sleep(random.uniform(0.1, 0.9) * duration)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
        lines = acks_of(pid, read)
        code, err = json.loads(lines[-1]) if lines and lines[-1].startswith("[") else (None, "")
        history = history_named(err)
        stopped_well = (code == 128 + signum and len(err.strip().splitlines()) == 1 and "--resume" in err
                        and history is not None and history.is_file())
        stopped += stopped_well
        finished = (path.exists() and path.with_suffix(".json").exists()
                    and checkpoints.load_checkpoint(path)["epoch"] == 3)
        # killed by the signal's default action: only before the command took the signals, or after it ended
        problem = None if stopped_well or code == 0 or (code is None and (finished or not path.exists())) else (
            f"trial {trial}: exit {code}, {err.strip()[:200]!r}")
        code, _, err = cli(*train_arguments(idx, path, 3, "--resume"))
        same = code == 0 and np.array_equal(checkpoints.load_checkpoint(path)["params"], reference["params"])
        left = sorted(item.name for item in path.parent.iterdir() if item.name not in ("ck.npz", "ck.json"))
        problem = problem or (None if same and not left else f"trial {trial}: resumed bit-identical {same}, left {left}")
        scenario.trial(problem, lost=not same)
    scenario.how = (f"SIGINT and SIGTERM in turn; {stopped} of {trials} runs stopped mid-run, the others had "
                    "finished or not begun")
    return scenario


# -- the summary, the results file, the table and README's line ------------------------------------

def run_all(kill_trials: int, train_trials: int, writer_trials: int, fault_epochs: tuple[int, ...]) -> list[Scenario]:
    with tempfile.TemporaryDirectory(prefix="faults-") as scratch_name:
        scratch = Path(scratch_name)
        steps = [lambda: kill_while_writing(kill_trials, scratch / "1"),
                 lambda: kill_while_training(train_trials, scratch / "2"),
                 lambda: disk_full(scratch / "3"), lambda: read_only_paths(scratch / "4"),
                 lambda: concurrent_writers(writer_trials, scratch / "5"),
                 lambda: signal_while_training(2 * train_trials, scratch / "6"),
                 lambda: read_only_mid_run(fault_epochs, scratch / "7"),
                 lambda: folder_removed_mid_run(fault_epochs, scratch / "8"),
                 lambda: symlinked_checkpoints(scratch / "9"), lambda: plain_array_as_checkpoint(scratch / "10"),
                 lambda: exploding_run(scratch / "11")]
        scenarios = []
        for number, step in enumerate(steps, start=1):
            (scratch / str(number)).mkdir()
            started = time.perf_counter()
            scenario = step()
            print(f"{scenario.name}: {scenario.trials} trials, {len(scenario.failures)} failures, "
                  f"{scenario.lost} with work lost ({time.perf_counter() - started:.1f} s)", flush=True)
            for line in scenario.failures[:5]:
                print(f"    {line}", flush=True)
            scenarios.append(scenario)
        return scenarios


def summary(scenarios: list[Scenario], seconds: float, command: str) -> dict:
    from cnn.machine import machine_info

    rows = [scenario.row() for scenario in scenarios]
    return {"rows": rows, "trials": sum(row["trials"] for row in rows),
            "failures": sum(row["failures"] for row in rows), "lost_work": sum(row["lost_work"] for row in rows),
            "seconds": round(seconds, 1), "date": time.strftime("%Y-%m-%d"), "command": command,
            "machine": machine_info()}


def link(target: Path, page: Path) -> str:
    """``target`` (a path in the repository) as a link from ``page``."""
    return Path(os.path.relpath(target, Path(page).resolve().parent)).as_posix()


def generated_by(results: dict, flag: str, page: Path) -> str:
    return (f"<!-- generated by `{results['command']} {flag} {Path(os.path.relpath(Path(page).resolve(), ROOT)).as_posix()}` from "
            "benchmarks/results/fault_injection.json; do not edit by hand -->")


def table_block(results: dict, page: Path = TABLE_PAGE) -> str:
    """The full account for ``page`` (docs/benchmarks.md), from a results file: what counts as a failure and as
    lost work, the totals, and a row a fault — the same words for the same figures."""
    paragraph = (f"By fault injection ([`benchmarks/fault_injection.py`]({link(ROOT / 'benchmarks' / 'fault_injection.py', page)}), "
                 f"{results['date']}, {results['machine']['cpu']}): **{results['trials']} trials, "
                 f"{results['failures']} failures, {results['lost_work']} with work lost.** A failure is a traceback, "
                 "a message of more than one line, a damaged checkpoint or a temporary file left behind; lost "
                 "work is a checkpoint whose write had returned, or the history of a run that stopped, gone afterwards.")
    again = results.get("as_ordinary_user")
    if again:
        paragraph += (f" The table is the run as root; run again as the ordinary user {again['user']}: {again['trials']} "
                      f"trials, {again['failures']} failures, {again['lost_work']} with work lost.")
    lines = [TABLE_MARKERS[0], generated_by(results, "--page", page),
             textwrap.fill(paragraph, width=100, break_long_words=False, break_on_hyphens=False),
             "", "| fault | injected by | trials | failures | work lost |", "|---|---|---:|---:|---:|"]
    lines += [f"| {row['scenario']} | {row['how']} | {row['trials']} | {row['failures']} | {row['lost_work']} |"
              for row in results["rows"]]
    return "\n".join(lines + [TABLE_MARKERS[1]])


def summary_line(results: dict, page: Path = ROOT / "README.md") -> str:
    """README's one line: the totals of both runs (as root, and as the ordinary user where it ran) and a link
    to the table."""
    again = results.get("as_ordinary_user")
    trials = (f"{results['trials']} trials as root and {again['trials']} as the user {again['user']}" if again
              else f"{results['trials']} trials")
    failures = results["failures"] + (again["failures"] if again else 0)
    lost = results["lost_work"] + (again["lost_work"] if again else 0)
    line = (f"**Fault injection** ([`benchmarks/fault_injection.py`]({link(ROOT / 'benchmarks' / 'fault_injection.py', page)}), "
            f"{results['date']}): kill -9, SIGINT and SIGTERM, a full disk, read-only and vanished folders, concurrent "
            f"writers — **{trials}, {failures} failures, {lost} with work lost** "
            f"([every fault and how it was injected]({link(TABLE_PAGE, page)}#{TABLE_ANCHOR})).")
    return "\n".join([SUMMARY_MARKERS[0], generated_by(results, "--readme", page), line, SUMMARY_MARKERS[1]])


def replace_block(page: Path, block: str, markers: tuple[str, str]) -> None:
    """``page`` with the text from ``markers[0]`` to ``markers[1]`` replaced by ``block`` (written atomically)."""
    start_marker, end_marker = markers
    text = page.read_text()
    if text.count(start_marker) != 1 or text.count(end_marker) != 1:
        raise SystemExit(f"{page}: needs one {start_marker} line and one {end_marker} line")
    start, end = text.index(start_marker), text.index(end_marker) + len(end_marker)
    with replaced_on_success(page) as temporary:
        temporary.write_text(text[:start] + block + text[end:])


def run_as_ordinary_user(quick: bool) -> dict | None:
    """This script again, as ``setpriv --reuid=nobody --regid=nogroup --clear-groups``: its totals, or None
    where there is no such user or no setpriv."""
    user = ordinary_user()
    if user is None or shutil.which("setpriv") is None:
        return None
    place = Path(tempfile.mkdtemp(prefix="faults-as-user-"))
    os.chown(place, *user)
    try:
        command = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", sys.executable, __file__,
                   "--results", str(place / "results.json")] + (["--quick"] if quick else [])
        run = subprocess.run(command, cwd=place, capture_output=True, text=True)
        print(f"as user nobody: {(run.stdout.strip().splitlines() or [run.stderr.strip()])[-1]}", flush=True)
        again = json.loads((place / "results.json").read_text())
    finally:
        shutil.rmtree(place, ignore_errors=True)
    return {"user": "nobody", **{key: again[key] for key in ("trials", "failures", "lost_work")}}


def render(results: dict, page: Path | None, readme: Path | None) -> None:
    if page:
        replace_block(page, table_block(results, page), TABLE_MARKERS)
    if readme:
        replace_block(readme, summary_line(results, readme), SUMMARY_MARKERS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials (what the test suite runs)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--page", type=Path, default=None,
                        help="rewrite the fault-injection table of this page (docs/benchmarks.md)")
    parser.add_argument("--readme", type=Path, default=None, help="rewrite this README's one-line summary")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: rewrite --page and --readme from the results file (--results)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--as-user-too", action="store_true",
                        help="as root: run every scenario again as the ordinary user nobody (setpriv) and record it")
    args = parser.parse_args(argv)
    if args.render_only:
        render(json.loads(args.results.read_text()), args.page, args.readme)
        return 0
    random.seed(args.seed)
    started = time.perf_counter()
    trials = (10, 3, 2, (1,)) if args.quick else (40, 8, 4, (1, 2))
    scenarios = run_all(*trials)
    command = ("python benchmarks/fault_injection.py" + (" --quick" if args.quick else "")
               + (" --as-user-too" if args.as_user_too else ""))
    results = summary(scenarios, time.perf_counter() - started, command)
    if args.as_user_too and os.geteuid() == 0:
        results["as_ordinary_user"] = run_as_ordinary_user(args.quick)
    with replaced_on_success(args.results) as temporary:
        temporary.write_text(json.dumps(results, indent=1) + "\n")
    print(f"total: {results['trials']} trials, {results['failures']} failures, {results['lost_work']} with work lost "
          f"({results['seconds']} s); {args.results}")
    render(results, args.page, args.readme)
    again = results.get("as_ordinary_user") or {"failures": 0, "lost_work": 0}
    return 0 if results["failures"] == results["lost_work"] == again["failures"] == again["lost_work"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
