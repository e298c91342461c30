"""The instructors' worked solutions of the tutorial notebooks' exercises run, in fast mode, and hold.

assignments/instructor/exercise-solutions/ has one module per notebook (``nbNN_*.py``) with a function per
exercise: its docstring is the worked answer, its body computes the evidence and asserts what the answer
claims — so a change to the library that makes an answer wrong fails here. Each exercise runs with
CNN_FAST=1 (tiny shapes, few steps, short MPI runs); the CUDA ones run in Numba's simulator
(tests/conftest.py switches it on).
"""

import importlib
import sys
from pathlib import Path

import nbformat
import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
SOLUTIONS = REPOSITORY / "assignments" / "instructor" / "exercise-solutions"
NOTEBOOKS = sorted((REPOSITORY / "notebooks").glob("[0-9][0-9]_*.ipynb"))
sys.path.insert(0, str(SOLUTIONS))
from run import exercises, solution_modules  # noqa: E402


def exercise_count(notebook: Path) -> int:
    """How many numbered exercises the notebook's '## Exercises' section sets."""
    markdown = "\n".join(cell.source for cell in nbformat.read(notebook, 4).cells if cell.cell_type == "markdown")
    return len([line for line in markdown.split("## Exercises")[1].splitlines() if line[:1].isdigit() and ". " in line[:4]])


def test_every_exercise_of_every_notebook_has_a_solution():
    modules = {name[2:4]: name for name in solution_modules()}
    assert sorted(modules) == [path.name[:2] for path in NOTEBOOKS]
    for notebook in NOTEBOOKS:
        module = importlib.import_module(modules[notebook.name[:2]])
        solved = exercises(module)
        assert len(solved) == exercise_count(notebook), f"{notebook.name}: exercises and solutions differ in number"
        assert all(len((solution.__doc__ or "").split()) > 40 for solution in solved), f"{module.__name__}: a worked answer"


CASES = [(name, index) for name in solution_modules()
         for index in range(len(exercises(importlib.import_module(name))))]


@pytest.mark.parametrize("name, index", CASES, ids=[f"{name[:4]}-{index + 1}" for name, index in CASES])
def test_solution_runs_in_fast_mode(name, index, monkeypatch):
    monkeypatch.setenv("CNN_FAST", "1")
    exercises(importlib.import_module(name))[index](fast=True)
