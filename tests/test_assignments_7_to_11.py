"""Assignments 7–11 graded four ways: the solutions, the blanks, wrong answers, and each part alone.

Every assignment is released (nbgrader's ``generate_assignment``) and graded for several "students":

- ``solutions`` submits the instructor's source notebook: full marks on every test cell;
- ``blanks`` submits the student version as released: zero on every test cell;
- ``wrong1`` and ``wrong2`` submit plausible wrong answers (``WRONG``; mistakes in different cells of one
  notebook share a submission): partial credit, losing exactly the points of the case families each
  mistake breaks, with a message that names what is wrong;
- ``only <cell>`` submits the release with one solution cell answered: exactly that part's points
  (``PARTS``) — no part needs another to be graded.

The performance assignments (9: the fused CPU layer, 10: the tiled GPU kernel) are graded on counts,
not times; their wrong answers are *correct but slow* — untiled, unfused, not parallel — and must
score below the fast solution while passing every correctness test. The CUDA kernels run in Numba's
simulator here (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1, and the notebook kernels inherit it).
One module-scoped fixture does all the grading — the solutions and blanks through nbgrader itself, the
rest through the notebook pool (tests/notebook_runner.py: the same seal check and scoring without a
kernel start per notebook); the tests read its results.
"""

from __future__ import annotations

from typing import NamedTuple

import nbformat
import pytest

from nbgrader_course import (is_written_answer, leaked_solutions, part_alone, part_alone_problems, shared_course,
                             shared_runner, solution_cell_ids, source_notebook, structure_problems, with_solution,
                             without_display_cells)

ASSIGNMENTS = ["a7_network_layers", "a8_solver", "a9_numba_fused", "a10_tiled_dense", "a11_distributed"]

#: each solution cell, and the test cells that grade it
PARTS = {
    "a7_network_layers": {"dense_forward": {"test_dense_forward"},
                          "dense_backward": {"test_dense_backward", "test_dense_gradient_check"},
                          "softmax_loss": {"test_softmax_values", "test_softmax_large_scores", "test_softmax_gradient_check"},
                          "maxpool_forward": {"test_maxpool_2x2", "test_maxpool_overlapping", "test_maxpool_switches"}},
    "a8_solver": {"sgd_momentum": {"test_sgd_plain", "test_sgd_momentum", "test_sgd_weight_decay"},
                  "train_loop": {"test_loop_same_as_library", "test_loop_step_schedule", "test_loop_stops_on_nan"},
                  "overfit_settings": {"test_overfit_accuracy", "test_overfit_loss"}},
    "a9_numba_fused": {"conv_plane": {"test_conv_plane"},
                       "conv_relu_pool": {"test_fused_2x2", "test_fused_overlapping", "test_parallel_loop",
                                          "test_no_full_size_temporary", "test_outputs_written_once",
                                          "test_convolution_computed_once"}},
    "a10_tiled_dense": {"tiled_kernel": {"test_tiled_whole_tiles", "test_tiled_ragged", "test_tiled_reads_x",
                                         "test_tiled_reads_w", "test_tiled_writes_y_once"},
                        "blocked_kernel": {"test_blocked_whole_tiles", "test_blocked_ragged", "test_blocked_global_reads",
                                           "test_blocked_shared_reads"}},
    "a11_distributed": {"ring_allreduce": {"test_ring_divisible", "test_ring_uneven", "test_ring_traffic"},
                        "parameter_server": {"test_server_weights", "test_server_velocity"},
                        "easgd": {"test_easgd_workers", "test_easgd_center", "test_easgd_traffic"}},
}


class Wrong(NamedTuple):
    """A plausible wrong submission: solution cells rewritten (``answers``: cell → code); it must lose
    exactly the test cells of ``fails``, each with an error that contains the given words."""

    student: str
    assignment: str
    what: str
    answers: dict
    fails: dict


SOFTMAX_WITHOUT_SHIFT = '''
def softmax_loss(logits, labels):
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    dlogits = probs.copy()
    dlogits[rows, labels] -= 1
    return -np.log(probs[rows, labels]).mean(), dlogits / len(labels)
'''

SOFTMAX_LOG_OF_P = '''
def softmax_loss(logits, labels):
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    dlogits = probs.copy()
    dlogits[rows, labels] -= 1
    return -np.log(probs[rows, labels]).mean(), dlogits / len(labels)
'''

