"""What keeps a training run's work: the divergence guard, the checkpoints it lets through, and the polite stop.

``Guard`` watches every number the host sees and writes every checkpoint of ``cnn.train``:

- every loss must be finite; every *test* loss must also be sane: at most ``SANE_FACTOR`` times the
  lowest test loss seen so far, the lowest counting from the loss of knowing nothing (ln of the
  number of classes, where an untrained network starts) — or, for a network that has learned
  much, at most that loss of knowing nothing itself (a few test images may well be ten times
  worse than a good network's average; worse than guessing, nothing is left of what it learned).
  ``--lr 2`` once kept a "last good" checkpoint whose test loss was 8.5·10²⁶: finite, and exploded;
- a checkpoint is written only for parameters that are finite and give a sane test loss;
- its lock must still be this run's (``CheckpointLock.holds``): a checkpoint folder removed or
  replaced during the run stops it in one line rather than writing into a folder nobody locked;
- a polite stop (``cnn.interrupt``: SIGINT, SIGTERM) is looked at after every request of steps: the
  checkpoint of exactly that point is written and ``TrainingStopped`` says, in one line, where and
  how to resume; its ``exit_code`` is the shell's for that signal (130, 143).

Each way a run ends early is an exception holding the run's history, which the command line saves.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cnn.checkpoint import save_checkpoint

#: a test loss more than this many times the lowest seen (or than the loss of knowing nothing) has exploded
SANE_FACTOR = 10.0


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became NaN, infinite or exploded; the message says when and what to change.

    ``history`` holds the run's history up to that point (None when the raiser had none to give)."""

    def __init__(self, message: str, history: dict | None = None):
        super().__init__(message)
        self.history = history


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint could not be written (disk full, file system gone read-only, its folder gone): training
    stopped, the previous checkpoint is as it was and no temporary is left; ``history`` holds the run so far."""

    def __init__(self, message: str, history: dict):
        super().__init__(message)
        self.history = history


class TrainingStopped(RuntimeError):
    """A polite stop (SIGINT, SIGTERM): the checkpoint of the stopping point is written, if the run writes
    checkpoints; the message says where and how to resume; ``exit_code`` is 130 or 143."""

    def __init__(self, message: str, history: dict, exit_code: int):
        super().__init__(message)
        self.history, self.exit_code = history, exit_code


def resume_point(epoch: int, batch: int) -> str:
    """"epoch E, batch B" (1-based) of the next step to train, from a 0-based position."""
    return f"epoch {epoch + 1}, batch {batch + 1}"


def divergence_message(config, loss, epoch, batch, lr, kept: str | None = None, measured: str = "loss",
                       why: str = "") -> str:
    """The one-line error when a number stops being finite or sane (also used by the MPI trainers).

    ``measured`` is what went wrong: "loss" (the training loss at step ``batch`` of ``epoch``,
    0-based), or what was measured after that step ("the test loss", "a parameter"); ``why`` follows
    the value when being finite was not enough. ``kept`` says which checkpoint is kept; by default
    the file at ``config.checkpoint`` if there is one.
    """
    if kept is None:
        kept = ("no checkpoint was being written (--checkpoint PATH keeps one)" if not config.checkpoint
                else f"the last good checkpoint is kept at {config.checkpoint}" if Path(config.checkpoint).exists()
                else "no checkpoint was written before it")
    when = "at" if measured == "loss" else "after"
    return (f"training diverged: {measured} is {loss}{why} {when} epoch {epoch + 1}, batch {batch + 1} (lr={lr:g}); "
            f"lower --lr or the initial weight scale (--init uniform or xavier); {kept}")


class Guard:
    """The run's guard (see the module's docstring).

    ``last`` is where the last good checkpoint resumes, (epoch, batch) 0-based: the one this run
    wrote last, or the one it resumed from; None while there is none. ``lock`` is the run's
    ``CheckpointLock`` (None without a checkpoint); ``stop`` its ``cnn.interrupt.StopRequest``.
    """

    def __init__(self, config, history: dict, test_count: int, num_classes: int, last: tuple[int, int] | None = None,
                 lock=None, stop=None):
        self.config, self.history, self.last, self.lock, self.stop = config, history, last, lock, stop
        self.probe_count = min(config.batch_size, test_count)    # test images tried before a mid-epoch checkpoint
        self.chance_loss = math.log(num_classes)                  # the loss of knowing nothing
        seen = [entry["test_loss"] for entry in history["epochs"]] + [entry[2] for entry in history["evals"]]
        self.best = min([loss for loss in seen if math.isfinite(loss)] + [self.chance_loss])

    def check(self, value: float, measured: str, epoch: int, batch: int, lr: float) -> None:
        """Stop training unless ``value`` (``measured`` at step ``batch`` of ``epoch``, 0-based) is finite."""
        if not math.isfinite(value):
            raise TrainingDiverged(divergence_message(self.config, value, epoch, batch, lr, self.kept(), measured),
                                   self.history)

    def check_test_loss(self, loss: float, epoch: int, batch: int, lr: float) -> None:
        """Stop training unless the test loss is finite and at most ``sane_limit()``; it then counts as seen."""
        self.check(loss, "the test loss", epoch, batch, lr)
        limit = self.sane_limit()
        if loss > limit:
            why = (f" (more than {limit:.3g}, {SANE_FACTOR:g} × the lowest test loss so far)" if limit > self.chance_loss
                   else f" (worse than knowing nothing, {limit:.3g}, after a lowest test loss of {self.best:.3g})")
            raise TrainingDiverged(divergence_message(self.config, f"{loss:.3g}", epoch, batch, lr, self.kept(),
                                                      "the test loss", why), self.history)
        self.best = min(self.best, loss)

    def sane_limit(self) -> float:
        """The largest test loss that has not exploded: SANE_FACTOR × the lowest seen (which starts at the
        loss of knowing nothing), but never less than the loss of knowing nothing."""
        return max(SANE_FACTOR * self.best, self.chance_loss)

    def checkpoint(self, stage, resume_at: tuple[int, int], rng_state: dict, epoch: int, batch: int, lr: float,
                   test_loss: float | None = None) -> None:
        """After step ``batch`` of ``epoch``, write the checkpoint that resumes at ``resume_at`` — if the
        parameters are sound: finite, and giving a sane test loss (``test_loss`` when the caller has
        just measured and checked it, else measured here on ``probe_count`` test images)."""
        params = stage.get_params()                 # a host copy: what is checked is what is written
        not_finite = params[~np.isfinite(params)]
        if not_finite.size:
            self.check(float(not_finite[0]), "a parameter", epoch, batch, lr)
        if test_loss is None:
            self.check_test_loss(stage.test_scores(self.probe_count)[1] / self.probe_count, epoch, batch, lr)
        where = f"the checkpoint {self.config.checkpoint} after epoch {epoch + 1}, batch {batch + 1}"
        if self.lock is not None and not self.lock.holds():
            raise CheckpointWriteFailed(
                f"cannot write {where}: {self.lock.path} is no longer the lock this run took (its folder was removed "
                f"or replaced during the run), so another run may be writing there; {self.previous()}", self.history)
        try:
            save_checkpoint(self.config.checkpoint, params, stage.get_momentum(), self.config, *resume_at,
                            rng_state, self.history)
        except OSError as err:
            raise CheckpointWriteFailed(f"cannot write {where} ({err.strerror or err}); {self.previous()}; "
                                        "no temporary file is left", self.history) from None
        self.last = resume_at

    def stop_if_asked(self, stage, resume_at: tuple[int, int], rng_state: dict, epoch: int, batch: int,
                      lr: float) -> None:
        """If a polite stop was asked for: write the checkpoint that resumes at ``resume_at`` (unless it
        was just written), then raise TrainingStopped saying where and how to resume."""
        if self.stop is None or not self.stop.requested:
            return
        if self.config.checkpoint and self.last != resume_at:
            self.checkpoint(stage, resume_at, rng_state, epoch, batch, lr)
        stopped = f"stopped by {self.stop.signal_name} after epoch {epoch + 1}, batch {batch + 1}"
        if not self.config.checkpoint:
            how = "no checkpoint was being written (--checkpoint PATH keeps one), so it cannot be resumed"
        else:
            how = (f"the checkpoint {self.config.checkpoint} resumes at {resume_point(*resume_at)}: "
                   "run the same command with --resume to go on")
        raise TrainingStopped(f"{stopped}; {how}", self.history, self.stop.exit_code)

    def previous(self) -> str:
        if self.last is None:
            return "this run had written no checkpoint yet"
        if not Path(self.config.checkpoint).exists():
            return "its previous checkpoint is gone too"
        return f"the previous checkpoint is intact (it resumes at {resume_point(*self.last)})"

    def kept(self) -> str:
        if not self.config.checkpoint:
            return "no checkpoint was being written (--checkpoint PATH keeps one)"
        if self.last is None:
            return "this run wrote no checkpoint before it, so none is kept"
        return f"the last good checkpoint is kept at {self.config.checkpoint} (it resumes at {resume_point(*self.last)})"
