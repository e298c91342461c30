"""The α-β cost model of a parameter server against a ring allreduce, and the ping-pong that measures α, β.

Sending n bytes costs T(n) = α + n·β (α: latency, β: seconds per byte, 1/bandwidth). For a
gradient of N bytes on P ranks, one step's communication costs::

    parameter server (``ps-sync``: rank 0 serves and computes; P−1 other workers)
        the server's link carries P−1 gradients in and P−1 weight vectors out
        bytes on the busiest link   2·(P−1)·N
        time                        2·(P−1)·(α + N·β)

    ring allreduce (``allreduce --allreduce ring``: reduce-scatter, then all-gather)
        every link carries 2·(P−1) chunks of N/P bytes
        bytes on the busiest link   2·(P−1)/P·N            → 2N, whatever P
        time                        2·(P−1)·(α + N/P·β)

The latency terms are the same, 2·(P−1)·α: both grow linearly with P. The bandwidth terms differ
by a factor P: the server's grows with P, the ring's stays near 2·N·β. So the ring wins wherever
N·β is not negligible against α — large models, slow links, many workers — and a tree-shaped
or hierarchical allreduce (MPI's own, NCCL's) is what removes the linear latency term.

α and β are measured by a ping-pong between ranks 0 and 1 (``pingpong``): rank 0 sends n bytes,
rank 1 sends them back, both waiting through ``World.wait`` as the strategies do; half the round
trip is T(n), and a straight-line fit over n gives α and β. ``measure_exchanges`` times the
strategies' own exchanges (``ps_sync.ParameterServer``, ``allreduce.ring_allreduce``, MPI's
``Iallreduce`` through ``World.wait``) on a vector of the model's size, so the model can be set
against what this machine's MPI does. ``measure_waits`` times MPI's allreduce back to back, as in
training, waited on four ways: ``World.wait``, ``MPI_Wait``, sleeping between tests as the first
version did (``wait_with_sleeps``), and MPI's blocking ``Allreduce`` — what sleeping cost, measured
in the same run as what replaced it. Run it with::

    mpiexec -n 4 python -m mpi4py -m cnn.parallel.costmodel --out results/costmodel-4.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

FLOAT_BYTES = 4


def ps_link_bytes(workers, nbytes):
    """Bytes through the parameter server's link per step: 2·(P−1)·N."""
    return 2 * (np.asarray(workers) - 1) * nbytes


def ring_link_bytes(workers, nbytes):
    """Bytes through each link of the ring per step: 2·(P−1)/P·N."""
    workers = np.asarray(workers)
    return 2 * (workers - 1) / workers * nbytes


def ps_seconds(workers, nbytes, alpha, beta):
    """T_ps = 2·(P−1)·(α + N·β)."""
    return 2 * (np.asarray(workers) - 1) * (alpha + nbytes * beta)


def ring_seconds(workers, nbytes, alpha, beta):
    """T_ring = 2·(P−1)·(α + N/P·β)."""
    workers = np.asarray(workers)
    return 2 * (workers - 1) * (alpha + nbytes / workers * beta)


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """The line T(n) = α + n·β through the measured one-way times, fitted on relative error
    (weights 1/T) so that the small messages, which set α, count as much as the large ones."""
    seconds = np.asarray(seconds, float)
    beta, alpha = np.polyfit(np.asarray(nbytes, float), seconds, 1, w=1 / seconds)
    return float(alpha), float(beta)


def pingpong(world, sizes, repeats: int = 50) -> list[float]:
    """One-way time of a message of each size between ranks 0 and 1 (the other ranks wait), waited
    on through ``World.wait``: half the median round trip (the median, because a busy machine adds
    scheduling hiccups)."""
    comm, times = world.comm, []
    for size in sizes:
        buffer = np.zeros(max(1, size), np.uint8)
        world.wait([comm.Ibarrier()], "barrier")
        if world.rank > 1:
            times.append(0.0)
            continue
        partner, round_trips = 1 - world.rank, []
        for _ in range(repeats):
            started = time.perf_counter()
            if world.rank == 0:
                world.wait([comm.Isend(buffer, dest=partner, tag=60)], "ping")
                world.wait([comm.Irecv(buffer, source=partner, tag=61)], "pong")
            else:
                world.wait([comm.Irecv(buffer, source=partner, tag=60)], "ping")
                world.wait([comm.Isend(buffer, dest=partner, tag=61)], "pong")
            round_trips.append(time.perf_counter() - started)
        times.append(float(np.median(round_trips)) / 2)
    return times


def wait_with_sleeps(requests, first: float = 1e-5, longest: float = 1e-3) -> None:
    """How the first version waited: test, sleep 10 µs, doubling up to 1 ms, test again. Kept
    only to measure what sleeping costs a collective that moves on only inside MPI calls."""
    from mpi4py import MPI

    pause = 0.0
    while not MPI.Request.Testall(requests):
        pause = min(longest, pause * 2 or first)
        time.sleep(pause)


