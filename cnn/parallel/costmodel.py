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
rank 1 sends them back; half the round trip is T(n), and a straight-line fit over n gives α and β.
``measure_exchanges`` times the strategies' own exchanges (``ps_sync.ParameterServer``,
``allreduce.ring_allreduce``, MPI's ``Iallreduce``) on a vector of the model's size, so the
model can be set against what this machine's MPI does. Run it with::

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


def pingpong(world, sizes, repeats: int = 50, spin: bool = True) -> list[float]:
    """One-way time of a message of each size between ranks 0 and 1 (the other ranks wait):
    half the median round trip (the median, because a busy machine adds scheduling hiccups).

    ``spin=True`` measures MPI itself; ``spin=False`` waits the way the strategies do (polling
    with short sleeps), which adds its own latency on top.
    """
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
                world.wait([comm.Isend(buffer, dest=partner, tag=60)], "ping", spin=spin)
                world.wait([comm.Irecv(buffer, source=partner, tag=61)], "pong", spin=spin)
            else:
                world.wait([comm.Irecv(buffer, source=partner, tag=60)], "ping", spin=spin)
                world.wait([comm.Isend(buffer, dest=partner, tag=61)], "pong", spin=spin)
            round_trips.append(time.perf_counter() - started)
        times.append(float(np.median(round_trips)) / 2)
    return times


def measure_exchanges(world, num_params: int, repeats: int = 20, dtype=np.float32) -> dict[str, float]:
    """Median seconds of one exchange of a ``num_params`` gradient: parameter server, ring, MPI allreduce."""
    from cnn.parallel.allreduce import mpi_allreduce, ring_allreduce
    from cnn.parallel.common import HostSGD
    from cnn.parallel.ps_sync import ParameterServer
    from cnn.parallel.timing import PhaseTimer
    from cnn.train import TrainConfig

    rng = np.random.default_rng(world.rank)
    message = rng.standard_normal(num_params + 1).astype(dtype)
    server = ParameterServer(world, PhaseTimer(world.rank), num_params, dtype)
    opt = HostSGD(np.zeros(num_params, dtype), TrainConfig(momentum=0.0, weight_decay=0.0))

    def parameter_server():
        server.prepare(0)
        server(message.copy(), opt, 0.0)

    exchanges = {"ps": parameter_server,
                 "ring": lambda: ring_allreduce(world, message.copy()),
                 "mpi-allreduce": lambda: mpi_allreduce(world, message.copy())}
    results = {}
    for name, exchange in exchanges.items():
        world.wait([world.comm.Ibarrier()], "barrier")
        exchange()                                             # warm-up
        world.wait([world.comm.Ibarrier()], "barrier")
        durations = []
        for _ in range(repeats):
            started = time.perf_counter()
            exchange()
            durations.append(time.perf_counter() - started)
        results[name] = float(np.median(durations))
    return results


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
        for spin in (True, False):
            seconds = pingpong(world, sizes, args.repeats, spin=spin)
            if world.rank == 0:
                alpha, beta = fit_alpha_beta(sizes, seconds)
                measured["mpi" if spin else "polled"] = {"one_way_seconds": seconds, "alpha": alpha, "beta": beta}
    measured["exchanges"] = {name: {"num_params": get_network(name).num_params,
                                    **measure_exchanges(world, get_network(name).num_params, max(5, args.repeats // 5))}
                             for name in args.models.split(",")}
    if world.rank == 0:
        write_json(args.out, measured)
        print(f"{world.size} ranks: " + ", ".join(
            f"{kind}: α = {measured[kind]['alpha'] * 1e6:.1f} µs, 1/β = {1 / measured[kind]['beta'] / 1e9:.2f} GB/s"
            for kind in ("mpi", "polled") if kind in measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
