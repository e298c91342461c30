"""Notebook 12, asynchronous SGD: worked solutions of its three exercises (MPI runs in the first and third)."""

from __future__ import annotations

import multiprocessing
from multiprocessing import shared_memory

import numpy as np

from cnn.parallel import launch
from common import mpi_options


def exercise_1(fast: bool) -> None:
    """Downpour with n_push=4, n_fetch=4: staleness, time per step, accuracy; which phase of breakdown_s shrinks?

    Answer. Each replica now accumulates four steps of gradient before one push, and fetches the server's
    weights every fourth step: a quarter of the messages. The communication phases of `breakdown_s` —
    "gradient fetch" on the server side and the replicas' "weight distribution" (fetching the weights) —
    shrink per step, so the time per step falls, most on a slow network. The price is staleness: a
    replica computes up to three steps on weights it has not refreshed while the other replicas' pushes
    land, and its pushed sum is applied in one go, so the staleness histogram moves to larger values and
    the accuracy reached per step (and per epoch) drops somewhat — DistBelief's trade of statistical
    efficiency for throughput. (In fast mode the runs are a few steps: the printout shows the fields the
    comparison reads; run without CNN_FAST for one epoch, where the differences appear.)
    """
    ranks, options = (2, mpi_options(fast)) if fast else (4, mpi_options(fast))
    runs = {every: launch.run("downpour", ranks, n_push=every, n_fetch=every, **options) for every in (1, 4)}
    for every, summary in runs.items():
        stale = summary["staleness"]
        print(f"n_push = n_fetch = {every}: {summary['time_per_step_s'] * 1e3:6.2f} ms a step, staleness mean "
              f"{stale['mean']:.2f} (histogram {stale['histogram']}), test accuracy {summary['final_test_accuracy']:.1%}; "
              + ", ".join(f"{phase} {seconds * 1e3:.2f} ms" for phase, seconds in summary["breakdown_s"].items()))
        assert {"mean", "max", "histogram", "count"} <= set(stale) and "compute" in summary["breakdown_s"]


def count_without_lock(counter_name: str, rank: int, increments: int, start) -> None:
    """One process: ``increments`` times, add 1 to the shared total (no lock) and to its own slot."""
    memory = shared_memory.SharedMemory(name=counter_name)
    counters = np.ndarray((3,), dtype=np.int64, buffer=memory.buf)       # [shared total, rank 0's, rank 1's]
    start.wait()                                                          # both processes count at the same time
    for _ in range(increments):
        counters[0] += 1            # load, add, store: another process may store in between
        counters[1 + rank] += 1     # only this process writes this slot
    del counters
    memory.close()


def exercise_2(fast: bool) -> None:
    """Hogwild counts staleness with one counter per rank; why would one shared counter, incremented by all, undercount?

    Answer. `counter += 1` on shared memory is three steps: load the value, add one, store it. Two ranks
    that load the same value before either stores both store value + 1: two increments, one counted. Without
    a lock (or an atomic fetch-and-add) the shared total therefore undercounts, by more the more often ranks
    collide — and the collisions grow with the number of ranks and the update rate, exactly when the count
    matters. With one counter per rank each counter has a single writer, so no increment is ever lost, and
    a reader sums them (a slightly old but never undercounted total). Below, two processes each count to
    the same number in a shared block, with a shared total and their own slots.
    """
    increments = 200_000 if fast else 2_000_000
    memory = shared_memory.SharedMemory(create=True, size=3 * 8)
    try:
        counters = np.ndarray((3,), dtype=np.int64, buffer=memory.buf)
        counters[:] = 0
        context = multiprocessing.get_context("spawn")
        start = context.Barrier(2)
        workers = [context.Process(target=count_without_lock, args=(memory.name, rank, increments, start))
                   for rank in (0, 1)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
        shared_total, per_rank = int(counters[0]), counters[1:].tolist()
        del counters
    finally:
        memory.close()
        memory.unlink()
    print(f"2 processes × {increments:,} increments: the shared counter says {shared_total:,}, "
          f"the per-rank counters {per_rank} sum to {sum(per_rank):,} ({2 * increments - shared_total:,} lost)")
    assert per_rank == [increments, increments] and shared_total <= 2 * increments


def exercise_3(fast: bool) -> None:
    """EASGD sync against async, τ = 1 and 4: which tolerates a slow worker better, and why?

    Answer. In `easgd_mode="sync"` (equation 2 of the paper) the master waits every τ steps for *all*
    workers' elastic differences before it moves the center: a worker three times slower makes every
    round three times longer, and the fast workers idle — the step time is the slowest worker's. In
    `async` (the round-robin / asynchronous variant) the master exchanges with whichever worker arrives,
    one at a time: fast workers keep going at their own pace, and the slow one simply contributes fewer
    exchanges (its `steps_per_rank` is smaller) — it tolerates the straggler far better. τ = 4 divides the
    number of exchanges by four in both modes, which helps a slow *network*, but in sync mode the slow
    worker still sets the pace of every round; a larger τ also lets the workers drift further from the
    center between pulls (ρ and η set how far). Below: one slow rank (`slow_rank=1`, three times slower).
    """
    ranks, options = (3, mpi_options(fast)) if fast else (4, mpi_options(fast))
    taus = (4,) if fast else (1, 4)
    for tau in taus:
        for mode in ("sync", "async"):
            summary = launch.run("easgd", ranks, easgd_mode=mode, tau=tau, slow_rank=1, slow_down=3.0, **options)
            print(f"easgd {mode:<5} τ={tau}: {summary['time_per_step_s'] * 1e3:6.2f} ms a step, steps per rank "
                  f"{summary['steps_per_rank']}, test accuracy {summary['final_test_accuracy']:.1%}")
            assert summary["steps_per_rank"] and summary["time_per_step_s"] > 0
