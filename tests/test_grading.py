"""cnn.grading, the instruments the assignments grade with: each one measured on a case whose answer is known.

The counters and the simulated ranks, the referee's protocol, judges and seals, and the own-work check —
each shown to catch what it is for (a kept reference, a replaced library function, a counter unwrapped)
and to let the honest case through.
"""

import types

import nbformat
import numpy as np
import pytest
from numba import njit, prange

from cnn.grading.authorship import allowed, library_calls, library_reached, library_replacements, own_work_problems
from cnn.grading.bytecode import is_blank, modules_imported
from cnn.grading.checks import parallel_loops
from cnn.grading.family import LIBRARY, close, switches
from cnn.grading.nbgrader_plugin import check_seals
from cnn.grading.protocol import decode, encode
from cnn.grading.ranks import Deadlock, RankFailed, run_ranks
from cnn.grading.referee import Referee, Session
from cnn.grading.seal import is_sealed, mac, seal_line
from cnn.grading.traffic import compiled_code_problems, count_cuda, count_python
from cnn.stages import s1_loops
from kernels.device import cuda

TILE = 4


@cuda.jit
def copy_tile_kernel(source, total, out):
    """Each block copies TILE numbers of ``source`` into shared memory once, then every thread reads all TILE."""
    tile = cuda.shared.array(TILE, np.float32)
    i = cuda.grid(1)
    tile[cuda.threadIdx.x] = source[i]
    cuda.syncthreads()
    value = np.float32(0.0)
    for k in range(TILE):
        value += tile[k]
    out[i] = value
    cuda.atomic.add(total, 0, source[i])


def test_cuda_traffic_counts_each_access_by_array_and_memory():
    source, total, out = np.arange(8, dtype=np.float32), np.zeros(1, np.float32), np.zeros(8, np.float32)
    traffic = count_cuda(copy_tile_kernel, 2, TILE, source, total, out)
    assert traffic.loads("source") == 16                  # once into the tile, once for the atomic
    assert traffic.stores("out") == 8 and traffic.loads("out") == 0
    assert traffic.atomics("total") == 1 * 8 and traffic.stores("total") == 0
    assert traffic.shared_stores() == 8 and traffic.shared_loads() == 8 * TILE
    assert "tile (shared memory)" in traffic.summary(per=8)
    np.testing.assert_allclose(out, [6] * 4 + [22] * 4)  # the kernel really ran, and updated its arrays
    assert total[0] == 28


seen_types = []


@cuda.jit
def remember_type(x, y):
    seen_types.append(type(x).__name__)
    y[0] = x[0]


def test_a_counted_kernel_gets_the_arrays_a_launch_gives_it():
    """The counter's arrays cannot be told from a simulated launch's: the same class."""
    x, y = np.ones(1, np.float32), np.zeros(1, np.float32)
    count_cuda(remember_type, 1, 1, x, y)
    remember_type[1, 1](x, y)
    assert seen_types[0] == seen_types[1] == "FakeWithinKernelCUDAArray"


@njit(parallel=True)
def row_sums(x, out):
    for i in prange(x.shape[0]):
        scratch = np.empty(x.shape[1])
        for j in range(x.shape[1]):
            scratch[j] = x[i, j]
        out[i] = scratch.sum()


@njit
def serial_row_sums(x, out):
    for i in prange(x.shape[0]):
        out[i] = x[i].sum()


def test_python_traffic_counts_reads_writes_and_temporaries():
    x, out = np.ones((3, 5)), np.zeros(3)
    _, traffic = count_python(row_sums, x, out)
    assert traffic.loads("x") == 15 and traffic.stores("out") == 3
    assert traffic.largest_allocation() == (5, (5,))
    np.testing.assert_allclose(out, 5)


_empty = np.empty


def copied_then_read(x, out):
    x = np.asarray(x)                 # neither a copy nor asarray takes the reads past the counter
    y = x.copy()
    scratch = _empty(4)               # an allocator kept in a global is still recorded
    out[0] = y[0, 0] + y[1, 1]
    scratch[0] = 0


