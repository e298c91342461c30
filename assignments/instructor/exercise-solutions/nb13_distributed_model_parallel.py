"""Notebook 13, model parallelism: worked solutions of its three exercises (MPI runs in the second)."""

from __future__ import annotations

from cnn.model import Conv, Dense, lenet5
from cnn.parallel import launch
from cnn.parallel.model_parallel import split_network
from common import mpi_options


def multiply_adds(net) -> list[int]:
    """Forward multiply-adds of each layer for one image (convolutions and dense layers; the rest ≈ 0)."""
    shapes, counts = net.activation_shapes(), []
    for index, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            _, out_h, out_w = shapes[index + 1]
            counts.append(layer.out_channels * layer.in_channels * layer.kernel ** 2 * out_h * out_w)
        elif isinstance(layer, Dense):
            counts.append(layer.in_features * layer.out_features)
        else:
            counts.append(0)
    return counts


def allowed_cuts(net) -> list[int]:
    """The cuts split_network accepts: where the activation is a vector (its refusal lists them)."""
    try:
        split_network(net, 1)
        return [1]
    except ValueError as refusal:
        print(f"split_network(lenet5, 1): {refusal}")
    return [split for split in range(1, len(net.layers)) if len(net.activation_shapes()[split]) == 1]


def exercise_1(fast: bool) -> None:
    """Each half's compute for every allowed cut of LeNet-5: can the ranks be balanced? A cut between the convolutions?

    Answer. LeNet-5's activation is a vector only after Flatten, so the allowed cuts are before the three
    Dense layers and their ReLUs (before layer 7, 8, 9, 10 or 11). The two convolutions do 240 000 of the
    281 640 multiply-adds of an image (85 %), and they are always in the first half: the split is at best
    85 / 15 (cut right after Flatten) and worse for any later cut — rank 1 idles most of every step, and no
    allowed cut can balance it. A cut between the convolutions (after the first pool, layer 3) would give
    about 31 % / 69 %: better, but it needs what `split_network` does not support — a Network whose output
    (and the second half's input) is a feature map (6×12×12 = 864 floats an image instead of 256), and the
    first pool's argmax and the ReLU mask kept on rank 0 for the backward pass. The balanced cut for this
    network would fall inside the second convolution, splitting its filters between ranks (Krizhevsky's
    scheme: each GPU half the channels), which needs the activations exchanged at every layer.
    """
    net = lenet5()
    counts, total = multiply_adds(net), sum(multiply_adds(net))
    cuts = allowed_cuts(net)
    for cut in cuts + [3]:
        front = sum(counts[:cut])
        front_net, back_net = split_network(net, cut) if cut in cuts else (None, None)
        label = "allowed" if cut in cuts else "not allowed: a feature map"
        print(f"cut before layer {cut:>2} ({label}): rank 0 {front / total:5.1%}, rank 1 {1 - front / total:5.1%} "
              f"of the multiply-adds; activation sent {net.activation_shapes()[cut]}")
        if front_net is not None:
            assert front_net.num_params + back_net.num_params == net.num_params
    assert cuts == [7, 8, 9, 10, 11] and all(sum(counts[:cut]) / total > 0.8 for cut in cuts)


def exercise_2(fast: bool) -> None:
    """A step with 1, 2, 4 and 8 micro-batches: where does it stop improving on this machine, and why?

    Answer. The bubble is 1/(M+1) of the step with two stages, so going from 1 to 2 micro-batches helps
    most (from 50 % idle to 33 %) and each doubling after that helps less (20 %, 11 %). Against it, every
    micro-batch costs two more messages each way, each paying MPI's latency and Python's per-call cost,
    and smaller matrix products run at a lower rate (notebook 02's third exercise); and on this machine
    the two ranks share two cores with everything else, so there is little real overlap to gain. The time
    per step therefore falls from 1 to 2 micro-batches and flattens or rises by 4 or 8 — where exactly
    depends on the machine (the printout below; fast mode runs only 1 and 2 on a few steps).
    """
    options = mpi_options(fast)
    timings = {}
    for micro_batches in ((1, 2) if fast else (1, 2, 4, 8)):
        summary = launch.run("model-parallel", 2, micro_batches=micro_batches, **options)
        timings[micro_batches] = summary["time_per_step_s"]
        waits = "; ".join(f"rank {rank}: " + ", ".join(f"{phase} {seconds * 1e3:.2f} ms"
                                                       for phase, seconds in phases.items() if phase.startswith("waiting"))
                          for rank, phases in sorted(summary["breakdown_per_rank"].items()))
        print(f"{micro_batches} micro-batch(es): {summary['time_per_step_s'] * 1e3:7.2f} ms a step; the bubble model "
              f"says {1 / (micro_batches + 1):.0%} idle; {waits}")
    assert all(seconds > 0 for seconds in timings.values())


def exercise_3(fast: bool) -> None:
    """4 ranks as two pipelines of two stages: the arrangement, and what the allreduce would carry.

    Answer. Ranks 0 → 1 form pipeline A and ranks 2 → 3 pipeline B: ranks 0 and 2 hold the front half
    (layers before the cut), ranks 1 and 3 the back half; each pipeline trains on half of the global
    batch, sending activations forward and their gradients back within the pipeline as in this notebook.
    After the backward pass, the replicas of each half average their weight gradients with an allreduce
    in their own group: ranks {0, 2} allreduce the front half's gradient, ranks {1, 3} the back half's —
    two allreduces of disjoint, smaller vectors at the same time, instead of one of the whole model. With
    the default cut (after Flatten) the front half holds the convolutions' 2 572 parameters and the back
    half the dense layers' 41 854: the back group carries 94 % of the bytes (MPI's `Comm.Split` by
    stage makes the two groups).
    """
    front, back = split_network(lenet5(), None)
    groups = {"front half (ranks 0 and 2)": front.num_params, "back half (ranks 1 and 3)": back.num_params}
    for label, params in groups.items():
        print(f"{label}: an allreduce of {params:,} floats = {4 * params / 1e3:.1f} kB a step")
    assert front.num_params == 2572 and back.num_params == 41854 and front.num_params + back.num_params == 44426
