"""Strategy ``model-parallel``: the network split by layers across two ranks (seed 002: Krizhevsky's
two GPUs, DistBelief's model partitions).

Rank 0 runs layers [0, k), rank 1 runs layers [k, L) and the loss::

    rank 0:  a = f_[0,k)(x)              ── a ──▶   rank 1:  loss of f_[k,L)(a); backward → dL/da
    rank 0:  backward from dL/da        ◀── dL/da ──
    both:    an SGD step on their own layers

Each half is a ``Network`` built from a slice of the layer list, run by the stage's own
layer-by-layer machinery (``HostStage._forward_layers`` and ``backward``), so a layer runs through
the same code whichever rank holds it. The cut must fall where the activation is a vector (after
``Flatten``), since a ``Network`` ends in one.

Pipelining, ``--micro-batches M`` (as GPipe): the batch is cut into M micro-batches; rank 0 sends
the activations of micro-batch m and goes on with m+1 while rank 1 works on m. The micro-batches'
gradients are summed, weighted by their sizes, and one update is taken per batch, so the weights
are those of one process with the whole batch (tested). With M = 1 one rank always waits for the
other; with two stages the idle share ("bubble") is about 1/(M+1) of the step — the timeline
(``--timeline``) shows it.

Each rank holds half of the network, so a checkpoint (every ``--checkpoint-every`` steps, else
every epoch) gathers both halves on rank 0, and ``--resume`` hands each rank its half back. If
either rank is lost, the other cannot save the whole: the last checkpoint is where to resume.
"""

from __future__ import annotations

import numpy as np

from cnn.model import Flatten, Network
from cnn.parallel import resume
from cnn.parallel.common import Run
from cnn.parallel.timing import COMPUTE, UPDATE
from cnn.stages import get_stage
from cnn.stages.base import HostStage
from cnn.train import evaluate

TAG_ACTIVATIONS, TAG_GRADIENTS, TAG_WEIGHTS = 50, 51, 52


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    if size != 2:
        raise ValueError(f"model-parallel splits the network across exactly 2 ranks, not {size} (mpiexec -n 2)")
    return 1, {0: "front layers", 1: "back layers + loss"}


def split_network(net: Network, split: int | None) -> tuple[Network, Network]:
    """The two halves: layers [0, split) and [split, L); the default cut is right after Flatten."""
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
    """Both halves' weights and momenta joined (the flat layout is in layer order): what a checkpoint holds."""

    def __init__(self, params: np.ndarray, momentum: np.ndarray):
        self.params, self.momentum = params, momentum

    def get_params(self):
        return self.params.copy()

    def get_momentum(self):
        return self.momentum.copy()


