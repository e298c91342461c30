"""The classroom assignments (assignments/source), graded by nbgrader both ways.

In a temporary nbgrader course directory (its own gradebook), for every assignment:

1. ``generate_assignment`` makes the student version: solutions replaced by ``raise NotImplementedError()``;
2. ``autograde`` grades two submissions — the instructor's source notebook (the solutions) and the
   student version as released (the blanks left);
3. the solutions must score full marks on every test cell, and the blanks zero on every test cell:
   an autograder that cannot fail is worthless.

The CUDA assignments run in Numba's simulator here (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1 and the
notebook kernels inherit it). One module-scoped fixture does all the grading (a kernel start per graded
notebook, about a minute in all); the tests then read the gradebook.
"""

import os
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
COURSE = REPOSITORY / "assignments"
ASSIGNMENTS = sorted(path.name for path in (COURSE / "source").iterdir() if path.is_dir())
STUDENTS = {"solutions": "source", "blanks": "release"}     # student id -> which version it submits


def source_notebook(assignment: str) -> Path:
    return COURSE / "source" / assignment / f"{assignment}.ipynb"


def nbgrader_cells(notebook) -> list:
    return [cell for cell in notebook.cells if "nbgrader" in cell.metadata]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{assignment: {"release": release notebook, student: {grade cell id: (score, max score)}}}."""
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    root = tmp_path_factory.mktemp("course")
    shutil.copytree(COURSE / "source", root / "source")
    config = PyFileConfigLoader("nbgrader_config.py", str(COURSE)).load_config()   # the committed settings
    config.CourseDirectory.root = str(root)
    config.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
    # nbgrader runs the `alembic` command when it creates a gradebook: the venv's bin must be on PATH
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    try:
        api = NbGraderAPI(config=config)
        outcome = api.generate_assignment("*")          # every assignment: what `make assignments` runs
        assert outcome["success"], f"generate_assignment:\n{outcome.get('error')}\n{outcome.get('log')}"
        for student, version in STUDENTS.items():
            shutil.copytree(root / version, root / "submitted" / student)
            outcome = api.autograde("*", student)
            assert outcome["success"], f"autograde ({student}):\n{outcome.get('error')}\n{outcome.get('log')}"
        results = {assignment: {"release": nbformat.read(root / "release" / assignment / f"{assignment}.ipynb", 4)}
                   for assignment in ASSIGNMENTS}
        with Gradebook(config.CourseDirectory.db_url) as gradebook:
            for assignment in ASSIGNMENTS:
                for student in STUDENTS:
                    submission = gradebook.find_submission(assignment, student)
                    results[assignment][student] = {grade.name: (grade.score, grade.max_score)
                                                    for notebook in submission.notebooks for grade in notebook.grades}
    finally:
        os.environ["PATH"] = path
    return results


def test_there_are_assignments():
    assert ASSIGNMENTS == ["a1_naive_conv", "a2_im2col", "a3_cuda_conv", "a4_fused_conv_pool", "a5_push_backward",
                           "a6_gradient_ring"]


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_source_has_solutions_tests_and_points(assignment):
    notebook = nbformat.read(source_notebook(assignment), 4)
    cells = nbgrader_cells(notebook)
    solutions = [cell for cell in cells if cell.metadata.nbgrader["solution"]]
    tests = [cell for cell in cells if cell.metadata.nbgrader["grade"]]
    assert solutions and tests
    for cell in solutions:
        assert "### BEGIN SOLUTION" in cell.source and "### END SOLUTION" in cell.source, cell.metadata.nbgrader["grade_id"]
    for cell in tests:
        assert cell.metadata.nbgrader["points"] > 0 and cell.metadata.nbgrader["locked"]
    assert sum(cell.metadata.nbgrader["points"] for cell in tests) == 10
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "strip the outputs"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_has_no_solutions(graded, assignment):
    release = graded[assignment]["release"]
    source = nbformat.read(source_notebook(assignment), 4)
    solution_code = {cell.metadata.nbgrader["grade_id"]: cell.source for cell in nbgrader_cells(source)
                     if cell.metadata.nbgrader["solution"]}
    for cell in nbgrader_cells(release):
        if cell.metadata.nbgrader["solution"]:
            assert "BEGIN SOLUTION" not in cell.source and "raise NotImplementedError()" in cell.source
            body = re.search(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", solution_code[cell.metadata.nbgrader["grade_id"]],
                             re.S).group(1)
            assert body.strip().splitlines()[-1].strip() not in cell.source


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_solutions_score_full_marks(graded, assignment):
    grades = graded[assignment]["solutions"]
    assert grades, "no test cell was graded"
    missing = {name: score for name, score in grades.items() if score[0] != score[1]}
    assert not missing, f"{assignment}: the solutions lose points on {missing}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_blanks_score_zero(graded, assignment):
    grades = graded[assignment]["blanks"]
    assert grades.keys() == graded[assignment]["solutions"].keys()
    scored = {name: score for name, score in grades.items() if score[0] != 0}
    assert not scored, f"{assignment}: the unanswered student version scores on {scored}"
