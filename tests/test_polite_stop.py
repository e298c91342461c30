"""A polite stop: SIGINT and SIGTERM only raise a flag (cnn.interrupt); training saves exactly there and
``--resume`` reproduces the uninterrupted run bit for bit (cnn.train in process; python -m cnn train in a
child that waits at a known step while the signal comes from outside: no sleep, no race). About 15 s."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cnn.interrupt import polite_stop, politely
from cnn.model import get_network
from cnn.stages import get_stage
from cnn.stages.base import Stage
from cnn.train import TrainingStopped, load_checkpoint, train

from test_reliability import assert_one_line, run_main, write_tiny_idx
from test_train import quiet, tiny_data


# -- cnn.interrupt ------------------------------------------------------------------------------

@pytest.mark.parametrize("signum, name, code", [(signal.SIGINT, "SIGINT", 130), (signal.SIGTERM, "SIGTERM", 143)])
def test_a_signal_only_sets_the_flag(signum, name, code):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with polite_stop() as stop:
        assert stop.installed and not stop.requested and stop.exit_code is None
        os.kill(os.getpid(), signum)            # delivered to this (main) thread before kill returns
        assert stop.requested and stop.signal_name == name and stop.exit_code == code
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


def test_a_second_sigint_is_not_polite_and_the_first_signal_is_the_one_recorded():
    with polite_stop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)     # first SIGINT: still polite, but SIGTERM came first
        assert (stop.signal_name, stop.exit_code) == ("SIGTERM", 143)
        with pytest.raises(KeyboardInterrupt):  # second SIGINT: Python's own handler again
            os.kill(os.getpid(), signal.SIGINT)


def test_the_previous_handlers_come_back_even_after_an_exception():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with pytest.raises(RuntimeError), polite_stop():
            raise RuntimeError("the block failed")
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_outside_the_main_thread_nothing_is_installed():
    results = []

    def run():
        with polite_stop() as stop:
            results.append((stop.installed, signal.getsignal(signal.SIGINT) is signal.default_int_handler))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results == [(False, True)]


# -- cnn.train: stop at the next step, save exactly there, resume bit for bit ------------------------

class SignalAt:
    """Wraps a stage; sends this process ``signum`` during its ``at``-th training step (1-based)."""

    run_steps = Stage.run_steps          # the default epoch loop, calling this wrapper's train_step

    def __init__(self, stage, at: int, signum: int):
        self.stage, self.at, self.signum, self.steps = stage, at, signum, 0

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def train_step(self, *args, **kwargs):
        self.steps += 1
        if self.steps == self.at:
            os.kill(os.getpid(), self.signum)       # the handler only raises the flag: the step goes on
        return self.stage.train_step(*args, **kwargs)


def numpy_stage(seed=0):
    return get_stage("numpy")(get_network("lenet5")).init("he", seed)


@pytest.fixture(scope="module")
def uninterrupted():
    """Two epochs of 6 steps, uninterrupted: (stage, history)."""
    stage = numpy_stage()
    return stage, train(quiet(epochs=2), tiny_data(), stage=stage)


def same_run(stage, history, reference_stage, reference_history) -> bool:
    return (np.array_equal(stage.get_params(), reference_stage.get_params())
            and np.array_equal(stage.get_momentum(), reference_stage.get_momentum())
            and [step[1:3] for step in history["steps"]] == [step[1:3] for step in reference_history["steps"]]
            and [(e["test_accuracy"], e["test_loss"]) for e in history["epochs"]]
            == [(e["test_accuracy"], e["test_loss"]) for e in reference_history["epochs"]])


@pytest.mark.parametrize("signum, at, resumes_at", [
    pytest.param(signal.SIGINT, 4, (0, 4), id="SIGINT mid-epoch"),
    pytest.param(signal.SIGTERM, 6, (0, 6), id="SIGTERM at the epoch's last step, before its evaluation"),
    pytest.param(signal.SIGTERM, 9, (1, 3), id="SIGTERM mid second epoch"),
])
def test_a_signal_saves_that_step_and_resume_is_bit_identical(tmp_path, uninterrupted, signum, at, resumes_at):
    checkpoint = tmp_path / "ck.npz"
    with pytest.raises(TrainingStopped) as stopped:
        train(quiet(epochs=2, checkpoint=str(checkpoint)), tiny_data(), stage=SignalAt(numpy_stage(), at, signum))
    assert stopped.value.exit_code == 128 + signum
    assert_one_line(str(stopped.value), f"stopped by {signal.Signals(signum).name} after epoch {(at - 1) // 6 + 1}, "
                    f"batch {(at - 1) % 6 + 1}", f"{checkpoint} resumes at epoch {resumes_at[0] + 1}, "
                    f"batch {resumes_at[1] + 1}", "--resume")
    assert len(stopped.value.history["steps"]) == at
    saved = load_checkpoint(checkpoint)
    assert (saved["epoch"], saved["batch"]) == resumes_at
    assert [path.name for path in tmp_path.iterdir()] == ["ck.npz"]          # no lock, no temporary

    resumed = numpy_stage(seed=99)                   # other weights: the checkpoint's must replace them
    history = train(quiet(epochs=2, checkpoint=str(checkpoint), resume=True), tiny_data(), stage=resumed)
    assert same_run(resumed, history, *uninterrupted)


def test_without_a_checkpoint_the_stop_says_it_cannot_be_resumed():
    with pytest.raises(TrainingStopped) as stopped:
        train(quiet(epochs=2), tiny_data(), stage=SignalAt(numpy_stage(), 2, signal.SIGTERM))
    assert_one_line(str(stopped.value), "stopped by SIGTERM after epoch 1, batch 2",
                    "no checkpoint was being written (--checkpoint PATH keeps one), so it cannot be resumed")
    assert len(stopped.value.history["steps"]) == 2


def test_a_signal_in_the_last_epochs_evaluation_lets_the_run_finish(tmp_path, uninterrupted):
    """Nothing is left to stop once the last step is done: the run completes (and exits 0)."""
    class SignalWhileEvaluating(SignalAt):
        sent = False

        def test_scores(self, count):
            if self.steps == 12 and not self.sent:
                os.kill(os.getpid(), self.signum)
                self.sent = True
            return self.stage.test_scores(count)
    stage = SignalWhileEvaluating(numpy_stage(), 0, signal.SIGTERM)
    history = train(quiet(epochs=2), tiny_data(), stage=stage)
    assert stage.sent and same_run(stage, history, *uninterrupted)


# -- python -m cnn train, signalled from outside --------------------------------------------------------

CHILD = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "benchmarks")!r})
from cnn.cli import main
from cnn.stages.base import Stage
from fault_injection import stages_wrapped_by

PAUSE_AT = int(sys.argv[1])


class PausedAt:
    '''Wraps the trained stage: in step PAUSE_AT, says so on stdout and waits for a line on stdin.'''
    run_steps = Stage.run_steps

    def __init__(self, stage):
        self.stage, self.steps = stage, 0

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def train_step(self, *args, **kwargs):
        self.steps += 1
        if self.steps == PAUSE_AT:
            print("paused", flush=True)
            sys.stdin.readline()             # the signal arrives here; the step then goes on
        return self.stage.train_step(*args, **kwargs)


with stages_wrapped_by(PausedAt):
    sys.exit(main(sys.argv[2:]))
"""