SWITCHES_IN_THE_WINDOW = '''
def maxpool_forward(x, size, stride):
    N, C, H, W = x.shape
    Ho, Wo = (H - size) // stride + 1, (W - size) // stride + 1
    y, argmax = np.empty((N, C, Ho, Wo)), np.empty((N, C, Ho, Wo), dtype=np.int64)
    for i in range(Ho):
        for j in range(Wo):
            windows = x[:, :, i * stride:i * stride + size, j * stride:j * stride + size].reshape(N, C, -1)
            y[:, :, i, j], argmax[:, :, i, j] = windows.max(axis=2), windows.argmax(axis=2)
    return y, argmax
'''

WEIGHT_DECAY_OUTSIDE_THE_VELOCITY = '''
def sgd_momentum(params, velocity, grad, lr, momentum, weight_decay):
    velocity *= momentum
    velocity += grad
    params -= lr * (velocity + weight_decay * params)
'''

SCHEDULE_IGNORED = '''
def train_loop(stage, images, labels, epochs, batch_size, lr, momentum=0.9, weight_decay=0.0, seed=0,
               step_epochs=None, gamma=0.1, update=sgd_momentum):
    rng = np.random.default_rng(seed)
    params, velocity, losses = stage.get_params(), stage.get_momentum(), []
    for epoch in range(epochs):
        order = rng.permutation(len(images))
        for batch in range(len(images) // batch_size):
            chosen = order[batch * batch_size:(batch + 1) * batch_size]
            stage.load_batch(images[chosen], labels[chosen])
            stage.forward()
            stage.backward()
            loss = stage.fetch_loss()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss {loss} at epoch {epoch + 1}, batch {batch + 1}")
            update(params, velocity, stage.get_grad(), lr, momentum, weight_decay)
            stage.set_params(params)
            losses.append(loss)
    stage.set_momentum(velocity)
    return losses
'''

UNFUSED = '''
@njit(parallel=True)
def conv_relu_pool(x, W, b, size, stride, out, switch):
    N, F = x.shape[0], W.shape[0]
    Hc, Wc = x.shape[2] - W.shape[2] + 1, x.shape[3] - W.shape[3] + 1
    planes = np.empty((N, F, Hc, Wc), dtype=x.dtype)
    for item in prange(N * F):
        conv_plane(x, W, b, item // F, item % F, planes[item // F, item % F])
    for item in prange(N * F):
        n, f = item // F, item % F
        for i in range(out.shape[2]):
            for j in range(out.shape[3]):
                best, winner = 0.0, (i * stride) * Wc + j * stride
                for h in range(i * stride, i * stride + size):
                    for w in range(j * stride, j * stride + size):
                        if planes[n, f, h, w] > best:
                            best, winner = planes[n, f, h, w], h * Wc + w
                out[n, f, i, j] = best
                switch[n, f, i, j] = winner
'''

SERIAL = '''
@njit(parallel=True)
def conv_relu_pool(x, W, b, size, stride, out, switch):
    N, F = x.shape[0], W.shape[0]
    Hc, Wc = x.shape[2] - W.shape[2] + 1, x.shape[3] - W.shape[3] + 1
    for item in range(N * F):
        n, f = item // F, item % F
        plane = np.empty((Hc, Wc), dtype=x.dtype)
        conv_plane(x, W, b, n, f, plane)
        for i in range(out.shape[2]):
            for j in range(out.shape[3]):
                best, winner = 0.0, (i * stride) * Wc + j * stride
                for h in range(i * stride, i * stride + size):
                    for w in range(j * stride, j * stride + size):
                        if plane[h, w] > best:
                            best, winner = plane[h, w], h * Wc + w
                out[n, f, i, j] = best
                switch[n, f, i, j] = winner
'''

UNTILED = '''
@cuda.jit
def dense_tiled_kernel(x, w, b, y):
    col, row = cuda.grid(2)
    if row < y.shape[0] and col < y.shape[1]:
        total = b[col]
        for k in range(x.shape[1]):
            total += x[row, k] * w[col, k]
        y[row, col] = total
'''