def test_copies_stay_counted_and_allocators_in_globals_are_recorded():
    x, out = np.ones((2, 2)), np.zeros(1)
    _, traffic = count_python(copied_then_read, x, out)
    assert traffic.loads("x") == 4 + 2               # the copy read it whole, then two reads of the copy
    assert traffic.largest_allocation() == (4, (2, 2))
    assert ("empty", (4,)) in traffic.allocations


def test_parallel_loops_lists_only_prange_loops_compiled_in_parallel():
    x, out = np.ones((3, 5)), np.zeros(3)
    row_sums(x, out)
    serial_row_sums(x, out)
    assert parallel_loops(row_sums) == ["for i in prange(x.shape[0]):"]
    assert parallel_loops(serial_row_sums) == []          # prange without parallel=True is a range


def introspecting(x, y):
    if type(x).__name__ == "CountedArray":
        x = x._array
    y[0] = x.copy_to_host()[0]


def test_code_that_inspects_what_it_is_given_is_refused_from_counting():
    problems = compiled_code_problems(introspecting)
    assert any("calls type()" in problem for problem in problems), problems
    assert any("._array" in problem and ".copy_to_host" in problem for problem in problems), problems
    assert compiled_code_problems(row_sums.py_func) == []


# -- the referee: protocol, judges, seals --------------------------------------------------------------------

def test_the_protocol_carries_arrays_and_tuples_and_no_objects():
    message = {"x": np.arange(6.0).reshape(2, 3), "shape": (2, 3), "nested": [{"n": np.int64(4), "f": 0.5}], "s": None}
    back = decode(encode(message))
    np.testing.assert_array_equal(back["x"], message["x"])
    assert back["shape"] == (2, 3) and back["nested"] == [{"n": 4, "f": 0.5}] and back["s"] is None
    with pytest.raises(TypeError, match="Python objects"):
        encode({"bad": np.array([object()], dtype=object)})
    with pytest.raises(TypeError, match="cannot be sent"):
        encode({"bad": {1, 2}})


def test_close_refuses_nan_that_rel_error_would_accept():
    verdict = close("y", np.array([2.0, 1.0]), 1e-6, "y")({"y": np.array([np.nan, 1.0])})
    assert not verdict.ok and "NaN or infinite" in verdict.message
    assert close("y", np.array([2.0, 1.0]), 1e-12, "y")({"y": [2.0, 1.0]}).ok
    assert "returned None" in close("y", np.zeros(2), 1e-6, "y")({"y": None}).message


def test_switches_accept_any_maximum_and_name_outsiders():
    plane = np.zeros((1, 1, 2, 4))                        # all ties: every position of a window is a maximum
    pooled = np.zeros((1, 1, 1, 2))
    judge = switches("s", plane, pooled, 2, 2, 1e-12, "switches")
    assert judge({"s": np.array([[[[5, 3]]]])}).ok
    verdict = judge({"s": np.array([[[[2, 3]]]])})
    assert not verdict.ok and "1 of 2 point outside their window" in verdict.message


def test_a_seal_is_valid_only_for_its_family_and_key():
    key, other = b"k" * 32, b"o" * 32
    line = seal_line(key, "a1_naive_conv", "test_forward_stride1")
    assert is_sealed(f"some output\n{line}\n", key, "a1_naive_conv", "test_forward_stride1")
    assert not is_sealed(line, other, "a1_naive_conv", "test_forward_stride1")
    assert not is_sealed(line, key, "a1_naive_conv", "test_forward_stride2")
    assert not is_sealed(line.replace(mac(key, "a1_naive_conv", "test_forward_stride1"), "0" * 40), key,
                         "a1_naive_conv", "test_forward_stride1")


