"""What every strategy shares: its options, the data shards, evaluation,
checkpoints after a failure, and the JSON summary rank 0 writes at the end.

Data sharding. Every rank loads the whole dataset and draws the same permutation per epoch from the
same seed — exactly the permutations ``cnn.train`` draws. Global step ``s`` of an epoch takes the
images ``order[s·G : (s+1)·G]`` (G = workers × batch size) and worker ``w`` takes the slice
``[w·b : (w+1)·b]`` of those. So the union of the workers' shards is the batch that one process
with batch size G would see, which is what makes ``ps-sync`` and ``allreduce`` testable against
``cnn.train``; and every worker gets the same number of steps per epoch (the images left over at the
end of an epoch are skipped), because a rank with no batch left would leave the others waiting in
a collective.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from cnn.model import get_network
from cnn.stages import get_stage
from cnn.train import TrainConfig, TrainingDiverged, divergence_message, evaluate, load_dataset, lr_at
from cnn.parallel import checkpoint, hosts
from cnn.parallel.checkpoint import Position, jsonable
from cnn.parallel.timing import PhaseTimer, format_breakdown, format_step, write_timeline
from cnn.parallel.world import PeerLost, World


@dataclass
class ParallelOptions:
    """The flags of ``python -m cnn.parallel`` beyond the training ones (see ``cnn.parallel.cli``)."""

    strategy: str = "allreduce"
    summary: str | None = None          # JSON summary (default results/parallel-STRATEGY-RANKS.json)
    timeline: str | None = None         # Chrome-trace JSON of every rank's phases
    log_every: int = 0                  # a log line every N steps (0: about ten per run)
    peer_timeout: float = 60.0          # seconds of silence before a peer counts as lost
    allreduce: str = "mpi"              # allreduce: "mpi" (MPI_Iallreduce) or "ring" (hand-written)
    overlap: bool = False               # allreduce: each layer's gradient allreduced as its backward ends
    n_push: int = 1                     # downpour: push accumulated gradients every n_push steps
    n_fetch: int = 1                    # downpour: fetch the server's weights every n_fetch steps
    server_rule: str | None = None      # downpour: "adagrad" (default) or "sgd" (with momentum)
    easgd_mode: str = "sync"            # easgd: "sync", "round-robin" or "async" (whoever arrives)
    rho: float | None = None            # easgd: elastic strength ρ (default: η·ρ = 0.9 / workers)
    tau: int = 1                        # easgd: steps between elastic exchanges
    portions: int | None = None         # sandblaster: portions per batch (default 2 × workers)
    max_copies: int = 2                 # sandblaster: copies of one portion in flight at most
    backup_after: float = 0.0           # sandblaster: a portion is late after this × the median portion time
    optimizer: str = "lbfgs"            # sandblaster: "lbfgs" (with a line search) or "sgd" (with momentum)
    history: int = 10                   # sandblaster: L-BFGS's memory m (curvature pairs kept)
    split: str | None = None            # model-parallel: the cut, "K" or "K:C" (default: balanced by cost)
    micro_batches: int = 1              # model-parallel: micro-batches per batch (pipelining)
    reduced: bool = False               # the network's narrow copy on the images' centre (the CUDA simulator)


class Interrupted(Exception):
    """Every rank agreed to stop after ``steps_done`` steps: a rank was sent SIGINT or SIGTERM."""

    def __init__(self, signal_name: str, exit_code: int, steps_done: int):
        super().__init__(f"stopped by {signal_name} after step {steps_done}")
        self.signal_name, self.exit_code, self.steps_done = signal_name, exit_code, steps_done


class Packet:
    """One message: a header of 8 float64 numbers and a payload vector, in one buffer.

    One buffer means one ``Isend`` and one ``Irecv`` per message, and a header-only message is
    just the first 64 bytes of it (a receive may be longer than the message it gets).
    """

    HEADER_BYTES = 64

    def __init__(self, size: int, dtype):
        dtype = np.dtype(dtype)
        self.buffer = np.zeros(self.HEADER_BYTES + size * dtype.itemsize, np.uint8)
        self.header = self.buffer[:self.HEADER_BYTES].view(np.float64)
        self.payload = self.buffer[self.HEADER_BYTES:].view(dtype)

    def header_only(self) -> np.ndarray:
        return self.buffer[:self.HEADER_BYTES]


class Run:
    """One rank's run: configuration, world, network, data, timer, history, and the final report.

    ``workers`` is the number of ranks that compute gradients; ``roles`` names each rank's part
    (for the log and the timeline).
    """

    def __init__(self, config: TrainConfig, options: ParallelOptions, world: World, workers: int,
                 roles: dict[int, str], command: str = ""):
        self.config, self.options, self.world = config, options, world
        self.workers, self.roles, self.command = workers, roles, command
        self.net = get_network(config.model, reduced_copy=options.reduced)
        self.dtype = np.dtype(config.dtype)
        hosts.check_job(world, config)        # every host: the same interpreter, package, dataset
        self.train_x, self.train_y, self.test_x, self.test_y = load_dataset(
            replace(config, progress=config.progress and world.rank == 0))     # rank 0 alone prints the data line
        if options.reduced:          # the narrow copy's smaller input: the centre of each image
            size = self.net.input_shape[1:]
            self.train_x, self.test_x = centre_crop(self.train_x, size), centre_crop(self.test_x, size)
        if tuple(self.train_x.shape[1:]) != self.net.input_shape:
            raise ValueError(f"model {config.model} expects images {self.net.input_shape}, "
                             f"data has {self.train_x.shape[1:]}")
        self.global_batch = workers * config.batch_size
        self.steps_per_epoch = len(self.train_x) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"the global batch of {self.global_batch} ({workers} workers × {config.batch_size}) "
                             f"is larger than the {len(self.train_x)} training images")
        self.total_steps = self.steps_per_epoch * config.epochs
        self.checkpoint = config.checkpoint or f"results/parallel-{options.strategy}.npz"
        variant = "-overlap" if options.overlap else ""      # its own file: not the plain run's
        self.summary_path = options.summary or f"results/parallel-{options.strategy}{variant}-{world.size}.json"
        self._orders, self._epoch_states = [], []
        self._rng = np.random.default_rng(config.seed)
        # Step 0 of Horovod's recipe: agree on t = 0 (the timeline's origin), which also checks every rank is up.
        origin = world.broadcast(np.array([time.time()]), "start-up broadcast", patience=10)[0]
        self.timer = PhaseTimer(world.rank, timeline=bool(options.timeline), origin=origin)
        self.history = {"config": asdict(config), "num_params": self.net.num_params, "steps": [], "evals": [],
                        "epochs": [], "train_seconds": 0.0}
        self.state = None            # what a rescue checkpoint saves: an object with get_params/get_momentum
        self.state_lacks = ""        # what that state lacks to continue exactly (e.g. the server's momentum)
        self.rescue_note = ""        # why this rank cannot write a rescue checkpoint (when state is None)
        self.completed_steps = 0     # global steps whose update this rank has seen complete
        self.started = time.perf_counter()
        self.train_seconds = None    # wall time of the training loop, set by training_done()

    # -- building blocks ----------------------------------------------------------------------
    def training_done(self) -> None:
        """Stamp the wall time of training (start-up and final evaluation excluded from img/s)."""
        self.train_seconds = time.perf_counter() - self.started

    def announce(self, detail: str = "", rate: bool = True) -> None:
        """Rank 0's first line: the layout, the batch and (``rate``: where the strategy follows one) the
        learning rate's schedule."""
        config = self.config
        schedule = (f"lr {config.lr:g} → {config.lr * config.lr_scale:g} (linear scaling ×{config.lr_scale:g}, "
                    f"warmup over {config.warmup_epochs:g} epoch(s))" if config.schedule == "warmup"
                    else f"lr {config.lr:g} ({config.schedule})")
        schedule = schedule if rate else "no learning-rate schedule"
        self.world.log(f"{self.options.strategy}: {self.world.size} ranks, {self.workers} worker(s) × batch "
                       f"{config.batch_size} = global batch {self.global_batch}, {self.steps_per_epoch} steps/epoch "
                       f"× {config.epochs} epoch(s); {schedule}; stage {config.stage}" + (f"; {detail}" if detail else ""))

    @property
    def rank(self) -> int:
        return self.world.rank

    def make_stage(self, net=None):
        """A fresh stage of the configured kind for ``net`` (default: the whole network)."""
        stage_class = get_stage(self.config.stage)
        if stage_class.device == "cuda":
            self._pin_gpu()
        return stage_class(net or self.net, self.dtype).init(self.config.init, self.config.seed)

    def _pin_gpu(self) -> None:
        """Horovod's "one GPU per process": the rank's index on its node picks the device."""
        from mpi4py import MPI

        from kernels.device import cuda, simulated

        local_rank = self.world.comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        if not simulated():
            cuda.select_device(local_rank % len(cuda.gpus))

    def initial_params(self, stage) -> np.ndarray:
        """Horovod's broadcast_parameters: every rank starts from rank 0's initial weights."""
        return self.world.broadcast(stage.get_params(), "initial weights")

    def lr(self, step: int, steps_per_epoch: int | None = None) -> float:
        return lr_at(self.config, step, steps_per_epoch or self.steps_per_epoch)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of the training set: the ones cnn.train draws, in the same sequence."""
        while len(self._orders) <= epoch:
            self._epoch_states.append(self._rng.bit_generator.state)
            self._orders.append(self._rng.permutation(len(self.train_x)))
        return self._orders[epoch]

    def shard(self, step: int, worker: int):
        """Images and labels of ``worker``'s part of global step ``step``."""
        start = worker * self.config.batch_size
        return self.global_range(step, start, start + self.config.batch_size)

    def global_range(self, step: int, start: int, stop: int):
        """Images and labels ``[start, stop)`` of global step ``step``'s batch (Sandblaster's portions)."""
        epoch, batch = divmod(step, self.steps_per_epoch)
        indices = self.order(epoch)[batch * self.global_batch + start:batch * self.global_batch + stop]
        return self.train_x[indices], self.train_y[indices]

    # -- logging ------------------------------------------------------------------------------
    def should_log(self, step: int, total: int | None = None) -> bool:
        total = total or self.total_steps
        every = self.options.log_every or max(1, total // 10)
        return self.config.progress and (step % every == 0 or step == total - 1)

    def end_step(self, step: int, loss: float | None, lr: float | None, total: int | None = None,
                 workers: int | None = None) -> dict[str, float]:
        """Close the timer's step, record loss and lr, log a line now and then; stop if the loss diverged."""
        record = self.timer.end_step()
        self.history["train_seconds"] += record["step"]
        if loss is not None:
            self.history["steps"].append([step + 1, loss, lr, self.history["train_seconds"]])
            if not math.isfinite(loss):
                epoch, batch = divmod(step, self.steps_per_epoch)
                raise TrainingDiverged(divergence_message(self.config, loss, epoch, batch, lr))
        if self.rank == 0 and self.should_log(step, total):
            self.world.log(format_step(step, total or self.total_steps, record, lr, loss, workers))
        return record

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate_sharded(self, stage, ranks: list[int] | None = None, subset: int | None = None) -> tuple[float, float]:
        """(accuracy, loss) of the stage's weights, each rank scoring its share of the test set,
        the counts summed across ranks (Horovod's metric averaging)."""
        size, index = self.world.size, self.world.rank
        test_x, test_y = self.test_x[:subset], self.test_y[:subset]
        mine = slice(index, None, size)
        totals = np.zeros(3)
        if len(test_y[mine]):
            accuracy, loss = evaluate(stage, test_x[mine], test_y[mine])
            totals[:] = accuracy * len(test_y[mine]), loss * len(test_y[mine]), len(test_y[mine])
        correct, loss_sum, count = self.world.allreduce_sum(totals, "test metrics")
        return correct / count, loss_sum / count

    def record_final(self, accuracy: float, loss: float, step: int) -> None:
        """The asynchronous strategies score their model once, at the end: recorded as the last epoch."""
        self.history["epochs"].append({"epoch": self.config.epochs, "test_accuracy": accuracy, "test_loss": loss,
                                       "train_seconds": self.history["train_seconds"], "step": step})

    def evaluate_final(self, stage, params: np.ndarray, who: str, step: int) -> None:
        """Rank 0 alone scores ``params`` on the whole test set, records it and logs it."""
        stage.set_params(params)
        accuracy, loss = evaluate(stage, self.test_x, self.test_y)
        self.record_final(accuracy, loss, step)
        self.world.log(f"{who}: test accuracy {accuracy:.2%}, test loss {loss:.4f}")

    def record_epoch(self, epoch: int, accuracy: float, loss: float) -> None:
        self.history["epochs"].append({"epoch": epoch + 1, "test_accuracy": accuracy, "test_loss": loss,
                                       "train_seconds": self.history["train_seconds"],
                                       "step": (epoch + 1) * self.steps_per_epoch})
        self.world.log(f"epoch {epoch + 1}/{self.config.epochs}: test accuracy {accuracy:.2%}, "
                       f"test loss {loss:.4f}, {self.history['train_seconds']:.1f} s of training so far")

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, steps_done: int, model=None, state: dict | None = None, rows: dict | None = None,
             lacks: str = "") -> str:
        """Checkpoint ``model`` (default ``self.state``: anything with get_params and get_momentum)
        after ``steps_done`` global steps, with the strategy's ``state`` and per-worker ``rows``."""
        model = model or self.state
        epoch, batch = divmod(steps_done, self.steps_per_epoch)
        self.order(epoch)   # the rng state at the start of that epoch
        layout = {"strategy": self.options.strategy, "ranks": self.world.size, "workers": self.workers}
        checkpoint.save(self.checkpoint, model.get_params(), model.get_momentum(), self.config,
                        Position(epoch, batch * self.global_batch, self.global_batch), self._epoch_states[epoch],
                        self.history, layout, state, rows, lacks)
        return self.checkpoint

    def checkpoint_due(self, steps_done: int, steps_per_epoch: int | None = None) -> bool:
        """After ``steps_done`` steps: every --checkpoint-every steps, else at the end of each epoch."""
        every = self.config.checkpoint_every or steps_per_epoch or self.steps_per_epoch
        return steps_done > 0 and steps_done % every == 0

    # -- the end ------------------------------------------------------------------------------
    def stop_after_loss(self, lost: PeerLost) -> int:
        """A peer was lost and this strategy cannot go on without it: roll call, the lowest survivor
        checkpoints what it holds (or names the checkpoint to resume from), stop with a message."""
        self.world.warn(str(lost))
        survivors = self.world.survivors(lost.ranks)
        writer = survivors[0]
        missing = ", ".join(map(str, sorted(self.world.lost))) or "none found"
        message = (f"{self.options.strategy} stopped at step {self.completed_steps + 1}: rank(s) {missing} lost "
                   f"(no answer within {self.world.timeout:g} s)")
        if self.rank == writer:
            message += "; " + self._rescue()
            self.world.warn(f"cnn.parallel: {message}")
        self.report(status="stopped", message=message, reporter=writer, patience=1.0)
        return 1

    def interrupted(self, stop) -> None:
        """The ranks agreed to stop after this step (``synchronous.train_synchronous``): learn which
        signal asked — SIGTERM, a scheduler's notice, wins over SIGINT when ranks got both — and
        raise ``Interrupted``."""
        mine = np.array([stop.exit_code == 130, stop.exit_code == 143], np.float64)
        _, terms = self.world.allreduce_sum(mine, "which signal stopped the run")
        name, code = ("SIGTERM", 143) if terms else ("SIGINT", 130)
        raise Interrupted(name, code, self.completed_steps)

    def stop_on_signal(self, stop: Interrupted) -> int:
        """Rank 0 writes a checkpoint of exactly the step every rank stopped after and says in one
        line where it is and how to resume; the summary is written; the signal's exit code."""
        self.training_done()
        message = f"{stop}"
        if self.rank == 0:
            path = self.save(stop.steps_done)
            again = self.command if " --resume" in self.command else self.command + " --resume"
            epoch, batch = divmod(stop.steps_done, self.steps_per_epoch)
            message = (f"stopped by {stop.signal_name} after step {stop.steps_done} of {self.total_steps} "
                       f"(epoch {epoch + 1}, batch {batch}): checkpoint of exactly that point in {path}; "
                       f"continue with: {again}")
            self.world.warn(f"cnn.parallel: {message}")
        self.report(status=f"stopped by {stop.signal_name}", message=message, patience=1.0)
        return stop.exit_code

    def _rescue(self) -> str:
        """Write what this rank holds of the last completed step, if it is enough to continue; say so."""
        if self.state is None:
            return (f"nothing written here ({self.rescue_note or 'the lost rank held the model'}); "
                    f"--resume continues from the last checkpoint: {checkpoint.describe(self.checkpoint)}")
        self.save(self.completed_steps, lacks=self.state_lacks)
        written = f"checkpoint of the last completed step ({self.completed_steps}) written to {self.checkpoint}"
        if self.state_lacks:
            return f"{written}, without {self.state_lacks} — --resume continues from it with that lost"
        return f"{written} — continue with --resume"

    def report(self, status: str = "completed", message: str = "", extra: dict | None = None,
               rank_extra: dict | None = None, reporter: int = 0, final_accuracy: float | None = None,
               final_loss: float | None = None, patience: float = 10.0) -> dict | None:
        """Gather every rank's timings to ``reporter`` (waiting ``patience`` timeouts at most), which
        prints the breakdown and writes the summary."""
        mine = {"role": self.roles.get(self.rank, "worker"), "breakdown": self.timer.mean(),
                "steps": len(self.timer.steps), "events": self.timer.events, **(rank_extra or {})}
        ranks = self.world.gather_objects(mine, root=reporter, patience=patience)
        if ranks is None:
            return None
        summary = self._summary(ranks, status, message, extra or {}, final_accuracy, final_loss)
        if summary["status"].startswith("completed") and self.at_chance(summary["final_test_accuracy"]):
            accuracy, chance = summary["final_test_accuracy"], self.chance_accuracy()
            summary["message"] = (f"test accuracy {accuracy:.2%} is chance level (always guessing the commonest "
                                  f"class scores {chance:.2%}): the run did not learn; lower --lr or --momentum")
            summary["status"] = "did not learn"
            self.world.warn(f"cnn.parallel: warning: {summary['message']}")
        self._print_summary(summary)
        write_json(self.summary_path, summary)
        if self.options.timeline:
            write_timeline(self.options.timeline, {r: v["events"] for r, v in ranks.items()},
                           {r: v["role"] for r, v in ranks.items()})
        return summary

    def chance_accuracy(self) -> float:
        """What always guessing the commonest class of the test set scores."""
        return float(np.bincount(self.test_y).max() / len(self.test_y))

    def at_chance(self, accuracy: float | None) -> bool:
        """Whether ``accuracy`` is within a tenth of the way from chance to perfect: nothing learned."""
        chance = self.chance_accuracy()
        return accuracy is not None and accuracy < chance + 0.1 * (1 - chance)

    def _summary(self, ranks, status, message, extra, final_accuracy, final_loss) -> dict:
        from cnn.machine import machine_info

        computing = [r for r, v in sorted(ranks.items()) if v["role"] not in ("server", "coordinator", "master")]
        view = [0] if 0 in computing else computing
        breakdown = _mean_of([ranks[r]["breakdown"] for r in view if ranks[r]["breakdown"]])
        images = sum(v.get("images", v["steps"] * self.config.batch_size) for r, v in ranks.items() if r in computing)
        seconds = self.train_seconds or (time.perf_counter() - self.started)
        if final_accuracy is None and self.history["epochs"]:
            final_accuracy, final_loss = (self.history["epochs"][-1]["test_accuracy"],
                                          self.history["epochs"][-1]["test_loss"])
        self.history["final_test_accuracy"] = final_accuracy
        return {
            "strategy": self.options.strategy, "ranks": self.world.size, "workers": self.workers,
            "status": status, "message": message, "lost_ranks": sorted(self.world.lost),
            "final_test_accuracy": final_accuracy, "final_test_loss": final_loss,
            "steps": self.total_steps, "global_batch": self.global_batch,
            "time_per_step_s": breakdown.get("step"),
            "breakdown_s": breakdown,
            "breakdown_view": "rank 0" if view == [0] else "mean of the worker ranks",
            "images_per_second": images / seconds,
            "train_wall_seconds": seconds,
            "breakdown_per_rank": {str(r): v["breakdown"] for r, v in sorted(ranks.items())},
            "roles": {str(r): v["role"] for r, v in sorted(ranks.items())},
            "steps_per_rank": {str(r): v["steps"] for r, v in sorted(ranks.items())},
            **extra,
            "per_rank": {str(r): {k: val for k, val in v.items() if k not in ("events", "breakdown", "role", "steps")}
                         for r, v in sorted(ranks.items())},
            "options": asdict(self.options), "config": asdict(self.config),
            "history": self.history, "machine": machine_info(), "command": self.command,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }

    def _print_summary(self, summary: dict) -> None:
        lines = [format_breakdown(summary["breakdown_s"], f"{summary['strategy']} on {summary['ranks']} ranks: "
                                  f"mean step ({summary['breakdown_view']})")]
        if summary["final_test_accuracy"] is not None:
            lines.append(f"final test accuracy {summary['final_test_accuracy']:.2%}")
        if summary["lost_ranks"]:
            lines.append(f"lost rank(s): {', '.join(map(str, summary['lost_ranks']))}")
        lines.append(f"{summary['status']}{': ' + summary['message'] if summary['message'] else ''}; "
                     f"summary in {self.summary_path}")
        print("\n".join(lines), flush=True)


def centre_crop(images: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The central ``size`` pixels of each (N, C, H, W) image (``--reduced``: the simulator's narrow networks)."""
    top, left = (images.shape[2] - size[0]) // 2, (images.shape[3] - size[1]) // 2
    return np.ascontiguousarray(images[:, :, top:top + size[0], left:left + size[1]])


def _mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    names = {name for d in dicts for name in d}
    return {name: sum(d.get(name, 0.0) for d in dicts) / len(dicts) for name in sorted(names)} if dicts else {}


def write_json(path: str | Path, value) -> None:
    """Write atomically (a temporary name, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=jsonable))
    os.replace(tmp, path)


def staleness_stats(values: list[int]) -> dict:
    """Mean, max and histogram of staleness values (updates applied in between)."""
    if not values:
        return {"count": 0, "mean": None, "max": None, "histogram": {}}
    counts = np.bincount(np.asarray(values, dtype=np.int64))
    return {"count": len(values), "mean": float(np.mean(values)), "max": int(max(values)),
            "histogram": {str(k): int(c) for k, c in enumerate(counts) if c}}
