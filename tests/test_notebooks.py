"""The tutorial notebooks (notebooks/NN_*.ipynb) run top to bottom on a CPU-only machine, in fast mode.

Each notebook is executed by nbclient in a fresh "python3" kernel — this interpreter's own (jupyter_client
starts a kernel spec whose command is ``python`` with ``sys.executable``; the run of the first notebook
checks that the kernel's ``sys.prefix`` is this environment's) — with
CNN_FAST=1: tiny shapes, a few hundred training steps at most, short benchmarks. CUDA notebooks run in
Numba's simulator when there is no GPU (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1, which the kernel
inherits; the notebooks' first cell would set it too). One kernel start per notebook.

Also checked without running anything: notebooks are committed with their outputs stripped, and each one
ends with exercises.
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

CELL_TIMEOUT = 600


def run_notebook(path: Path, extra_cells=()):
    """Execute the notebook (with ``extra_cells`` appended) as Jupyter would, from its own folder."""
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    notebook.cells += [nbformat.v4.new_code_cell(source) for source in extra_cells]
    NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return notebook


def test_the_course_notebooks_exist():
    names = [path.stem for path in NOTEBOOKS]
    for expected in ("00_quick_start", "01_stage1_loops", "02_stage2_im2col", "03_stage3_numba_cpu",
                     "04_cuda_basics", "05_stage4_cuda", "06_stage5_fused", "07_stage6_ring", "08_stage7_tuning",
                     "09_results", "10_distributed_sync",
                     "11_distributed_async", "12_distributed_model_parallel", "13_distributed_large_batch"):
        assert expected in names


def test_notebooks_are_committed_without_outputs():
    dirty = [path.relative_to(REPOSITORY) for path in course_notebooks()
             if has_outputs(nbformat.read(path, as_version=4))]
    assert not dirty, f"run python notebooks/strip_outputs.py: {dirty} have outputs"


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
