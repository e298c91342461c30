"""Strategy ``model-parallel``: the network split across two ranks (seed 002: Krizhevsky's two GPUs,
DistBelief's model partitions), the cut chosen by measured cost, a convolution split by its filters.

Rank 0 runs the front of the network, rank 1 the back and the loss. Where the cut falls is a
``partition.Partition`` (``--split K`` or ``K:C``; by default the one that balances the measured
per-layer cost, ``partition.balanced_partition``): with a plain cut K::

    rank 0:  a = f_[0,K)(x)              ── a ──▶   rank 1:  loss of f_[K,L)(a); backward → dL/da
    rank 0:  backward from dL/da        ◀── dL/da ──
    both:    an SGD step on their own layers

and with K:C the convolution block at K is shared: rank 0 sends a (the block's input) at once, then
computes output channels [0, C) of the block while rank 1 computes channels [C, F) of it — the two
halves of the layer at the same time — and sends its part y0; rank 1 joins [y0 | y1] along the
channels and goes on. Backward, rank 1 sends dL/dy0 and its share's dL/da; rank 0 adds its own
share's dL/da to it before its front layers' backward pass.

Each piece is a ``Network`` built from the layer list, run by the stage's own layer-by-layer
machinery (``HostStage._forward_layers`` and ``backward``), so a layer runs through the same code
whichever rank holds it; ``partition.take`` and ``put`` map the whole flat parameter vector onto
the pieces and back.

Pipelining, ``--micro-batches M`` (as GPipe): the batch is cut into M micro-batches; rank 0 sends
the activations of micro-batch m and goes on with m+1 while rank 1 works on m. The micro-batches'
gradients are summed, weighted by their sizes, and one update is taken per batch, so the weights
are those of one process with the whole batch (tested, with a split convolution too). With M = 1
one rank always waits for the other; with two balanced stages the idle share ("bubble") is about
1/(M+1) of the step — the timeline (``--timeline``) shows it. Pipelining cannot help an unbalanced
cut: with the first version's cut (after Flatten) rank 0 computed 20.9 ms a step and rank 1 0.7 ms,
and 1/4/8 micro-batches took 20.0/21.4/25.4 ms a step (``benchmarks/parallel_model_split.py``
measures both cuts).

Each rank holds part of the network, so a checkpoint (every ``--checkpoint-every`` steps, else
every epoch) gathers the pieces on rank 0, and ``--resume`` hands each rank its pieces back (the
cut may differ between the runs: the checkpoint holds the whole vector). If either rank is lost,
the other cannot save the whole: the last checkpoint is where to resume.
"""

from __future__ import annotations

import numpy as np

from cnn.model import Flatten, Network
from cnn.parallel import partition, resume
from cnn.parallel.common import Run
from cnn.parallel.timing import COMPUTE, UPDATE
from cnn.stages import get_stage
from cnn.stages.base import HostStage
from cnn.train import evaluate

TAG_ACTIVATIONS, TAG_SHARE, TAG_GRADIENTS, TAG_WEIGHTS = 50, 53, 51, 52


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    if size != 2:
        raise ValueError(f"model-parallel splits the network across exactly 2 ranks, not {size} (mpiexec -n 2)")
    return 1, {0: "front layers", 1: "back layers + loss"}


def split_network(net: Network, split: int | None) -> tuple[Network, Network]:
    """The first version's cut, where the activation is a vector: layers [0, split) and [split, L)
    (default: right after Flatten). The strategy now cuts anywhere (``partition.pieces``); this
    stays for notebook 13, which compares the two."""
    shapes = net.activation_shapes()
    if split is None:
        split = next(i + 1 for i, layer in enumerate(net.layers) if isinstance(layer, Flatten))
    vector_cuts = [i for i in range(1, len(net.layers)) if len(shapes[i]) == 1]
    if split not in vector_cuts:
        raise ValueError(f"--split {split}: the network can be cut only where its activation is a vector, "
                         f"before layer {', '.join(map(str, vector_cuts))} of {net.name}")
    return (Network(f"{net.name}[:{split}]", net.input_shape, net.layers[:split]),
            Network(f"{net.name}[{split}:]", shapes[split], net.layers[split:]))


class WholeModel:
    """The whole network's weights and momenta, put together from the pieces: what a checkpoint holds."""

    def __init__(self, params: np.ndarray, momentum: np.ndarray):
        self.params, self.momentum = params, momentum

    def get_params(self):
        return self.params.copy()

    def get_momentum(self):
        return self.momentum.copy()


