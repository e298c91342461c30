"""``World.wait`` waits at MPI's speed while the peers answer quickly, frees its core while they do
not, and still gives up on a dead one.

- ``wait_until``'s schedule, on a clock the test drives (no real time): it spins (no nap) for
  ``SPIN_SECONDS``, then naps 20 µs doubling to 1 ms, never past the deadline.
- In one two-rank job: the same LeNet-5-sized allreduce waited through ``World.wait`` and through
  ``MPI_Wait``, alternately, equal sums, medians within a spin and a few naps of each other (a
  loaded machine slows a spinning wait unevenly; benchmarks/parallel_waits.py measures the ratio
  with its spread); then rank 1 is a straggler (it sleeps 1.5 s before joining) and
  rank 0, waiting for it, must use under a quarter of that time in CPU (it naps; the goal in
  docs/distributed.md is 20 %, measured at about 2 %); then rank 1 stays silent and rank 0's wait
  must end with ``PeerLost`` after its timeout.
- In another job, rank 0 finalizes while rank 1 sleeps: ``finalize_within``'s watchdog must end rank 0
  (and the job) within its patience, not when rank 1 comes.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("mpi4py")

from cnn.parallel import launch  # noqa: E402

try:
    MPIEXEC = launch.find_mpiexec()
except FileNotFoundError:
    MPIEXEC = None


class FakeClock:
    """``time.monotonic`` and ``time.sleep`` of a clock that moves only when told: by ``tick`` seconds a
    call to monotonic (the cost of a test), by the nap itself on sleep."""

    def __init__(self, tick: float):
        self.now, self.tick, self.naps = 0.0, tick, []

    def monotonic(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


def test_wait_until_spins_first_then_naps_up_to_a_millisecond(monkeypatch):
    from cnn.parallel import world

    clock = FakeClock(tick=1e-6)
    monkeypatch.setattr(world.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(world.time, "sleep", clock.sleep)
    monkeypatch.setattr(world.os, "sched_yield", lambda: None)
    # done within the spin: not one nap
    calls = []
    assert world.wait_until(lambda: calls.append(1) or len(calls) > 1000, 10.0)
    assert clock.naps == [] and clock.now < world.SPIN_SECONDS
    # a long wait: spin, then naps doubling from 20 µs to 1 ms, until the condition holds at 0.5 s
    clock.now, ready_at = 0.0, 0.5
    assert world.wait_until(lambda: clock.now >= ready_at, 10.0)
    assert clock.naps[0] == pytest.approx(world.FIRST_NAP) and max(clock.naps) == pytest.approx(world.LONGEST_NAP)
    assert all(b == pytest.approx(min(2 * a, world.LONGEST_NAP)) for a, b in zip(clock.naps, clock.naps[1:]))
    assert ready_at <= clock.now < ready_at + world.LONGEST_NAP + 1e-3     # woken within one nap
    spun = clock.now - sum(clock.naps)
    assert spun >= world.SPIN_SECONDS                                        # the spin came first
    # never past the deadline
    clock.now = 0.0
    assert not world.wait_until(lambda: False, 0.2)
    assert 0.2 <= clock.now < 0.2 + 1e-3


SCRIPT = """
import time
import numpy as np
from mpi4py import MPI
from cnn.model import get_network
from cnn.parallel.world import PeerLost, World

world = World(MPI.COMM_WORLD, timeout=30)
comm = world.comm
vector = np.random.default_rng(world.rank).standard_normal(get_network("lenet5").num_params + 1).astype(np.float32)
expected = np.empty_like(vector)
comm.Allreduce(vector, expected, op=MPI.SUM)
mpi_wait, waited = [], []
for repeat in range(200):
    total = np.empty_like(vector)
    comm.Barrier()
    started = time.perf_counter()
    comm.Iallreduce(vector, total, op=MPI.SUM).Wait()
    mpi_wait.append(time.perf_counter() - started)
    assert np.array_equal(total, expected)
    comm.Barrier()
    started = time.perf_counter()
    total = world.allreduce_sum(vector, "allreduce")
    waited.append(time.perf_counter() - started)
    assert np.array_equal(total, expected)
