"""P MPI ranks in one process: threads that exchange messages through mpi4py's point-to-point names.

``run_ranks(P, function, ...)`` runs ``function(comm, *args)`` once per rank, each in its own thread,
and returns every rank's result and the traffic of every link. ``comm`` answers to the names of
mpi4py's ``MPI.COMM_WORLD`` that a collective written by hand needs — ``Get_rank``/``rank``,
``Get_size``/``size``, ``Send``, ``Recv``, ``Sendrecv`` — with numpy buffers, so a function written
against it runs unchanged under ``mpiexec -n P python -m mpi4py …``.

Sends are *synchronous* (rendezvous): ``Send`` returns only once the receiver has taken the message.
MPI may buffer a small message instead, but it need not, and for large ones it does not: a program
is correct in MPI only if it is correct without buffering (the standard calls it *safe*). So a
ring in which every rank first sends, then receives, waits here for ever — and since every rank is
then waiting for another, the deadlock is detected at once and reported with what each rank waits
for. ``Sendrecv`` posts its send and its receive together and is the safe way to pass a ring along.

``Traffic`` counts, per directed link (source → destination), the messages and the numbers they
carried: what the α-β cost model of notebook 11 charges for. A ring allreduce sends
2·(P−1)/P·N numbers per rank; a gather to rank 0 and a broadcast back sends (P−1)·N through rank
0's link; the count tells them apart exactly, where a clock on one machine would not.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import numpy as np

ANY_TAG = -1


class Deadlock(RuntimeError):
    """Every rank still running waits for a message (or a receiver) that no other rank will provide."""


class RankFailed(RuntimeError):
    """A rank raised; the message names the rank and the original error."""


class Traffic:
    """Messages and numbers carried by each directed link (source, destination)."""

    def __init__(self, size: int):
        self.size = size
        self.messages: dict[tuple[int, int], int] = defaultdict(int)
        self.numbers: dict[tuple[int, int], int] = defaultdict(int)

    def record(self, source: int, dest: int, count: int) -> None:
        self.messages[(source, dest)] += 1
        self.numbers[(source, dest)] += count

    def sent(self, rank: int) -> int:
        """Numbers rank ``rank`` sent, to all destinations together."""
        return sum(count for (source, _), count in self.numbers.items() if source == rank)

    def received(self, rank: int) -> int:
        return sum(count for (_, dest), count in self.numbers.items() if dest == rank)

    def messages_sent(self, rank: int) -> int:
        return sum(count for (source, _), count in self.messages.items() if source == rank)

    def busiest_rank(self) -> tuple[int, int]:
        """(rank, numbers) of the rank whose link carries the most, sent plus received."""
        loads = [self.sent(rank) + self.received(rank) for rank in range(self.size)]
        return int(np.argmax(loads)), max(loads)

    def summary(self) -> str:
        lines = []
        for rank in range(self.size):
            messages = self.messages_sent(rank)
            lines.append(f"  rank {rank}: sent {messages} message{'s' * (messages != 1)}, {self.sent(rank)} numbers; "
                         f"received {self.received(rank)} numbers")
        return "\n".join(lines)


class _Message:
    __slots__ = ("data", "taken")

    def __init__(self, data: np.ndarray):
        self.data, self.taken = data, False


class _World:
    """The shared state of the ranks: queued messages, who waits for what, and the traffic."""

    def __init__(self, size: int, timeout: float):
        self.size, self.timeout = size, timeout
        self.condition = threading.Condition()
        self.queues: dict[tuple[int, int, int], deque] = defaultdict(deque)   # (source, dest, tag) → messages
        self.waiting: dict[int, tuple[str, object]] = {}                        # rank → (what, ready predicate)
        self.running = set(range(size))
        self.failure: BaseException | None = None
        self.traffic = Traffic(size)

    def wait(self, rank: int, what: str, ready) -> None:
        """Block (holding the condition) until ``ready()``; detect deadlocks and time out."""
        deadline = time.monotonic() + self.timeout
        while not ready():
            if self.failure is not None:
                raise RankFailed(f"rank {rank} stopped: another rank failed") from None
            self.waiting[rank] = (what, ready)
            if self._deadlocked():
                self.failure = Deadlock(self._deadlock_message())
                self.condition.notify_all()
                del self.waiting[rank]
                raise self.failure
            left = deadline - time.monotonic()
            if left <= 0:
                del self.waiting[rank]
                raise TimeoutError(f"rank {rank} waited {self.timeout:g} s {what}")
            self.condition.wait(min(left, 1.0))
            self.waiting.pop(rank, None)

    def _deadlocked(self) -> bool:
        return all(rank in self.waiting and not self.waiting[rank][1]() for rank in self.running)

    def _deadlock_message(self) -> str:
        waits = "; ".join(f"rank {rank} waits {self.waiting[rank][0]}" for rank in sorted(self.waiting))
        return (f"deadlock: {waits}. Every rank waits for another. Sends are synchronous, as MPI's may be: "
                f"use comm.Sendrecv to send and receive in one call")

    def post(self, source: int, dest: int, tag: int, buffer) -> _Message:
        self._check_peer(source, dest, "send to")
        data = np.array(buffer, copy=True)
        message = _Message(data)
        self.queues[(source, dest, tag)].append(message)
        self.traffic.record(source, dest, data.size)
        self.condition.notify_all()
        return message

    def take(self, source: int, dest: int, tag: int, buffer) -> None:
        self._check_peer(dest, source, "receive from")
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"rank {dest}: Recv needs a numpy array to receive into, got {type(buffer).__name__}")
        queue = self.queues[(source, dest, tag)]
        self.wait(dest, f"in Recv for a message from rank {source} (tag {tag})", lambda: bool(queue))
        message = queue.popleft()
        if message.data.size != buffer.size:
            raise ValueError(f"rank {dest}: the message from rank {source} holds {message.data.size} numbers, "
                             f"the receive buffer {buffer.size}")
        buffer.reshape(-1)[...] = message.data.reshape(-1)
        message.taken = True
        self.condition.notify_all()

    def _check_peer(self, rank: int, peer, verb: str) -> None:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"rank {rank}: cannot {verb} rank {peer!r}; ranks are 0 … {self.size - 1}")
        if peer == rank:
            raise ValueError(f"rank {rank}: a message to itself; keep the data instead")


class SimulatedComm:
    """One rank's view of the world, with the names of mpi4py's ``Comm`` (numpy buffers only)."""

    def __init__(self, world: _World, rank: int):
        self._world, self.rank, self.size = world, rank, world.size

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` to ``dest`` and return once ``dest`` has received it (rendezvous)."""
        world = self._world
        with world.condition:
            message = world.post(self.rank, dest, tag, buf)
            world.wait(self.rank, f"in Send to rank {dest} (tag {tag}) for rank {dest} to receive",
                       lambda: message.taken)

    def Recv(self, buf, source: int, tag: int = 0, status=None) -> None:
        """Receive the next message from ``source`` with ``tag`` into ``buf`` (same number of elements)."""
        with self._world.condition:
            self._world.take(source, self.rank, tag, buf)

    def Sendrecv(self, sendbuf, dest: int, sendtag: int = 0, recvbuf=None, source: int | None = None,
                 recvtag: int = 0, status=None) -> None:
        """Send ``sendbuf`` to ``dest`` and receive into ``recvbuf`` from ``source``, both at once."""
        if recvbuf is None or source is None:
            raise ValueError(f"rank {self.rank}: Sendrecv needs recvbuf= and source=")
        world = self._world
        with world.condition:
            message = world.post(self.rank, dest, sendtag, sendbuf)
            world.take(source, self.rank, recvtag, recvbuf)
            world.wait(self.rank, f"in Sendrecv for rank {dest} to receive", lambda: message.taken)


def run_ranks(size: int, function, *args, per_rank=None, timeout: float = 30.0):
    """Run ``function(comm, *args, *per_rank[r])`` on ranks r = 0 … size−1; return (results, Traffic).

    ``per_rank`` is a list of argument tuples, one per rank (each rank's own data). The first rank
    to raise stops the others, and its error is raised here with the rank named.
    """
    if size < 1:
        raise ValueError(f"need at least one rank, got {size}")
    world = _World(size, timeout)
    results: list = [None] * size
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        try:
            extra = tuple(per_rank[rank]) if per_rank is not None else ()
            results[rank] = function(SimulatedComm(world, rank), *args, *extra)
        except BaseException as err:             # reported below, with the rank
            errors[rank] = err
            with world.condition:
                if world.failure is None:
                    world.failure = err
        finally:
            with world.condition:
                world.running.discard(rank)
                world.condition.notify_all()

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"a rank was still running after {timeout:g} s (an endless loop?)")
    if world.failure is not None:
        first = world.failure
        rank = next((r for r, err in errors.items() if err is first), None)
        if isinstance(first, Deadlock):
            raise Deadlock(str(first)) from None
        raise RankFailed(f"rank {rank}: {type(first).__name__}: {first}") from first
    return results, world.traffic