NOT_REGISTER_BLOCKED = '''
@cuda.jit
def dense_blocked_kernel(x, w, b, y):
    x_tile = cuda.shared.array((TILE, TILE), np.float32)
    w_tile = cuda.shared.array((TILE, WIDE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row, first = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * WIDE
    t0 = t1 = t2 = t3 = np.float32(0.0)
    for start in range(0, x.shape[1], TILE):
        k = start + tx
        x_tile[ty, tx] = x[row, k] if row < x.shape[0] and k < x.shape[1] else 0
        for r in range(REGISTERS):
            o = first + ty + r * TILE
            w_tile[tx, ty + r * TILE] = w[o, k] if o < w.shape[0] and k < x.shape[1] else 0
        cuda.syncthreads()
        for kk in range(TILE):
            t0 += x_tile[ty, kk] * w_tile[kk, tx]
            t1 += x_tile[ty, kk] * w_tile[kk, tx + TILE]
            t2 += x_tile[ty, kk] * w_tile[kk, tx + 2 * TILE]
            t3 += x_tile[ty, kk] * w_tile[kk, tx + 3 * TILE]
        cuda.syncthreads()
    col = first + tx
    for r, total in ((0, t0), (1, t1), (2, t2), (3, t3)):
        if row < y.shape[0] and col + r * TILE < y.shape[1]:
            y[row, col + r * TILE] = total + b[col + r * TILE]
'''

UNTILED_FOUR_PER_THREAD = '''
@cuda.jit
def dense_blocked_kernel(x, w, b, y):
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row, first = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * WIDE
    if row < y.shape[0]:
        for r in range(REGISTERS):
            col = first + tx + r * TILE
            if col < y.shape[1]:
                total = b[col]
                for k in range(x.shape[1]):
                    total += x[row, k] * w[col, k]
                y[row, col] = total
'''

GATHER_AND_BROADCAST = '''
def ring_allreduce(comm, vector):
    size, rank = comm.Get_size(), comm.Get_rank()
    if rank != 0:
        comm.Send(vector, dest=0)
        comm.Recv(vector, source=0)
        return vector
    received = np.empty_like(vector)
    for source in range(1, size):
        comm.Recv(received, source=source)
        vector += received
    for dest in range(1, size):
        comm.Send(vector, dest=dest)
    return vector
'''

SEND_THEN_RECEIVE = '''
def ring_allreduce(comm, vector):
    size, rank = comm.Get_size(), comm.Get_rank()
    bounds = np.linspace(0, len(vector), size + 1).astype(int)
    chunk = lambda index: vector[bounds[index % size]:bounds[index % size + 1]]
    right, left = (rank + 1) % size, (rank - 1) % size
    for k in range(size - 1):
        comm.Send(chunk(rank - k), dest=right)
        received = np.empty_like(chunk(rank - k - 1))
        comm.Recv(received, source=left)
        chunk(rank - k - 1)[...] += received
    for k in range(size - 1):
        comm.Send(chunk(rank - k + 1), dest=right)
        comm.Recv(chunk(rank - k), source=left)
    return vector
'''

CENTER_WORKER_BY_WORKER = '''
def easgd_exchange(comm, weights, lr, rho):
    size, rank = comm.Get_size(), comm.Get_rank()
    alpha = lr * rho
    received = np.empty_like(weights)
    if rank == 0:
        for worker in range(1, size):
            comm.Sendrecv(weights.copy(), dest=worker, recvbuf=received, source=worker)
            weights += alpha * (received - weights)
    else:
        comm.Sendrecv(weights, dest=0, recvbuf=received, source=0)
        weights -= alpha * (weights - received)
'''

