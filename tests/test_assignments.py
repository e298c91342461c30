"""The classroom assignments (assignments/source), graded by nbgrader: right, blank and wrong submissions.

In a temporary nbgrader course directory (its own gradebook), for every assignment:

1. ``generate_assignment`` makes the student version: solutions replaced by ``raise NotImplementedError()``;
2. ``autograde`` grades the instructor's source notebook (the solutions), the student version as released
   (the blanks left), and the plausible wrong submissions of ``WRONG`` below (the solutions with one
   mistake put in: the rows of the instructor guide's table of wrong submissions);
3. the solutions must score full marks on every test cell, the blanks zero on every test cell — an
   autograder that cannot fail is worthless — and each wrong submission must lose exactly the test cells
   its mistake breaks, each with an error message that names what is wrong, and keep every other.

The CUDA assignments run in Numba's simulator here (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1 and the
notebook kernels inherit it). One module-scoped fixture does all the grading (a kernel start per graded
notebook, a minute or two in all); the tests then read the gradebook and the autograded notebooks.
"""

import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
COURSE = REPOSITORY / "assignments"
# The first six assignments, one per stage of the first half of the course (tests/test_assignments_new.py
# proves the later ones the same way).
ASSIGNMENTS = ["a1_naive_conv", "a2_im2col", "a3_cuda_conv", "a4_fused_conv_pool", "a5_push_backward",
               "a6_gradient_ring"]
STUDENTS = {"solutions": "source", "blanks": "release"}     # student id -> which version it submits


@dataclass(frozen=True)
class Wrong:
    """A wrong submission: the solution cell ``cell`` of ``assignment`` with each (old, new) edit made once.

    ``loses`` maps every test cell the mistake must fail to words its error message must contain; every
    other test cell must keep its points, except those in ``may_lose``: value tests of a racy kernel, which
    the simulator seldom fails and a GPU may."""

    student: str
    assignment: str
    cell: str
    edits: tuple
    loses: dict
    may_lose: tuple = field(default=())


