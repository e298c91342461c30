"""Checkpoints of a distributed run: ``cnn.train``'s file, plus where the run stands in images and
what each strategy needs to continue exactly.

One ``.npz`` file, written atomically (``cnn.atomic``: a temporary of its own, then a rename), holding::

    params, momentum              the model: the weights and momentum of the server, of the center
                                  (EASGD), of the shared window (Hogwild) or of every rank (allreduce)
    epoch, batch, rng_state,      as ``cnn.train`` writes them (``batch`` counted in this run's global
    config, history               batches), so ``cnn.train.load_checkpoint`` reads the file too
    parallel                      JSON: the strategy, its ranks and workers, the global batch, the
                                  position as *images into the epoch*, the strategy's own numbers
                                  (updates applied, each replica's next step, staleness values) and
                                  what the file lacks (``"lacks"``: e.g. a server's momentum lost
                                  with the server)
    rows_<name>                   per-worker arrays, one row per worker (EASGD's W^i and v^i,
                                  Hogwild's momenta)

The position is kept in images, not steps, because a step's size depends on the number of workers:
resuming on another number of ranks starts at the same image (``position_step``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from cnn.atomic import replaced_on_success

ROWS_PREFIX = "rows_"


@dataclass
class Position:
    """Where a run stands: ``epoch`` and ``images`` into it, seen with a global batch of ``global_batch``."""

    epoch: int
    images: int
    global_batch: int


@dataclass
class Saved:
    """A checkpoint as read back: the model, the position, the history and the strategy's state."""

    params: np.ndarray
    momentum: np.ndarray
    position: Position
    history: dict
    strategy: str
    workers: int
    ranks: int
    config: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    lacks: str = ""


def save(path: str | Path, params: np.ndarray, momentum: np.ndarray, config, position: Position,
         rng_state: dict, history: dict, layout: dict, state: dict | None = None,
         rows: dict[str, np.ndarray] | None = None, lacks: str = "") -> None:
    """Write the checkpoint atomically; ``layout`` = {"strategy", "ranks", "workers"}."""
    path = Path(path)
    parallel = {**layout, "global_batch": position.global_batch, "images_into_epoch": position.images,
                "state": state or {}, "lacks": lacks}
    arrays = {ROWS_PREFIX + name: value for name, value in (rows or {}).items()}
    with replaced_on_success(path) as temporary, open(temporary, "wb") as handle:
        np.savez(handle, params=params, momentum=momentum, epoch=position.epoch,
                 batch=position.images // position.global_batch, rng_state=json.dumps(rng_state),
                 config=json.dumps(asdict(config)), history=json.dumps(history),
                 parallel=json.dumps(parallel, default=jsonable), **arrays)


def load(path: str | Path) -> Saved:
    """The checkpoint at ``path``; one written by ``cnn.train`` reads as one worker of batch
    ``config.batch_size``. A missing or damaged file is one ValueError line naming it."""
    from cnn.train import load_checkpoint

    saved = load_checkpoint(path)
    parallel = saved["parallel"]
    try:
        with np.load(path, allow_pickle=False) as archive:
            rows = {name[len(ROWS_PREFIX):]: archive[name] for name in archive.files if name.startswith(ROWS_PREFIX)}
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a valid checkpoint ({err})") from None
    if parallel is None:                       # written by cnn.train: one process
        batch_size = saved["config"]["batch_size"]
        parallel = {"strategy": "cnn.train", "ranks": 1, "workers": 1, "global_batch": batch_size,
                    "images_into_epoch": saved["batch"] * batch_size}
    position = Position(saved["epoch"], parallel["images_into_epoch"], parallel["global_batch"])
    return Saved(saved["params"], saved["momentum"], position, saved["history"], parallel["strategy"],
                 parallel["workers"], parallel["ranks"], saved["config"], parallel.get("state", {}), rows,
                 parallel.get("lacks", ""))


def position_step(position: Position, steps_per_epoch: int, global_batch: int) -> tuple[int, int]:
    """(first step of a run with ``global_batch`` images per step, images it sees again): the step
    whose batch holds image ``position.images`` of the epoch, and how many of that batch's images
    come before it (0 when the position falls on a batch boundary, as it does when one global batch
    divides the other)."""
    batch, repeated = divmod(position.images, global_batch)
    if batch >= steps_per_epoch:               # past this run's last full batch of the epoch
        return (position.epoch + 1) * steps_per_epoch, 0
    return position.epoch * steps_per_epoch + batch, repeated


def describe(path: str | Path) -> str:
    """"step S (epoch E, image I)" of the checkpoint at ``path``, or why there is none."""
    if not Path(path).exists():
        return f"no checkpoint at {path} yet"
    try:
        saved = load(path)
    except ValueError as err:
        return str(err)
    position = saved.position
    return f"{path}, epoch {position.epoch + 1}, image {position.images}"


def jsonable(value):
    """``json.dumps``'s ``default``: numpy scalars and arrays as Python numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
