"""Cheats on every assignment they apply to: each earns 0 in the families it attacks, saying what was refused.

Issue 26: the student's code runs in the grader's kernel, so it can reach what the tests compare with.
Each ``Cheat`` is a submission — the released notebook with one or more cells answered — that tries:

- ``replace``: return zeros and replace the library's reference with its own function
  (``s1_loops.conv_forward = conv_forward_naive``), so that the tests compare zeros with zeros;
- ``global``: keep the library's function in a global (``_theirs = s1_loops.conv_forward``) — or a
  default argument, a ``sys.modules`` lookup, the answer *being* the library's function — and call it;
- ``unwrap``: tell the traffic counter's arrays from plain ones (``type(x).__name__``, a private
  attribute, a copy) and do the work where it does not count;
- ``baseline``: inflate the untiled kernel's counts the old limits were computed from;
- ``helper``: redefine ``grade``, the function every test cell calls, to print "passed";
- ``fake``: rewrite every later cell with an IPython input transformer to print "10/10", or hide every
  error with a custom exception handler;
- ``seal``: print a forged seal, or one made by a referee of the student's own.

Every cheat must score 0 on each test cell it attacks, with the words given in that cell's error. The
cheats are graded through the notebook pool (tests/notebook_runner.py: the cells run in an IPython shell,
the seal check and nbgrader's scoring after), a few of them also through nbgrader itself, with the
course's committed configuration — the proof that nbgrader's autograde applies the seal check.
"""

from __future__ import annotations

from typing import NamedTuple

import nbformat
import pytest

from nbgrader_course import (ASSIGNMENTS, is_test_cell, shared_course, shared_runner, solution_cell_ids, source_notebook,
                             with_solution, without_display_cells)

REFUSED = "the course library was changed"
UNSEALED = "no sealed verdict"


class Cheat(NamedTuple):
    name: str
    assignment: str
    answers: dict       # solution cell -> code; every other cell as released (blank)
    attacks: dict       # test cell -> words its error must contain


def families(*names, words):
    return {name: words for name in names}


# -- replace a reference --------------------------------------------------------------------------------------

