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

Checkpoints are ``.npz`` files written to a temporary name and renamed, so a crash never leaves a
half-written one. They hold parameters, momentum, the position (epoch and batch), the state of the
shuffling generator at the start of that epoch and the configuration, so ``resume`` reproduces the
uninterrupted run exactly. A non-finite loss stops training with a message and leaves the last
good checkpoint in place (seed 000's lesson: too large a learning rate or initial weights).
"""

from __future__ import annotations

import json
import math
import os
import time
import zipfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from cnn.model import INIT_SCHEMES, get_network
from cnn.stages import get_stage

SCHEDULES = ("constant", "step", "warmup")
DATASET_OF_MODEL = {"lenet5": "mnist", "alexnet-small": "cifar10"}


@dataclass
class TrainConfig:
    model: str = "lenet5"
    stage: str = "numpy"
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "step"
    step_epochs: int = 6          # "step": decay every this many epochs
    gamma: float = 0.1            # "step": decay factor
    lr_scale: float = 1.0         # "warmup": target rate = lr_scale · lr
    warmup_epochs: float = 1.0    # "warmup": length of the linear ramp
    init: str = "he"
    seed: int = 0
    dtype: str = "float32"
    data_dir: str | None = None
    limit_train: int | None = None   # use only the first N training images (quick runs, tests)
    limit_test: int | None = None
    eval_every: int = 0           # also evaluate on `eval_subset` test images every N steps (learning curves)
    eval_subset: int = 1000
    checkpoint: str | None = None
    checkpoint_every: int = 0     # steps between checkpoints; 0 = at the end of each epoch only
    resume: bool = False
    progress: bool = True

    def check(self) -> "TrainConfig":
        """Raise ValueError with one line naming the first impossible setting."""
        positive = ("epochs", "batch_size", "lr", "step_epochs", "eval_subset")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("momentum", "weight_decay", "warmup_epochs", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.init not in INIT_SCHEMES:
            raise ValueError(f"unknown init {self.init!r}; choose one of {', '.join(INIT_SCHEMES)}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        for name in ("limit_train", "limit_test"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.resume and not self.checkpoint:
            raise ValueError("resume needs a checkpoint path (--checkpoint)")
        get_network(self.model)
        return self


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message says when and what to change."""


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

def save_checkpoint(path: str | Path, stage, config: TrainConfig, epoch: int, batch: int,
                    rng_state: dict, history: dict) -> None:
    """Write atomically: to ``path.tmp`` first, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        np.savez(handle, params=stage.get_params(), momentum=stage.get_momentum(),
                 epoch=epoch, batch=batch, rng_state=json.dumps(rng_state),
                 config=json.dumps(asdict(config)), history=json.dumps(history))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict:
    """The checkpoint's contents; a missing or damaged file is one ValueError line naming it."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {"params": archive["params"], "momentum": archive["momentum"],
                    "epoch": int(archive["epoch"]), "batch": int(archive["batch"]),
                    "rng_state": json.loads(str(archive["rng_state"])),
                    "config": json.loads(str(archive["config"])),
                    "history": json.loads(str(archive["history"]))}
    except FileNotFoundError:
        raise ValueError(f"{path}: no such checkpoint") from None
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: not a valid checkpoint ({err})") from None


def config_from_checkpoint(saved: dict, **overrides) -> TrainConfig:
    known = {field.name for field in fields(TrainConfig)}
    values = {key: value for key, value in saved["config"].items() if key in known}
    values.update(overrides)
    return TrainConfig(**values)


# -- the loop -----------------------------------------------------------------------------------

def _new_history(config: TrainConfig, num_params: int) -> dict:
    return {"config": asdict(config), "num_params": num_params, "steps": [], "evals": [], "epochs": [],
            "train_seconds": 0.0}


def _progress_bar(total: int, initial: int, epoch: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}", unit="batch",
                disable=not enabled, leave=True, dynamic_ncols=True)


