"""The command line: real runs on a tiny IDX dataset, and one-line errors with exit code 2 for bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest

from cnn.cli import main
from cnn.data import write_idx


@pytest.fixture
def tiny_mnist(tmp_path):
    """A 64/32-image dataset in MNIST's IDX layout: loads with --data-dir after format checks."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "tiny"
    folder.mkdir()
    for prefix, count in (("train", 64), ("t10k", 32)):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = rng.integers(0, 50, (count, 28, 28)).astype(np.uint8)
        images[:, :8, :8] += labels[:, None, None] * 20
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return folder


def run_cli(*args):
    """Run ``python -m cnn`` in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "cnn", *args], capture_output=True, text=True, timeout=300)


def test_train_then_evaluate(tiny_mnist, tmp_path):
    checkpoint, out = tmp_path / "c.npz", tmp_path / "h.json"
    result = run_cli("train", "--data-dir", str(tiny_mnist), "--epochs", "2", "--batch-size", "16",
                     "--checkpoint", str(checkpoint), "--out", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "final test accuracy" in result.stdout
    history = json.loads(out.read_text())
    assert len(history["epochs"]) == 2 and history["command"].startswith("python -m cnn train")
    assert history["machine"]["cores"] >= 1

    result = run_cli("evaluate", "--checkpoint", str(checkpoint), "--data-dir", str(tiny_mnist))
    assert result.returncode == 0, result.stderr
    accuracy = float(result.stdout.split("test accuracy ")[1].split("%")[0]) / 100
    assert accuracy == pytest.approx(history["final_test_accuracy"], abs=0.5e-4)   # printed as 12.34%


def test_data_command_describes_files(tiny_mnist):
    result = run_cli("data", "--data-dir", str(tiny_mnist))
    assert result.returncode == 0, result.stderr
    assert "train-images-idx3-ubyte.gz" in result.stdout


def test_stages_command_lists_reference_stages():
    result = run_cli("stages")
    assert result.returncode == 0, result.stderr
    assert "loops" in result.stdout and "numpy" in result.stdout


@pytest.mark.parametrize("argv,message", [
    (["train", "--epochs", "0"], "must be > 0"),
    (["train", "--lr", "fast"], "not a valid float"),
    (["train", "--stage", "gpu-magic"], "invalid choice"),
    (["train", "--momentum", "1.5"], "momentum must be in"),
    (["train", "--data-dir", "/nonexistent/mnist"], "/nonexistent/mnist"),
    (["train", "--resume"], "resume needs a checkpoint"),
    (["evaluate", "--checkpoint", "/nonexistent.npz"], "no such checkpoint"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_corrupt_data_file_is_one_line(tiny_mnist, capsys):
    labels = tiny_mnist / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:20])
    code = main(["train", "--data-dir", str(tiny_mnist), "--epochs", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "t10k-labels-idx1-ubyte.gz" in err and len(err.strip().splitlines()) == 1