def test_the_referee_seals_only_a_family_every_case_of_which_passed():
    referee, session = Referee(b"k" * 32), Session()
    opened = referee.handle({"op": "open", "assignment": "a1_naive_conv", "family": "test_forward_stride1"}, session)
    for index, case in enumerate(opened["cases"]):
        x, w, b, stride, pad = case["inputs"]["args"]
        reply = referee.handle({"op": "answer", "attempt": opened["attempt"], "case": index,
                                "outputs": {"y": s1_loops.conv_forward(x, w, b, stride, pad)}}, session)
        assert reply["ok"] and "rel_error" in reply["lines"][0]
    referee.handle({"op": "own_work", "attempt": opened["attempt"], "problems": []}, session)
    verdict = referee.handle({"op": "close", "attempt": opened["attempt"]}, session)
    assert verdict["passed"] and is_sealed(verdict["seal"], b"k" * 32, "a1_naive_conv", "test_forward_stride1")


def test_the_referee_refuses_to_seal_a_wrong_a_half_answered_or_an_unchecked_family():
    referee, session = Referee(b"k" * 32), Session()

    def attempt(answer_all: bool, right: bool, report: bool):
        opened = referee.handle({"op": "open", "assignment": "a1_naive_conv", "family": "test_forward_stride2"}, session)
        cases = opened["cases"] if answer_all else opened["cases"][:1]
        for index, case in enumerate(cases):
            x, w, b, stride, pad = case["inputs"]["args"]
            y = s1_loops.conv_forward(x, w, b, stride, pad)
            referee.handle({"op": "answer", "attempt": opened["attempt"], "case": index,
                            "outputs": {"y": y if right else 0 * y}}, session)
        if report:
            referee.handle({"op": "own_work", "attempt": opened["attempt"], "problems": []}, session)
        return referee.handle({"op": "close", "attempt": opened["attempt"]}, session)

    assert "relative error" in attempt(True, False, True)["message"]
    assert "never answered" in attempt(False, True, True)["message"]
    assert "own work did not run" in attempt(True, True, False)["message"]
    assert attempt(True, True, True)["passed"]
    with pytest.raises(KeyError):
        referee.handle({"op": "open", "assignment": "os", "family": "x"}, session)


def test_check_seals_gives_an_error_to_every_test_cell_without_its_seal():
    key = b"k" * 32
    test = {"nbgrader": {"grade": True, "solution": False, "grade_id": "test_a", "points": 1}}
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("grade('test_a')", metadata=test),
                                               nbformat.v4.new_code_cell("grade('test_a')", metadata=test)])
    notebook.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout",
                                                        text=seal_line(key, "a1_naive_conv", "test_a") + "\n")]
    notebook.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="test_a passed — 10/10\n")]
    assert check_seals(notebook, key, "a1_naive_conv") == ["test_a"]
    assert [output.output_type for output in notebook.cells[1].outputs] == ["stream", "error"]
    assert "no sealed verdict" in notebook.cells[1].outputs[1].evalue


# -- own work ------------------------------------------------------------------------------------------------

