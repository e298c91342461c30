"""One rank's view of the job: its communicator, a deadline on every wait, the lost ranks, leaving.

MPI collectives cannot time out, and a blocking receive from a dead process waits forever. So no
call in this package blocks: every message is a nonblocking request (``Isend``, ``Irecv``,
``Ibcast``, ``Iallreduce``), and ``World.wait`` tests it until it completes or ``timeout`` seconds
pass, then raises ``PeerLost`` saying what it was waiting for.

Between two tests the waiting rank does not sleep: it spins, as MPI's own ``MPI_Wait`` does. A
nonblocking collective moves on only while its ranks are inside an MPI call, so every microsecond a
rank sleeps is added to the exchange: the first version slept between tests (10 µs doubling to
1 ms) and made a LeNet-5 allreduce 20-70 times slower than MPI's blocking one on an idle 16-core
host. Where the job has more ranks on this node than there are cores, the spinning rank gives its
core away with ``sched_yield`` between tests (Open MPI's ``mpi_yield_when_idle``), so that the
ranks that compute get it. ``tests/test_parallel_wait.py`` times both ways in one job.

What happens to the survivors when a rank dies is the launcher's choice:

- plain ``mpiexec``: the runtime ends the whole job as soon as one process exits abnormally.
  Nothing hangs; the last periodic checkpoint is what remains.
- ``mpiexec --runtime-options recoverable`` (Open MPI 5; MPICH: ``-disable-auto-cleanup``): the
  survivors keep running, notice the silence through their deadlines and decide what to do —
  carry on without the lost worker (Downpour, Sandblaster) or stop cleanly, writing a checkpoint
  of the last completed step where they hold the whole state, else naming the last periodic one.
  ``cnn.parallel.launch`` adds this option where the MPI has it (not Open MPI 4.1).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from cnn.parallel.launch import usable_cores

TAG_ALIVE, TAG_SUMMARY = 9001, 9002   # reserved; strategies use tags below 100


def spin_until(condition, seconds: float, yield_core: bool = True) -> bool:
    """Call ``condition()`` until it is true (True) or ``seconds`` have passed (False), never
    sleeping; with ``yield_core`` the core goes to any other process that is ready between calls."""
    if condition():
        return True
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        if yield_core:
            os.sched_yield()
    return True


def ranks_on_this_node(size: int) -> int:
    """How many ranks of the job share this node, as the launcher says (else all of them)."""
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return size


class PeerLost(RuntimeError):
    """A peer did not answer within the deadline; the message says who and what was awaited."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)


@dataclass
class FaultHooks:
    """Test hooks: ``kill_rank`` exits abruptly at ``kill_at_step``; ``slow_rank`` computes ``slow_down``× slower."""

    kill_rank: int | None = None
    kill_at_step: int | None = None
    slow_rank: int | None = None
    slow_down: float = 1.0


