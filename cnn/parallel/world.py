"""One rank's view of the job: its communicator, a deadline on every wait, the lost ranks, leaving.

MPI collectives cannot time out, and a blocking receive from a dead process waits forever. So no
call in this package blocks: every message is a nonblocking request (``Isend``, ``Irecv``,
``Ibcast``, ``Iallreduce``), and ``World.wait`` tests it until it completes or ``timeout`` seconds
pass, then raises ``PeerLost`` saying what it was waiting for.

How a rank waits (``wait_until``): it first *spins* on MPI's test for ``SPIN_SECONDS``, as MPI's own
``MPI_Wait`` does, then *naps* between tests — 20 µs, doubling up to ``LONGEST_NAP`` (1 ms). A
nonblocking collective moves on only while its ranks are inside an MPI call, so a rank that naps
during a short exchange adds its nap to it: the first version napped from the start and made a
LeNet-5 allreduce 20-70 times slower than MPI's blocking one on an idle 16-core host. Spinning
first keeps an exchange that takes less than the spin (the allreduce of a LeNet-5 gradient takes
a tenth of a millisecond) exactly as fast as ``MPI_Wait``; napping afterwards frees the core during
a long wait — for a slow peer, a straggler — at a cost of at most one nap (1 ms) when it ends.
Where the job has more ranks on this node than there are cores, the spinning rank also gives its
core away with ``sched_yield`` between tests (Open MPI's ``mpi_yield_when_idle``).
``tests/test_parallel_wait.py`` checks both halves in one job; ``benchmarks/parallel_cost_model.py``
measures the wake-up against ``MPI_Wait`` and the waiting rank's CPU time.

What happens to the survivors when a rank dies is the launcher's choice:

- plain ``mpiexec``: the runtime ends the whole job as soon as one process exits abnormally.
  Nothing hangs; the last periodic checkpoint is what remains.
- ``mpiexec --runtime-options recoverable`` (Open MPI 5; MPICH: ``-disable-auto-cleanup``): the
  survivors keep running, notice the silence through their deadlines and decide what to do —
  carry on without the lost worker (Downpour, Sandblaster) or stop cleanly, writing a checkpoint
  of the last completed step where they hold the whole state, else naming the last periodic one.
  ``cnn.parallel.launch`` adds this option where the MPI has it (not Open MPI 4.1).

A stop costs about one timeout, not three: the first survivor whose deadline passes starts a *roll
call* — it sends a token to every other rank — and every rank that is waiting for anything also
listens for those tokens, so the others join at once instead of each waiting out a timeout of its
own; the roll call then waits for the ranks nobody suspects a little longer than for the ones
someone found silent (``survivors``). After a loss the survivors leave without ``MPI_Finalize``,
which can hang on a message the dead rank left half-way (``leave``); a rank that never learnt of the
loss finalizes, under a watchdog that ends it if MPI_Finalize waits for the dead rank (``finalize_within``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from cnn.parallel.launch import usable_cores

TAG_ALIVE, TAG_SUMMARY, TAG_DONE, TAG_ROLL = 9001, 9002, 9004, 9005   # reserved; strategies use tags below 100
SPIN_SECONDS = 0.005       # spin this long before napping: longer than an exchange that is not waiting for anyone
FIRST_NAP, LONGEST_NAP = 20e-6, 1e-3
ROLL_CALL_PATIENCE = 0.5   # × timeout: how long a roll call waits for a rank that does not answer
SUSPECT_GRACE = 0.25       # × timeout: ... and for a rank that some survivor already found silent (or
                           # once no answer has come for that long: a live rank on a loaded machine may
                           # need a few hundred milliseconds to be scheduled and answer)


def wait_until(condition, seconds: float, yield_core: bool = True, spin: float | None = None) -> bool:
    """Call ``condition()`` until it is true (True) or ``seconds`` have passed (False): spinning for
    ``spin`` seconds (default ``SPIN_SECONDS``; giving the core to any other ready process between
    calls, with ``yield_core``), then napping between calls, 20 µs doubling to 1 ms."""
    spin = SPIN_SECONDS if spin is None else spin
    if condition():
        return True
    now = started = time.monotonic()
    deadline, nap = started + seconds, FIRST_NAP
    while not condition():
        now = time.monotonic()
        if now > deadline:
            return False
        if now - started < spin:
            if yield_core:
                os.sched_yield()
        else:
            time.sleep(min(nap, max(0.0, deadline - now)))
            nap = min(2 * nap, LONGEST_NAP)
    return True


def ranks_on_this_node(size: int) -> int:
    """How many ranks of the job share this node, as the launcher says (else all of them)."""
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return size


class PeerLost(RuntimeError):
    """A peer did not answer within the deadline, or another rank started a roll call after losing
    one; the message says who and what was awaited, ``ranks`` the ranks suspected."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)


