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

``--overlap`` (with ``mpi``): communication overlapped with the backward pass, as PyTorch's
DistributedDataParallel and Horovod do it. The backward pass produces the gradient last layer
first; as soon as a layer's backward is done its *bucket* — its slice of the flat gradient, W and
b together — goes into a nonblocking ``MPI_Iallreduce`` while the layers below are still being
computed. Between two layers the rank tests the requests in flight, which is what moves a
nonblocking collective on (a single-threaded MPI progresses only inside MPI calls: Horovod has a
background thread for it). Before the update the rank waits for all of them::

    forward; Iallreduce(loss)
    for layer = L … 1:   backward(layer);  Iallreduce(bucket of layer);  Test(everything in flight)
    Wait(all);  g /= P;  update

The sums are those of one allreduce of the whole vector (element by element the same additions),
so the weights are the same (``tests/test_parallel_algorithms_mpi.py``, float64). What it buys is
the wait after the backward pass: only the buckets still in flight when the first layer's backward
ends are waited for (``benchmarks/parallel_algorithms.py --only overlap`` measures it).

With ``--stage cuda-ring`` or ``cuda-tuned`` the gradient stays on the GPU: ``cnn.parallel.gpu_ranks``.
"""

from __future__ import annotations

import numpy as np

from mpi4py import MPI

from cnn.parallel.common import Run
from cnn.parallel.synchronous import TAIL, Exchange, train_synchronous
from cnn.parallel.timing import AVERAGE, UPDATE
from cnn.stages.base import HostStage

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


class Allreduce(Exchange):
    """The exchange of one allreduce step: average [gradient | loss | stop], then every rank takes the
    SGD step. (Every rank holds the weights and the momentum: a rescue checkpoint lacks nothing.)"""

    def __init__(self, world, timer, algorithm: str):
        self.world, self.timer, self.algorithm = world, timer, algorithm
        self.reduce = ring_allreduce if algorithm == "ring" else mpi_allreduce

    def __call__(self, message: np.ndarray, opt, lr: float) -> tuple[float, bool]:
        size = len(message) - TAIL
        with self.timer.phase(AVERAGE, label=f"allreduce ({self.algorithm})"):
            self.reduce(self.world, message)
            message /= self.world.size
        with self.timer.phase(UPDATE):
            opt.step(message[:size], lr)
        return float(message[size]), bool(message[size + 1] > 0)


def layer_buckets(net) -> dict[int, tuple[int, int]]:
    """Layer index → [start, stop) of its parameters (W and b) in the flat vector, for every layer that has some."""
    buckets = {}
    for slot in net.param_layout():
        start, stop = buckets.get(slot.layer, (slot.offset, slot.offset))
        buckets[slot.layer] = (min(start, slot.offset), max(stop, slot.offset + slot.size))
    return buckets


class OverlappedAllreduce(Allreduce):
    """``--overlap``: each layer's bucket goes into an ``Iallreduce`` as soon as its backward is done."""

    def __init__(self, world, timer, net):
        super().__init__(world, timer, "mpi")
        self.buckets, self.pending = layer_buckets(net), []

    def compute(self, stage: HostStage, images, labels, message: np.ndarray) -> None:
        comm, size = self.world.comm, len(message) - TAIL
        stage.load_batch(images, labels)
        stage.forward()
        message[size] = stage.fetch_loss()
        self.pending = [comm.Iallreduce(MPI.IN_PLACE, message[size:], op=MPI.SUM)]    # [loss | stop]
        grad_out = stage.dlogits
        for index in reversed(range(len(stage.net.layers))):
            grad_out = stage._layer_backward(index, grad_out)
            if index in self.buckets:
                start, stop = self.buckets[index]
                message[start:stop] = stage.grad[start:stop]
                self.pending.append(comm.Iallreduce(MPI.IN_PLACE, message[start:stop], op=MPI.SUM))
            MPI.Request.Testall(self.pending)            # progress: a collective moves on inside MPI calls

    def __call__(self, message: np.ndarray, opt, lr: float) -> tuple[float, bool]:
        size = len(message) - TAIL
        with self.timer.phase(AVERAGE, label="allreduce (buckets still in flight)"):
            self.world.wait(self.pending, "gradient buckets")
            message /= self.world.size
        with self.timer.phase(UPDATE):
            opt.step(message[:size], lr)
        return float(message[size]), bool(message[size + 1] > 0)


def check_overlap(options, stage_class) -> None:
    """--overlap needs MPI's nonblocking allreduce and a stage that runs layer by layer on the host."""
    if options.allreduce != "mpi":
        raise ValueError("--overlap needs --allreduce mpi: the hand-written ring waits on every chunk")
    if not issubclass(stage_class, HostStage):
        raise ValueError(f"--overlap runs the backward pass layer by layer on the host (stages loops, numpy); "
                         f"stage {stage_class.name!r} does not")


def train(run: Run) -> dict:
    from cnn.parallel import gpu_ranks
    from cnn.stages import get_stage

    stage_class = get_stage(run.config.stage)
    if stage_class.device == "cuda":
        return gpu_ranks.train(run)
    if run.options.overlap:
        check_overlap(run.options, stage_class)
        run.announce("allreduce: mpi, overlapped with the backward pass (one Iallreduce per layer)")
        return train_synchronous(run, OverlappedAllreduce(run.world, run.timer, run.net))
    run.announce(f"allreduce: {run.options.allreduce}")
    return train_synchronous(run, Allreduce(run.world, run.timer, run.options.allreduce))
