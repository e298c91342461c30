"""The training loop of the synchronous data-parallel strategies (``ps-sync``, ``allreduce``).

Every rank computes the gradient of its shard; an *exchange* turns the P gradients into one
averaged update that every rank applies, so all ranks hold the same weights after every step::

    for step:
        message = [ gradient of my shard | my loss | stop? ]    compute
        exchange(message) → the new weights, the mean loss,     (what the strategies differ in)
                            whether any rank was asked to stop

The loss rides along as one extra number in the gradient's buffer, so averaging the gradient also
averages the loss — Horovod's "metrics reduced across ranks" for free — and so does a stop flag:
the ranks agree on the step at which a polite stop (SIGINT, SIGTERM) ends the run. With P workers
of batch b the average of their gradients is the gradient of the P·b images of the global batch,
so the weights equal those of one process trained with batch P·b (up to float rounding): the test
suite checks exactly that.
"""

from __future__ import annotations

import numpy as np

from cnn.interrupt import polite_stop
from cnn.parallel import resume
from cnn.parallel.common import Run
from cnn.parallel.optimizers import server_optimizer
from cnn.parallel.timing import COMPUTE

TAIL = 2
"""Numbers after the gradient in a step's message: the loss and a stop flag (1 where the rank was
asked to stop by SIGINT or SIGTERM). Averaged with the gradient, the loss becomes the global batch's
and the flag says whether any rank was asked: every rank learns it in the same step, for free."""


class Exchange:
    """What a synchronous strategy does with each step's gradient (``ps_sync.ParameterServer``,
    ``allreduce.Allreduce``): ``prepare(step)`` runs before compute, ``compute`` fills the message
    [gradient | loss | stop] up to the stop flag (an exchange may start sending while it does:
    ``allreduce --overlap``), ``__call__(message, opt, lr)`` turns it into the new weights in ``opt``
    and returns the mean loss and whether any rank asked to stop; ``rescue_lacks(rank)`` says what a
    rescue checkpoint written by ``rank`` lacks."""

    def prepare(self, step: int) -> None:
        pass

    def rescue_lacks(self, rank: int) -> str:
        return ""

    def compute(self, stage, images, labels, message: np.ndarray) -> None:
        loss, grad = stage.loss_and_grad(images, labels)
        message[:-TAIL], message[-TAIL] = grad, loss

    def __call__(self, message: np.ndarray, opt, lr: float) -> tuple[float, bool]:
        raise NotImplementedError


def train_synchronous(run: Run, exchange: Exchange) -> dict:
    """Train with ``exchange`` (an ``Exchange``): every rank computes, the exchange averages.

    SIGINT or SIGTERM (Ctrl-C, a scheduler's notice) on any rank only raises that rank's stop flag
    (``cnn.interrupt.polite_stop``); the step in flight finishes, the flag travels with its
    gradient, and every rank stops after that same step (``Run.stop_on_signal``: rank 0 writes a
    checkpoint of exactly that point)."""
    world, config, timer = run.world, run.config, run.timer
    stage = run.make_stage()
    opt = server_optimizer(run.initial_params(stage), config)
    run.state, run.state_lacks = opt, exchange.rescue_lacks(world.rank)
    start = resume.weights_and_momentum(run, opt.params, opt.velocity)     # SGD: the synchronous rule
    stage.set_params(opt.params)
    message = np.empty(run.net.num_params + TAIL, run.dtype)
    with polite_stop() as stop:
        for step in range(start, run.total_steps):
            world.maybe_die(step)
            world.maybe_interrupt(step)
            lr = run.lr(step)
            exchange.prepare(step)
            message[-1] = stop.requested
            with timer.phase(COMPUTE):
                exchange.compute(stage, *run.shard(step, world.rank), message)
            world.maybe_straggle(timer.current[COMPUTE])
            mean_loss, stopping = exchange(message, opt, lr)
            stage.set_params(opt.params)
            run.completed_steps = step + 1
            run.end_step(step, mean_loss, lr, workers=world.size)
            evaluate_and_checkpoint(run, stage, step)
            if stopping and step + 1 < run.total_steps:
                run.interrupted(stop)
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
