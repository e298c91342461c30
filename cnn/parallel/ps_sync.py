"""Strategy ``ps-sync``: the synchronous parameter server of seed 000, with real training.

Rank 0 is the server (the "parameter shard") and computes a shard as well; every rank is a worker.
One step, with the phases seed 000 timed::

    every rank    forward + backward on its shard ...................... compute
    workers       send [gradient | loss | stop] to rank 0
    rank 0        receive the P−1 gradients ............................ gradient fetch
                  g = (1/P) Σ_r g_r ................................... gradient averaging
                  v ← μ·v + g + λ·θ,  θ ← θ − η·v ....................... weight update
                  send [θ | mean loss | stop] to every worker .......... weight distribution

The gather is written as P−1 receives and the broadcast as P−1 sends (what a linear MPI_Gather and
MPI_Bcast do inside) so that the server knows *which* worker is late. Everything passes through
rank 0's link: 2·(P−1) vectors per step, the bottleneck the ring allreduce removes
(``cnn.parallel.costmodel``).
"""

from __future__ import annotations

import numpy as np

from cnn.parallel.common import Run
from cnn.parallel.synchronous import TAIL, Exchange, train_synchronous
from cnn.parallel.timing import AVERAGE, DISTRIBUTE, FETCH, UPDATE

TAG_GRADIENT, TAG_WEIGHTS = 1, 2


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    """(number of workers, role of each rank that is not a plain worker)."""
    return size, {0: "server + worker"}


class ParameterServer(Exchange):
    """The exchange of one ps-sync step: ``__call__(message, opt, lr)`` → mean loss, new weights in ``opt``."""

    def __init__(self, world, timer, size: int, dtype):
        self.world, self.timer, self.size = world, timer, size
        self.workers = list(range(1, world.size))
        self.reply = np.empty(size + TAIL, dtype)              # [θ | mean loss | stop]
        if world.rank == 0:
            self.inbox = np.empty((world.size, size + TAIL), dtype)

    def prepare(self, step: int) -> None:
        """The server posts its receives before computing, so early gradients land straight in place."""
        if self.world.rank == 0:
            comm = self.world.comm
            self.requests = [comm.Irecv(self.inbox[r], source=r, tag=TAG_GRADIENT) for r in self.workers]

    def rescue_lacks(self, rank: int) -> str:
        """The workers receive the weights only: the momentum lives on the server alone."""
        return "" if rank == 0 else "the momentum, which only the server (rank 0) held: it restarts from zero"

    def __call__(self, message: np.ndarray, opt, lr: float) -> tuple[float, bool]:
        self._serve(message, opt, lr) if self.world.rank == 0 else self._work(message, opt)
        return float(self.reply[self.size]), bool(self.reply[self.size + 1] > 0)

    def _serve(self, message, opt, lr) -> None:
        world, timer, comm = self.world, self.timer, self.world.comm
        with timer.phase(FETCH):
            world.wait(self.requests, "gradient", peers=self.workers)
        with timer.phase(AVERAGE):
            self.inbox[0] = message
            mean = self.inbox.sum(axis=0) / world.size
        with timer.phase(UPDATE):
            opt.step(mean[:self.size], lr)
        with timer.phase(DISTRIBUTE):
            self.reply[:self.size], self.reply[self.size:] = opt.params, mean[self.size:]
            sends = [comm.Isend(self.reply, dest=r, tag=TAG_WEIGHTS) for r in self.workers]
            world.wait(sends, "receipt of the weights", peers=self.workers)

    def _work(self, message, opt) -> None:
        world, timer, comm = self.world, self.timer, self.world.comm
        incoming = comm.Irecv(self.reply, source=0, tag=TAG_WEIGHTS)
        with timer.phase(FETCH):          # this worker's part of the gather: handing its gradient over
            world.wait([comm.Isend(message, dest=0, tag=TAG_GRADIENT)], "receipt of the gradient", peers=[0])
        with timer.phase(DISTRIBUTE):     # waiting for the server's average, update and broadcast
            world.wait([incoming], "weights", peers=[0])
        opt.params[...] = self.reply[:self.size]


def train(run: Run) -> dict:
    run.announce("rank 0 is the parameter server")
    return train_synchronous(run, ParameterServer(run.world, run.timer, run.net.num_params, run.dtype))
