"""Strategy ``allreduce``: data-parallel SGD with an allreduce of the flat gradient (Horovod, seed 003).

Every rank computes the gradient of its shard, then all ranks sum their gradients with one
allreduce and divide by P; every rank applies the same update to its own copy of the weights (and
its own copy of the momentum). No rank is special, and no link carries more than the others.

Two allreduces:

- ``--allreduce mpi``: ``MPI_Iallreduce``, the library's own algorithm (nonblocking, so the wait
  has a deadline).
- ``--allreduce ring``: the bandwidth-optimal ring, written out with point-to-point messages. The
  vector is cut into P chunks; rank r sends to r+1 and receives from r−1::

      reduce-scatter, P−1 steps: at step k send chunk (r−k) mod P, receive chunk (r−k−1) mod P
                                 and add it to mine — after P−1 steps rank r holds the full sum
                                 of chunk (r+1) mod P
      all-gather,     P−1 steps: pass the finished chunks around the ring the same way, copying

  Each rank sends 2·(P−1) messages of N/P numbers: 2·(P−1)/P·N in all, nearly independent of P.
"""

from __future__ import annotations

import numpy as np

from cnn.parallel.common import Run
from cnn.parallel.synchronous import train_synchronous
from cnn.parallel.timing import AVERAGE, UPDATE

TAG_REDUCE_SCATTER, TAG_ALL_GATHER = 20, 21
ALGORITHMS = ("mpi", "ring")


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    return size, {}


def chunk_bounds(length: int, parts: int) -> np.ndarray:
    """Start of each of ``parts`` nearly equal chunks of ``range(length)``, then ``length``."""
    return np.linspace(0, length, parts + 1).astype(np.int64)


def ring_allreduce(world, vector: np.ndarray, timer=None) -> np.ndarray:
    """Sum ``vector`` across all ranks, in place, by reduce-scatter then all-gather around the ring."""
    size, rank, comm = world.size, world.rank, world.comm
    if size == 1:
        return vector
    bounds = chunk_bounds(len(vector), size)

    def chunk(index):                                           # a view: chunk number index mod P
        index %= size
        return vector[bounds[index]:bounds[index + 1]]

    right, left = (rank + 1) % size, (rank - 1) % size
    scratch = np.empty(np.diff(bounds).max(), vector.dtype)
    for k in range(size - 1):                                   # reduce-scatter
        outgoing, incoming = chunk(rank - k), chunk(rank - k - 1)
        received = scratch[:len(incoming)]
        requests = [comm.Isend(outgoing, dest=right, tag=TAG_REDUCE_SCATTER),
                    comm.Irecv(received, source=left, tag=TAG_REDUCE_SCATTER)]
        world.wait(requests, "reduce-scatter chunk", peers=[right, left])
        incoming += received
    for k in range(size - 1):                                   # all-gather
        outgoing, incoming = chunk(rank - k + 1), chunk(rank - k)
        requests = [comm.Isend(outgoing, dest=right, tag=TAG_ALL_GATHER),
                    comm.Irecv(incoming, source=left, tag=TAG_ALL_GATHER)]
        world.wait(requests, "all-gather chunk", peers=[right, left])
    return vector


def mpi_allreduce(world, vector: np.ndarray) -> np.ndarray:
    """Sum ``vector`` across all ranks, in place, with MPI_Iallreduce."""
    return world.allreduce_sum(vector, "gradient allreduce", in_place=True)


class Allreduce:
    """The exchange of one allreduce step: average [gradient | loss], then every rank takes the SGD step."""

    def __init__(self, world, timer, algorithm: str):
        self.world, self.timer, self.algorithm = world, timer, algorithm
        self.reduce = ring_allreduce if algorithm == "ring" else mpi_allreduce

    def prepare(self, step: int) -> None:
        pass

    def rescue_lacks(self, rank: int) -> str:
        return ""          # every rank holds the weights and the momentum

    def __call__(self, message: np.ndarray, opt, lr: float) -> float:
        size = len(message) - 1
        with self.timer.phase(AVERAGE, label=f"allreduce ({self.algorithm})"):
            self.reduce(self.world, message)
            message /= self.world.size
        with self.timer.phase(UPDATE):
            opt.step(message[:size], lr)
        return float(message[size])


def train(run: Run) -> dict:
    run.announce(f"allreduce: {run.options.allreduce}")
    return train_synchronous(run, Allreduce(run.world, run.timer, run.options.allreduce))