@dataclass
class FaultHooks:
    """Test hooks: ``kill_rank`` exits abruptly at ``kill_at_step``; ``slow_rank`` computes ``slow_down``×
    slower; ``interrupt_rank`` sends itself ``interrupt_signal`` ("INT" or "TERM") at ``interrupt_at_step``."""

    kill_rank: int | None = None
    kill_at_step: int | None = None
    slow_rank: int | None = None
    slow_down: float = 1.0
    interrupt_rank: int | None = None
    interrupt_at_step: int | None = None
    interrupt_signal: str = "TERM"


class World:
    """``comm``, ``rank``, ``size`` plus deadline-bounded waits and rank-0 logging."""

    def __init__(self, comm=None, timeout: float = 60.0, hooks: FaultHooks | None = None, quiet: bool = False):
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # An error that belongs to no communicator (Open MPI's TCP transport when a peer on another
        # host dies: "Socket closed") goes to MPI_COMM_SELF's handler, by default one that aborts the
        # job; returned instead, the survivors find the loss through their deadlines as on one host.
        MPI.COMM_SELF.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.timeout = timeout
        self.hooks = hooks or FaultHooks()
        self.quiet = quiet
        self.lost: set[int] = set()
        self.suspects: set[int] = set()          # ranks some survivor found silent (they may still be alive)
        self.oversubscribed = ranks_on_this_node(self.size) > usable_cores()
        self.reporter = 0                         # the rank that gathers the summary (the writer after a loss)
        self._roll_call = None                    # the receive that hears a roll call started elsewhere ...
        self._listen_buffer = None                # ... into this buffer
        self._heard: list[np.ndarray] = []        # tokens heard and not yet counted by a roll call

    # -- logging: rank 0 speaks, the others stay quiet ------------------------------------------
    def log(self, message: str) -> None:
        if self.rank == 0 and not self.quiet:
            print(message, flush=True)

    def warn(self, message: str) -> None:
        """A line on stderr from whichever rank has something to report (used when rank 0 may be gone)."""
        print(message, file=sys.stderr, flush=True)

    # -- waiting with a deadline ----------------------------------------------------------------
    def listen_for_roll_calls(self) -> None:
        """From now on every wait also hears a roll call that another survivor starts (``survivors``),
        and ends with ``PeerLost`` at once instead of waiting out its own timeout."""
        if self._roll_call is None and self.size > 1:
            self._listen_buffer = np.zeros(self.size + 1, np.int64)
            self._roll_call = self.comm.Irecv(self._listen_buffer, source=MPI.ANY_SOURCE, tag=TAG_ALIVE)

    def _heard_roll_call(self) -> bool:
        """Whether a roll-call token came (kept in ``_heard``; the listener is posted again). With ULFM
        the listener, a receive from any source, also reports any peer's failure: acknowledged, and
        left to the requests that involve the peer."""
        if self._roll_call is None:
            return False
        try:
            if not self._roll_call.Test():
                return False
        except MPI.Exception:
            self._acknowledge_failures()      # the listener stays posted and can still hear a token
            return False
        self._heard.append(self._listen_buffer)
        self._roll_call = None
        self.listen_for_roll_calls()
        return True

    def _acknowledge_failures(self) -> None:
        """ULFM: acknowledge the failures MPI reported, so that a receive from any source can match again."""
        try:
            self.comm.Ack_failed()
        except (NotImplementedError, MPI.Exception):
            pass

    def _roll_call_started(self) -> PeerLost:
        caller = int(self._heard[-1][0])
        suspects = [r for r in range(self.size) if self._heard[-1][1 + r]]
        self.suspects.update(suspects)
        who = f" (rank{'s' if len(suspects) > 1 else ''} {', '.join(map(str, suspects))} silent)" if suspects else ""
        return PeerLost(f"rank {self.rank}: rank {caller} started a roll call{who}", suspects)

    def _until(self, condition, seconds: float) -> bool:
        """``wait_until(condition)``, ending with PeerLost as soon as a roll call is heard."""
        heard = []

        def done_or_roll_call() -> bool:
            if condition():
                return True
            if self._heard_roll_call():
                heard.append(True)
                return True
            return False

        finished = wait_until(done_or_roll_call, seconds, self.oversubscribed)
        if heard:
            raise self._roll_call_started()
        return finished

    def wait(self, requests, what: str, peers=(), patience: float = 1.0) -> None:
        """Wait until every request completes; raise PeerLost after ``patience`` × ``timeout`` seconds.

        ``peers``: the rank each request talks to (one per request), or the ranks involved; on a
        timeout the message names the peers whose requests are still pending.
        """
        requests, peers = list(requests), list(peers)
        limit = patience * self.timeout
        try:
            if self._until(lambda: MPI.Request.Testall(requests), limit):
                return
        except MPI.Exception as err:          # a peer's failure reported by MPI itself (ULFM, across hosts)
            raise PeerLost(f"rank {self.rank}: {what} failed: {err.Get_error_string()}",
                           peers if len(set(peers)) < self.size else ()) from None
        if len(peers) == len(requests):
            peers = [peer for peer, request in zip(peers, requests) if not request.Test()]
        peers = sorted(set(peers))
        who = f" from rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}" if peers else ""
        raise PeerLost(f"rank {self.rank}: no {what}{who} within {limit:g} s", peers)

    def poll_any(self, requests, patience: float) -> int | None:
        """Index of a completed request, or None if none completes within ``patience`` seconds."""
        found = []

        def one_done() -> bool:
            try:
                index, done = MPI.Request.Testany(requests)
            except MPI.Exception:             # a failed peer's request (ULFM): set aside, its deadline finds it
                self._set_aside_failed(requests, found)
                return bool(found)
            if done and index != MPI.UNDEFINED:
                found.append(index)
            return bool(found)

        return found[0] if self._until(one_done, patience) else None

    @staticmethod
    def _set_aside_failed(requests: list, found: list) -> None:
        """Replace the requests MPI reports failed by MPI.REQUEST_NULL (in place); note one that completed."""
        for index, request in enumerate(requests):
            if request == MPI.REQUEST_NULL:
                continue
            try:
                if request.Test():
                    found.append(index)
                    return
            except MPI.Exception:
                requests[index] = MPI.REQUEST_NULL

    def cancel(self, request, what: str) -> None:
        """Cancel a receive from a lost peer and complete it, as MPI requires (a cancelled request
        still has to be waited on). A receive the peer had half-filled cannot be cancelled: it is
        given up after a second, with a line."""
        if request == MPI.REQUEST_NULL:
            return
        try:
            request.Cancel()
            finished = wait_until(request.Test, 1.0, self.oversubscribed)
        except MPI.Exception:                 # the peer's failure, reported by MPI: nothing left to complete
            return
        if not finished:
            self.warn(f"rank {self.rank}: could not cancel the {what} (a message was half-way)")

    # -- the two collectives of Horovod's recipe, bounded by the deadline -----------------------
    def broadcast(self, array: np.ndarray, what: str, root: int = 0, patience: float = 1.0) -> np.ndarray:
        """In place: every rank's ``array`` becomes root's (Horovod's broadcast_parameters)."""
        self.wait([self.comm.Ibcast(array, root=root)], what, peers=(root,) if self.rank != root else (), patience=patience)
        return array

    def broadcast_object(self, value, what: str, root: int = 0, patience: float = 1.0):
        """Root's ``value`` (anything JSON holds) on every rank: its length, then its bytes."""
        data = np.frombuffer(json.dumps(value).encode(), np.uint8) if self.rank == root else None
        length = self.broadcast(np.array([len(data) if data is not None else 0], np.int64), f"{what} (length)", root,
                                patience)
        buffer = data.copy() if data is not None else np.empty(int(length[0]), np.uint8)
        return json.loads(self.broadcast(buffer, what, root, patience).tobytes().decode())

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

    def maybe_interrupt(self, step: int) -> None:
        """``--interrupt-rank R --interrupt-at-step S``: rank R sends itself SIGINT or SIGTERM at step S,
        as Ctrl-C or a scheduler would."""
        if self.rank == self.hooks.interrupt_rank and step == self.hooks.interrupt_at_step:
            os.kill(os.getpid(), getattr(signal, "SIG" + self.hooks.interrupt_signal))

    def maybe_straggle(self, compute_seconds: float) -> None:
        """``--slow-rank R --slow-down F``: rank R takes F times as long to compute."""
        if self.rank == self.hooks.slow_rank and self.hooks.slow_down > 1:
            time.sleep((self.hooks.slow_down - 1) * compute_seconds)

    # -- after a failure ------------------------------------------------------------------------
    def survivors(self, suspects=()) -> list[int]:
        """The ranks that answer a roll call; every survivor calls this after PeerLost.

        Each survivor sends a token — its rank and the ranks it found silent — to every other rank
        twice: once to wake it (the listener every wait tests, ``listen_for_roll_calls``: a waiting
        rank ends its wait at once, so the survivors meet within moments of the first one noticing),
        once as its answer, received from that rank alone on a tag of its own (with ULFM a receive
        from any source stalls once a peer has failed, so it cannot be what counts the answers).
        The roll call ends when every rank has answered, or, after ``SUSPECT_GRACE`` of a timeout,
        when the ranks still silent are all suspects (some survivor found them silent) or no answer
        has come for that long; ``ROLL_CALL_PATIENCE`` timeouts at most. A live rank is waiting too,
        or one step's compute away from it, and answers at once. (Agreeing on who is alive is itself
        a distributed problem; ULFM's MPI_Comm_agree solves it properly. This roll call is enough
        when the timeout is well above a step's compute: the default is 60 s.)
        """
        self.suspects.update(suspects)
        answered = {self.rank}
        if self._roll_call is not None:           # the listener is done with: a stalled receive from any
            self._acknowledge_failures()          # source (ULFM) would hold up the answers behind it
            self.cancel(self._roll_call, "roll-call listener")
            self._roll_call = None
        failed = self._failed_by_mpi()
        others = [r for r in range(self.size) if r != self.rank and r not in self.lost]
        token = np.zeros(self.size + 1, np.int64)
        token[0] = self.rank
        token[1 + np.array(sorted(self.suspects | failed), dtype=np.int64)] = 1
        sends, pending, inbox = [], {}, {}
        for other in [r for r in others if r not in failed]:     # a send to a dead peer over TCP can abort
            try:
                sends += [self.comm.Isend(token, dest=other, tag=TAG_ROLL),      # the answer first
                          self.comm.Isend(token, dest=other, tag=TAG_ALIVE)]
                inbox[other] = np.zeros(self.size + 1, np.int64)
                pending[other] = self.comm.Irecv(inbox[other], source=other, tag=TAG_ROLL)
            except MPI.Exception:             # MPI knows it failed (ULFM)
                failed.add(other)
        started = last_answer = time.monotonic()
        grace = SUSPECT_GRACE * self.timeout

        def settled() -> bool:
            nonlocal last_answer
            now = time.monotonic()
            for other in list(pending):
                try:
                    if not pending[other].Test():
                        continue
                except MPI.Exception:         # its failure, reported by MPI (ULFM)
                    failed.add(other)
                    del pending[other]
                    continue
                answered.add(other)
                self.suspects.update(r for r in range(self.size) if inbox[other][1 + r])
                del pending[other]
                last_answer = now
            if not pending:
                return True
            if now - started < grace:
                return False
            return all(r in self.suspects for r in pending) or now - last_answer > grace

        wait_until(settled, ROLL_CALL_PATIENCE * self.timeout, self.oversubscribed)
        for other, request in pending.items():
            self.cancel(request, f"roll-call answer of rank {other}")
        self.lost.update(r for r in others if r not in answered)
        wait_until(lambda: all(self._completed(send) for send in sends), 1.0, self.oversubscribed)
        return sorted(answered - self.lost)

    def _failed_by_mpi(self) -> set[int]:
        """The ranks MPI itself knows have failed (ULFM's MPI_Comm_get_failed; empty without ULFM)."""
        try:
            group = self.comm.Get_failed()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), self.comm.Get_group())
        except (NotImplementedError, MPI.Exception):
            return set()
        return {rank for rank in ranks if rank != MPI.UNDEFINED}

    @staticmethod
    def _completed(request) -> bool:
        try:
            return request.Test()
        except MPI.Exception:
            return True

    def gather_objects(self, value, root: int = 0, patience: float = 10.0) -> dict[int, object] | None:
        """Root gets {rank: value} from every rank that is not lost and answers in time; others get None.

        Ranks finish at different times (an asynchronous server still serves the slower workers),
        so this waits ``patience`` timeouts.
        """
        self.reporter = root
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

        wait_until(everyone_reported, patience * self.timeout, self.oversubscribed)
        self.lost.update(waiting)
        return values

    def leave(self, code: int) -> int:
        """The exit code, output flushed.

        Without a loss: the roll-call listener is cancelled and the caller goes on to MPI_Finalize.
        After a loss the survivors do not finalize: MPI_Finalize can hang when the dead rank was
        half-way through a message (a rank that printed its stop message stayed alive for minutes).
        Instead the rank that wrote the summary tells the others it is done, and every survivor
        ends its process at once with ``code`` — after the writer, so that the runtime never ends
        the job under it while it writes.
        """
        if not self.lost:
            if self._roll_call is not None:
                self.cancel(self._roll_call, "roll-call listener")
                self._roll_call = None
            sys.stdout.flush()
            sys.stderr.flush()
            return code
        done = np.zeros(1, np.int64)
        try:
            if self.rank == self.reporter:    # every rank MPI does not know dead: one the roll call missed too
                gone = self._failed_by_mpi()
                others = [r for r in range(self.size) if r != self.rank and r not in gone]
                sends = [self.comm.Isend(done, dest=r, tag=TAG_DONE) for r in others]
                wait_until(lambda: all(self._completed(send) for send in sends), 1.0, self.oversubscribed)
            elif self.reporter not in self.lost:
                request = self.comm.Irecv(done, source=self.reporter, tag=TAG_DONE)
                wait_until(lambda: self._completed(request), self.timeout, self.oversubscribed)
        except MPI.Exception:                 # the writer's or a peer's failure (ULFM): leave all the same
            pass
        _exit_flushed(code)


