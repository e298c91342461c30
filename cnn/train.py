"""Training: minibatch SGD with momentum, any stage, checkpoints that survive interruption and divergence.

The loop is the same for every stage — it only calls the ``Stage`` interface, an epoch at a time::

    stage.load_dataset(train, test)                       once
    for each epoch:   order = a seeded shuffle;  lrs = the schedule's rate at each step
        stage.begin_epoch(order, lrs, ...)
        while steps remain:   losses = stage.run_steps(first, count)     (count = up to the next
                              sync point: the stage's steps_per_sync, --eval-every, --checkpoint-every)
        evaluate on the test set (stage.test_scores), write a checkpoint

A CPU stage runs ``run_steps`` as one ``train_step`` a step (``steps_per_sync`` = 1); a GPU stage
with the ``device-epoch`` fix runs the requested steps with data, order and rates already on the
device, and the host waits for it once per request. Every step's loss is in the history; a
step's training time is interpolated within its request (the host only sees when a request ends).

Learning-rate schedules (``lr_at``):

- ``constant``: η
- ``step``:     η · γ^⌊epoch / step_epochs⌋
- ``warmup``:   the linear scaling rule with gradual warmup (Goyal et al. 2017, seed 003): the
  target rate is k·η (k = ``lr_scale``, e.g. the number of workers); during the first
  ``warmup_epochs`` the rate climbs linearly, batch by batch, from η to k·η.

Checkpoints (``cnn.checkpoint``) hold parameters, momentum, the position (epoch and batch), the
state of the shuffling generator at the start of that epoch and the configuration, so ``resume``
reproduces the uninterrupted run exactly. Before training, the checkpoint's path is checked
writable and locked against a second run; each checkpoint is written whole or not at all.

The guard (``cnn.guard``; seed 000's lesson: too large a learning rate or initial weights) looks at
every number the host sees — each step's loss, each test loss, which must also stay within a sane
factor of the best seen — and, before each checkpoint, at the parameters themselves: they must be
finite and give a sane loss on test images, since a step whose loss was finite may still have left
exploded weights behind. Anything else stops training with one line that names the last good
checkpoint, if there is one. The host's arithmetic runs under ``np.errstate(all="ignore")``: the
guard reports overflow itself, in that one line.

Ctrl-C (SIGINT) and SIGTERM (a cluster scheduler, a notebook server) only raise a flag
(``cnn.interrupt``); after the current request of steps the guard writes the checkpoint of exactly
that point and stops the run with one line saying how to resume it (exit 130 / 143 on the command
line). Resuming it gives, bit for bit, what the uninterrupted run would have.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from cnn.checkpoint import (CheckpointLock, check_writable, checkpoint_bytes, load_checkpoint,  # noqa: F401
                            save_checkpoint)
from cnn.config import SCHEDULES, TrainConfig  # noqa: F401  (TrainConfig and SCHEDULES are also read from here)
from cnn.guard import (CheckpointWriteFailed, Guard, TrainingDiverged, TrainingStopped,  # noqa: F401
                       divergence_message, resume_point)
from cnn.interrupt import polite_stop
from cnn.model import get_network
from cnn.stages import get_stage

DATASET_OF_MODEL = {"lenet5": "mnist", "alexnet-small": "cifar10"}


def lr_at(config: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Learning rate for global step ``step`` (0-based) under the configured schedule."""
    epoch = step / steps_per_epoch
    if config.schedule == "warmup":
        target = config.lr * config.lr_scale
        if epoch < config.warmup_epochs:
            return config.lr + (target - config.lr) * epoch / config.warmup_epochs
        return target
    if config.schedule == "step":
        return config.lr * config.gamma ** int(epoch // config.step_epochs)
    return config.lr


# -- data ---------------------------------------------------------------------------------------

def load_dataset(config: TrainConfig):
    """The dataset the model was built for, normalised to the stage's dtype, limited if asked."""
    from cnn import data

    name = DATASET_OF_MODEL[config.model]
    dataset = data.load_mnist(config.data_dir) if name == "mnist" else data.load_cifar10(config.data_dir)
    if config.progress:
        print(f"data: {dataset.origin}", flush=True)
    dtype = np.dtype(config.dtype)
    train_x = data.normalize(dataset.train_images[:config.limit_train], dataset.mean, dataset.std, dtype)
    test_x = data.normalize(dataset.test_images[:config.limit_test], dataset.mean, dataset.std, dtype)
    return (train_x, dataset.train_labels[:config.limit_train].astype(np.int64),
            test_x, dataset.test_labels[:config.limit_test].astype(np.int64))


def evaluate(stage, images: np.ndarray, labels: np.ndarray, batch_size: int = 1000) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of the stage's current parameters on a labelled set."""
    from cnn.stages.base import score_batches

    correct, loss_sum = score_batches(stage, images, labels, batch_size)
    return correct / len(images), loss_sum / len(images)


def evaluate_loaded(stage, count: int) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on the first ``count`` images of the test set given to ``load_dataset``."""
    correct, loss_sum = stage.test_scores(count)
    return correct / count, loss_sum / count


# -- checkpoints --------------------------------------------------------------------------------

def config_from_checkpoint(saved: dict, **overrides) -> TrainConfig:
    known = {field.name for field in fields(TrainConfig)}
    values = {key: value for key, value in saved["config"].items() if key in known}
    values.update(overrides)
    return TrainConfig(**values)


def epoch_seconds(history: dict) -> list[float]:
    """Seconds of training in each epoch of ``history`` (from its cumulative ``train_seconds``)."""
    totals = [epoch["train_seconds"] for epoch in history["epochs"]]
    return [later - earlier for earlier, later in zip([0.0] + totals, totals)]


def pace_line(history: dict) -> str:
    """How long an epoch took: the first apart when it was slower (a JIT stage compiles its kernels there)."""
    seconds = epoch_seconds(history)
    if not seconds:
        return "no epoch trained"
    rest = float(np.median(seconds[1:])) if len(seconds) > 1 else None
    if rest is None or seconds[0] < 1.5 * rest:
        return f"{sum(seconds) / len(seconds):.2f} s of training per epoch"
    return f"{rest:.2f} s of training per epoch after the first ({seconds[0]:.1f} s, compilation included)"


# -- the loop -----------------------------------------------------------------------------------

def _new_history(config: TrainConfig, num_params: int) -> dict:
    return {"config": asdict(config), "num_params": num_params, "steps": [], "evals": [], "epochs": [],
            "train_seconds": 0.0}


def _progress_bar(total: int, initial: int, epoch: int, enabled: bool):
    from tqdm import tqdm

    # disable=None: a bar only when stderr is a terminal (a redirected log would fill with its updates)
    return tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}", unit="batch",
                disable=None if enabled else True, leave=True, dynamic_ncols=True)


def train(config: TrainConfig, data=None, stage=None) -> dict:
    """Train as configured and return the history (also stored in every checkpoint).

    ``data`` = (train_x, train_y, test_x, test_y) already normalised, or None to load the dataset.
    ``stage`` = a ready stage instance to train (its network and parameters are used as they are), or
    None to build ``config.stage`` for ``config.model``, initialised with ``config.init`` and ``config.seed``.

    With a checkpoint, its path is checked writable (ValueError, one line) and locked against a
    second run before anything else is done, and stays locked until the run ends. SIGINT and SIGTERM
    stop the run politely (``cnn.interrupt``): after the current request of steps, the checkpoint of
    that point is written and TrainingStopped raised (see ``cnn.guard``).
    """
    config.check()
    net = stage.net if stage is not None else get_network(config.model)
    with polite_stop() as stop, _locked(config, net) as lock:
        return _train(config, net, data, stage, lock, stop)


@contextlib.contextmanager
def _locked(config: TrainConfig, net):
    """The run's CheckpointLock, its path checked writable first; None without a checkpoint."""
    if not config.checkpoint:
        yield None
        return
    check_writable(config.checkpoint, "--checkpoint", checkpoint_bytes(net.num_params, config.dtype))
    with CheckpointLock(config.checkpoint) as lock:
        yield lock


def _train(config: TrainConfig, net, data, stage, lock, stop) -> dict:
    train_x, train_y, test_x, test_y = data if data is not None else load_dataset(config)
    if tuple(train_x.shape[1:]) != net.input_shape:
        raise ValueError(f"model {config.model} expects images {net.input_shape}, data has {train_x.shape[1:]}")
    steps_per_epoch = len(train_x) // config.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"batch size {config.batch_size} is larger than the {len(train_x)} training images")
    if stage is None:
        stage = get_stage(config.stage)(net, np.dtype(config.dtype)).init(config.init, config.seed)
    rng = np.random.default_rng(config.seed)
    history, start_epoch, start_batch = _new_history(config, net.num_params), 0, 0
    resumed = _resume(config, net, stage, rng, steps_per_epoch) if config.resume else None
    if resumed is not None:
        history, start_epoch, start_batch = resumed
    guard = Guard(config, history, len(test_x), net.num_classes, last=(start_epoch, start_batch) if resumed else None,
                  lock=lock, stop=stop)

    stage.load_dataset(train_x, train_y, test_x, test_y)
    with np.errstate(all="ignore"):                 # overflow is the guard's to report, in one line
        for epoch in range(start_epoch, config.epochs):
            epoch_rng_state = rng.bit_generator.state
            order = rng.permutation(len(train_x))
            lrs = [lr_at(config, epoch * steps_per_epoch + batch, steps_per_epoch) for batch in range(steps_per_epoch)]
            stage.begin_epoch(order, lrs, config.batch_size, config.momentum, config.weight_decay)
            _train_epoch(config, stage, epoch, start_batch, steps_per_epoch, len(test_x), epoch_rng_state, history,
                         guard)
            start_batch = 0
            accuracy, loss = evaluate_loaded(stage, len(test_x))
            guard.check_test_loss(loss, epoch, steps_per_epoch - 1, lrs[-1])
            history["epochs"].append({"epoch": epoch + 1, "test_accuracy": accuracy, "test_loss": loss,
                                      "train_seconds": history["train_seconds"],
                                      "step": (epoch + 1) * steps_per_epoch})
            if config.progress:
                print(f"epoch {epoch + 1}/{config.epochs}: test accuracy {accuracy:.2%}, test loss {loss:.4f}, "
                      f"{history['train_seconds']:.1f} s of training so far", flush=True)
            if config.checkpoint:
                guard.checkpoint(stage, (epoch + 1, 0), rng.bit_generator.state, epoch, steps_per_epoch - 1, lrs[-1],
                                 test_loss=loss)
            if epoch + 1 < config.epochs:           # after the last epoch there is nothing left to stop
                guard.stop_if_asked(stage, (epoch + 1, 0), rng.bit_generator.state, epoch, steps_per_epoch - 1,
                                    lrs[-1])
    history["final_test_accuracy"] = history["epochs"][-1]["test_accuracy"] if history["epochs"] else None
    return history


def _resume(config: TrainConfig, net, stage, rng, steps_per_epoch: int) -> tuple[dict, int, int] | None:
    """Load ``config.checkpoint`` into the stage and the generator: (history, epoch, batch); None if
    there is no checkpoint yet. Says which, in one line. (Batch ``steps_per_epoch`` is allowed: a run
    stopped after an epoch's last step, before its evaluation.)"""
    path = Path(config.checkpoint)
    if not path.exists():
        print(f"no checkpoint at {path} yet: starting from the beginning", flush=True)
        return None
    saved = load_checkpoint(path)
    model = saved["config"].get("model", "an unknown model")
    if model != config.model or saved["params"].size != net.num_params:
        raise ValueError(f"{path}: a checkpoint of {model} ({saved['params'].size:,} parameters), not of "
                         f"{config.model} ({net.num_params:,}); resume it with --model {model}, "
                         "or give another --checkpoint")
    stage.set_params(saved["params"])
    stage.set_momentum(saved["momentum"])
    rng.bit_generator.state = saved["rng_state"]
    epoch, batch = saved["epoch"], batch_to_resume_at(saved, config.batch_size, path)
    if batch > steps_per_epoch:
        raise ValueError(f"{path}: resumes at {resume_point(epoch, batch)}, but an epoch here has {steps_per_epoch} "
                         f"batches of {config.batch_size}; resume it with the data and --batch-size it was written with")
    if epoch >= config.epochs:
        print(f"{path} has finished all {epoch} epochs: nothing left to train (raise --epochs to go on)", flush=True)
    else:
        print(f"resuming from {resume_point(epoch, batch)} ({path})", flush=True)
    return saved["history"], epoch, batch


def batch_to_resume_at(saved: dict, batch_size: int, path) -> int:
    """The batch of ``batch_size`` images at which to go on. A distributed run's checkpoint counts its
    own global batches, so its position is converted from images (ValueError if it falls mid-batch)."""
    if saved["parallel"] is None:
        return saved["batch"]
    images = saved["parallel"]["images_into_epoch"]
    if images % batch_size:
        raise ValueError(f"{path}: written {images} images into an epoch, not a whole number of "
                         f"--batch-size {batch_size} batches; resume it with a batch size that divides {images}")
    return images // batch_size


def next_sync(config: TrainConfig, stage, step: int, epoch_end: int) -> int:
    """The first global step count after ``step`` at which the host must look: the stage's sync
    interval, an evaluation (--eval-every), a checkpoint (--checkpoint-every) or the epoch's end."""
    candidates = [step + stage.steps_per_sync, epoch_end]
    for every in (config.eval_every, config.checkpoint_every if config.checkpoint else 0):
        if every:
            candidates.append(step + every - step % every)
    return min(candidates)


def _train_epoch(config, stage, epoch, start_batch, steps_per_epoch, test_count, epoch_rng_state, history, guard):
    """One pass over the epoch's batches, from ``start_batch`` on, in requests of ``run_steps``.

    A checkpoint due at the epoch's last step is left to the one written after the epoch's evaluation.
    """
    bar = _progress_bar(steps_per_epoch, start_batch, epoch, config.progress)
    last_accuracy = history["epochs"][-1]["test_accuracy"] if history["epochs"] else float("nan")
    batch = start_batch
    try:
        while batch < steps_per_epoch:
            first_step = epoch * steps_per_epoch        # sync points are counted in global steps
            end = next_sync(config, stage, first_step + batch, first_step + steps_per_epoch) - first_step
            started, before = time.perf_counter(), history["train_seconds"]
            losses = stage.run_steps(batch, end - batch)
            elapsed = time.perf_counter() - started
            for offset, loss in enumerate(losses):
                step = epoch * steps_per_epoch + batch + offset
                lr = float(stage.plan.lrs[batch + offset])
                guard.check(loss, "loss", epoch, batch + offset, lr)
                seconds = before + elapsed * (offset + 1) / len(losses)
                history["steps"].append([step + 1, float(loss), lr, seconds])
            history["train_seconds"] = before + elapsed
            step_after, test_loss = epoch * steps_per_epoch + end, None
            if config.eval_every and step_after % config.eval_every == 0:
                subset = min(config.eval_subset, test_count)
                accuracy, test_loss = evaluate_loaded(stage, subset)
                guard.check_test_loss(test_loss, epoch, end - 1, lr)
                history["evals"].append([step_after, accuracy, test_loss, history["train_seconds"]])
                last_accuracy = accuracy
            shown_accuracy = "n/a" if math.isnan(last_accuracy) else f"{last_accuracy:.2%}"   # none measured yet
            bar.set_postfix(loss=f"{losses[-1]:.4f}", test_acc=shown_accuracy,
                            img_s=f"{len(losses) * config.batch_size / elapsed:,.0f}")
            bar.update(end - batch)
            if (config.checkpoint and config.checkpoint_every and step_after % config.checkpoint_every == 0
                    and end < steps_per_epoch):
                guard.checkpoint(stage, (epoch, end), epoch_rng_state, epoch, end - 1, lr, test_loss)
            guard.stop_if_asked(stage, (epoch, end), epoch_rng_state, epoch, end - 1, lr)
            batch = end
    finally:
        bar.close()