def train(config: TrainConfig, data=None, stage=None) -> dict:
    """Train as configured and return the history (also stored in every checkpoint).

    ``data`` = (train_x, train_y, test_x, test_y) already normalised, or None to load the dataset.
    ``stage`` = a ready stage instance to train (its network and parameters are used as they are), or
    None to build ``config.stage`` for ``config.model``, initialised with ``config.init`` and ``config.seed``.
    """
    config.check()
    net = stage.net if stage is not None else get_network(config.model)
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

    if config.resume and Path(config.checkpoint).exists():
        saved = load_checkpoint(config.checkpoint)
        stage.set_params(saved["params"])
        stage.set_momentum(saved["momentum"])
        rng.bit_generator.state = saved["rng_state"]
        history, start_epoch, start_batch = saved["history"], saved["epoch"], saved["batch"]

    stage.load_dataset(train_x, train_y, test_x, test_y)
    for epoch in range(start_epoch, config.epochs):
        epoch_rng_state = rng.bit_generator.state
        order = rng.permutation(len(train_x))
        lrs = [lr_at(config, epoch * steps_per_epoch + batch, steps_per_epoch) for batch in range(steps_per_epoch)]
        stage.begin_epoch(order, lrs, config.batch_size, config.momentum, config.weight_decay)
        _train_epoch(config, stage, epoch, start_batch, steps_per_epoch, len(test_x), epoch_rng_state, history)
        start_batch = 0
        accuracy, loss = evaluate_loaded(stage, len(test_x))
        history["epochs"].append({"epoch": epoch + 1, "test_accuracy": accuracy, "test_loss": loss,
                                  "train_seconds": history["train_seconds"],
                                  "step": (epoch + 1) * steps_per_epoch})
        if config.progress:
            print(f"epoch {epoch + 1}/{config.epochs}: test accuracy {accuracy:.2%}, test loss {loss:.4f}, "
                  f"{history['train_seconds']:.1f} s of training so far", flush=True)
        if config.checkpoint:
            save_checkpoint(config.checkpoint, stage, config, epoch + 1, 0, rng.bit_generator.state, history)
    history["final_test_accuracy"] = history["epochs"][-1]["test_accuracy"] if history["epochs"] else None
    return history


def next_sync(config: TrainConfig, stage, step: int, epoch_end: int) -> int:
    """The first global step count after ``step`` at which the host must look: the stage's sync
    interval, an evaluation (--eval-every), a checkpoint (--checkpoint-every) or the epoch's end."""
    candidates = [step + stage.steps_per_sync, epoch_end]
    for every in (config.eval_every, config.checkpoint_every if config.checkpoint else 0):
        if every:
            candidates.append(step + every - step % every)
    return min(candidates)


def _train_epoch(config, stage, epoch, start_batch, steps_per_epoch, test_count, epoch_rng_state, history):
    """One pass over the epoch's batches, from ``start_batch`` on, in requests of ``run_steps``."""
    bar = _progress_bar(steps_per_epoch, start_batch, epoch, config.progress)
    last_accuracy = history["epochs"][-1]["test_accuracy"] if history["epochs"] else float("nan")
    batch = start_batch
    while batch < steps_per_epoch:
        first_step = epoch * steps_per_epoch        # sync points are counted in global steps
        end = next_sync(config, stage, first_step + batch, first_step + steps_per_epoch) - first_step
        started, before = time.perf_counter(), history["train_seconds"]
        losses = stage.run_steps(batch, end - batch)
        elapsed = time.perf_counter() - started
        for offset, loss in enumerate(losses):
            step = epoch * steps_per_epoch + batch + offset
            lr = float(stage.plan.lrs[batch + offset])
            if not math.isfinite(loss):
                bar.close()
                raise TrainingDiverged(divergence_message(config, loss, epoch, batch + offset, lr))
            seconds = before + elapsed * (offset + 1) / len(losses)
            history["steps"].append([step + 1, float(loss), lr, seconds])
        history["train_seconds"] = before + elapsed
        step_after = epoch * steps_per_epoch + end
        if config.eval_every and step_after % config.eval_every == 0:
            subset = min(config.eval_subset, test_count)
            accuracy, test_loss = evaluate_loaded(stage, subset)
            history["evals"].append([step_after, accuracy, test_loss, history["train_seconds"]])
            last_accuracy = accuracy
        shown_accuracy = "n/a" if math.isnan(last_accuracy) else f"{last_accuracy:.2%}"   # none measured yet
        bar.set_postfix(loss=f"{losses[-1]:.4f}", test_acc=shown_accuracy,
                        img_s=f"{len(losses) * config.batch_size / elapsed:,.0f}")
        bar.update(end - batch)
        if config.checkpoint and config.checkpoint_every and step_after % config.checkpoint_every == 0:
            save_checkpoint(config.checkpoint, stage, config, epoch, end, epoch_rng_state, history)
        batch = end
    bar.close()


def divergence_message(config, loss, epoch, batch, lr) -> str:
    """The one-line error when the loss stops being finite (also used by the MPI trainers)."""
    kept = (f"the last good checkpoint is kept at {config.checkpoint}" if config.checkpoint
            else "no checkpoint was being written (--checkpoint PATH keeps one)")
    return (f"training diverged: loss is {loss} at epoch {epoch + 1}, batch {batch + 1} (lr={lr:g}); "
            f"lower --lr or the initial weight scale (--init uniform or xavier); {kept}")