REPLACE = [
    Cheat("replace", "a1_naive_conv", {"conv_forward": '''
from cnn.stages import s1_loops


def conv_forward_naive(x, W, b, stride, pad):
    N, C, H, Wd = x.shape
    F, _, K, _ = W.shape
    return np.zeros((N, F, (H + 2 * pad - K) // stride + 1, (Wd + 2 * pad - K) // stride + 1))


s1_loops.conv_forward = conv_forward_naive          # the tests compared with s1_loops.conv_forward
'''}, families("test_forward_stride1", "test_forward_stride2", "test_forward_padding", words=REFUSED)),
    Cheat("replace", "a2_im2col", {"im2col": '''
from cnn.stages import s2_numpy


def im2col(x, K, stride, pad):
    Ho, Wo = (x.shape[2] + 2 * pad - K) // stride + 1, (x.shape[3] + 2 * pad - K) // stride + 1
    return np.zeros((x.shape[0] * Ho * Wo, x.shape[1] * K * K)), (Ho, Wo)


s2_numpy.im2col = im2col
'''}, families("test_im2col_stride1", "test_im2col_stride2", "test_im2col_padding", words=REFUSED)),
    Cheat("replace", "a3_cuda_conv", {"forward_kernel": '''
from cnn.stages import s1_loops


@cuda.jit
def conv_forward_kernel(x, w, y, stride, pad):
    k = cuda.grid(1)
    if k < y.size:
        y.reshape(-1)[k] = 0


def zeros_like_reference(x, w, b, stride, pad):
    return np.zeros((x.shape[0], w.shape[0], (x.shape[2] + 2 * pad - w.shape[2]) // stride + 1,
                     (x.shape[3] + 2 * pad - w.shape[2]) // stride + 1))


s1_loops.conv_forward = zeros_like_reference
'''}, families("test_forward_stride1", "test_forward_stride2", "test_forward_padding", words=REFUSED)),
    Cheat("replace", "a4_fused_conv_pool", {"fused_kernel": '''
from cnn.stages import s1_loops


@cuda.jit
def conv_relu_pool_forward_kernel(x, w, b, y, switches, stride, pad, size, pool_stride, conv_width):
    pass


s1_loops.maxpool_forward = lambda x, size, stride: (x[:, :, :0, :0], x[:, :, :0, :0])
'''}, families("test_lenet_case", "test_overlapping_pools_stride1", "test_padded_conv", words=REFUSED)),
    Cheat("replace", "a5_push_backward", {"maxpool_kernel": '''
from cnn.stages import s1_loops


@cuda.jit
def maxpool_backward_push_kernel(dy, argmax, dx):
    pass


s1_loops.maxpool_backward = lambda dy, argmax, x_shape, size, stride: np.zeros(x_shape)
'''}, families("test_maxpool_2x2", "test_maxpool_overlapping_stride1", "test_maxpool_overlapping_stride2",
               words=REFUSED)),
    Cheat("replace", "a6_gradient_ring", {"slot_ring": '''
import kernels.gradient_ring


class SlotRing:
    def __init__(self, slots, consumers):
        self.states, self.holders, self.step_in, self.waits = [], [], [], 0

    def claim(self, step, timeout=60.0):
        return 0

    def publish(self, slot):
        pass

    def release(self, slot, consumer):
        pass


kernels.gradient_ring.SlotStates = SlotRing
'''}, families("test_states_one_consumer", "test_states_two_consumers", words=REFUSED)),
    Cheat("replace", "a7_network_layers", {"dense_forward": '''
from cnn.stages import s1_loops


def dense_forward(x, W, b):
    return np.zeros((x.shape[0], W.shape[0]))


s1_loops.dense_forward = dense_forward
'''}, families("test_dense_forward", words=REFUSED)),
    Cheat("replace", "a8_solver", {"sgd_momentum": '''
import cnn.stages.base


def sgd_momentum(params, velocity, grad, lr, momentum, weight_decay):
    pass


cnn.stages.base.sgd_momentum_update = sgd_momentum
'''}, families("test_sgd_plain", "test_sgd_momentum", "test_sgd_weight_decay", words=REFUSED)),
    Cheat("replace", "a9_numba_fused", {"conv_plane": '''
from cnn.stages import s1_loops


@njit
def conv_plane(x, W, b, n, f, plane):
    plane[:, :] = 0.0


s1_loops.conv_forward = lambda x, W, b, stride, pad: np.zeros((x.shape[0], W.shape[0], x.shape[2] - W.shape[2] + 1,
                                                             x.shape[3] - W.shape[3] + 1))
'''}, families("test_conv_plane", words=REFUSED)),
    Cheat("replace", "a10_tiled_dense", {"tiled_kernel": '''
from cnn.stages import s1_loops


@cuda.jit
def dense_tiled_kernel(x, w, b, y):
    col, row = cuda.grid(2)
    if row < y.shape[0] and col < y.shape[1]:
        y[row, col] = 0


s1_loops.dense_forward = lambda x, W, b: np.zeros((x.shape[0], W.shape[0]))
'''}, families("test_tiled_whole_tiles", "test_tiled_ragged", words=REFUSED)),
    Cheat("replace", "a11_distributed", {"parameter_server": '''
import cnn.stages.base


def parameter_server_step(comm, params, velocity, grad, lr, momentum, weight_decay):
    pass                                               # every rank keeps its weights


cnn.stages.base.sgd_momentum_update = lambda params, velocity, grad, lr, momentum, weight_decay: None
'''}, families("test_server_weights", "test_server_velocity", words=REFUSED)),
    Cheat("replace-numpy", "a11_distributed", {"ring_allreduce": '''
def ring_allreduce(comm, vector):
    return vector                                      # no exchange at all


np.sum = lambda vectors, axis=None, **kwargs: vectors[0]   # the old tests summed with np.sum in the kernel
'''}, families("test_ring_divisible", "test_ring_uneven", "test_ring_traffic", words="relative error")),
]