def load_notebook_functions(source: str) -> types.SimpleNamespace:
    """Define ``source`` as a notebook would: its functions' module is __main__."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<notebook cell>", "exec"), namespace)
    return types.SimpleNamespace(**namespace)


NOTEBOOK = '''
import importlib

import numpy as np
from cnn.stages import s1_loops

_kept = s1_loops.conv_forward
_library = [s1_loops.conv_backward]


def honest(x):
    return np.tanh(x) + helper(x)


def helper(x):
    return 2 * x


def through_a_global(x, W, b):
    return _kept(x, W, b, 1, 0)


def through_a_helper(x):
    return uses_the_library(x)


def uses_the_library(x):
    return s1_loops.relu_forward(x)


def through_a_default(x, f=s1_loops.maxpool_forward):
    return f(x, 2, 2)


def through_a_list(dy, x, W):
    return _library[0](dy, x, W, 1, 0)


def imports_it(x):
    from cnn.stages.s2_numpy import im2col
    return im2col(x, 3, 1, 0)


def at_run_time(x):
    return getattr(importlib.import_module("cnn.stages.s1_" + "loops"), "relu_" + "forward")(x)
'''


def test_own_work_follows_what_a_function_reaches_not_its_text():
    cell = load_notebook_functions(NOTEBOOK)
    rules = LIBRARY
    assert own_work_problems([cell.honest], rules, {}) == []
    assert library_reached(cell.through_a_global) == [("cnn.stages.s1_loops.conv_forward", "_kept")]
    assert "uses cnn.stages.s1_loops (through s1_loops in uses_the_library)" in \
        own_work_problems([cell.through_a_helper], rules, {})[0]
    assert "through a default argument" in own_work_problems([cell.through_a_default], rules, {})[0]
    assert "cnn.stages.s1_loops.conv_backward (through _library)" in own_work_problems([cell.through_a_list], rules, {})[0]
    assert modules_imported(cell.imports_it) == {"cnn.stages.s2_numpy.im2col"}
    assert "imported in it" in own_work_problems([cell.imports_it], rules, {})[0]
    assert "is the library's cnn.stages.s1_loops.conv_forward" in own_work_problems([s1_loops.conv_forward], rules, {})[0]
    assert own_work_problems([cell.at_run_time], rules, {}) == []               # nothing to see without running it
    with library_calls() as calls:
        cell.at_run_time(np.ones(3))
    assert "cnn.stages.s1_loops.relu_forward" in calls
    assert "while the tests ran it" in own_work_problems([], rules, calls)[0]


def test_rules_decide_by_their_last_match():
    rules = (("cnn.*", False), ("kernels.*", False), ("kernels.conv2d.conv_window_sum", True))
    assert not allowed("cnn.stages.s1_loops.conv_forward", rules) and not allowed("kernels.conv2d.x", rules)
    assert allowed("kernels.conv2d.conv_window_sum", rules) and allowed("numpy.tanh", rules)


def test_calls_into_lent_functions_are_not_the_students():
    cell = load_notebook_functions("def loop(update, x):\n    return update(x)\n")
    with library_calls() as calls:
        calls.exempt(s1_loops.relu_forward)
        cell.loop(s1_loops.relu_forward, np.ones(2))
    assert calls == {}


def test_a_library_function_replaced_from_a_notebook_is_named():
    cell = load_notebook_functions("def mine(x, W, b, stride, pad):\n    return 0\n")
    saved = s1_loops.conv_forward
    s1_loops.conv_forward = cell.mine
    try:
        assert "cnn.stages.s1_loops.conv_forward is now mine from this notebook" in library_replacements()
    finally:
        s1_loops.conv_forward = saved
    assert library_replacements() == []


def test_a_blank_is_a_function_that_only_raises_not_implemented():
    cell = load_notebook_functions('def blank(x):\n    """doc"""\n    # YOUR CODE HERE\n    raise NotImplementedError()\n'
                                   'def started(x):\n    y = x\n    raise NotImplementedError()\n')
    assert is_blank(cell.blank) and not is_blank(cell.started) and not is_blank(None)


# -- simulated ranks -----------------------------------------------------------------------------------------

def ring_pass(comm, value):
    """Every rank sends its value right and returns what came from the left."""
    received = np.empty(1)
    comm.Sendrecv(np.array([value]), dest=(comm.rank + 1) % comm.size, recvbuf=received,
                  source=(comm.rank - 1) % comm.size)
    return received[0]


def send_first(comm):
    comm.Send(np.zeros(3), dest=(comm.rank + 1) % comm.size)
    comm.Recv(np.zeros(3), source=(comm.rank - 1) % comm.size)


def test_ranks_exchange_and_count_every_link():
    results, traffic = run_ranks(3, ring_pass, per_rank=[(10.0,), (11.0,), (12.0,)])
    assert results == [12.0, 10.0, 11.0]
    assert all(traffic.sent(rank) == 1 and traffic.messages_sent(rank) == 1 for rank in range(3))


def test_ranks_detect_a_deadlock_and_say_who_waits_for_whom():
    with pytest.raises(Deadlock, match="rank 0 waits in Send to rank 1"):
        run_ranks(3, send_first)


def test_ranks_name_the_rank_that_failed():
    def fail_on_two(comm):
        if comm.rank == 2:
            raise KeyError("oops")
        comm.Recv(np.zeros(1), source=2)

    with pytest.raises(RankFailed, match="rank 2: KeyError"):
        run_ranks(3, fail_on_two)
