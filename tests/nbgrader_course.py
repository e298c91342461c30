"""Grading the course's assignments with nbgrader in a throw-away course directory (shared by the tests).

An autograder is only worth something if it can fail, so the tests grade submissions whose scores
they know: the instructor's solutions (full marks), the student version as released (zero), deliberately
wrong answers (partial credit, failing exactly the cells that test what is wrong), each part answered
alone (that part's points), and cheats (nothing)::

    course = shared_course(tmp_path_factory)          # every assignment, generated once for the whole session
    course.submit("blanks", "a7_network_layers", course.release("a7_network_layers"))
    grades = course.autograde("a7_network_layers", "blanks")   # {test cell: Grade(score, max_score, error)}

``Course`` grades through nbgrader itself (``autograde``: a kernel per notebook, the committed
``nbgrader_config.py`` with its referee and seal check); ``shared_runner()`` grades the same way without
a kernel per notebook (tests/notebook_runner.py), for the many submissions whose point is what the
tests say, not nbgrader's plumbing. ``with_solution(notebook, cell, code)`` puts an answer into a solution
cell; ``structure_problems`` and ``leaked_solutions`` are the checks every source notebook and its
release must pass.
"""

from __future__ import annotations

import atexit
import copy
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import nbformat

from notebook_runner import Grade, NotebookRunner, error_text

REPOSITORY = Path(__file__).resolve().parent.parent
COURSE = REPOSITORY / "assignments"
POINTS_PER_ASSIGNMENT = 10
ASSIGNMENTS = sorted((path.name for path in (COURSE / "source").iterdir() if path.is_dir()),
                     key=lambda name: int(name.split("_")[0][1:]))
ANSWER_STUB = "YOUR ANSWER HERE"      # nbgrader's text in place of a written answer in the release


def source_notebook(assignment: str) -> Path:
    return COURSE / "source" / assignment / f"{assignment}.ipynb"


def nbgrader_cells(notebook) -> list:
    return [cell for cell in notebook.cells if "nbgrader" in cell.metadata]


def is_test_cell(cell) -> bool:
    """An autograded test: a code cell with points that is not a student's answer."""
    return cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade") and \
        not cell.metadata["nbgrader"].get("solution")


def is_written_answer(cell) -> bool:
    """A manually graded written answer: a markdown cell that is both a solution and a grade cell."""
    nbgrader = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "markdown" and nbgrader.get("grade") and nbgrader.get("solution")


def solution_cell_ids(notebook) -> list[str]:
    """The code cells the student writes, in order."""
    return [cell.metadata.nbgrader["grade_id"] for cell in nbgrader_cells(notebook)
            if cell.cell_type == "code" and cell.metadata.nbgrader.get("solution")]


@contextmanager
def _venv_on_path():
    """nbgrader runs the `alembic` command when it creates a gradebook: the venv's bin must be on PATH."""
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    try:
        yield
    finally:
        os.environ["PATH"] = path


