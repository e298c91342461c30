"""The classroom assignments 1–6 (assignments/source), graded: right, blank, wrong, and each part alone.

1. nbgrader's ``generate_assignment`` makes the student version (solutions replaced by
   ``raise NotImplementedError()``); nbgrader's ``autograde`` — with the committed configuration, its
   referee and its seal check — grades the instructor's source notebook (the solutions) and the student
   version as released (the blanks left): full marks on every test cell, and zero on every test cell;
2. the plausible wrong submissions of ``WRONG`` (the solutions with one mistake put in: the rows of the
   instructor guide's table) must each lose exactly the test cells its mistake breaks, each with an
   error message that names what is wrong, and keep every other;
3. every part answered alone — the release with one solution cell put back — must earn exactly that
   part's points (``PARTS``): no part needs another to be graded.

The CUDA assignments run in Numba's simulator here (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1 and the
notebook kernels inherit it). One module-scoped fixture does all the grading: the solutions and blanks
through nbgrader (a kernel per notebook), the wrong and part-alone submissions through the notebook pool
(tests/notebook_runner.py: the same cells, the same seal check and nbgrader's own scoring, without a
kernel start per notebook). The tests then read the grades and errors.
"""

from dataclasses import dataclass, field

import nbformat
import pytest

from nbgrader_course import (is_test_cell, is_written_answer, leaked_solutions, part_alone, part_alone_problems,
                             shared_course, shared_runner, solution_cell_ids, source_notebook, structure_problems,
                             with_solution, without_display_cells)

# The first six assignments, one per stage of the first half of the course
# (tests/test_assignments_7_to_11.py proves the later ones the same way).
ASSIGNMENTS = ["a1_naive_conv", "a2_im2col", "a3_cuda_conv", "a4_fused_conv_pool", "a5_push_backward",
               "a6_gradient_ring"]

#: each solution cell, and the test cells that grade it (a4 is one part: its solutions notebook is that part alone)
PARTS = {
    "a1_naive_conv": {"conv_forward": {"test_forward_stride1", "test_forward_stride2", "test_forward_padding"},
                      "conv_backward": {"test_backward_stride1", "test_backward_stride2", "test_backward_padding",
                                        "test_gradient_check_stride1", "test_gradient_check_stride2"}},
    "a2_im2col": {"im2col": {"test_im2col_stride1", "test_im2col_stride2", "test_im2col_padding"},
                  "col2im": {"test_col2im_stride1", "test_col2im_stride2", "test_col2im_padding"},
                  "conv_forward": {"test_conv_forward_stride1", "test_conv_forward_stride2"},
                  "conv_backward": {"test_conv_backward_stride1", "test_conv_backward_stride2"}},
    "a3_cuda_conv": {"forward_kernel": {"test_forward_stride1", "test_forward_stride2", "test_forward_padding"},
                     "filter_kernel": {"test_filter_stride1", "test_filter_stride2", "test_filter_padding"},
                     "data_kernel": {"test_data_stride1", "test_data_stride2", "test_data_padding"}},
    "a5_push_backward": {"maxpool_kernel": {"test_maxpool_2x2", "test_maxpool_overlapping_stride1",
                                            "test_maxpool_overlapping_stride2", "test_atomics_maxpool"},
                         "conv_kernel": {"test_conv_stride1", "test_conv_stride2", "test_conv_padding", "test_atomics_conv"}},
    "a6_gradient_ring": {"slot_ring": {"test_states_one_consumer", "test_states_two_consumers", "test_waiting",
                                       "test_deadline"},
                         "weighted_sum": {"test_weighted_sum", "test_accumulation"}},
}


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
          (("### BEGIN SOLUTION\n", "### BEGIN SOLUTION\n    from cnn.stages import s2_numpy\n"
                                     "    return s2_numpy.im2col(x, K, stride, pad)\n"),),
          {"test_im2col_stride1": "im2col uses cnn.stages.s2_numpy", "test_im2col_stride2": "im2col uses cnn.stages.s2_numpy",
           "test_im2col_padding": "im2col uses cnn.stages.s2_numpy"}),
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