WRONG = [
    Wrong("wrong1", "a7_network_layers", "softmax without the row maximum; switches inside the window",
          {"softmax_loss": SOFTMAX_WITHOUT_SHIFT, "maxpool_forward": SWITCHES_IN_THE_WINDOW},
          {"test_softmax_large_scores": "np.exp overflowed", "test_maxpool_switches": "positions inside the window"}),
    Wrong("wrong2", "a7_network_layers", "softmax shifted by the row maximum, but its loss from np.log(p)",
          {"softmax_loss": SOFTMAX_LOG_OF_P}, {"test_softmax_large_scores": "a probability rounded to 0 was logged"}),
    Wrong("wrong1", "a8_solver", "weight decay outside the velocity; the learning-rate schedule ignored",
          {"sgd_momentum": WEIGHT_DECAY_OUTSIDE_THE_VELOCITY, "train_loop": SCHEDULE_IGNORED},
          {"test_sgd_weight_decay": "weight decay λ = 0.01", "test_loop_step_schedule": "step rate"}),
    Wrong("wrong1", "a9_numba_fused", "correct but unfused: the whole convolution output in one array",
          {"conv_relu_pool": UNFUSED}, {"test_no_full_size_temporary": "the whole convolution output"}),
    Wrong("wrong2", "a9_numba_fused", "correct but serial: range instead of prange",
          {"conv_relu_pool": SERIAL}, {"test_parallel_loop": "no loop that Numba runs in parallel"}),
    Wrong("wrong1", "a10_tiled_dense", "correct but untiled, and register blocking without the register",
          {"tiled_kernel": UNTILED, "blocked_kernel": NOT_REGISTER_BLOCKED},
          {"test_tiled_reads_x": "reads x 32.00 times per output from global memory",
           "test_tiled_reads_w": "reads w 32.00 times per output from global memory",
           "test_blocked_shared_reads": "2.00 times per multiply-add"}),
    Wrong("wrong2", "a10_tiled_dense", "correct but untiled: four outputs a thread, every operand from global memory",
          {"blocked_kernel": UNTILED_FOUR_PER_THREAD},
          {"test_blocked_global_reads": "reads x 32.00 times per output from global memory",
           "test_blocked_shared_reads": "reads x 32.00 times per output from global memory"}),
    Wrong("wrong1", "a11_distributed", "a gather to rank 0 and a broadcast; EASGD's center updated worker by worker",
          {"ring_allreduce": GATHER_AND_BROADCAST, "easgd": CENTER_WORKER_BY_WORKER},
          {"test_ring_traffic": "rank 0 sent 3000 numbers", "test_easgd_workers": "worker 2's weights",
           "test_easgd_center": "the center"}),
    Wrong("wrong2", "a11_distributed", "a ring that sends before it receives",
          {"ring_allreduce": SEND_THEN_RECEIVE},
          {test: "Deadlock: deadlock: rank 0 waits in Send" for test in
           ("test_ring_divisible", "test_ring_uneven", "test_ring_traffic")}),
]

#: the correctness test cells of the performance assignments: a slow answer must pass them all
CORRECTNESS = {"a9_numba_fused": {"test_conv_plane", "test_fused_2x2", "test_fused_overlapping"},
               "a10_tiled_dense": {"test_tiled_whole_tiles", "test_tiled_ragged", "test_blocked_whole_tiles",
                                   "test_blocked_ragged"}}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{(assignment, student): {test cell: Grade}}, and the released notebooks under ("release", assignment)."""
    course = shared_course(tmp_path_factory)
    results = {("release", assignment): course.release(assignment) for assignment in ASSIGNMENTS}
    for assignment in ASSIGNMENTS:                                    # through nbgrader itself
        for student, notebook in (("solutions", course.source(assignment)), ("blanks", course.release(assignment))):
            course.submit(student, assignment, notebook)
            results[(assignment, student)] = course.autograde(assignment, student)
    submissions = {}
    for wrong in WRONG:
        notebook = submissions.get((wrong.assignment, wrong.student), course.source(wrong.assignment))
        for cell, code in wrong.answers.items():
            notebook = with_solution(notebook, cell, code.strip("\n"))
        submissions[(wrong.assignment, wrong.student)] = notebook
    for assignment, parts in PARTS.items():
        for cell in parts:
            submissions[(assignment, f"only {cell}")] = part_alone(course.source(assignment), course.release(assignment), cell)
    grades = shared_runner().grade([without_display_cells(notebook) for notebook in submissions.values()],
                                   [assignment for assignment, _ in submissions])
    results.update(zip(submissions, grades))
    return results


def total(grades) -> float:
    return sum(grade.score for grade in grades.values())


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_source_structure(assignment):
    assert structure_problems(nbformat.read(source_notebook(assignment), 4)) == []


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_has_no_solutions(graded, assignment):
    source = nbformat.read(source_notebook(assignment), 4)
    assert leaked_solutions(source, graded[("release", assignment)]) == []


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_solutions_score_full_marks(graded, assignment):
    grades = graded[(assignment, "solutions")]
    lost = {name: grade for name, grade in grades.items() if grade.score != grade.max_score}
    assert grades and not lost, f"{assignment}: the solutions lose points on {lost}"
    assert total(grades) == 10


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_blanks_score_zero(graded, assignment):
    grades = graded[(assignment, "blanks")]
    assert grades.keys() == graded[(assignment, "solutions")].keys()
    scored = {name: grade for name, grade in grades.items() if grade.score != 0}
    assert not scored, f"{assignment}: the unanswered student version scores on {scored}"


@pytest.mark.parametrize("wrong", WRONG, ids=[f"{w.assignment}-{w.student}" for w in WRONG])
def test_wrong_answer_loses_exactly_its_families(graded, wrong):
    grades = graded[(wrong.assignment, wrong.student)]
    failed = {name for name, grade in grades.items() if grade.score < grade.max_score}
    assert failed == wrong.fails.keys(), f"{wrong.what}: failed {sorted(failed)}, expected {sorted(wrong.fails)}"
    assert 0 < total(grades) < 10
    for name, words in wrong.fails.items():
        assert grades[name].score == 0 and words in grades[name].error, (
            f"{wrong.what}: cell {name} says {grades[name].error!r}, which does not name the mistake ({words!r})")


@pytest.mark.parametrize("wrong", [w for w in WRONG if w.assignment in CORRECTNESS],
                         ids=[f"{w.assignment}-{w.student}" for w in WRONG if w.assignment in CORRECTNESS])
def test_slow_correct_answer_scores_below_the_fast_one(graded, wrong):
    """Untiled, unfused, serial: right numbers, fewer points than the solution."""
    grades = graded[(wrong.assignment, wrong.student)]
    assert all(grades[name].score == grades[name].max_score for name in CORRECTNESS[wrong.assignment]), \
        f"{wrong.what} should be correct"
    assert total(grades) < total(graded[(wrong.assignment, "solutions")])


@pytest.mark.parametrize("assignment, cell", [(a, cell) for a, parts in PARTS.items() for cell in parts])
def test_each_part_alone_earns_its_points(graded, assignment, cell):
    """The release with only ``cell`` answered: that part's test cells at full marks, every other at zero."""
    grades = graded[(assignment, f"only {cell}")]
    problem = part_alone_problems(grades, PARTS[assignment], cell)
    assert not problem, f"{assignment}: {problem}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_parts_cover_every_solution_cell(assignment):
    assert set(PARTS[assignment]) == set(solution_cell_ids(nbformat.read(source_notebook(assignment), 4)))