class Course:
    """An nbgrader course directory under ``root`` holding copies of some of the course's assignments."""

    def __init__(self, root: Path, assignments: list[str]):
        from nbgrader.apps import NbGraderAPI
        from traitlets.config.loader import PyFileConfigLoader

        self.root = Path(root)
        for assignment in assignments:
            shutil.copytree(COURSE / "source" / assignment, self.root / "source" / assignment)
        config = PyFileConfigLoader("nbgrader_config.py", str(COURSE)).load_config()   # the committed settings
        config.CourseDirectory.root = str(self.root)
        config.CourseDirectory.db_url = f"sqlite:///{self.root / 'gradebook.db'}"
        self.db_url = config.CourseDirectory.db_url
        with _venv_on_path():
            self.api = NbGraderAPI(config=config)
            for assignment in assignments:
                outcome = self.api.generate_assignment(assignment)
                assert outcome["success"], f"generate_assignment {assignment}:\n{outcome.get('error')}\n{outcome.get('log')}"

    def source(self, assignment: str):
        return nbformat.read(self.root / "source" / assignment / f"{assignment}.ipynb", 4)

    def release(self, assignment: str):
        return nbformat.read(self.root / "release" / assignment / f"{assignment}.ipynb", 4)

    def submit(self, student: str, assignment: str, notebook) -> None:
        folder = self.root / "submitted" / student / assignment
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, folder / f"{assignment}.ipynb")

    def autograde(self, assignment: str, student: str) -> dict[str, Grade]:
        """Autograde one submission; {test cell id: Grade} of its autograded test cells."""
        from nbgrader.api import Gradebook

        with _venv_on_path():
            outcome = self.api.autograde(assignment, student)
        assert outcome["success"], f"autograde {assignment} ({student}):\n{outcome.get('error')}\n{outcome.get('log')}"
        graded = nbformat.read(self.root / "autograded" / student / assignment / f"{assignment}.ipynb", 4)
        tests = {cell.metadata.nbgrader["grade_id"]: error_text(cell) for cell in graded.cells if is_test_cell(cell)}
        with Gradebook(self.db_url) as gradebook:
            submission = gradebook.find_submission(assignment, student)
            return {grade.name: Grade(grade.score, grade.max_score, tests[grade.name])
                    for notebook in submission.notebooks for grade in notebook.grades if grade.name in tests}

    def written_answers(self, assignment: str, student: str) -> dict[str, bool]:
        """The written answers of an autograded submission: {cell id: whether it waits to be graded by hand}
        (an answer left as the stub does not: nbgrader gives it 0)."""
        from nbgrader.api import Gradebook

        with Gradebook(self.db_url) as gradebook:
            submission = gradebook.find_submission(assignment, student)
            return {grade.name: bool(grade.needs_manual_grade) for notebook in submission.notebooks
                    for grade in notebook.grades if grade.cell.cell_type == "markdown"}


def with_solution(notebook, grade_id: str, code: str):
    """A copy of ``notebook`` whose solution cell ``grade_id`` holds ``code`` instead: a student's answer."""
    answer = copy.deepcopy(notebook)
    cells = [cell for cell in nbgrader_cells(answer) if cell.metadata.nbgrader["grade_id"] == grade_id]
    assert len(cells) == 1 and cells[0].metadata.nbgrader["solution"], f"no solution cell {grade_id!r}"
    cells[0].source = code
    return answer


def structure_problems(notebook) -> list[str]:
    """What is wrong with a source notebook's nbgrader structure (an empty list when nothing is)."""
    cells = nbgrader_cells(notebook)
    solutions = [cell for cell in cells if cell.cell_type == "code" and cell.metadata.nbgrader["solution"]]
    tests = [cell for cell in cells if is_test_cell(cell)]
    problems = [] if solutions and tests else ["no solution cell or no test cell"]
    problems += [f"{cell.metadata.nbgrader['grade_id']}: no ### BEGIN SOLUTION / ### END SOLUTION" for cell in solutions
                 if "### BEGIN SOLUTION" not in cell.source or "### END SOLUTION" not in cell.source]
    problems += [f"{cell.metadata.nbgrader['grade_id']}: a test cell must be read-only and have points" for cell in tests
                 if not (cell.metadata.nbgrader.get("points", 0) > 0 and cell.metadata.nbgrader["locked"])]
    problems += [f"{cell.metadata.nbgrader['grade_id']}: a test cell must call grade({cell.metadata.nbgrader['grade_id']!r}, …)"
                 for cell in tests if f'grade("{cell.metadata.nbgrader["grade_id"]}"' not in cell.source]
    problems += [f"{cell.metadata.nbgrader['grade_id']}: a written answer needs points and a model answer"
                 for cell in notebook.cells if is_written_answer(cell)
                 if not (cell.metadata.nbgrader.get("points", 0) > 0 and cell.source.strip() and ANSWER_STUB not in cell.source)]
    total = sum(cell.metadata.nbgrader.get("points", 0) for cell in tests)
    if total != POINTS_PER_ASSIGNMENT:
        problems.append(f"the tests are worth {total} points, not {POINTS_PER_ASSIGNMENT}")
    if any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"):
        problems.append("outputs left in: strip them (python notebooks/strip_outputs.py)")
    ids = [cell.metadata.nbgrader["grade_id"] for cell in cells]
    problems += [f"grade_id {name!r} used twice" for name in sorted(set(ids)) if ids.count(name) > 1]
    return problems


