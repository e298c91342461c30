"""cnn.grading, the instruments the assignments grade with: each one measured on a case whose answer is known."""

import numpy as np
import pytest
from numba import njit, prange

from cnn.grading.checks import check, check_switches, parallel_loops
from cnn.grading.ranks import Deadlock, RankFailed, run_ranks
from cnn.grading.traffic import count_cuda, count_python
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


def test_parallel_loops_lists_only_prange_loops_compiled_in_parallel():
    x, out = np.ones((3, 5)), np.zeros(3)
    row_sums(x, out)
    serial_row_sums(x, out)
    assert parallel_loops(row_sums) == ["for i in prange(x.shape[0]):"]
    assert parallel_loops(serial_row_sums) == []          # prange without parallel=True is a range


def test_check_refuses_nan_that_rel_error_would_accept():
    with pytest.raises(AssertionError, match="NaN or infinite"):
        check("y", np.array([np.nan, 1.0]), np.array([2.0, 1.0]), 1e-6)
    check("y", np.array([2.0, 1.0]), np.array([2.0, 1.0]), 1e-12)


def test_check_switches_accepts_any_maximum_and_names_outsiders():
    plane = np.zeros((1, 1, 2, 4))                        # all ties: every position of a window is a maximum
    pooled = np.zeros((1, 1, 1, 2))
    check_switches("ties", np.array([[[[5, 3]]]]), plane, pooled, 2, 2)
    with pytest.raises(AssertionError, match="outside their window"):
        check_switches("outside", np.array([[[[2, 3]]]]), plane, pooled, 2, 2)


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