def put_pieces(net: Network, pieces: list, state: np.ndarray, params: np.ndarray, momentum: np.ndarray) -> None:
    """Write a ``Side.state()`` vector of ``pieces`` into the whole network's ``params`` and ``momentum``."""
    sizes = [piece.num_params for piece in pieces]
    parts = np.split(state, np.cumsum(sizes + sizes)[:-1])
    for piece, weights, velocity in zip(pieces, parts[:len(sizes)], parts[len(sizes):]):
        partition.put(net, params, piece, weights)
        partition.put(net, momentum, piece, velocity)


class Side:
    """The pieces one rank runs, a stage for each, and where their parameters sit in the whole vector."""

    def __init__(self, run: Run, pieces: list[partition.Piece]):
        stage_class = get_stage(run.config.stage)
        self.net, self.pieces = run.net, pieces
        self.stages = [stage_class(piece.net, run.dtype) for piece in pieces]
        self.grad_sums = [np.zeros(piece.num_params, run.dtype) for piece in pieces]

    def load(self, params: np.ndarray, momentum: np.ndarray) -> None:
        for piece, stage in zip(self.pieces, self.stages):
            stage.set_params(partition.take(self.net, params, piece))
            stage.set_momentum(partition.take(self.net, momentum, piece))

    def state(self) -> np.ndarray:
        """[params of every piece | momenta of every piece], in piece order."""
        return np.concatenate([stage.get_params() for stage in self.stages] +
                              [stage.get_momentum() for stage in self.stages])

    def begin_batch(self) -> None:
        for grad_sum in self.grad_sums:
            grad_sum[...] = 0

    def add_grad(self, index: int, weight: float) -> None:
        self.grad_sums[index] += self.stages[index].grad * weight

    def update(self, lr: float, config) -> None:
        for stage, grad_sum in zip(self.stages, self.grad_sums):
            stage.grad[...] = grad_sum
            stage.update(lr, config.momentum, config.weight_decay)