def leaked_solutions(source, release) -> list[str]:
    """Solution cells of ``release`` that still hold (the last line of) the source's solution code, and
    written answers that are not the blank stub."""
    solution_code = {cell.metadata.nbgrader["grade_id"]: cell.source for cell in nbgrader_cells(source)
                     if cell.metadata.nbgrader["solution"]}
    leaks = []
    for cell in nbgrader_cells(release):
        name = cell.metadata.nbgrader["grade_id"]
        if not cell.metadata.nbgrader["solution"]:
            continue
        if cell.cell_type == "markdown":
            if cell.source.strip() != ANSWER_STUB:
                leaks.append(name)
            continue
        body = re.search(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", solution_code[name], re.S).group(1)
        if ("BEGIN SOLUTION" in cell.source or "raise NotImplementedError()" not in cell.source
                or body.strip().splitlines()[-1].strip() in cell.source):
            leaks.append(name)
    return leaks


# -- one course and one runner for the whole session ---------------------------------------------------------

_SHARED: dict = {}


def shared_course(tmp_path_factory) -> Course:
    """Every assignment in one throw-away course directory, generated once per test session (its gradebook
    is what costs: nbgrader creates it, and each assignment in it, through alembic)."""
    if "course" not in _SHARED:
        _SHARED["course"] = Course(tmp_path_factory.mktemp("course"), ASSIGNMENTS)
    return _SHARED["course"]


def shared_runner() -> NotebookRunner:
    """The warm notebook pool and its referee, started once per test session (tests/notebook_runner.py)."""
    if "runner" not in _SHARED:
        _SHARED["runner"] = runner = NotebookRunner(ASSIGNMENTS)
        atexit.register(runner.close)
    return _SHARED["runner"]


#: read-only cells that only show the student something (a timing): left out of the notebooks the pool grades
DISPLAY_ONLY = ("timing", "speedup")


def without_display_cells(notebook):
    """A copy of ``notebook`` without its display-only cells, which grade nothing."""
    trimmed = copy.deepcopy(notebook)
    trimmed.cells = [cell for cell in trimmed.cells if cell.metadata.get("nbgrader", {}).get("grade_id") not in DISPLAY_ONLY]
    return trimmed


def part_alone(source, release, cell: str):
    """The released notebook with only solution cell ``cell`` answered: the source's answer put back."""
    answer = next(c for c in nbgrader_cells(source) if c.metadata.nbgrader["grade_id"] == cell)
    return with_solution(release, cell, answer.source)


def part_alone_problems(grades: dict, parts: dict, cell: str) -> str:
    """What is wrong with the grades of the release with only ``cell`` answered: "" when that part's test
    cells ``parts[cell]`` have full marks and every other test cell zero."""
    if set().union(*parts.values()) != grades.keys():
        return f"PARTS must name every test cell once: {sorted(grades)}"
    earned = {name for name, grade in grades.items() if grade.score == grade.max_score > 0}
    scored = {name for name, grade in grades.items() if grade.score != 0}
    if earned != parts[cell] or scored != earned:
        missing = {name: grades[name].error for name in parts[cell] - earned}
        return f"{cell} alone: earned {sorted(earned)}, scored {sorted(scored)}; missing {missing}"
    return ""