# -- keep a reference in a global (and its cousins) -----------------------------------------------------------

GLOBAL = [
    Cheat("global", "a1_naive_conv", {"conv_forward": '''
from cnn.stages import s1_loops
_theirs = s1_loops.conv_forward


def conv_forward_naive(x, W, b, stride, pad):
    return _theirs(x, W, b, stride, pad)
'''}, families("test_forward_stride1", "test_forward_stride2", "test_forward_padding",
               words="uses cnn.stages.s1_loops.conv_forward (through _theirs)")),
    Cheat("default-argument", "a1_naive_conv", {"conv_forward": '''
from cnn.stages import s1_loops


def conv_forward_naive(x, W, b, stride, pad, _theirs=s1_loops.conv_forward):
    return _theirs(x, W, b, stride, pad)
'''}, families("test_forward_stride1", words="uses cnn.stages.s1_loops.conv_forward (through a default argument)")),
    Cheat("lookup-at-run-time", "a1_naive_conv", {"conv_forward": '''
import importlib


def conv_forward_naive(x, W, b, stride, pad):
    module = importlib.import_module("cnn.stages." + "s1_" + "loops")
    return getattr(module, "conv_" + "forward")(x, W, b, stride, pad)
'''}, families("test_forward_stride1", words="called cnn.stages.s1_loops.conv_forward while the tests ran it")),
    Cheat("is-the-library's", "a1_naive_conv", {"conv_backward": '''
from cnn.stages.s1_loops import conv_backward as conv_backward_naive
'''}, families("test_backward_stride1", "test_gradient_check_stride1",
               words="is the library's cnn.stages.s1_loops.conv_backward")),
    Cheat("global", "a2_im2col", {"col2im": '''
from cnn.stages.s2_numpy import col2im as _col2im


def col2im(dcols, x_shape, K, stride, pad):
    return _col2im(dcols, x_shape, K, stride, pad)
'''}, families("test_col2im_stride1", "test_col2im_stride2", "test_col2im_padding",
               words="uses cnn.stages.s2_numpy.col2im (through _col2im)")),
    Cheat("global", "a3_cuda_conv", {"forward_kernel": '''
from kernels.conv2d import conv_window_sum as _sum


@cuda.jit
def conv_forward_kernel(x, w, y, stride, pad):
    k = cuda.grid(1)
    if k >= y.size:
        return
    j = k % y.shape[3]
    i = (k // y.shape[3]) % y.shape[2]
    f = (k // (y.shape[3] * y.shape[2])) % y.shape[1]
    n = k // (y.shape[3] * y.shape[2] * y.shape[1])
    y[n, f, i, j] = _sum(x, w, n, f, i, j, stride, pad)
'''}, families("test_forward_stride1", "test_forward_stride2", "test_forward_padding",
               words="uses kernels.conv2d.conv_window_sum (through _sum)")),
    Cheat("global", "a4_fused_conv_pool", {"fused_kernel": '''
from kernels.conv_pool_fused import relu_pool_window as _window


@cuda.jit
def conv_relu_pool_forward_kernel(x, w, b, y, switches, stride, pad, size, pool_stride, conv_width):
    k = cuda.grid(1)
    if k >= y.size:
        return
    j = k % y.shape[3]
    i = (k // y.shape[3]) % y.shape[2]
    f = (k // (y.shape[3] * y.shape[2])) % y.shape[1]
    n = k // (y.shape[3] * y.shape[2] * y.shape[1])
    best, best_at = _window(x, w, b[f], n, f, i, j, stride, pad, size, pool_stride, conv_width)
    y[n, f, i, j] = best
    switches[n, f, i, j] = best_at
'''}, families("test_lenet_case", "test_strided_conv", words="uses kernels.conv_pool_fused.relu_pool_window (through _window)")),
    Cheat("global", "a5_push_backward", {"conv_kernel": '''
from kernels.conv2d_push import push_conv_gradient as _push


@cuda.jit
def conv_backward_push_kernel(dy, x, w, dx, dw, db, stride, pad):
    k = cuda.grid(1)
    if k >= dy.size:
        return
    j = k % dy.shape[3]
    i = (k // dy.shape[3]) % dy.shape[2]
    f = (k // (dy.shape[3] * dy.shape[2])) % dy.shape[1]
    n = k // (dy.shape[3] * dy.shape[2] * dy.shape[1])
    cuda.atomic.add(db, f, dy[n, f, i, j])
    _push(dy[n, f, i, j], n, f, i, j, x, w, dx, dw, stride, pad, True)
'''}, families("test_conv_stride1", "test_conv_stride2", "test_conv_padding",
               words="uses kernels.conv2d_push.push_conv_gradient (through _push)")),
    Cheat("global", "a6_gradient_ring", {"slot_ring": '''
from kernels.gradient_ring import SlotStates as _Reference


class SlotRing:
    def __init__(self, slots, consumers):
        self._ring = _Reference(slots, consumers)
        self.slots, self.consumers, self._changed = self._ring.slots, self._ring.consumers, self._ring._changed
        self.states, self.holders, self.step_in = self._ring.states, self._ring.holders, self._ring.step_in

    waits = property(lambda self: self._ring.waits)

    def claim(self, step, timeout=60.0):
        return self._ring.claim(step, timeout)

    def publish(self, slot):
        return self._ring.publish(slot)

    def release(self, slot, consumer):
        return self._ring.release(slot, consumer)
'''}, families("test_states_one_consumer", "test_waiting", words="uses kernels.gradient_ring.SlotStates (through _Reference)")),
    Cheat("global", "a7_network_layers", {"softmax_loss": '''
from cnn.stages.base import softmax_cross_entropy as _reference


def softmax_loss(logits, labels):
    return _reference(logits, labels)
'''}, families("test_softmax_values", "test_softmax_large_scores", "test_softmax_gradient_check",
               words="uses cnn.stages.base.softmax_cross_entropy (through _reference)")),
    Cheat("global", "a8_solver", {"sgd_momentum": '''
from cnn.stages.base import sgd_momentum_update as _update


def sgd_momentum(params, velocity, grad, lr, momentum, weight_decay):
    _update(params, velocity, grad, lr, momentum, weight_decay)
'''}, families("test_sgd_plain", "test_sgd_momentum", "test_sgd_weight_decay",
               words="uses cnn.stages.base.sgd_momentum_update (through _update)")),
    Cheat("library-step", "a8_solver", {"train_loop": '''
def train_loop(stage, images, labels, epochs, batch_size, lr, momentum=0.9, weight_decay=0.0, seed=0,
               step_epochs=None, gamma=0.1, update=sgd_momentum):
    rng = np.random.default_rng(seed)
    losses = []
    for epoch in range(epochs):
        order = rng.permutation(len(images))
        rate = lr if step_epochs is None else lr * gamma ** (epoch // step_epochs)
        for batch in range(len(images) // batch_size):
            chosen = order[batch * batch_size:(batch + 1) * batch_size]
            losses.append(stage.train_step(images[chosen], labels[chosen], rate, momentum, weight_decay))
            if not math.isfinite(losses[-1]):
                raise FloatingPointError(f"loss {losses[-1]} at epoch {epoch + 1}, batch {batch + 1}")
    return losses
'''}, families("test_loop_same_as_library", "test_loop_step_schedule",
               words="called cnn.stages.base.Stage.train_step while the tests ran it")),
    Cheat("is-the-library's", "a9_numba_fused", {"conv_plane": '''
from cnn.grading.assignments.a9_numba_fused import reference_conv_plane as conv_plane
'''}, families("test_conv_plane", words="is the library's cnn.grading.assignments.a9_numba_fused.reference_conv_plane")),
    Cheat("global", "a10_tiled_dense", {"tiled_kernel": '''
from kernels.dense import element as _element


@cuda.jit
def dense_tiled_kernel(x, w, b, y):
    col, row = cuda.grid(2)
    if row < y.shape[0] and col < y.shape[1]:
        total = b[col]
        for k in range(x.shape[1]):
            total += _element(x, row, k, False, x.shape[0], x.shape[1]) * w[col, k]
        y[row, col] = total
'''}, families("test_tiled_whole_tiles", "test_tiled_reads_x", words="uses kernels.dense.element (through _element)")),
    Cheat("global", "a11_distributed", {"ring_allreduce": '''
from cnn.parallel.allreduce import chunk_bounds as _bounds


def ring_allreduce(comm, vector):
    size, rank = comm.Get_size(), comm.Get_rank()
    bounds = _bounds(len(vector), size)

    def chunk(index):
        index %= size
        return vector[bounds[index]:bounds[index + 1]]

    right, left = (rank + 1) % size, (rank - 1) % size
    for k in range(size - 1):
        received = np.empty_like(chunk(rank - k - 1))
        comm.Sendrecv(chunk(rank - k), dest=right, recvbuf=received, source=left)
        chunk(rank - k - 1)[...] += received
    for k in range(size - 1):
        received = np.empty_like(chunk(rank - k))
        comm.Sendrecv(chunk(rank - k + 1), dest=right, recvbuf=received, source=left)
        chunk(rank - k)[...] = received
    return vector
'''}, families("test_ring_divisible", "test_ring_uneven", "test_ring_traffic",
               words="uses cnn.parallel.allreduce.chunk_bounds (through _bounds)")),
]