def finalize_within(patience: float, code: int) -> None:
    """MPI_Finalize; if it has not returned after ``patience`` seconds, the end of this process with ``code``
    and a line on stderr. A rank that never learnt of a lost peer finalizes like any other, and
    MPI_Finalize can wait for the dead one for ever (seen in CI: Sandblaster's workers after a killed
    worker, until the test's limit killed the job).

    The watchdog is a timer thread, and a thread runs Python only while it holds the GIL: mpi4py's
    ``MPI.Finalize`` keeps the GIL for the whole call (measured: a 3 s timer fired only when a 20 s
    MPI_Finalize returned), so MPI_Finalize is called through ctypes, which lets the GIL go during a
    foreign call. (Where the library cannot be found, without /proc, mpi4py's call is the fallback and
    the watchdog cannot fire during it.)
    """
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return

    def leave_without_finalize() -> None:
        print(f"MPI_Finalize did not return in {patience:g} s (a peer lost without this rank knowing it?): "
              "leaving without it", file=sys.stderr)
        _exit_flushed(code)

    watchdog = threading.Timer(patience, leave_without_finalize)
    watchdog.daemon = True
    watchdog.start()
    libmpi = _loaded_libmpi()
    if libmpi is not None:
        libmpi.MPI_Finalize()
    else:
        MPI.Finalize()
    watchdog.cancel()


def _loaded_libmpi():
    """The MPI library this process runs on, opened with ctypes (its path from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "/libmpi.so" in line}
    except OSError:
        return None
    return ctypes.CDLL(min(paths)) if paths else None


def _exit_flushed(code: int) -> None:
    """The end of this process with ``code`` at once — no MPI_Finalize, no Python shutdown — its output flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
