"""Where model parallelism cuts the network: measured per-layer cost, a balanced cut, and a
convolution split by output channels across the two ranks.

A cut (``Partition``) is "rank 0 runs layers [0, K)", optionally with "and output channels [0, C)
of the convolution at K": then the convolution block at K — the Conv and the per-channel layers
after it (ReLU, MaxPool), which need only their own channels — runs on both ranks, F·C/F filters on
rank 0 and the other F − C on rank 1, each reading the same input (as Krizhevsky's two GPUs each held
half of a layer's filters, and DistBelief split layers across machines)::

    rank 0:  head = layers [0, K)        ── a ──▶   rank 1:
             share0 = block K, [0, C)               share1 = block K, channels [C, F)
                                         ── y0 ──▶  y = [y0 | y1] → tail = the layers after block K → loss
             backward:   ◀── dL/dy0, and dL/da from channels [C, F) ──
             dL/da = the sum of both shares' dL/da; then the head's backward

Each piece is a ``Network`` of its own (a ``Flatten`` appended where it ends in an image, since a
``Network`` ends in a vector), run by the stage's own layer-by-layer code; ``Piece.layers`` says
which layer of the whole network, and which of its output channels, each of its layers holds, so
the whole flat parameter vector is cut into the pieces' vectors and put back together from them.

Balancing. ``measure_costs`` times each layer's forward + backward alone on a batch, and each
convolution block with a single filter (a quick probe: the fastest of a few interleaved repeats, on
this machine, with this stage). With c_i the layers' costs, a plain cut K costs rank 0 Σ_{i<K} c_i and
rank 1 the rest. A shared block is not simply cheaper in proportion to its filters: each share reads
the whole input and computes a whole input gradient (col2im adds up every tap whatever the filters),
so the block's cost is split into a fixed part a and a part b per filter — the single-filter probe
against the whole block gives both — and the cut K:C costs rank 0 Σ_{i<K} c_i + a + b·C and rank 1
a + b·(F − C) + Σ_{i after the block} c_i. ``balanced_partition`` takes the cut — plain, or through a
convolution's channels — whose slower rank is fastest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cnn.model import Conv, Flatten, MaxPool, Network, ReLU, param_views

PER_CHANNEL = (ReLU, MaxPool)          # layers that work on each channel alone: they follow a split Conv


@dataclass(frozen=True)
class Partition:
    """Rank 0 runs layers [0, cut) and, when ``channels`` is set, output channels [0, channels) of the
    convolution block at ``cut``; rank 1 runs the rest."""

    cut: int
    channels: int | None = None

    def __str__(self) -> str:
        return f"{self.cut}" if self.channels is None else f"{self.cut}:{self.channels}"


@dataclass(frozen=True)
class Piece:
    """A part of the network one rank runs: its own ``Network``, and for each of its layers the
    layer of the whole network it holds and the output channels of it (None: all, or no weights)."""

    net: Network
    layers: tuple[tuple[int, slice | None], ...]

    @property
    def num_params(self) -> int:
        return self.net.num_params


def block_end(net: Network, index: int) -> int:
    """The layer after the convolution block at ``index``: the Conv and the per-channel layers after it."""
    end = index + 1
    while end < len(net.layers) and isinstance(net.layers[end], PER_CHANNEL):
        end += 1
    return end


def parse_split(text: str | None, net: Network) -> Partition | None:
    """``--split K`` or ``K:C`` as a Partition (None: choose by cost); a one-line ValueError when impossible."""
    if text is None:
        return None
    try:
        cut, _, channels = text.partition(":")
        partition = Partition(int(cut), int(channels) if channels else None)
    except ValueError:
        raise ValueError(f"--split {text}: give K (a layer index) or K:C (a layer and a number of channels)") from None
    check_partition(partition, net)
    return partition


def check_partition(partition: Partition, net: Network) -> None:
    last = len(net.layers) - 1
    if not 1 <= partition.cut <= last and not (partition.channels and partition.cut == 0):
        raise ValueError(f"--split {partition}: the cut must leave layers on both ranks: 1 to {last} (or 0:C)")
    if partition.channels is not None:
        layer = net.layers[partition.cut]
        if not isinstance(layer, Conv):
            raise ValueError(f"--split {partition}: layer {partition.cut} of {net.name} is {type(layer).__name__}, "
                             f"not a convolution; the convolutions are layers "
                             f"{', '.join(str(i) for i, x in enumerate(net.layers) if isinstance(x, Conv))}")
        if not 0 < partition.channels < layer.out_channels:
            raise ValueError(f"--split {partition}: layer {partition.cut} has {layer.out_channels} output channels: "
                             f"C must lie in 1 … {layer.out_channels - 1}")


def _piece(net: Network, name: str, input_shape, layers: list, holds: list) -> Piece:
    """A Piece from ``layers`` (a Flatten appended if they end in an image)."""
    shape = tuple(input_shape)
    for layer in layers:
        shape = layer.output_shape(shape)
    if len(shape) != 1:
        layers, holds = layers + [Flatten()], holds + [(-1, None)]
    return Piece(Network(name, tuple(input_shape), tuple(layers)), tuple(holds))


def pieces(net: Network, partition: Partition) -> tuple[list[Piece], list[Piece]]:
    """(rank 0's pieces, rank 1's pieces), in the order each rank runs them forward."""
    shapes, cut = net.activation_shapes(), partition.cut
    own = [(i, None) for i in range(len(net.layers))]
    front = [_piece(net, f"{net.name}[:{cut}]", shapes[0], list(net.layers[:cut]), own[:cut])] if cut else []
    if partition.channels is None:
        back = [_piece(net, f"{net.name}[{cut}:]", shapes[cut], list(net.layers[cut:]), own[cut:])]
        return front, back
    end, conv, channels = block_end(net, cut), net.layers[cut], partition.channels

    def share(first, stop, name):
        layer = Conv(conv.in_channels, stop - first, conv.kernel, conv.stride, conv.pad)
        holds = [(cut, slice(first, stop))] + [(i, None) for i in range(cut + 1, end)]
        return _piece(net, name, shapes[cut], [layer, *net.layers[cut + 1:end]], holds)

    front.append(share(0, channels, f"{net.name}[{cut}][:{channels}]"))
    back = [share(channels, conv.out_channels, f"{net.name}[{cut}][{channels}:]")]
    if end < len(net.layers):
        back.append(_piece(net, f"{net.name}[{end}:]", shapes[end], list(net.layers[end:]), own[end:]))
    return front, back


def take(net: Network, flat: np.ndarray, piece: Piece) -> np.ndarray:
    """The piece's flat vector (weights or momentum) cut out of the whole network's ``flat``."""
    out = np.zeros(piece.num_params, flat.dtype)
    whole, part = param_views(net, flat), param_views(piece.net, out)
    for index, (layer, channels) in enumerate(piece.layers):
        for name, view in part[index].items():
            view[...] = whole[layer][name][channels or slice(None)]
    return out


def put(net: Network, flat: np.ndarray, piece: Piece, values: np.ndarray) -> None:
    """Write the piece's flat ``values`` back into the whole network's ``flat`` (the inverse of ``take``)."""
    whole, part = param_views(net, flat), param_views(piece.net, values)
    for index, (layer, channels) in enumerate(piece.layers):
        for name, view in part[index].items():
            whole[layer][name][channels or slice(None)] = view


# -- the probe and the balance ---------------------------------------------------------------------

class Costs(NamedTuple):
    """What the probe measured: seconds of forward + backward of each layer alone (``layers``), and
    for each convolution block (by the index of its Conv) its cost split as ``fixed`` + ``per_filter``
    × filters: the part a share of the block pays whatever its filters (reading the whole input,
    and the input's gradient: its col2im adds up every tap) and the part that grows with them."""

    layers: np.ndarray
    blocks: dict[int, tuple[float, float]]

    def as_json(self) -> dict:
        return {"layers": self.layers.tolist(), "blocks": {str(k): list(v) for k, v in self.blocks.items()}}

    @classmethod
    def from_json(cls, value: dict) -> "Costs":
        return cls(np.array(value["layers"]), {int(k): tuple(v) for k, v in value["blocks"].items()})


def _conv_share(net: Network, index: int, filters: int) -> Piece:
    """The convolution block at ``index`` with only ``filters`` of its output channels."""
    conv, shapes, end = net.layers[index], net.activation_shapes(), block_end(net, index)
    layer = Conv(conv.in_channels, filters, conv.kernel, conv.stride, conv.pad)
    holds = [(index, slice(0, filters))] + [(i, None) for i in range(index + 1, end)]
    return _piece(net, f"{net.name}[{index}][:{filters}]", shapes[index], [layer, *net.layers[index + 1:end]], holds)


def time_pieces(pieces: list[Piece], input_shapes: list, stage_class, batch: int, dtype=np.float32,
                repeats: int = 7, seed: int = 0) -> np.ndarray:
    """Seconds of forward + backward of each piece alone, on a random batch.

    Every repeat times every piece once, one after the other, and each keeps its fastest time: on a
    busy machine a burst of someone else's work then lands on one repeat of every piece rather than
    on all the repeats of one, and the fastest time is the one with the least of it.
    """
    rng, probes = np.random.default_rng(seed), []
    for piece, shape in zip(pieces, input_shapes):
        stage = stage_class(piece.net, dtype)
        stage.set_params(0.1 * rng.standard_normal(piece.num_params).astype(dtype))
        probes.append((stage, rng.standard_normal((batch, *shape)).astype(dtype),
                       rng.standard_normal((batch, piece.net.num_classes)).astype(dtype)))
    times = np.empty((repeats + 1, len(probes)))
    for repeat in range(repeats + 1):                   # the first round warms up: not counted
        for index, (stage, x, upstream) in enumerate(probes):
            started = time.perf_counter()
            _, stage.saved = stage._forward_layers(x)
            stage.dlogits = upstream
            stage.backward()
            times[repeat, index] = time.perf_counter() - started
    return times[1:].min(axis=0)


def measure_costs(net: Network, stage_class, batch: int, dtype=np.float32, repeats: int = 7) -> Costs:
    """The probe: every layer alone, and every convolution block with one filter (which, against the
    whole block, splits its cost into the fixed part and the part per filter)."""
    shapes = net.activation_shapes()
    singles = [_piece(net, f"probe {i}", shapes[i], [layer], [(i, None)]) for i, layer in enumerate(net.layers)]
    convs = [i for i, layer in enumerate(net.layers) if isinstance(layer, Conv) and layer.out_channels > 1]
    times = time_pieces(singles + [_conv_share(net, i, 1) for i in convs],
                        shapes[:len(net.layers)] + [shapes[i] for i in convs], stage_class, batch, dtype, repeats)
    layers, blocks = times[:len(net.layers)], {}
    for index, one_filter in zip(convs, times[len(net.layers):]):
        whole = float(layers[index:block_end(net, index)].sum())
        per_filter = max(0.0, (whole - float(one_filter)) / (net.layers[index].out_channels - 1))
        blocks[index] = (max(0.0, whole - per_filter * net.layers[index].out_channels), float(per_filter))
    return Costs(layers, blocks)


def rank_costs(net: Network, costs: Costs, partition: Partition) -> tuple[float, float]:
    """(rank 0's, rank 1's) seconds under ``partition``: the layers each holds, and with a shared
    block, each share's fixed part plus its filters' part."""
    cut, layers = partition.cut, costs.layers
    if partition.channels is None:
        return float(layers[:cut].sum()), float(layers[cut:].sum())
    fixed, per_filter = costs.blocks[cut]
    filters, end = net.layers[cut].out_channels, block_end(net, cut)
    return (float(layers[:cut].sum()) + fixed + per_filter * partition.channels,
            fixed + per_filter * (filters - partition.channels) + float(layers[end:].sum()))


def candidates(net: Network) -> list[Partition]:
    """Every plain cut, and every split of every convolution's output channels."""
    plain = [Partition(cut) for cut in range(1, len(net.layers))]
    split = [Partition(index, channels) for index, layer in enumerate(net.layers) if isinstance(layer, Conv)
             for channels in range(1, layer.out_channels)]
    return plain + split


def balanced_partition(net: Network, costs: Costs) -> Partition:
    """The cut whose slower rank is fastest (a plain cut where one is as good: fewer messages)."""
    return min(candidates(net), key=lambda p: (round(max(rank_costs(net, costs, p)), 9), p.channels is not None))


def default_cut(net: Network) -> Partition:
    """The first version's cut: right after Flatten (everything that is not a vector on rank 0)."""
    return Partition(next(i + 1 for i, layer in enumerate(net.layers) if isinstance(layer, Flatten)))