# -- unwrap the counter; inflate a baseline ------------------------------------------------------------------

UNTILED = '''
@cuda.jit
def dense_tiled_kernel(x, w, b, y):
    {unwrap}
    col, row = cuda.grid(2)
    if row < y.shape[0] and col < y.shape[1]:
        total = b[col]
        for k in range(x.shape[1]):
            total += x[row, k] * w[col, k]
        y[row, col] = total
'''
COUNTED = ("test_tiled_reads_x", "test_tiled_reads_w", "test_tiled_writes_y_once")
RECOMPUTING = '''
@njit(parallel=True)
def conv_relu_pool(x, W, b, size, stride, out, switch):
    {unwrap}
    N, F, C, K = x.shape[0], W.shape[0], x.shape[1], W.shape[2]
    Wc = x.shape[3] - K + 1
    for item in prange(N * F):
        n, f = item // F, item % F
        for i in range(out.shape[2]):
            for j in range(out.shape[3]):
                best, winner = 0.0, (i * stride) * Wc + j * stride
                for h in range(i * stride, i * stride + size):
                    for v in range(j * stride, j * stride + size):
                        value = b[f]                       # each window recomputes its convolution outputs
                        for c in range(C):
                            for p in range(K):
                                for q in range(K):
                                    value += W[f, c, p, q] * x[n, c, h + p, v + q]
                        if value > best:
                            best, winner = value, h * Wc + v
                out[n, f, i, j] = best
                switch[n, f, i, j] = winner
'''