def choose_partition(run: Run) -> tuple[partition.Partition, partition.Costs | None]:
    """--split as given, else rank 0 probes the layers' cost at the micro-batch size and picks the
    balanced cut; every rank gets the same (and the costs, for the summary)."""
    given = partition.parse_split(run.options.split, run.net)
    if given is not None:
        return given, None
    choice = None
    if run.rank == 0:
        micro_batch = max(1, run.config.batch_size // run.options.micro_batches)
        costs = partition.measure_costs(run.net, get_stage(run.config.stage), micro_batch, run.dtype)
        best = partition.balanced_partition(run.net, costs)
        choice = {"cut": best.cut, "channels": best.channels, "costs": costs.as_json()}
    choice = run.world.broadcast_object(choice, "the balanced cut")
    return partition.Partition(choice["cut"], choice["channels"]), partition.Costs.from_json(choice["costs"])


def train(run: Run) -> dict:
    world, config, options = run.world, run.config, run.options
    if not issubclass(get_stage(config.stage), HostStage):
        raise ValueError(f"model-parallel runs each piece layer by layer on the host; stage {config.stage!r} "
                         f"does not (use loops, numpy or numba-cpu)")
    if options.micro_batches > config.batch_size:
        raise ValueError(f"--micro-batches {options.micro_batches} is more than the batch of {config.batch_size}")
    cut, costs = choose_partition(run)
    front, back = partition.pieces(run.net, cut)
    side = Side(run, front if world.rank == 0 else back)
    shares = partition.rank_costs(run.net, costs, cut) if costs else None
    why = f"balanced: {shares[0] * 1e3:.2f} / {shares[1] * 1e3:.2f} ms measured" if shares else "--split"
    run.announce(f"cut {cut} ({why}); rank 0: {' + '.join(p.net.name for p in front)}, "
                 f"rank 1: {' + '.join(p.net.name for p in back)}; {options.micro_batches} micro-batch(es)")
    whole = run.make_stage()
    params = run.initial_params(whole)
    momentum = np.zeros_like(params)
    start = resume.weights_and_momentum(run, params, momentum)
    side.load(params, momentum)
    run.rescue_note = "each rank holds part of the network"
    bounds = np.linspace(0, config.batch_size, options.micro_batches + 1).astype(np.int64)
    flow = Flow(run, cut, front, back)
    for step in range(start, run.total_steps):
        world.maybe_die(step)
        lr = run.lr(step)
        side.begin_batch()
        loss = (flow.front_step if world.rank == 0 else flow.back_step)(side, step, bounds)
        with run.timer.phase(UPDATE):
            side.update(lr, config)
        run.completed_steps = step + 1
        run.end_step(step, loss, lr)
        epoch_ended = (step + 1) % run.steps_per_epoch == 0
        if epoch_ended or run.checkpoint_due(step + 1):
            model = _gather_whole(run, side, back)
            if epoch_ended and world.rank == 0:
                whole.set_params(model.params)
                accuracy, test_loss = evaluate(whole, run.test_x, run.test_y)
                run.record_epoch((step + 1) // run.steps_per_epoch - 1, accuracy, test_loss)
            if world.rank == 0:
                run.save(step + 1, model=model)
    run.training_done()
    return {"extra": {"split": str(cut), "costs_s": costs.as_json() if costs else None, "rank_costs_s": shares}}


class Flow:
    """The messages of one step between the two ranks, for the cut ``cut``."""

    def __init__(self, run: Run, cut: partition.Partition, front, back):
        self.run, self.world, self.timer, self.comm = run, run.world, run.timer, run.world.comm
        shapes = run.net.activation_shapes()
        self.head = cut.cut > 0                                   # rank 0 has layers before the cut
        self.channels = cut.channels                              # None: a plain cut
        self.cut_shape = shapes[cut.cut]                          # the activation a crossing the cut
        if cut.channels is not None:
            self.block_out = shapes[partition.block_end(run.net, cut.cut)]     # (F, H', W') after the block
        self.features = int(np.prod(self.cut_shape))

    def _share_size(self, channels: int) -> int:
        return channels * int(np.prod(self.block_out[1:]))

    # -- rank 0 ------------------------------------------------------------------------------------
    def front_step(self, side: Side, step: int, bounds: np.ndarray) -> float:
        """Forward every micro-batch, send what rank 1 needs; then backward each from rank 1's reply."""
        timer, comm = self.timer, self.comm
        images, _ = self.run.shard(step, 0)
        sizes = np.diff(bounds)
        replies = [np.empty(self._reply_size(size), self.run.dtype) for size in sizes]
        receives = [comm.Irecv(reply, source=1, tag=TAG_GRADIENTS) for reply in replies]
        sends, saved, kept = [], [], []                      # kept: the arrays being sent, alive until sent
        for m, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            x = np.ascontiguousarray(images[start:stop], dtype=self.run.dtype)
            with timer.phase(COMPUTE, label=f"forward {m}"):
                a, head_saved = side.stages[0]._forward_layers(x) if self.head else (x, None)
            kept.append(np.ascontiguousarray(a).reshape(len(x), -1))
            sends.append(comm.Isend(kept[-1], dest=1, tag=TAG_ACTIVATIONS))
            share_saved = None
            if self.channels is not None:
                with timer.phase(COMPUTE, label=f"forward {m}, channels [0, {self.channels})"):
                    y0, share_saved = side.stages[-1]._forward_layers(kept[-1].reshape(len(x), *self.cut_shape))
                kept.append(np.ascontiguousarray(y0))
                sends.append(comm.Isend(kept[-1], dest=1, tag=TAG_SHARE))
            saved.append((head_saved, share_saved))
        loss = 0.0
        for m, size in enumerate(sizes):
            with timer.phase("waiting for gradients"):
                self.world.wait([receives[m]], "activation gradients", peers=[1])
            weight = size / bounds[-1]
            with timer.phase(COMPUTE, label=f"backward {m}"):
                upstream = self._front_backward(side, saved[m], replies[m][:-1], size, weight)
                if self.head:
                    stage = side.stages[0]
                    stage.saved, stage.dlogits = saved[m][0], upstream.reshape(size, -1)
                    stage.backward()
                    side.add_grad(0, weight)
            loss += float(replies[m][-1]) * weight
        with timer.phase("sending activations"):
            self.world.wait(sends, "receipt of the activations", peers=[1] * len(sends))
        return loss

    def _reply_size(self, size: int) -> int:
        """Rank 1's reply for a micro-batch of ``size``: [dL/da or (dL/dy0, its share's dL/da) | loss]."""
        if self.channels is None:
            return size * self.features + 1
        return size * (self._share_size(self.channels) + (self.features if self.head else 0)) + 1

    def _front_backward(self, side: Side, saved, reply: np.ndarray, size: int, weight: float) -> np.ndarray | None:
        """dL/da for the head: rank 1's, plus, with a split convolution, rank 0's own share's."""
        if self.channels is None:
            return reply
        share = side.stages[-1]
        dy0 = reply[:size * self._share_size(self.channels)].reshape(size, -1)
        share.saved, share.dlogits = saved[1], dy0
        share.backward()
        side.add_grad(len(side.stages) - 1, weight)
        if not self.head:
            return None
        return share.input_grad.reshape(size, -1) + reply[dy0.size:].reshape(size, -1)

    # -- rank 1 ------------------------------------------------------------------------------------
    def back_step(self, side: Side, step: int, bounds: np.ndarray) -> float:
        """For each micro-batch: receive, forward (its share, then the tail) + loss + backward, reply."""
        timer, comm, dtype = self.timer, self.comm, self.run.dtype
        _, labels = self.run.shard(step, 0)
        sizes = np.diff(bounds)
        inputs = [np.empty((size, self.features), dtype) for size in sizes]
        receives = [comm.Irecv(array, source=0, tag=TAG_ACTIVATIONS) for array in inputs]
        if self.channels is not None:
            theirs = [np.empty((size, self._share_size(self.channels)), dtype) for size in sizes]
            share_receives = [comm.Irecv(array, source=0, tag=TAG_SHARE) for array in theirs]
        tail, loss, sends, replies = side.stages[-1], 0.0, [], []
        for m, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            size, weight = sizes[m], sizes[m] / bounds[-1]
            with timer.phase("waiting for activations"):
                self.world.wait([receives[m]], "activations", peers=[0])
            if self.channels is None:
                x = inputs[m].reshape(size, *self.cut_shape)
            else:
                share = side.stages[0]
                with timer.phase(COMPUTE, label=f"forward {m}, channels [{self.channels}, F)"):
                    y1, share_saved = share._forward_layers(inputs[m].reshape(size, *self.cut_shape))
                with timer.phase("waiting for activations"):
                    self.world.wait([share_receives[m]], "the other channels", peers=[0])
                x = np.concatenate([theirs[m].reshape(size, self.channels, *self.block_out[1:]),
                                    y1.reshape(size, -1, *self.block_out[1:])], axis=1)
            with timer.phase(COMPUTE, label=f"forward + backward {m}"):
                tail.load_batch(x, labels[start:stop])
                tail.forward()
                tail.backward()
                side.add_grad(len(side.stages) - 1, weight)
                reply = self._back_reply(side, tail.input_grad.reshape(size, *x.shape[1:]),
                                         share_saved if self.channels is not None else None, weight)
            replies.append(np.append(reply, tail.fetch_loss()).astype(dtype))
            sends.append(comm.Isend(replies[-1], dest=0, tag=TAG_GRADIENTS))
            loss += tail.fetch_loss() * weight
        with timer.phase("sending gradients"):
            self.world.wait(sends, "receipt of the gradients", peers=[0] * len(sends))
        return loss

    def _back_reply(self, side: Side, dx: np.ndarray, share_saved, weight: float) -> np.ndarray:
        """dL/da for rank 0; with a split convolution, dL/dy0 and this share's dL/da."""
        if self.channels is None:
            return dx.ravel()
        share, size = side.stages[0], len(dx)
        share.saved, share.dlogits = share_saved, np.ascontiguousarray(dx[:, self.channels:]).reshape(size, -1)
        share.backward()
        side.add_grad(0, weight)
        parts = [dx[:, :self.channels].ravel()]
        if self.head:
            parts.append(share.input_grad.ravel())
        return np.concatenate(parts)


def _gather_whole(run: Run, side: Side, back: list) -> WholeModel | None:
    """Rank 1 sends its pieces (weights and momenta) to rank 0, which returns the whole network's."""
    world, comm = run.world, run.world.comm
    if world.rank == 1:
        world.wait([comm.Isend(side.state(), dest=0, tag=TAG_WEIGHTS)], "receipt of the back pieces", peers=[0])
        return None
    theirs = np.empty(2 * sum(piece.num_params for piece in back), run.dtype)
    world.wait([comm.Irecv(theirs, source=1, tag=TAG_WEIGHTS)], "the back pieces", peers=[1])
    params, momentum = np.zeros(run.net.num_params, run.dtype), np.zeros(run.net.num_params, run.dtype)
    put_pieces(run.net, side.pieces, side.state(), params, momentum)
    put_pieces(run.net, back, theirs, params, momentum)
    return WholeModel(params, momentum)