if world.rank == 0:
    print(f"MPI_Wait {np.median(mpi_wait) * 1e6:.1f} us, World.wait {np.median(waited) * 1e6:.1f} us", flush=True)

# a straggler: rank 1 joins 1.5 s late; rank 0 waits, napping
comm.Barrier()
if world.rank == 1:
    time.sleep(1.5)
cpu, wall = time.process_time(), time.perf_counter()
world.allreduce_sum(vector, "allreduce with a straggler")
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
if world.rank == 0:
    print(f"waiting for the straggler: {cpu:.3f} s of CPU in {wall:.3f} s", flush=True)

# a silent peer: rank 0 must give up after its timeout
comm.Barrier()
if world.rank == 0:
    quick = World(comm, timeout=0.5)
    request = comm.Irecv(np.empty(1), source=1, tag=77)
    started = time.perf_counter()
    try:
        quick.wait([request], "a message that never comes", peers=[1])
        print("no PeerLost")
    except PeerLost as lost:
        print(f"PeerLost after {time.perf_counter() - started:.2f} s: {lost} {lost.ranks}")
    quick.cancel(request, "test receive")
comm.Barrier()
"""


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")
def test_world_wait_is_as_fast_as_mpi_frees_the_core_and_keeps_its_deadline():
    argv = [MPIEXEC, *launch.launcher_flags(MPIEXEC, 2, fault_tolerant=False), "-n", "2", sys.executable,
            "-m", "mpi4py", "-c", SCRIPT]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=launch.environment())
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    timing = next(line for line in lines if line.startswith("MPI_Wait"))
    mpi_wait, waited = (float(part.split()[-2]) for part in timing.split(","))
    # Medians of 200 alternating calls. On a quiet machine the two are equal (the exchange ends within the
    # spin); on one at a load of 25 with a core kept busy, World.wait's median once reached 4.7 ms against
    # 0.18 ms, so the bound only says it stays within a spin and a few naps of MPI_Wait: the schedule itself
    # (no nap within the spin) is held exactly by test_wait_until_spins_first_then_naps_up_to_a_millisecond.
    assert waited <= 2 * mpi_wait + 10_000, timing
    straggler = next(line for line in lines if line.startswith("waiting for the straggler"))
    cpu, wall = float(straggler.split()[4]), float(straggler.split()[-2])
    assert wall >= 1.4 and cpu < 0.25 * wall, straggler
    lost = next(line for line in lines if "PeerLost" in line)
    assert lost.startswith("PeerLost after"), lost
    seconds = float(lost.split()[2])
    assert 0.5 <= seconds < 10, lost
    assert "from rank 1" in lost and lost.endswith("(1,)"), lost


FINALIZE_SCRIPT = """
import time
from mpi4py import MPI
from cnn.parallel.world import finalize_within

if MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(40)          # a peer that does not finalize for a long time (as a dead one never does)
finalize_within(1.0, 7)
print("finalized", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")
def test_finalize_within_gives_up_on_a_peer_that_does_not_finalize():
    """Rank 0 waits in MPI_Finalize for rank 1, which sleeps 40 s: its 1 s watchdog must end it with code 7
    (and the job with it) long before — with mpi4py's MPI.Finalize, which keeps the GIL, the watchdog
    thread could not run until rank 1 came (measured: the job took 41.6 s, the whole sleep)."""
    argv = [MPIEXEC, *launch.launcher_flags(MPIEXEC, 2, fault_tolerant=False), "-n", "2", sys.executable,
            "-c", FINALIZE_SCRIPT]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=launch.environment())
    elapsed = time.monotonic() - started
    assert "MPI_Finalize did not return in 1 s" in done.stderr, done.stderr[-2000:]
    assert done.returncode != 0 and elapsed < 30, (done.returncode, elapsed)