UNWRAP = [
    Cheat("unwrap-by-type", "a10_tiled_dense", {"tiled_kernel": UNTILED.format(
        unwrap='if type(x).__name__ == "CountedArray":\n        x, w = x.array, w.array')},
          families(*COUNTED, words="calls type(), which compiled code cannot")),
    Cheat("unwrap-private", "a10_tiled_dense", {"tiled_kernel": UNTILED.format(unwrap="x, w = x._item._ary, w._item._ary")},
          families(*COUNTED, words="reads ._ary, ._item")),
    Cheat("unwrap-copy-to-host", "a10_tiled_dense", {"tiled_kernel": UNTILED.format(
        unwrap="x, w = x.copy_to_host(), w.copy_to_host()")}, families(*COUNTED, words="reads .copy_to_host")),
    Cheat("baseline", "a10_tiled_dense", {"tiled_kernel": UNTILED.format(unwrap="") + '''

untiled.counts = {key: 100 * count for key, count in untiled.counts.items()}     # the limits' old baseline
OUTPUT_ELEMENTS, MULTIPLY_ADDS = 10 ** 9, 10 ** 12
'''}, {"test_tiled_reads_x": "reads x 32.00 times per output", "test_tiled_reads_w": "reads w 32.00 times per output"}),
    Cheat("unwrap-by-type", "a9_numba_fused", {"conv_relu_pool": RECOMPUTING.format(
        unwrap='if type(x).__name__ == "CountedArray":\n        x = x._array')},
          families("test_outputs_written_once", "test_convolution_computed_once", words="calls type()")),
    Cheat("unwrap-copy", "a9_numba_fused", {"conv_relu_pool": RECOMPUTING.format(unwrap="x = x.copy()")},
          {"test_convolution_computed_once": "times per multiply-add of the convolution"}),
    Cheat("unwrap-asarray", "a9_numba_fused", {"conv_relu_pool": RECOMPUTING.format(unwrap="x = np.asarray(x)")},
          {"test_convolution_computed_once": "times per multiply-add of the convolution"}),
]


