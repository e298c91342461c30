"""``--resume`` in every strategy: rank 0 reads the checkpoint (``cnn.parallel.checkpoint``), checks
that it can continue this run, and tells every rank where to start; then the strategy hands each
rank its part of the saved state.

    resumed = resume.load(run)                                   # every rank; None: a fresh start
    if resumed:
        resume.broadcast(run, resumed, "params", opt.params)     # the model, to every rank
        resume.scatter(run, resumed, "momentum", velocity, ranks)   # row w of a per-worker array, to ranks[w]
        start = resumed.step

``weights_and_momentum(run, params, momentum)`` is those lines for the strategies whose whole state
is the weights and the momentum (the synchronous ones, GPU ranks, model parallelism).

The position is saved in images, so a synchronous run resumes on another number of ranks at the
same image, with the learning rate of its own layout (a line says both). The strategies that save
each worker's own state resume on the same layout only, and refuse another in one line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cnn.parallel import checkpoint

SAME_STATE = {"ps-sync", "allreduce", "sandblaster", "model-parallel", "cnn.train"}
"""Strategies whose checkpoints hold the same thing (weights, momentum, a position): each resumes the others'."""
PER_WORKER_STATE = ("downpour", "hogwild", "easgd")
"""Strategies that save each worker's own state: they resume on the same number of workers only."""
TAG_RESUME = 9003


def _peak_lr(config: dict) -> float:
    return config["lr"] * (config["lr_scale"] if config["schedule"] == "warmup" else 1)


@dataclass
class Resumed:
    """Where a resumed run starts: its first ``step``, the strategy's saved ``state`` (every rank)
    and, on rank 0, the whole checkpoint (``saved``)."""

    step: int
    state: dict
    saved: checkpoint.Saved | None


def load(run) -> Resumed | None:
    """``--resume``: rank 0 reads the checkpoint and checks that it fits this run; every rank
    learns the step to start from and the strategy's saved numbers (None: a fresh start)."""
    if not run.config.resume:
        return None
    saved, plan = None, None
    if run.world.rank == 0 and Path(run.checkpoint).exists():
        try:
            saved = checkpoint.load(run.checkpoint)
            plan = _plan(run, saved)
        except ValueError as err:
            plan = {"error": str(err)}
    plan = run.world.broadcast_object(plan, "resume plan")
    if plan is None:
        run.world.log(f"--resume: no checkpoint at {run.checkpoint} yet, starting afresh")
        return None
    if "error" in plan:
        raise ValueError(plan["error"])
    run.world.log(plan["line"])
    if saved is not None:
        run.history = saved.history
    run.completed_steps = plan["step"]
    return Resumed(plan["step"], plan["state"], saved)

def _plan(run, saved: checkpoint.Saved) -> dict:
    """Where this run starts from ``saved``, and the line that says so; a ValueError line where
    the checkpoint cannot continue this run."""
    strategy, path = run.options.strategy, run.checkpoint
    if saved.params.shape != (run.net.num_params,):
        raise ValueError(f"{path}: the checkpoint does not hold {run.config.model}'s parameters")
    if saved.strategy != strategy and not {saved.strategy, strategy} <= SAME_STATE:
        raise ValueError(f"{path}: a {saved.strategy} checkpoint cannot continue {strategy}; "
                         f"resume it with --strategy {saved.strategy}")
    if strategy in PER_WORKER_STATE and saved.workers != run.workers:
        raise ValueError(f"{path}: holds the state of {saved.workers} {strategy} worker(s), this run has "
                         f"{run.workers}; resume on {saved.ranks} ranks (-n {saved.ranks}) or start afresh")
    step, repeated = checkpoint.position_step(saved.position, run.steps_per_epoch, run.global_batch)
    where = f"epoch {saved.position.epoch + 1}, image {saved.position.images}"
    line = f"resuming from {path} at step {step} ({where})"
    if saved.position.global_batch != run.global_batch:
        line = (f"resuming {path}, saved by {saved.workers} worker(s) with a global batch of "
                f"{saved.position.global_batch}, on {run.workers} worker(s) with a global batch of "
                f"{run.global_batch}: {where} is step {step} here"
                + (f" ({repeated} images of that batch are seen again)" if repeated else "")
                + f"; the learning rate follows this run's layout: peak {_peak_lr(asdict(run.config)):g} "
                  f"(was {_peak_lr(saved.config):g})")
    if saved.lacks:
        line += f"; the checkpoint lacks {saved.lacks}"
    return {"step": step, "state": saved.state, "line": line}

def broadcast(run, resumed: Resumed, name: str, out: np.ndarray) -> np.ndarray:
    """Rank 0's saved ``params`` or ``momentum`` copied into ``out`` on every rank."""
    if run.world.rank == 0:
        out[...] = getattr(resumed.saved, name)
    return run.world.broadcast(out, f"resumed {name}")

def weights_and_momentum(run, params: np.ndarray, momentum: np.ndarray) -> int:
    """The step to start at: 0 on a fresh start; else that of the checkpoint, whose weights and momentum
    are copied into ``params`` and ``momentum`` on every rank (the strategies whose state is just those)."""
    resumed = load(run)
    if not resumed:
        return 0
    broadcast(run, resumed, "params", params)
    broadcast(run, resumed, "momentum", momentum)
    return resumed.step


def scatter(run, resumed: Resumed, name: str, out: np.ndarray | None, ranks: list[int]) -> None:
    """Row w of the saved per-worker array ``name`` into ``out`` on rank ``ranks[w]``."""
    comm = run.world.comm
    if run.world.rank == 0:
        rows = resumed.saved.rows[name]
        run.world.wait([comm.Isend(np.ascontiguousarray(rows[w]), dest=rank, tag=TAG_RESUME)
                         for w, rank in enumerate(ranks) if rank != 0], f"receipt of the saved {name}", ranks)
        if 0 in ranks:
            out[...] = rows[ranks.index(0)]
    elif run.world.rank in ranks:
        run.world.wait([comm.Irecv(out, source=0, tag=TAG_RESUME)], f"saved {name}", [0])