def train(run: Run) -> dict:
    world, config, options = run.world, run.config, run.options
    front, back = split_network(run.net, options.split)
    mine = front if world.rank == 0 else back
    stage = get_stage(config.stage)(mine, run.dtype)
    if not isinstance(stage, HostStage):
        raise ValueError(f"model-parallel runs each half layer by layer on the host; stage {config.stage!r} "
                         f"does not (use loops or numpy)")
    if options.micro_batches > config.batch_size:
        raise ValueError(f"--micro-batches {options.micro_batches} is more than the batch of {config.batch_size}")
    run.announce(f"rank 0: {front.name} ({front.num_params} parameters), rank 1: {back.name} "
                 f"({back.num_params} parameters), {options.micro_batches} micro-batch(es)")
    whole = run.make_stage()
    params = run.initial_params(whole)
    momentum, start = np.zeros_like(params), 0
    resumed = resume.load(run)
    if resumed:
        resume.broadcast(run, resumed, "params", params)
        resume.broadcast(run, resumed, "momentum", momentum)
        start = resumed.step
    mine_slice = slice(0, front.num_params) if world.rank == 0 else slice(front.num_params, None)
    stage.set_params(params[mine_slice])
    stage.set_momentum(momentum[mine_slice])
    run.rescue_note = "each rank holds half of the network"
    bounds = np.linspace(0, config.batch_size, options.micro_batches + 1).astype(np.int64)
    step_function = front_step if world.rank == 0 else back_step
    for step in range(start, run.total_steps):
        world.maybe_die(step)
        lr = run.lr(step)
        loss = step_function(run, stage, step, bounds, back.input_shape[0])
        with run.timer.phase(UPDATE):
            stage.update(lr, config.momentum, config.weight_decay)
        run.completed_steps = step + 1
        run.end_step(step, loss, lr)
        epoch_ended = (step + 1) % run.steps_per_epoch == 0
        if epoch_ended or run.checkpoint_due(step + 1):
            model = _gather_whole(run, stage)
            if epoch_ended and world.rank == 0:
                whole.set_params(model.params)
                accuracy, test_loss = evaluate(whole, run.test_x, run.test_y)
                run.record_epoch((step + 1) // run.steps_per_epoch - 1, accuracy, test_loss)
            if world.rank == 0:
                run.save(step + 1, model=model)
    run.training_done()
    return {}


def front_step(run: Run, stage: HostStage, step: int, bounds: np.ndarray, features: int) -> float:
    """Rank 0: forward every micro-batch and send its activations; then backward each from rank 1's gradient."""
    world, timer, comm = run.world, run.timer, run.world.comm
    images, _ = run.shard(step, 0)
    sizes = np.diff(bounds)
    replies = [np.empty(size * features + 1, run.dtype) for size in sizes]     # [dL/da | loss]
    receives = [comm.Irecv(reply, source=1, tag=TAG_GRADIENTS) for reply in replies]
    sends, saved, activations = [], [], []
    for m, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        with timer.phase(COMPUTE, label=f"forward {m}"):
            activation, kept = stage._forward_layers(np.ascontiguousarray(images[start:stop], dtype=run.dtype))
        activations.append(np.ascontiguousarray(activation))
        saved.append(kept)
        sends.append(comm.Isend(activations[-1], dest=1, tag=TAG_ACTIVATIONS))
    grad_sum, loss = np.zeros_like(stage.grad), 0.0
    for m, size in enumerate(sizes):
        with timer.phase("waiting for gradients"):
            world.wait([receives[m]], "activation gradients", peers=[1])
        with timer.phase(COMPUTE, label=f"backward {m}"):
            stage.saved, stage.dlogits = saved[m], replies[m][:-1].reshape(size, features)
            stage.backward()
            grad_sum += stage.grad * (size / bounds[-1])
        loss += float(replies[m][-1]) * size / bounds[-1]
    with timer.phase("sending activations"):
        world.wait(sends, "receipt of the activations", peers=[1] * len(sends))
    stage.grad[...] = grad_sum
    return loss


def back_step(run: Run, stage: HostStage, step: int, bounds: np.ndarray, features: int) -> float:
    """Rank 1: for each micro-batch, receive activations, forward + loss + backward, send dL/da back."""
    world, timer, comm = run.world, run.timer, run.world.comm
    _, labels = run.shard(step, 0)
    sizes = np.diff(bounds)
    inputs = [np.empty((size, features), run.dtype) for size in sizes]
    receives = [comm.Irecv(array, source=0, tag=TAG_ACTIVATIONS) for array in inputs]
    grad_sum, loss, sends, replies = np.zeros_like(stage.grad), 0.0, [], []
    for m, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        with timer.phase("waiting for activations"):
            world.wait([receives[m]], "activations", peers=[0])
        with timer.phase(COMPUTE, label=f"forward + backward {m}"):
            stage.load_batch(inputs[m], labels[start:stop])
            stage.forward()
            stage.backward()
            grad_sum += stage.grad * (sizes[m] / bounds[-1])
        replies.append(np.append(stage.input_grad.ravel(), stage.fetch_loss()).astype(run.dtype))
        sends.append(comm.Isend(replies[-1], dest=0, tag=TAG_GRADIENTS))
        loss += stage.fetch_loss() * sizes[m] / bounds[-1]
    with timer.phase("sending gradients"):
        world.wait(sends, "receipt of the gradients", peers=[0] * len(sends))
    stage.grad[...] = grad_sum
    return loss


def _gather_whole(run: Run, stage: HostStage) -> WholeModel | None:
    """Rank 1 sends its half (weights and momentum) to rank 0, which returns the whole network's."""
    world, comm = run.world, run.world.comm
    if world.rank == 1:
        half = np.concatenate([stage.get_params(), stage.get_momentum()])
        world.wait([comm.Isend(half, dest=0, tag=TAG_WEIGHTS)], "receipt of the back half", peers=[0])
        return None
    back_size = run.net.num_params - stage.params.size
    half = np.empty(2 * back_size, run.dtype)
    world.wait([comm.Irecv(half, source=1, tag=TAG_WEIGHTS)], "back half of the weights", peers=[1])
    return WholeModel(np.concatenate([stage.get_params(), half[:back_size]]),
                      np.concatenate([stage.get_momentum(), half[back_size:]]))
