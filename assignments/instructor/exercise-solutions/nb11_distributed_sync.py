"""Notebook 11, synchronous data parallelism: worked solutions of its three exercises (MPI runs in the second)."""

from __future__ import annotations

import numpy as np

from cnn.model import alexnet_small, lenet5
from cnn.parallel import costmodel, launch
from cnn.parallel.allreduce import chunk_bounds
from common import mpi_options

ALPHA, BETA = 20e-6, 1e-9           # the notebook's illustrative latency (s) and time per byte (1 GB/s)


def exercise_1(fast: bool) -> None:
    """With the cost model, the rank count where the parameter server takes twice the ring's time; why the same for both?

    Answer. T_ps / T_ring = (α + Nβ) / (α + Nβ/P): the factor 2(P−1) cancels. It equals 2 when
    Nβ(1 − 2/P) = α, i.e. P = 2Nβ / (Nβ − α). For LeNet-5, N = 44 426 floats = 178 kB, Nβ = 178 µs ≫ α =
    20 µs, so P = 2.25: from 3 ranks on the server spends more than twice as long; for AlexNet-small
    (N = 147 338 floats = 589 kB) P = 2.07: also 3 ranks. The answer is (nearly) the same because both gradients are large
    enough for the bandwidth term to dominate: then the ratio is ≈ P whatever N is — the ring divides the
    bytes each link carries by P, the server's one link carries all of them. Only when Nβ approaches α
    (tiny models, or very slow latency) does the crossing move to larger P.
    """
    ranks = np.arange(2, 33)
    found = {}
    for net in (lenet5(), alexnet_small()):
        nbytes = 4 * net.num_params
        ratio = costmodel.ps_seconds(ranks, nbytes, ALPHA, BETA) / costmodel.ring_seconds(ranks, nbytes, ALPHA, BETA)
        found[net.name] = int(ranks[np.argmax(ratio >= 2)])
        exact = 2 * nbytes * BETA / (nbytes * BETA - ALPHA)
        print(f"{net.name:<14} N = {nbytes / 1e3:7.0f} kB: T_ps / T_ring = " + ", ".join(
            f"{r:.2f} (P={p})" for p, r in zip(ranks[:4], ratio[:4])) + f" … -> twice from P = {found[net.name]} "
              f"(the crossing at P = {exact:.2f})")
    assert found["lenet5"] == found["alexnet-small"] == 3


def exercise_2(fast: bool) -> None:
    """ps-sync and allreduce (MPI) on the same ranks and options: which phase does the ring remove, which does it add?

    Answer. In `ps-sync` a step is: workers compute, the server fetches their gradients ("gradient
    fetch"), averages them ("gradient averaging": a few additions), takes the SGD step ("weight update")
    and sends the new weights to every worker ("weight distribution") — the workers wait through all of
    it. `allreduce` removes the gradient fetch and the weight distribution: there is no server and no
    weights ever travel. What it adds is the communication inside "gradient averaging", which grows from
    the server's arithmetic to the whole exchange — the 2(P−1) messages of the ring (or MPI's allreduce),
    after which *every* rank holds the sum and takes the same SGD step itself. The breakdowns printed
    below show it (in fast mode the runs are two steps long: the phase names mean something, the times
    little).
    """
    ranks = 2 if fast else 4
    options = mpi_options(fast)
    runs = {"ps-sync": launch.run("ps-sync", ranks, **options),
            "allreduce": launch.run("allreduce", ranks, allreduce="mpi", **options)}
    for name, summary in runs.items():
        print(f"{name:<10} {summary['workers']} workers: " + ", ".join(
            f"{phase} {seconds * 1e3:.2f} ms" for phase, seconds in summary["breakdown_s"].items()))
    server, ring = set(runs["ps-sync"]["breakdown_s"]), set(runs["allreduce"]["breakdown_s"])
    print(f"only in ps-sync: {sorted(server - ring)}; in both: {sorted(server & ring)}")
    assert {"gradient fetch", "weight distribution"} <= server - ring
    assert {"gradient averaging", "weight update"} <= ring


def exercise_3(fast: bool) -> None:
    """`chunk_bounds` cuts the vector in P chunks: what happens to the ring's advantage when N ≪ P·α/β?

    Answer. The ring sends 2(P−1) messages of N/P numbers each; each costs α + (N/P)β. When N/P·β is
    small against α — N ≪ P·α/β — every message costs about α whatever it carries, and the ring takes
    2(P−1)·α: exactly the parameter server's latency term. The server's bandwidth term 2(P−1)·Nβ is then
    small too, so the two cost the same and the ring's advantage (dividing the bytes by P) is gone; both
    are latency-bound, and an algorithm with fewer, larger steps wins (recursive doubling or a tree:
    log₂P steps instead of 2(P−1) — which is what MPI's own allreduce picks for small messages). At the
    extreme, N < P, `chunk_bounds` even gives empty chunks: messages that carry nothing and still cost α.
    """
    ranks = 16
    threshold = ranks * ALPHA / BETA / 4                       # N·β = P·α, in floats
    for floats in (10, 1_000, 44_426, int(threshold), 10_000_000):
        nbytes = 4 * floats
        ratio = costmodel.ps_seconds(ranks, nbytes, ALPHA, BETA) / costmodel.ring_seconds(ranks, nbytes, ALPHA, BETA)
        print(f"N = {floats:>10,} floats on P = {ranks}: T_ps / T_ring = {ratio:5.2f}")
    small = costmodel.ps_seconds(ranks, 40, ALPHA, BETA) / costmodel.ring_seconds(ranks, 40, ALPHA, BETA)
    large = costmodel.ps_seconds(ranks, 4e7, ALPHA, BETA) / costmodel.ring_seconds(ranks, 4e7, ALPHA, BETA)
    bounds = chunk_bounds(10, ranks)
    print(f"chunk_bounds(10, {ranks}) = {bounds.tolist()}: {int(np.sum(np.diff(bounds) == 0))} empty chunks")
    assert small < 1.01 and large > 0.9 * ranks and np.sum(np.diff(bounds) == 0) > 0