def measure_exchanges(world, num_params: int, repeats: int = 20, dtype=np.float32) -> dict[str, float]:
    """Median seconds of one exchange of a ``num_params`` gradient, the ranks starting together:
    the parameter server's, the ring's and MPI's allreduce, as the strategies run them."""
    from cnn.parallel.allreduce import mpi_allreduce, ring_allreduce
    from cnn.parallel.optimizers import HostSGD
    from cnn.parallel.ps_sync import ParameterServer
    from cnn.parallel.timing import PhaseTimer
    from cnn.train import TrainConfig

    server = ParameterServer(world, PhaseTimer(world.rank), num_params, dtype)
    opt = HostSGD(np.zeros(num_params, dtype), TrainConfig(momentum=0.0, weight_decay=0.0))

    def parameter_server(buffer):
        server.prepare(0)
        server(buffer, opt, 0.0)

    exchanges = {"ps": parameter_server,
                 "ring": lambda buffer: ring_allreduce(world, buffer),
                 "mpi-allreduce": lambda buffer: mpi_allreduce(world, buffer)}
    return _interleaved(world, exchanges, num_params, repeats, dtype, together=True)


def measure_waits(world, num_params: int, repeats: int = 20, dtype=np.float32) -> dict[str, float]:
    """Seconds per allreduce of a ``num_params`` gradient run back to back, as in training (the
    ranks drift apart and wait for each other), for each way of waiting: ``World.wait``, MPI's own
    ``MPI_Wait``, sleeping between tests as the first version did, and MPI's blocking allreduce."""
    from mpi4py import MPI

    def nonblocking(buffer):
        return world.comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)

    ways = {"World.wait": lambda buffer: world.wait([nonblocking(buffer)], "allreduce"),
            "MPI_Wait": lambda buffer: nonblocking(buffer).Wait(),
            "sleeps": lambda buffer: wait_with_sleeps([nonblocking(buffer)]),
            "blocking": lambda buffer: world.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)}
    return _interleaved(world, ways, num_params, repeats, dtype, together=False)


def _interleaved(world, ways: dict, num_params: int, repeats: int, dtype, together: bool) -> dict[str, float]:
    """Time each of ``ways`` (a function of the buffer) ``repeats`` times, the ways interleaved so
    that whatever else the machine does slows each alike, after one round of warm-up. ``together``:
    a barrier before each call and the median call; else ten calls back to back, per call."""
    from cnn.parallel.synchronous import TAIL

    message = np.random.default_rng(world.rank).standard_normal(num_params + TAIL).astype(dtype)
    message[-1] = 0                                        # [gradient | loss | stop flag]: nobody stops
    buffer = np.empty_like(message)
    durations = {name: [] for name in ways}
    calls = 1 if together else 10
    for repeat in range(repeats + 1):
        for name, way in ways.items():
            buffer[...] = message
            world.wait([world.comm.Ibarrier()], "barrier")
            started = time.perf_counter()
            for _ in range(calls):
                way(buffer)
            if repeat:
                durations[name].append((time.perf_counter() - started) / calls)
    return {name: float(np.median(values)) for name, values in durations.items()}


def main(argv=None) -> int:
    from mpi4py import MPI

    from cnn.model import get_network
    from cnn.parallel.common import write_json
    from cnn.parallel.world import World

    parser = argparse.ArgumentParser(prog="python -m cnn.parallel.costmodel", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file written by rank 0")
    parser.add_argument("--sizes", default="8,64,512,4096,32768,262144,1048576",
                        help="ping-pong message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--models", default="lenet5,alexnet-small")
    args = parser.parse_args(argv)
    world = World(MPI.COMM_WORLD, timeout=120.0)
    sizes = [int(size) for size in args.sizes.split(",")]
    measured = {"ranks": world.size, "sizes": sizes}
    if world.size >= 2:
        seconds = pingpong(world, sizes, args.repeats)
        if world.rank == 0:
            alpha, beta = fit_alpha_beta(sizes, seconds)
            measured["pingpong"] = {"one_way_seconds": seconds, "alpha": alpha, "beta": beta}
    measured["exchanges"] = {name: {"num_params": get_network(name).num_params,
                                    **measure_exchanges(world, get_network(name).num_params, max(5, args.repeats // 5))}
                             for name in args.models.split(",")}
    measured["waits"] = {name: measure_waits(world, get_network(name).num_params, max(5, args.repeats // 5))
                         for name in args.models.split(",")}
    if world.rank == 0:
        write_json(args.out, measured)
        fit = measured.get("pingpong")
        print(f"{world.size} ranks" + (f": α = {fit['alpha'] * 1e6:.1f} µs, 1/β = {1 / fit['beta'] / 1e9:.2f} GB/s"
                                        if fit else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
