"""A polite stop of the synchronous strategies: SIGINT or SIGTERM to any rank (or to the launcher)
finishes the step in flight, the ranks agree on it, rank 0 writes a checkpoint of exactly that
point through the atomic writer and says in one line where it is and how to resume, and the job
exits with 130 / 143; ``--resume`` then ends on exactly the weights of an uninterrupted run (bit for
bit).

``--interrupt-rank R --interrupt-at-step S --interrupt-signal TERM`` makes rank R send itself the
signal at step S (deterministic: no race with the run's end); the launcher test sends a real
SIGINT from outside, to the launcher, as Ctrl-C would.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from cnn.parallel import launch  # noqa: E402
from test_parallel import (MPIEXEC, assert_ran_to_the_end, assert_same_weights, checkpoint_of,  # noqa: E402,F401
                           data_dir, one_process, run_parallel)

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")]


@pytest.mark.parametrize("strategy, ranks, signal_name, code, rank", [
    ("allreduce", 2, "TERM", 143, 1),            # a scheduler's notice, to a worker
    ("ps-sync", 3, "INT", 130, 2),               # Ctrl-C, to one worker of a parameter server
])
def test_a_signal_stops_every_rank_at_the_same_step_and_resume_is_exact(strategy, ranks, signal_name, code, rank,
                                                                        data_dir, tmp_path):
    whole = run_parallel(strategy, ranks, data_dir, tmp_path, name="whole", limit_train=192)
    assert_ran_to_the_end(whole)
    stopped = run_parallel(strategy, ranks, data_dir, tmp_path, limit_train=192, interrupt_rank=rank,
                           interrupt_at_step=3, interrupt_signal=signal_name)
    assert stopped.returncode == code, stopped.stderr[-2000:]
    lines = [line for line in stopped.stderr.splitlines() if f"stopped by SIG{signal_name}" in line]
    assert len(lines) == 1, stopped.stderr[-2000:]                      # rank 0 alone says it, in one line
    # the signal came during step 3 (0-based): that step finished, every rank stopped after it
    assert f"after step 4 of {192 // (8 * ranks)}" in lines[0] and str(tmp_path / "run.npz") in lines[0]
    assert "continue with: mpiexec" in lines[0] and lines[0].endswith("--resume")
    assert stopped.summary["status"] == f"stopped by SIG{signal_name}"
    assert int(checkpoint_of(tmp_path / "run.npz")["batch"]) == 4
    resumed = run_parallel(strategy, ranks, data_dir, tmp_path, limit_train=192, resume=True)
    assert_ran_to_the_end(resumed)
    got, expected = checkpoint_of(tmp_path / "run.npz")["params"], checkpoint_of(tmp_path / "whole.npz")["params"]
    assert np.array_equal(got, expected)                 # bit for bit: the same steps, the same arithmetic
    assert_same_weights(got, one_process(data_dir, 8 * ranks, limit_train=192, schedule="warmup",
                                         lr_scale=ranks)[0], tolerance=1e-3)   # and what one process learns


def test_ctrl_c_to_the_launcher_is_a_polite_stop(data_dir, tmp_path):
    """The launcher passes its first SIGINT to the ranks instead of letting mpiexec end them; a slow
    rank stretches the run so that the signal lands before its end."""
    argv = [sys.executable, "-m", "cnn.parallel.launch", "-n", "2", "--strategy", "allreduce", "--data-dir",
            str(data_dir), "--batch-size", "8", "--epochs", "2", "--log-every", "1", "--slow-rank", "1",
            "--slow-down", "40", "--checkpoint", str(tmp_path / "run.npz"), "--summary", str(tmp_path / "run.json")]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=launch.environment())
    for line in process.stdout:
        if line.startswith("step 3/"):
            break
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-2000:]
    line = next(line for line in err.splitlines() if "stopped by SIGINT" in line)
    steps = int(line.split("after step ")[1].split()[0])
    assert 3 <= steps < 2 * 256 // 16, line
    assert int(checkpoint_of(tmp_path / "run.npz")["batch"]) == steps % (256 // 16)
