"""``World.wait`` waits at MPI's own speed while the peers are alive, and still gives up on a dead one.

Both are checked inside one two-rank job: the same LeNet-5-sized allreduce is timed alternately
through ``World.wait`` (a nonblocking ``Iallreduce`` waited on with a deadline) and through MPI's
blocking ``Allreduce``, so whatever else the machine is doing slows both the same way; the test
compares their medians with a generous margin, and counts the calls to ``time.sleep`` made while
waiting: none (the first version slept between tests, 10 µs doubling to 1 ms, and took 20-70 times
MPI's time on an idle 16-core host). Then rank 1 stays silent and rank 0's wait must end with
``PeerLost`` after its timeout.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")

from cnn.parallel import launch  # noqa: E402

try:
    MPIEXEC = launch.find_mpiexec()
except FileNotFoundError:
    MPIEXEC = None

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")]

SCRIPT = """
import time
import numpy as np
from mpi4py import MPI
from cnn.model import get_network
from cnn.parallel.world import PeerLost, World

sleeps, real_sleep = [], time.sleep
time.sleep = lambda seconds: (sleeps.append(seconds), real_sleep(seconds))

world = World(MPI.COMM_WORLD, timeout=30)
comm = world.comm
vector = np.random.default_rng(world.rank).standard_normal(get_network("lenet5").num_params + 1).astype(np.float32)
total = np.empty_like(vector)
blocking, waited = [], []
for repeat in range(300):
    comm.Barrier()
    started = time.perf_counter()
    comm.Allreduce(vector, total, op=MPI.SUM)
    blocking.append(time.perf_counter() - started)
    comm.Barrier()
    started = time.perf_counter()
    waited_total = world.allreduce_sum(vector, "allreduce")
    waited.append(time.perf_counter() - started)
    assert np.array_equal(waited_total, total)
if world.rank == 0:
    print(f"blocking {np.median(blocking) * 1e6:.1f} us, World.wait {np.median(waited) * 1e6:.1f} us", flush=True)
print(f"rank {world.rank} slept {len(sleeps)} times while waiting", flush=True)

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
    request.Cancel()
    request.Wait()
comm.Barrier()
"""


def test_world_wait_is_as_fast_as_mpi_and_keeps_its_deadline():
    argv = [MPIEXEC, *launch.launcher_flags(MPIEXEC, 2, fault_tolerant=False), "-n", "2", sys.executable,
            "-m", "mpi4py", "-c", SCRIPT]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=launch.environment())
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert sorted(line for line in lines if "slept" in line) == [f"rank {r} slept 0 times while waiting" for r in (0, 1)]
    timing = next(line for line in lines if line.startswith("blocking"))
    blocking, waited = (float(part.split()[-2]) for part in timing.split(","))
    # the margin leaves room for a loaded machine
    assert waited <= 3 * blocking + 50, timing
    lost = next(line for line in lines if "PeerLost" in line)
    assert lost.startswith("PeerLost after"), lost
    seconds = float(lost.split()[2])
    assert 0.5 <= seconds < 10, lost
    assert "from rank 1" in lost and lost.endswith("(1,)"), lost
