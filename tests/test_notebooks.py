"""The tutorial notebooks (notebooks/NN_*.ipynb) run top to bottom on a CPU-only machine, in fast mode.

Each notebook is executed by nbclient in a fresh "python3" kernel — this interpreter's own (jupyter_client
starts a kernel spec whose command is ``python`` with ``sys.executable``; the run of the first notebook
checks that the kernel's ``sys.prefix`` is this environment's) — with
CNN_FAST=1: tiny shapes, a few hundred training steps at most, short benchmarks. CUDA notebooks run in
Numba's simulator when there is no GPU (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1, which the kernel
inherits; the notebooks' first cell would set it too). One kernel start per notebook.

Also checked without running anything: each tutorial notebook is committed with the outputs of a full
run (``python notebooks/execute.py``, ``make notebooks``): every code cell ran, in order, no error, its
plots stored as pictures, the size kept in check; the assignment notebooks are committed blank; and each
tutorial notebook ends with exercises.

Why nbclient itself and not a pytest plugin over it: nbmake runs each notebook as a test item through
nbclient too, but it takes its settings from the command line (CNN_FAST, the extra cell that prints the
kernel's ``sys.prefix``, skipping the MPI notebooks where there is no mpiexec would all move out of this
file); nbval compares every stored output with a new run's, and these notebooks store a *full* run while
the suite runs them in fast mode, so it would need ``--nbval-lax``, which is nbclient again. The harness
here is ``run_notebook``'s four lines.

No time decides a result: a cell may take ``CELL_TIMEOUT``, the kernel ``KERNEL_START_TIMEOUT`` to start,
and the outputs of a finished cell ``OUTPUT_TIMEOUT`` to arrive — each a bound on a hang, far above what a
loaded 2-core machine needs, and a late output is an error (``raise_on_iopub_timeout``), never silently
dropped (nbclient's default waits 4 s and then goes on without it, so an error output could be lost).
"""

import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPOSITORY / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
sys.path.insert(0, str(NOTEBOOK_DIR))
from strip_outputs import course_notebooks, has_outputs  # noqa: E402

CELL_TIMEOUT = 600           # seconds a cell may run
KERNEL_START_TIMEOUT = 300   # nbclient's default, 60 s, is short when eight processes share two cores
OUTPUT_TIMEOUT = 120         # for a cell's outputs after its reply (nbclient's default: 4 s, then it drops them)


def run_notebook(path: Path, extra_cells=()):
    """Execute the notebook (with ``extra_cells`` appended) as Jupyter would, from its own folder."""
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    notebook.cells += [nbformat.v4.new_code_cell(source) for source in extra_cells]
    NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT, startup_timeout=KERNEL_START_TIMEOUT,
                   iopub_timeout=OUTPUT_TIMEOUT, raise_on_iopub_timeout=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return notebook


def test_the_course_notebooks_exist():
    names = [path.stem for path in NOTEBOOKS]
    for expected in ("00_quick_start", "01_stage1_loops", "02_stage2_im2col", "03_stage3_numba_cpu",
                     "04_cuda_basics", "05_stage4_cuda", "06_stage5_fused", "07_stage6_ring", "08_stage7_tuning",
                     "09_stage8_fused_net", "10_results", "11_distributed_sync",
                     "12_distributed_async", "13_distributed_model_parallel", "14_distributed_large_batch"):
        assert expected in names


def test_assignment_notebooks_are_committed_without_outputs():
    dirty = [path.relative_to(REPOSITORY) for path in course_notebooks()
             if has_outputs(nbformat.read(path, as_version=4))]
    assert not dirty, f"run python notebooks/strip_outputs.py: {dirty} have outputs"


#: the calls that draw: a notebook making one must store at least one picture
DRAWS = re.compile(r"\b(plots\.\w+_(plot|curves|grid|maps)|learning_curves|digit_grid|filters_and_feature_maps|"
                   r"draw_\w+|show_ablations)\(")
LARGEST_NOTEBOOK = 3 * 2**20


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_tutorial_notebook_is_committed_with_the_outputs_of_a_full_run(path):
    """What a reader on GitHub sees: every cell's outputs from a full run (python notebooks/execute.py)."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert notebook.metadata.get("course", {}).get("fast_mode") is False, \
        f"{path.name}: not stored from a full run (python notebooks/execute.py {path.name[:2]})"
    counts = [cell.execution_count for cell in code]
    assert None not in counts and counts == sorted(counts), f"{path.name}: not every cell ran, in order"
    outputs = [output for cell in code for output in cell.outputs]
    errors = [output for output in outputs if output.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    tracebacks = [output.text for output in outputs if output.output_type == "stream" and "Traceback" in output.text]
    assert not tracebacks, f"{path.name}: a traceback in the stored output: {tracebacks[0][-300:]}"
    assert outputs, f"{path.name}: no output at all"
    if any(DRAWS.search(cell.source) for cell in code):
        pictures = [output for output in outputs if "image/png" in output.get("data", {})]
        assert pictures, f"{path.name}: it draws, but no picture is stored"
    assert path.stat().st_size < LARGEST_NOTEBOOK, f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_ends_with_exercises(path):
    markdown = "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "markdown")
    exercises = markdown.split("## Exercises")
    assert len(exercises) == 2, f"{path.name}: one '## Exercises' section"
    assert len(re.findall(r"^\d\. ", exercises[1], re.M)) >= 2, f"{path.name}: at least two exercises"


def mpi_missing() -> str | None:
    """Why the distributed notebooks cannot run here (they launch mpiexec), or None."""
    try:
        from cnn.parallel.launch import find_mpiexec
        find_mpiexec()
    except (ImportError, FileNotFoundError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_in_fast_mode(path, monkeypatch):
    if "distributed" in path.stem and mpi_missing():
        pytest.skip(mpi_missing())
    monkeypatch.setenv("CNN_FAST", "1")
    notebook = run_notebook(path, extra_cells=["import sys; print(sys.prefix)"])
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors
    if path == NOTEBOOKS[0]:     # once: the kernel runs in this environment (the venv), not some other Python
        printed = notebook.cells[-1].outputs[0].text.strip()
        assert os.path.realpath(printed) == os.path.realpath(sys.prefix)


def test_stored_streams_keep_a_progress_bar_s_last_state_only():
    from execute import tidy_outputs

    cell = nbformat.v4.new_code_cell("train()")
    pieces = [("stderr", "epoch 1:   0%| 0/9"), ("stderr", "epoch 1:  50%| 4/9"), ("stderr", "epoch 1: 100%| 9/9\n"),
              ("stdout", "done, "), ("stdout", "99 %\n")]
    cell.outputs = [nbformat.v4.new_output("stream", name=name, text=text) for name, text in pieces]
    notebook = nbformat.v4.new_notebook(cells=[cell])
    tidy_outputs(notebook)
    assert [(output.name, output.text) for output in cell.outputs] == [("stderr", "epoch 1: 100%| 9/9\n"),
                                                                      ("stdout", "done, 99 %\n")]