class World:
    """``comm``, ``rank``, ``size`` plus deadline-bounded waits and rank-0 logging."""

    def __init__(self, comm=None, timeout: float = 60.0, hooks: FaultHooks | None = None, quiet: bool = False):
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = timeout
        self.hooks = hooks or FaultHooks()
        self.quiet = quiet
        self.lost: set[int] = set()
        self.oversubscribed = ranks_on_this_node(self.size) > usable_cores()

    # -- logging: rank 0 speaks, the others stay quiet ------------------------------------------
    def log(self, message: str) -> None:
        if self.rank == 0 and not self.quiet:
            print(message, flush=True)

    def warn(self, message: str) -> None:
        """A line on stderr from whichever rank has something to report (used when rank 0 may be gone)."""
        print(message, file=sys.stderr, flush=True)

    # -- waiting with a deadline ----------------------------------------------------------------
    def wait(self, requests, what: str, peers=(), patience: float = 1.0) -> None:
        """Spin until every request completes; raise PeerLost after ``patience`` × ``timeout`` seconds.

        ``peers``: the rank each request talks to (one per request), or the ranks involved; on a
        timeout the message names the peers whose requests are still pending.
        """
        requests, peers = list(requests), list(peers)
        limit = patience * self.timeout
        if spin_until(lambda: MPI.Request.Testall(requests), limit, self.oversubscribed):
            return
        if len(peers) == len(requests):
            peers = [peer for peer, request in zip(peers, requests) if not request.Test()]
        peers = sorted(set(peers))
        who = f" from rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}" if peers else ""
        raise PeerLost(f"rank {self.rank}: no {what}{who} within {limit:g} s", peers)

    def poll_any(self, requests, patience: float) -> int | None:
        """Index of a completed request, or None if none completes within ``patience`` seconds."""
        found = []

        def one_done() -> bool:
            index, done = MPI.Request.Testany(requests)
            if done and index != MPI.UNDEFINED:
                found.append(index)
            return bool(found)

        return found[0] if spin_until(one_done, patience, self.oversubscribed) else None

    # -- the two collectives of Horovod's recipe, bounded by the deadline -----------------------
    def broadcast(self, array: np.ndarray, what: str, root: int = 0, patience: float = 1.0) -> np.ndarray:
        """In place: every rank's ``array`` becomes root's (Horovod's broadcast_parameters)."""
        self.wait([self.comm.Ibcast(array, root=root)], what, peers=(root,) if self.rank != root else (), patience=patience)
        return array

    def broadcast_object(self, value, what: str, root: int = 0):
        """Root's ``value`` (anything JSON holds) on every rank: its length, then its bytes."""
        data = np.frombuffer(json.dumps(value).encode(), np.uint8) if self.rank == root else None
        length = self.broadcast(np.array([len(data) if data is not None else 0], np.int64), f"{what} (length)", root)
        buffer = data.copy() if data is not None else np.empty(int(length[0]), np.uint8)
        return json.loads(self.broadcast(buffer, what, root).tobytes().decode())

    def allreduce_sum(self, array: np.ndarray, what: str, in_place: bool = False) -> np.ndarray:
        """The element-wise sum of every rank's ``array``: a new array, or ``array`` itself overwritten."""
        if in_place:
            self.wait([self.comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM)], what)
            return array
        total = np.empty_like(array)
        self.wait([self.comm.Iallreduce(array, total, op=MPI.SUM)], what)
        return total

    # -- test hooks -----------------------------------------------------------------------------
    def maybe_die(self, step: int) -> None:
        """``--kill-rank R --kill-at-step S``: rank R dies at step S without a word to MPI.

        It dies the way a crashed or OOM-killed process does, by SIGKILL. (Exiting with a non-zero
        status instead is not the same to Open MPI 5's runtime: with one rank left, it then ends the
        job, ``recoverable`` or not — whereas a rank killed by a signal leaves its last peer running.)
        """
        if self.rank == self.hooks.kill_rank and step == self.hooks.kill_at_step:
            self.warn(f"rank {self.rank}: killing itself at step {step} (--kill-rank test hook)")
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_straggle(self, compute_seconds: float) -> None:
        """``--slow-rank R --slow-down F``: rank R takes F times as long to compute."""
        if self.rank == self.hooks.slow_rank and self.hooks.slow_down > 1:
            time.sleep((self.hooks.slow_down - 1) * compute_seconds)

    # -- after a failure ------------------------------------------------------------------------
    def survivors(self) -> list[int]:
        """Ranks that answer a roll call within the timeout; every survivor calls this after PeerLost.

        Each survivor sends its rank to every other rank and listens for theirs, for two timeouts:
        a survivor may notice the loss one timeout after another (it was waiting on the one that
        noticed first). Agreeing on who is alive is itself a distributed problem; ULFM's
        MPI_Comm_agree solves it properly, this roll call is enough when the survivors reach it
        within two timeouts of each other.
        """
        others = [r for r in range(self.size) if r != self.rank and r not in self.lost]
        token = np.array([self.rank], dtype=np.int64)
        for other in others:
            self.comm.Isend(token, dest=other, tag=TAG_ALIVE)     # never waited on: the peer may be dead
        inbox = {other: np.empty(1, np.int64) for other in others}
        pending = {other: self.comm.Irecv(inbox[other], source=other, tag=TAG_ALIVE) for other in others}
        answered = {self.rank}

        def everyone_answered() -> bool:
            for other in [r for r, request in pending.items() if request.Test()]:
                answered.add(other)
                del pending[other]
            return not pending

        spin_until(everyone_answered, 2 * self.timeout)
        self.lost.update(pending)
        return sorted(answered)

    def gather_objects(self, value, root: int = 0, patience: float = 10.0) -> dict[int, object] | None:
        """Root gets {rank: value} from every rank that is not lost and answers in time; others get None.

        Ranks finish at different times (an asynchronous server still serves the slower workers),
        so this waits ``patience`` timeouts.
        """
        if self.rank != root:
            request = self.comm.isend(value, dest=root, tag=TAG_SUMMARY)
            if self.poll_any([request], patience * self.timeout) is None:
                self.warn(f"rank {self.rank}: rank {root} did not take the summary within {patience * self.timeout:g} s")
                self.lost.add(root)
            return None
        values, waiting = {root: value}, [r for r in range(self.size) if r != root and r not in self.lost]

        def everyone_reported() -> bool:
            for other in list(waiting):
                message = self.comm.improbe(source=other, tag=TAG_SUMMARY)
                if message is not None:
                    values[other] = message.recv()
                    waiting.remove(other)
            return not waiting

        spin_until(everyone_reported, patience * self.timeout)
        self.lost.update(waiting)
        return values

    def leave(self, code: int) -> int:
        """The exit code, output flushed. The survivors of a loss still leave through MPI_Finalize:
        with ``--runtime-options recoverable`` Open MPI finalizes without the dead rank, whereas a
        survivor that skipped it would count as one more abnormal exit and end the job for the
        others before they are done.

        Finalize can still hang when the dead rank was half-way through a message (a receive
        already matched to data that will never come). After a loss a watchdog therefore ends the
        process if leaving takes longer than the timeout: ``faulthandler``'s timer runs in its own
        C thread, so it fires even while MPI_Finalize holds the interpreter. Everything has been
        written by then.
        """
        sys.stdout.flush()
        sys.stderr.flush()
        if self.lost:
            faulthandler.dump_traceback_later(2 * self.timeout + 3, exit=True, file=open(os.devnull, "w"))
        return code