def solution_cell(notebook, grade_id: str):
    return next(cell for cell in notebook.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def wrong_notebook(wrong: Wrong):
    """The source notebook with the mistake put into its solution cell (each edit must match exactly once)."""
    notebook = nbformat.read(source_notebook(wrong.assignment), 4)
    code = solution_cell(notebook, wrong.cell).source
    for old, new in wrong.edits:
        assert code.count(old) == 1, f"{wrong.student}: {old!r} is not once in cell {wrong.cell}"
        code = code.replace(old, new)
    return with_solution(notebook, wrong.cell, code)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """The assignments in the session's course directory, and every submission's grades:
    grades[assignment, student] = {test cell id: Grade(score, max_score, error)}."""
    course = shared_course(tmp_path_factory)
    grades = {}
    for assignment in ASSIGNMENTS:                           # through nbgrader itself
        for student, notebook in (("solutions", course.source(assignment)), ("blanks", course.release(assignment))):
            course.submit(student, assignment, notebook)
            grades[assignment, student] = course.autograde(assignment, student)
    submissions = [(wrong.assignment, wrong.student, wrong_notebook(wrong)) for wrong in WRONG]
    submissions += [(assignment, f"only {cell}", part_alone(course.source(assignment), course.release(assignment), cell))
                    for assignment, parts in PARTS.items() for cell in parts]
    graded = shared_runner().grade([without_display_cells(notebook) for *_, notebook in submissions],
                                   [name for name, *_ in submissions])
    grades.update({(assignment, student): result for (assignment, student, _), result in zip(submissions, graded)})
    return course, grades


def test_there_are_assignments():
    assert all(source_notebook(assignment).exists() for assignment in ASSIGNMENTS)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_source_has_solutions_tests_and_points(assignment):
    notebook = nbformat.read(source_notebook(assignment), 4)
    assert not structure_problems(notebook)
    tests = [cell for cell in notebook.cells if is_test_cell(cell)]
    assert len(tests) >= 5, "partial credit: a test cell per family of cases, not one per part"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_has_no_solutions(course, assignment):
    generated, _ = course
    assert not leaked_solutions(generated.source(assignment), generated.release(assignment))


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_solutions_score_full_marks(course, assignment):
    grades = course[1][assignment, "solutions"]
    assert grades, "no test cell was graded"
    missing = {name: grade for name, grade in grades.items() if grade.score != grade.max_score}
    assert not missing, f"{assignment}: the solutions lose points on {missing}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_blanks_score_zero(course, assignment):
    grades = course[1][assignment, "blanks"]
    assert grades.keys() == course[1][assignment, "solutions"].keys()
    scored = {name: grade for name, grade in grades.items() if grade.score != 0}
    assert not scored, f"{assignment}: the unanswered student version scores on {scored}"


def test_every_assignment_has_a_wrong_submission_with_partial_credit(course):
    partial = {wrong.assignment for wrong in WRONG
               if 0 < sum(grade.score for grade in course[1][wrong.assignment, wrong.student].values()) < 10}
    assert partial == set(ASSIGNMENTS)


@pytest.mark.parametrize("wrong", WRONG, ids=lambda wrong: wrong.student)
def test_wrong_submission_loses_only_what_it_breaks(course, wrong):
    grades = course[1][wrong.assignment, wrong.student]
    assert set(wrong.loses) | set(wrong.may_lose) <= grades.keys(), "a test cell named here no longer exists"
    for grade_id, words in wrong.loses.items():
        assert grades[grade_id].score == 0, f"{wrong.student}: {grade_id} should fail, scored {grades[grade_id]}"
        assert words in grades[grade_id].error, f"{wrong.student}: {grade_id}'s message does not say {words!r}"
    lost = {name: grade for name, grade in grades.items()
            if name not in wrong.loses and name not in wrong.may_lose and grade.score != grade.max_score}
    assert not lost, f"{wrong.student} should keep these points, but lost {lost}"


def test_a_backward_pass_wrong_only_at_stride_2_keeps_the_other_families_points(course):
    grades = course[1]["a1_naive_conv", "a1-backward-ignores-stride"]
    assert sum(grade.score for grade in grades.values()) == 8
    for family in ("test_backward_stride1", "test_backward_padding", "test_gradient_check_stride1"):
        assert grades[family].score == grades[family].max_score > 0, family
    assert grades["test_backward_stride2"].score == grades["test_gradient_check_stride2"].score == 0


@pytest.mark.parametrize("student, written", [("a5-long-hand-add-into-dx", LONG_HAND_DX),
                                              ("a5-plain-add-into-dx", "dx[n, c, h, col] += g * w[f, c, p, q]")])
def test_a_non_atomic_add_into_dx_loses_the_atomics_points_naming_its_line(course, student, written):
    grade = course[1]["a5_push_backward", student]["test_atomics_conv"]
    assert (grade.score, grade.max_score) == (0, 2)
    kernel = solution_cell(wrong_notebook(next(w for w in WRONG if w.student == student)), "conv_kernel").source
    line = kernel[:kernel.index(written)].count("\n") + 1          # the kernel's cell starts with @cuda.jit
    assert f"line {line}: `{written}`" in grade.error and "cuda.atomic.add" in grade.error, grade.error


@pytest.mark.parametrize("assignment, cell", [(a, cell) for a, parts in PARTS.items() for cell in parts])
def test_each_part_alone_earns_its_points(course, assignment, cell):
    """The release with only ``cell`` answered: that part's test cells at full marks, every other at zero."""
    grades = course[1][assignment, f"only {cell}"]
    problem = part_alone_problems(grades, PARTS[assignment], cell)
    assert not problem, f"{assignment}: {problem}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_parts_cover_every_solution_cell(assignment):
    cells = solution_cell_ids(nbformat.read(source_notebook(assignment), 4))
    assert set(PARTS.get(assignment, {cells[0]: None})) == set(cells), \
        f"{assignment}: PARTS must list its solution cells {cells} (a one-part assignment may be left out)"


#: the written questions (cs231n's inline questions), graded by hand apart from the 10 autograded points
WRITTEN = {"a4_fused_conv_pool": {"q_what_fusion_saves": 2}, "a5_push_backward": {"q_push_or_pull": 2}}


@pytest.mark.parametrize("assignment", sorted(WRITTEN))
def test_written_questions_are_answered_in_the_source_and_blank_in_the_release(course, assignment):
    """The source holds a model answer; the release the stub; nbgrader leaves a written answer to a human
    and gives an unanswered stub 0 at once."""
    generated, grades = course
    answers = {cell.metadata.nbgrader["grade_id"]: cell for cell in generated.source(assignment).cells
               if is_written_answer(cell)}
    assert {name: cell.metadata.nbgrader["points"] for name, cell in answers.items()} == WRITTEN[assignment]
    assert all(len(cell.source.split()) > 50 for cell in answers.values()), "a model answer for the rubric"
    released = [cell for cell in generated.release(assignment).cells if is_written_answer(cell)]
    assert [cell.source.strip() for cell in released] == ["YOUR ANSWER HERE"] * len(WRITTEN[assignment])
    assert generated.written_answers(assignment, "solutions") == {name: True for name in WRITTEN[assignment]}
    assert generated.written_answers(assignment, "blanks") == {name: False for name in WRITTEN[assignment]}