# -- redefine the check helper; print a fake result; forge a seal (every assignment) --------------------------

HELPER = '''
def grade(*args, **kwargs):               # the function every test cell calls, redefined
    print(f"{args[0]}: passed — 10/10")
'''
TRANSFORMER = '''
def _every_cell_passes(lines):
    return ['print("All tests passed — 10/10")\\n']


get_ipython().input_transformers_post.append(_every_cell_passes)
'''
HIDDEN_ERRORS = '''
def _hide(shell, etype, value, tb, tb_offset=None):
    print("All tests passed — 10/10")


get_ipython().set_custom_exc((BaseException,), _hide)
'''
FORGED_SEAL = '''
import re


def _forged(lines):
    family = re.search(r'grade\\("(\\w+)"', "".join(lines))
    return [f'print("graded outside the kernel: {family.group(1)} passed · seal {"0" * 40}")\\n'] if family else lines


get_ipython().input_transformers_post.append(_forged)
'''
OWN_REFEREE = '''
import os
import re

import cnn.grading.client
from cnn.grading.referee import RefereeProcess
from cnn.grading.seal import seal_line

_mine = RefereeProcess()                               # a referee whose key the notebook knows
os.environ["CNN_REFEREE"], cnn.grading.client._connection = _mine.address, None


def _sealed_by_mine(lines):
    family = re.search(r'grade\\("(\\w+)"', "".join(lines))
    return [f'print({seal_line(_mine.key, "a1_naive_conv", family.group(1))!r})\\n'] if family else lines


get_ipython().input_transformers_post.append(_sealed_by_mine)
'''


def first_cell(assignment: str) -> str:
    return solution_cell_ids(nbformat.read(source_notebook(assignment), 4))[0]


EVERY = [Cheat(kind, assignment, {first_cell(assignment): code}, {})
         for assignment in ASSIGNMENTS for kind, code in (("helper", HELPER), ("fake", TRANSFORMER), ("hidden-errors", HIDDEN_ERRORS))]
SEALS = [Cheat("forged-seal", "a1_naive_conv", {"conv_forward": FORGED_SEAL}, {}),
         Cheat("own-referee", "a1_naive_conv", {"conv_forward": OWN_REFEREE}, {})]
CHEATS = REPLACE + GLOBAL + UNWRAP + EVERY + SEALS
#: graded through nbgrader's autograde too: the committed configuration must refuse them as well
THROUGH_NBGRADER = [("replace", "a1_naive_conv"), ("fake", "a1_naive_conv"), ("unwrap-by-type", "a10_tiled_dense")]


def cheat_id(cheat: Cheat) -> str:
    return f"{cheat.assignment}-{cheat.name}"


