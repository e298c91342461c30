"""The command line: real runs on a tiny IDX dataset, and one-line errors with exit code 2 for bad input."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cnn.cli import main
from cnn.data import write_idx
from cnn.stages import NOTEBOOK_OF_STAGE, NUMPY_FOR_NUMBA_CUDA, stage_names

REPOSITORY = Path(__file__).resolve().parent.parent


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
    """Progress on (the default), stderr a pipe as in a redirected log: the epoch lines, but no progress bar."""
    checkpoint, out = tmp_path / "c.npz", tmp_path / "h.json"
    result = run_cli("train", "--data-dir", str(tiny_mnist), "--epochs", "2", "--batch-size", "16",
                     "--checkpoint", str(checkpoint), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "final test accuracy" in result.stdout and "epoch 2/2: test accuracy" in result.stdout
    assert "batch/s" not in result.stderr and "%|" not in result.stderr, result.stderr
    history = json.loads(out.read_text())
    assert len(history["epochs"]) == 2 and history["command"].startswith("python -m cnn train")
    assert history["machine"]["cores"] >= 1 and len(history["machine"]["load_average"]) == 3

    result = run_cli("evaluate", "--checkpoint", str(checkpoint), "--data-dir", str(tiny_mnist))
    assert result.returncode == 0, result.stderr
    accuracy = float(result.stdout.split("test accuracy ")[1].split("%")[0]) / 100
    assert accuracy == pytest.approx(history["final_test_accuracy"], abs=0.5e-4 + 1e-12)   # printed as 12.34%


def test_data_command_describes_files(tiny_mnist):
    result = run_cli("data", "--data-dir", str(tiny_mnist))
    assert result.returncode == 0, result.stderr
    assert "train-images-idx3-ubyte.gz" in result.stdout


def test_the_console_script_calls_itself_cnn():
    script = Path(sys.executable).with_name("cnn")
    if not script.is_file():
        pytest.skip(f"no console script at {script} (pip install -e . makes it)")
    shown = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: cnn "), shown.stdout
    wrong = subprocess.run([str(script), "train", "--epochs", "0"], capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and wrong.stderr.startswith("cnn train: error: "), wrong.stderr
    assert run_cli("--help").stdout.startswith("usage: python -m cnn ")


def test_stages_command_lists_reference_stages():
    result = run_cli("stages")
    assert result.returncode == 0, result.stderr
    assert "loops" in result.stdout and "numpy" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line[:1].isdigit()]
    columns = {re.search(r" (ok |n/a)  ", line).start() for line in lines}      # one column, cuda-fused-net too
    assert len(lines) >= 8 and len(columns) == 1, result.stdout


@pytest.mark.parametrize("argv,message", [
    (["train", "--epochs", "0"], "must be > 0"),
    (["train", "--lr", "fast"], "not a valid float"),
    (["train", "--stage", "gpu-magic"], "invalid choice"),
    (["train", "--momentum", "1.5"], "must be in [0, 1)"),
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


def cuda_stages() -> set[str]:
    """The registered stages that run CUDA kernels (stage 8 joined stages 4-7)."""
    return {name for name in stage_names() if name.startswith("cuda")}


def stages_without_gpu(*prelude):
    """``python -m cnn stages`` with the simulator off, after the Python lines of ``prelude``."""
    code = "\n".join([*prelude, "import sys", "from cnn.cli import main", "sys.exit(main(['stages']))"])
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(os.path.isdir("/proc/driver/nvidia/gpus"), reason="this machine has an NVIDIA GPU")
def test_stages_command_gives_each_unavailable_stage_its_own_hint():
    result = stages_without_gpu()
    assert result.returncode == 0, result.stderr
    unavailable = {line.split()[1]: line for line in result.stdout.splitlines() if " n/a " in line}
    assert set(unavailable) == cuda_stages() and {"cuda", "cuda-fused", "cuda-ring", "cuda-tuned"} <= cuda_stages()
    for name, line in unavailable.items():
        assert "no CUDA GPU found" in line and f"--stage {name} " in line
        assert NOTEBOOK_OF_STAGE[name] in line
    assert len(set(unavailable.values())) == len(cuda_stages())


@pytest.mark.skipif(os.path.isdir("/proc/driver/nvidia/gpus"), reason="this machine has an NVIDIA GPU")
def test_stages_command_names_a_numpy_that_numba_cuda_cannot_compile_with():
    """numpy 2.5 dropped np.row_stack, which numba-cuda 0.30 overloads at its first compile: said in one line."""
    result = stages_without_gpu("import numpy", "del numpy.row_stack")
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("numba-cuda and numpy: numba-cuda ") and "row_stack" in last
    assert f"pip install '{NUMPY_FOR_NUMBA_CUDA}'" in last
    assert "numba-cuda and numpy" not in stages_without_gpu().stdout      # the pair installed here works


def test_every_extra_with_numba_cuda_pins_the_numpy_it_works_with():
    import tomllib

    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    with_numba_cuda = [name for name, needs in extras.items() if any(n.startswith("numba-cuda") for n in needs)]
    assert set(with_numba_cuda) >= {"cuda", "dev"}
    for name in with_numba_cuda:
        assert NUMPY_FOR_NUMBA_CUDA in extras[name], f"extra {name!r} lacks {NUMPY_FOR_NUMBA_CUDA!r}"


def test_the_cpu_pytorch_install_asks_for_the_torch_of_the_bench_extra():
    """`make bench-cpu` and pyproject's comment install PyTorch's CPU build with the bench extra's own requirement
    (the index is PyTorch's, not a registry this suite may reach: the text is checked, not resolved)."""
    import re
    import tomllib

    bench = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    [torch] = [requirement for requirement in bench if requirement.startswith("torch")]
    makefile = (REPOSITORY / "Makefile").read_text()
    index = re.search(r"^TORCH_CPU_INDEX := (\S+)$", makefile, re.M).group(1)
    recipe = makefile.split("\nbench-cpu:", 1)[1].split("\n\n", 1)[0]
    assert f'pip install --quiet "{torch}" --index-url $(TORCH_CPU_INDEX)' in recipe
    assert recipe.index("--index-url") < recipe.index("-e \".[bench]\"")     # the CPU build first, then the rest
    assert index == "https://download.pytorch.org/whl/cpu"
    assert f'pip install "{torch}" --index-url {index} && pip install -e \'.[bench]\'' in \
        (REPOSITORY / "pyproject.toml").read_text()


def test_on_a_gpu_a_broken_numba_cuda_numpy_pair_is_said_once():
    """With a GPU (stubbed here) and a numpy numba-cuda cannot compile with, the CUDA stages point to one line."""
    result = stages_without_gpu("import numpy", "del numpy.row_stack", "import kernels.device",
                                "kernels.device.gpu_unavailable_reason = lambda: None")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert sum("row_stack" in line for line in lines) == 1 and "row_stack" in lines[-1]
    assert sum("the last line says why" in line for line in lines) == len(cuda_stages())