ATOMIC_DX = "cuda.atomic.add(dx, (n, c, h, col), g * w[f, c, p, q])"
LONG_HAND_DX = "dx[n, c, h, col] = dx[n, c, h, col] + g * w[f, c, p, q]"
CONV_PUSH_VALUES = ("test_conv_stride1", "test_conv_stride2", "test_conv_padding")
WRONG = [
    Wrong("a1-overwrites-dx", "a1_naive_conv", "conv_backward",
          (("dxp[:, :, rows, cols] += ", "dxp[:, :, rows, cols] = "),),
          {"test_backward_stride1": "dx, x", "test_backward_stride2": "dx, x", "test_backward_padding": "dx, x",
           "test_gradient_check_stride1": "dx vs numerical", "test_gradient_check_stride2": "dx vs numerical"}),
    Wrong("a1-no-bias", "a1_naive_conv", "conv_forward",
          (("axes=([1, 2, 3], [1, 2, 3])) + b", "axes=([1, 2, 3], [1, 2, 3]))"),),
          {"test_forward_stride1": "forward, x", "test_forward_stride2": "forward, x",
           "test_forward_padding": "forward, x"}),
    Wrong("a1-backward-ignores-stride", "a1_naive_conv", "conv_backward",   # right at stride 1, wrong at stride 2
          (("slice(i * stride, i * stride + K), slice(j * stride, j * stride + K)", "slice(i, i + K), slice(j, j + K)"),),
          {"test_backward_stride2": "s=2", "test_gradient_check_stride2": "s=2"}),
    Wrong("a2-col2im-overwrites", "a2_im2col", "col2im",
          (("q:q + stride * Wo:stride] += dcols", "q:q + stride * Wo:stride] = dcols"),),
          {"test_col2im_stride1": "col2im", "test_col2im_stride2": "col2im", "test_col2im_padding": "col2im",
           "test_conv_backward_stride1": "dx, x", "test_conv_backward_stride2": "dx, x"}),
    Wrong("a2-calls-the-library", "a2_im2col", "im2col",
          (("### BEGIN SOLUTION\n", "### BEGIN SOLUTION\n    return s2_numpy.im2col(x, K, stride, pad)\n"),),
          {"test_im2col_stride1": "im2col uses s2_numpy", "test_im2col_stride2": "im2col uses s2_numpy",
           "test_im2col_padding": "im2col uses s2_numpy"}),
    Wrong("a3-dx-ignores-padding", "a3_cuda_conv", "data_kernel",
          (("p = h + pad - i * stride", "p = h - i * stride"), ("q = col + pad - j * stride", "q = col - j * stride")),
          {"test_data_stride2": "p=1", "test_data_padding": "p=2"}),
    Wrong("a4-switches-in-pooled-coordinates", "a4_fused_conv_pool", "fused_kernel",
          (("best_at = ci * conv_width + cj", "best_at = i * y.shape[3] + j"),),
          {"test_lenet_case": "switches", "test_overlapping_pools_stride1": "switches",
           "test_overlapping_pools_stride2": "switches", "test_padded_conv": "switches", "test_strided_conv": "switches"}),
    Wrong("a4-windows-every-size-positions", "a4_fused_conv_pool", "fused_kernel",   # right when they do not overlap
          (("ci = i * pool_stride + pi", "ci = i * size + pi"), ("cj = j * pool_stride + pj", "cj = j * size + pj")),
          {"test_overlapping_pools_stride1": "pool 3×3 s=1", "test_overlapping_pools_stride2": "pool 3×3 s=2"}),
    Wrong("a5-plain-add-into-dx", "a5_push_backward", "conv_kernel",
          ((ATOMIC_DX, "dx[n, c, h, col] += g * w[f, c, p, q]"),),
          {"test_atomics_conv": "`dx[n, c, h, col] += g * w[f, c, p, q]`"}, may_lose=CONV_PUSH_VALUES),
    Wrong("a5-long-hand-add-into-dx", "a5_push_backward", "conv_kernel",     # the race the `+=` search missed
          ((ATOMIC_DX, LONG_HAND_DX),),
          {"test_atomics_conv": f"`{LONG_HAND_DX}`"}, may_lose=CONV_PUSH_VALUES),
    Wrong("a5-no-bias-gradient", "a5_push_backward", "conv_kernel",
          (("    cuda.atomic.add(db, f, g)\n", ""),),
          {"test_conv_stride1": "db, x", "test_conv_stride2": "db, x", "test_conv_padding": "db, x"}),
    Wrong("a6-first-release-frees", "a6_gradient_ring", "slot_ring",
          (("            if not self.holders[slot]:\n                self.states[slot] = FREE",
            "            self.states[slot] = FREE"),),
          {"test_states_two_consumers": "expected"}),
    Wrong("a6-release-wakes-nobody", "a6_gradient_ring", "slot_ring",
          (("                self.states[slot] = FREE\n            self._changed.notify_all()",
            "                self.states[slot] = FREE"),),
          {"test_waiting": "claim(2) should return slot 0"}),
    Wrong("a6-claim-never-waits", "a6_gradient_ring", "slot_ring",
          (("if not self._changed.wait_for(lambda: not self.holders[slot], timeout):", "if True:"),),
          {"test_waiting": "claim(2) must wait", "test_deadline": "claim gave up after"}),
    Wrong("a6-unweighted-sum", "a6_gradient_ring", "weighted_sum",
          (("total += weights[s] * slots[s, k]", "total += slots[s, k]"),),
          {"test_weighted_sum": "weighted sum of", "test_accumulation": "accumulated micro-batch gradients"}),
]


def source_notebook(assignment: str) -> Path:
    return COURSE / "source" / assignment / f"{assignment}.ipynb"


def nbgrader_cells(notebook) -> list:
    return [cell for cell in notebook.cells if "nbgrader" in cell.metadata]


def cell_by_id(notebook, grade_id: str):
    return next(cell for cell in nbgrader_cells(notebook) if cell.metadata.nbgrader["grade_id"] == grade_id)


def wrong_notebook(wrong: Wrong):
    """The source notebook with the mistake put into its solution cell (each edit must match exactly once)."""
    notebook = nbformat.read(source_notebook(wrong.assignment), 4)
    cell = cell_by_id(notebook, wrong.cell)
    for old, new in wrong.edits:
        assert cell.source.count(old) == 1, f"{wrong.student}: {old!r} is not once in cell {wrong.cell}"
        cell.source = cell.source.replace(old, new)
    return notebook