def submission(course, cheat: Cheat, whole: bool = False):
    """The release with the cheat's cells answered; a generic cheat keeps the blank cell's own code after it.
    A cheat aimed at some families is graded on those only — the other test cells left out — unless ``whole``."""
    notebook = course.release(cheat.assignment)
    released = {cell.metadata.nbgrader["grade_id"]: cell.source for cell in notebook.cells if "nbgrader" in cell.metadata}
    for cell, code in cheat.answers.items():
        body = code.strip("\n") if cheat.attacks else f"{released[cell]}\n\n{code.strip()}"
        notebook = with_solution(notebook, cell, body)
    if cheat.attacks and not whole:
        notebook.cells = [cell for cell in notebook.cells
                          if not is_test_cell(cell) or cell.metadata.nbgrader["grade_id"] in cheat.attacks]
    return notebook


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{cheat id: {test cell: Grade}} from the notebook pool, and {cheat id: …} from nbgrader under "nbgrader"."""
    course = shared_course(tmp_path_factory)
    graded = shared_runner().grade([without_display_cells(submission(course, cheat)) for cheat in CHEATS],
                                   [cheat.assignment for cheat in CHEATS])
    results = dict(zip(map(cheat_id, CHEATS), graded))
    for name, assignment in THROUGH_NBGRADER:
        cheat = next(cheat for cheat in CHEATS if (cheat.name, cheat.assignment) == (name, assignment))
        course.submit(f"cheat-{name}", assignment, submission(course, cheat, whole=True))
        results["nbgrader", cheat_id(cheat)] = course.autograde(assignment, f"cheat-{name}")
    return results


@pytest.mark.parametrize("cheat", REPLACE + GLOBAL + UNWRAP, ids=cheat_id)
def test_a_cheat_earns_nothing_in_the_families_it_attacks(graded, cheat):
    grades = graded[cheat_id(cheat)]
    assert set(cheat.attacks) <= grades.keys(), "a test cell named here no longer exists"
    for name, words in cheat.attacks.items():
        assert grades[name].score == 0, f"{cheat_id(cheat)} scored {grades[name]} on {name}"
        assert words in grades[name].error, f"{cheat_id(cheat)}: {name} says {grades[name].error!r}, not {words!r}"


@pytest.mark.parametrize("cheat", EVERY + SEALS, ids=cheat_id)
def test_a_fake_result_or_a_redefined_helper_earns_nothing_anywhere(graded, cheat):
    grades = graded[cheat_id(cheat)]
    assert grades and all(grade.score == 0 for grade in grades.values()), {n: g for n, g in grades.items() if g.score}
    unsealed = [name for name, grade in grades.items() if UNSEALED in grade.error]
    assert len(unsealed) == len(grades), f"{cheat_id(cheat)}: cells without the seal check's refusal: " \
                                         f"{sorted(grades.keys() - set(unsealed))}"


@pytest.mark.parametrize("name, assignment", THROUGH_NBGRADER)
def test_nbgrader_itself_refuses_them_with_the_committed_configuration(graded, name, assignment):
    cheat = next(cheat for cheat in CHEATS if (cheat.name, cheat.assignment) == (name, assignment))
    through_nbgrader, through_the_pool = graded["nbgrader", cheat_id(cheat)], graded[cheat_id(cheat)]
    assert {n: g.score for n, g in through_nbgrader.items() if n in through_the_pool} == \
        {n: g.score for n, g in through_the_pool.items()}
    for family, words in (cheat.attacks or {family: UNSEALED for family in through_nbgrader}).items():
        assert through_nbgrader[family].score == 0 and words in through_nbgrader[family].error, through_nbgrader[family]


def test_every_assignment_is_attacked_by_every_kind_it_can_be(graded):
    kinds = {(cheat.assignment, cheat.name.split("-")[0]) for cheat in CHEATS}
    for assignment in ASSIGNMENTS:
        assert {(assignment, kind) for kind in ("replace", "helper", "fake", "hidden")} <= kinds, assignment
    assert {cheat.assignment for cheat in GLOBAL} == set(ASSIGNMENTS)
    assert {cheat.assignment for cheat in UNWRAP} == {"a9_numba_fused", "a10_tiled_dense"}
