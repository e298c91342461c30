"""The training loop of the synchronous data-parallel strategies (``ps-sync``, ``allreduce``).

Every rank computes the gradient of its shard; an *exchange* turns the P gradients into one
averaged update that every rank applies, so all ranks hold the same weights after every step::

    for step:
        message = [ gradient of my shard | my loss ]            compute
        exchange(message) → the new weights, the mean loss      (what the strategies differ in)

The loss rides along as one extra number in the gradient's buffer, so averaging the gradient also
averages the loss — Horovod's "metrics reduced across ranks" for free. With P workers of batch b
the average of their gradients is the gradient of the P·b images of the global batch, so the
weights equal those of one process trained with batch P·b (up to float rounding): the test suite
checks exactly that.
"""

from __future__ import annotations

import numpy as np

from cnn.parallel import resume
from cnn.parallel.common import Run
from cnn.parallel.optimizers import server_optimizer
from cnn.parallel.timing import COMPUTE


class Exchange:
    """What a synchronous strategy does with each step's gradient (``ps_sync.ParameterServer``,
    ``allreduce.Allreduce``): ``prepare(step)`` runs before compute, ``compute`` fills the message
    [gradient | loss] (an exchange may start sending while it does: ``allreduce --overlap``),
    ``__call__(message, opt, lr)`` turns it into the new weights in ``opt`` and returns the mean
    loss; ``rescue_lacks(rank)`` says what a rescue checkpoint written by ``rank`` lacks."""

    def prepare(self, step: int) -> None:
        pass

    def rescue_lacks(self, rank: int) -> str:
        return ""

    def compute(self, stage, images, labels, message: np.ndarray) -> None:
        loss, grad = stage.loss_and_grad(images, labels)
        message[:-1], message[-1] = grad, loss

    def __call__(self, message: np.ndarray, opt, lr: float) -> float:
        raise NotImplementedError


def train_synchronous(run: Run, exchange: Exchange) -> dict:
    """Train with ``exchange`` (an ``Exchange``): every rank computes, the exchange averages."""
    world, config, timer = run.world, run.config, run.timer
    stage = run.make_stage()
    opt = server_optimizer(run.initial_params(stage), config)
    run.state, run.state_lacks = opt, exchange.rescue_lacks(world.rank)
    start = resume.weights_and_momentum(run, opt.params, opt.velocity)     # SGD: the synchronous rule
    stage.set_params(opt.params)
    size = run.net.num_params
    message = np.empty(size + 1, run.dtype)
    for step in range(start, run.total_steps):
        world.maybe_die(step)
        lr = run.lr(step)
        exchange.prepare(step)
        with timer.phase(COMPUTE):
            exchange.compute(stage, *run.shard(step, world.rank), message)
        world.maybe_straggle(timer.current[COMPUTE])
        mean_loss = exchange(message, opt, lr)
        stage.set_params(opt.params)
        run.completed_steps = step + 1
        run.end_step(step, mean_loss, lr, workers=world.size)
        evaluate_and_checkpoint(run, stage, step)
    run.training_done()
    return {}


def evaluate_and_checkpoint(run: Run, stage, step: int) -> None:
    """Per-step and per-epoch evaluation (every rank scores a share), checkpoints by rank 0 only."""
    config, done = run.config, step + 1
    if config.eval_every and done % config.eval_every == 0:
        accuracy, loss = run.evaluate_sharded(stage, subset=config.eval_subset)
        run.history["evals"].append([done, accuracy, loss, run.history["train_seconds"]])
    epoch_ended = done % run.steps_per_epoch == 0
    if epoch_ended:
        accuracy, loss = run.evaluate_sharded(stage)
        run.record_epoch(done // run.steps_per_epoch - 1, accuracy, loss)
    if run.rank == 0 and (epoch_ended or run.checkpoint_due(done)):
        run.save(done)