def train_arguments(tiny_idx: Path, checkpoint: Path, out: Path, *extra) -> list[str]:
    return ["train", "--data-dir", str(tiny_idx), "--epochs", "2", "--batch-size", "16", "--checkpoint",
            str(checkpoint), "--out", str(out), "--no-progress", *extra]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_command_line_stops_politely_and_resumes_bit_for_bit(tmp_path, signum):
    """The signal comes from outside, while the child waits at a known step (no sleep, no race)."""
    tiny_idx = write_tiny_idx(tmp_path / "idx")          # 64 training images: 4 steps an epoch
    reference, checkpoint, out = tmp_path / "reference.npz", tmp_path / "run" / "ck.npz", tmp_path / "run" / "h.json"
    assert run_main(*train_arguments(tiny_idx, reference, tmp_path / "reference.json"))[0] == 0

    child = subprocess.Popen([sys.executable, "-c", CHILD, "6", *train_arguments(tiny_idx, checkpoint, out)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "paused", child.stderr.read()
        child.send_signal(signum)
        child.stdin.write("go on\n")
        child.stdin.flush()
        _, err = child.communicate(timeout=300)
    finally:
        child.kill()
    assert child.returncode == 128 + signum, err
    assert_one_line(err, f"stopped by {signal.Signals(signum).name} after epoch 2, batch 2",
                    f"{checkpoint} resumes at epoch 2, batch 3: run the same command with --resume", f"history in {out}")
    assert sorted(path.name for path in checkpoint.parent.iterdir()) == ["ck.npz", "h.json"]    # no .lock
    assert len(json.loads(out.read_text())["steps"]) == 6

    code, output, err = run_main(*train_arguments(tiny_idx, checkpoint, out, "--resume"))
    assert code == 0, err
    assert f"resuming from epoch 2, batch 3 ({checkpoint})" in output
    finished, expected = load_checkpoint(checkpoint), load_checkpoint(reference)
    assert np.array_equal(finished["params"], expected["params"])
    assert np.array_equal(finished["momentum"], expected["momentum"])
    assert [step[1] for step in finished["history"]["steps"]] == [step[1] for step in expected["history"]["steps"]]


def test_a_polite_stop_inside_another_shares_it_and_politely_holds_one_around_a_command():
    with polite_stop() as outer:
        with polite_stop() as inner:
            assert inner is outer
        os.kill(os.getpid(), signal.SIGTERM)    # the inner block's end restored nothing
        assert outer.requested

    @politely
    def command():
        os.kill(os.getpid(), signal.SIGTERM)    # after the work: the command still finishes
        return "finished"
    assert command() == "finished"