def test_an_untiled_kernel_with_no_shared_memory_gets_nothing_for_shared_reads(graded):
    """Issue 25: the untiled kernel in place of the register-blocked one reads no shared memory at all —
    the shared-reads family must give it 0, saying it keeps no tile."""
    grade = graded[("a10_tiled_dense", "wrong2")]["test_blocked_shared_reads"]
    assert grade.score == 0, grade
    assert "reads x 32.00 times per output from global memory" in grade.error, grade.error


#: the written questions (cs231n's inline questions), graded by hand apart from the 10 autograded points
WRITTEN = {"a9_numba_fused": {"q_why_faster": 2},
           "a10_tiled_dense": {"q_traffic_and_time": 2, "q_what_the_profile_shows": 2},
           "a11_distributed": {"q_what_staleness_costs": 2}}


@pytest.mark.parametrize("assignment", sorted(WRITTEN))
def test_written_questions_are_answered_in_the_source_and_blank_in_the_release(graded, assignment):
    """The source holds a model answer; the release the stub (nbgrader's autograde of both is checked for
    assignments 4 and 5 in tests/test_assignments.py)."""
    answers = {cell.metadata.nbgrader["grade_id"]: cell for cell in nbformat.read(source_notebook(assignment), 4).cells
               if is_written_answer(cell)}
    assert {name: cell.metadata.nbgrader["points"] for name, cell in answers.items()} == WRITTEN[assignment]
    assert all(len(cell.source.split()) > 50 for cell in answers.values()), "a model answer for the rubric"
    released = [cell for cell in graded[("release", assignment)].cells if is_written_answer(cell)]
    assert [cell.source.strip() for cell in released] == ["YOUR ANSWER HERE"] * len(WRITTEN[assignment])


def test_the_a10_gpu_timing_command_runs(tmp_path):
    """assignments/instructor/time_a10.py, which fills the instructor guide's assignment-10 times on a GPU,
    runs here on a tiny product in the simulator: every kernel checked against numpy, the file written."""
    import json
    import subprocess
    import sys

    out = tmp_path / "a10.json"
    script = source_notebook("a10_tiled_dense").parents[2] / "instructor" / "time_a10.py"
    done = subprocess.run([sys.executable, str(script), "--simulator", "--size", "16", "--repeats", "1", "--rounds", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["simulated"] and record["device"] == "Numba's CUDA simulator"
    assert set(record["kernels"]) == {"untiled", "tiled", "register-blocked", "register-blocked, W tile rows unpadded",
                                      "register-blocked, sums in cuda.local.array"}