def error_message(notebook, grade_id: str) -> str:
    """What a graded test cell raised ('' when it ran without an error)."""
    errors = [output for output in cell_by_id(notebook, grade_id).get("outputs", []) if output.output_type == "error"]
    return " ".join(f"{error.ename}: {error.evalue}" for error in errors)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{assignment: {"release": notebook, student: {grade cell id: (score, max score)}, "autograded": {student: notebook}}}."""
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    root = tmp_path_factory.mktemp("course")
    for assignment in ASSIGNMENTS:
        shutil.copytree(COURSE / "source" / assignment, root / "source" / assignment)
    config = PyFileConfigLoader("nbgrader_config.py", str(COURSE)).load_config()   # the committed settings
    config.CourseDirectory.root = str(root)
    config.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
    # nbgrader runs the `alembic` command when it creates a gradebook: the venv's bin must be on PATH
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    try:
        api = NbGraderAPI(config=config)
        outcome = api.generate_assignment("*")          # what `make assignments` runs (here on the six)
        assert outcome["success"], f"generate_assignment:\n{outcome.get('error')}\n{outcome.get('log')}"
        for student, version in STUDENTS.items():
            shutil.copytree(root / version, root / "submitted" / student)
        for wrong in WRONG:
            folder = root / "submitted" / wrong.student / wrong.assignment
            folder.mkdir(parents=True)
            nbformat.write(wrong_notebook(wrong), folder / f"{wrong.assignment}.ipynb")
        outcome = api.autograde("*", "*")
        assert outcome["success"], f"autograde:\n{outcome.get('error')}\n{outcome.get('log')}"
        results = {assignment: {"release": nbformat.read(root / "release" / assignment / f"{assignment}.ipynb", 4),
                                "autograded": {}} for assignment in ASSIGNMENTS}
        submissions = [(assignment, student) for assignment in ASSIGNMENTS for student in STUDENTS]
        submissions += [(wrong.assignment, wrong.student) for wrong in WRONG]
        with Gradebook(config.CourseDirectory.db_url) as gradebook:
            for assignment, student in submissions:
                submission = gradebook.find_submission(assignment, student)
                results[assignment][student] = {grade.name: (grade.score, grade.max_score)
                                                for notebook in submission.notebooks for grade in notebook.grades}
                results[assignment]["autograded"][student] = nbformat.read(
                    root / "autograded" / student / assignment / f"{assignment}.ipynb", 4)
    finally:
        os.environ["PATH"] = path
    return results


def test_there_are_assignments():
    assert all(source_notebook(assignment).exists() for assignment in ASSIGNMENTS)


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
    assert len(tests) >= 5, "partial credit: a test cell per family of cases, not one per part"
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


def test_every_assignment_has_a_wrong_submission_with_partial_credit(graded):
    partial = {wrong.assignment for wrong in WRONG
               if 0 < sum(score for score, _ in graded[wrong.assignment][wrong.student].values()) < 10}
    assert partial == set(ASSIGNMENTS)


@pytest.mark.parametrize("wrong", WRONG, ids=lambda wrong: wrong.student)
def test_wrong_submission_loses_only_what_it_breaks(graded, wrong):
    grades = graded[wrong.assignment][wrong.student]
    assert set(wrong.loses) | set(wrong.may_lose) <= grades.keys(), "a test cell named here no longer exists"
    autograded = graded[wrong.assignment]["autograded"][wrong.student]
    for grade_id, words in wrong.loses.items():
        assert grades[grade_id][0] == 0, f"{wrong.student}: {grade_id} should fail, scored {grades[grade_id]}"
        message = error_message(autograded, grade_id)
        assert words in message, f"{wrong.student}: {grade_id}'s message does not say {words!r}: {message!r}"
    kept = {name: score for name, score in grades.items() if name not in wrong.loses and name not in wrong.may_lose}
    lost = {name: score for name, score in kept.items() if score[0] != score[1]}
    assert not lost, f"{wrong.student} should keep these points, but lost {lost}: " + "; ".join(
        error_message(autograded, name) for name in lost)


def test_a_backward_pass_wrong_only_at_stride_2_keeps_the_other_families_points(graded):
    grades = graded["a1_naive_conv"]["a1-backward-ignores-stride"]
    assert sum(score for score, _ in grades.values()) == 8
    for family in ("test_backward_stride1", "test_backward_padding", "test_gradient_check_stride1"):
        assert grades[family][0] == grades[family][1] > 0, family
    assert grades["test_backward_stride2"][0] == grades["test_gradient_check_stride2"][0] == 0


@pytest.mark.parametrize("student, written", [("a5-long-hand-add-into-dx", LONG_HAND_DX),
                                              ("a5-plain-add-into-dx", "dx[n, c, h, col] += g * w[f, c, p, q]")])
def test_a_non_atomic_add_into_dx_loses_the_atomics_points_naming_its_line(graded, student, written):
    grades = graded["a5_push_backward"][student]
    assert grades["test_atomics_conv"] == (0, 2)
    kernel = cell_by_id(wrong_notebook(next(w for w in WRONG if w.student == student)), "conv_kernel").source
    line = kernel[:kernel.index(written)].count("\n") + 1          # the kernel's cell starts with @cuda.jit
    message = error_message(graded["a5_push_backward"]["autograded"][student], "test_atomics_conv")
    assert f"line {line}: `{written}`" in message and "cuda.atomic.add" in message, message
