"""Strategy ``sandblaster``: a coordinator hands out small portions of each batch (Dean et al. 2012; seed 002).

Rank 0 is the coordinator (and holds the weights, as a parameter server); ranks 1…P−1 are workers.
The global batch of workers × b images is cut into ``--portions`` pieces, more pieces than
workers. For each batch::

    while some portion has no result:
        a worker that reports a result is idle: give it the next portion nobody has started,
        or, when none is left, a *duplicate* of a portion still out that is late — out for longer
        than --backup-after × the median time a portion has taken (default 0: any portion still out)
        — at most --max-copies copies at a time; the first result for a portion wins
    θ ← SGD step with  g = (1/B) Σ_portions (sum of the portion's gradients)

A fast worker takes more portions than a slow one, so the batch is not held up by the slowest
machine, and the duplicates finish the last portions of a straggler ("backup tasks", as in
MapReduce: DistBelief copies the portions still out near the end of a batch, and so does the
default here). One update per full batch: the result equals one process with batch B (up to float
rounding), which the tests check. A worker that keeps a portion for longer than
``--peer-timeout`` seconds without answering is declared lost; its portion is finished by others
and the run goes on.

Backing up at once is a bet on the tail: the copy is wasted work whenever the original comes back
first, but a worker that would otherwise idle costs nothing, and the batch ends with the faster
copy. Measured with 4 ranks on this project's 2-core machine (LeNet-5, batch 3 × 32, one epoch of
625 batches, two alternating pairs of runs), where the operating system makes any rank a
straggler now and then (each run: ``mpiexec -n 4 python -m mpi4py -m cnn.parallel --strategy
sandblaster --epochs 1 --batch-size 32 --init xavier --warmup-epochs 0.25 --backup-after X``; its
summary's ``duplicates``, ``time_per_step_s`` and ``images_per_second``)::

    --backup-after   duplicates sent   step time       images/s
    0 (default)      1099, 1103        14.8, 17.2 ms   3232, 2791
    1.5              12, 56            17.5, 21.7 ms   2723, 2208

Almost every duplicate was thrown away, and the run was still about 20 % faster with them. Where
a duplicate takes a machine that other jobs could use, the threshold is the cheaper choice.

A task carries the weights only when the worker's copy is out of date (once per batch).

The coordinator holds the whole state (θ, v, the step), so it alone checkpoints, every
``--checkpoint-every`` steps, else every epoch, and at the end; ``--resume`` continues from it on
any number of workers (the position is kept in images). If the coordinator is lost, the workers
stop and name that checkpoint.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import numpy as np
from mpi4py import MPI

from cnn.parallel import resume
from cnn.parallel.common import Packet, Run, server_optimizer
from cnn.parallel.timing import COMPUTE, DISTRIBUTE, FETCH, UPDATE
from cnn.parallel.world import PeerLost

TAG_TASK, TAG_RESULT = 40, 41
STEP, PORTION, START, STOP, VERSION, FLAGS = range(6)     # task header slots
LOSS_SUM, COUNT = 2, 3                                     # result header slots (after STEP, PORTION)
HAS_WEIGHTS, STOP_WORKING = 1, 2


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    if size < 2:
        raise ValueError("sandblaster needs at least 2 ranks: a coordinator and a worker")
    return size - 1, {0: "coordinator"}


def portion_bounds(batch: int, portions: int) -> np.ndarray:
    """Where each portion of a batch starts, then the batch size."""
    if portions > batch:
        raise ValueError(f"--portions {portions} is more than the {batch} images of a global batch")
    return np.linspace(0, batch, portions + 1).astype(np.int64)


def train(run: Run) -> dict:
    portions = run.options.portions or 2 * run.workers
    run.announce(f"{portions} portions per batch, at most {run.options.max_copies} copies of one in flight")
    stage = run.make_stage()
    params = run.initial_params(stage)
    resumed = resume.load(run)
    if run.rank == 0:
        coordinator = Coordinator(run, params, portion_bounds(run.global_batch, portions))
        if resumed:
            coordinator.opt.params[...], coordinator.opt.velocity[...] = resumed.saved.params, resumed.saved.momentum
        return coordinator.coordinate(stage, resumed.step if resumed else 0)
    run.rescue_note = "the coordinator, rank 0, held the model"
    return work(run, stage)


def choose_backup(out_since: dict[int, float], copies: dict[int, int], late_after: float | None,
                  now: float) -> int | None:
    """The portion an idle worker duplicates: of the unfinished portions ``out_since`` (portion →
    when its oldest copy went out; those with a free copy slot), the least-copied of those out for
    at least ``late_after`` seconds. None when none is late, or none can be called late yet."""
    if late_after is None:
        return None
    late = [portion for portion, since in out_since.items() if now - since >= late_after]
    return min(late, key=lambda portion: copies[portion]) if late else None


class Coordinator:
    """Rank 0: portions to idle workers, duplicates to stragglers, one update per batch."""

    def __init__(self, run: Run, params: np.ndarray, bounds: np.ndarray):
        self.run, self.world, self.comm, self.timer = run, run.world, run.world.comm, run.timer
        self.opt = run.state = server_optimizer(params, run.config)
        self.bounds, self.version = bounds, 0
        self.workers = list(range(1, self.world.size))
        size = run.net.num_params
        self.tasks = {w: Packet(size, run.dtype) for w in self.workers}
        self.results = {w: Packet(size, run.dtype) for w in self.workers}
        self.sends = {w: MPI.REQUEST_NULL for w in self.workers}
        self.receives = [self.comm.Irecv(self.results[w].buffer, source=w, tag=TAG_RESULT) for w in self.workers]
        self.worker_version = {w: -1 for w in self.workers}
        self.assigned: dict[int, tuple[int, int, float]] = {}     # worker -> (step, portion, when)
        self.active = set(self.workers)
        self.duplicates = self.wasted = self.idle_with_portions_out = 0
        self.portions_done_by = defaultdict(int)
        self.portion_seconds = deque(maxlen=64)     # hand-out to result, of the latest portions

    def coordinate(self, stage, start: int = 0) -> dict:
        run = self.run
        for step in range(start, run.total_steps):
            self.world.maybe_die(step)
            lr = run.lr(step)
            grad_sum, loss_sum = self._batch(step)
            with self.timer.phase(UPDATE):
                self.opt.step(grad_sum / run.global_batch, lr)
            self.version += 1
            run.completed_steps = step + 1
            run.end_step(step, loss_sum / run.global_batch, lr, workers=len(self.active))
            if run.checkpoint_due(step + 1) and step + 1 < run.total_steps:
                run.save(step + 1)
        self._stop_workers()
        run.training_done()
        run.evaluate_final(stage, self.opt.params, f"coordinator, {self.duplicates} duplicate portions sent, "
                           f"{self.wasted} results discarded", run.total_steps)
        run.save(run.total_steps)
        return {"extra": {"portions": len(self.bounds) - 1, "duplicates": self.duplicates,
                          "backup_after": self.run.options.backup_after,
                          "idle_with_portions_out": self.idle_with_portions_out,
                          "discarded_results": self.wasted,
                          "portions_done_by": {str(w): n for w, n in sorted(self.portions_done_by.items())}}}

    def _batch(self, step: int):
        """Hand out the portions of ``step``'s batch until each has a result; return the summed gradient and loss."""
        count = len(self.bounds) - 1
        waiting, done, copies = list(range(count)), set(), defaultdict(int)
        grad_sum, loss_sum = np.zeros(self.run.net.num_params, self.run.dtype), 0.0
        for worker in sorted(self.active):
            if worker not in self.assigned:
                self._give(worker, step, waiting, done, copies)
        while len(done) < count:
            with self.timer.phase(FETCH, label="waiting for results"):
                index = self.world.poll_any(self.receives, patience=self._patience(step, done, copies))
            if index is None:
                self._drop_silent(step, waiting, done, copies)
                continue
            worker = self.workers[index]
            result = self.results[worker]
            result_step, portion = int(result.header[STEP]), int(result.header[PORTION])
            self.portion_seconds.append(time.monotonic() - self.assigned.pop(worker)[2])
            if result_step == step:
                copies[portion] -= 1
            if result_step == step and portion not in done:
                with self.timer.phase("summing portions"):
                    grad_sum += result.payload
                    loss_sum += result.header[LOSS_SUM]
                done.add(portion)
                self.portions_done_by[worker] += 1
            else:
                self.wasted += 1
            self.receives[index] = self.comm.Irecv(result.buffer, source=worker, tag=TAG_RESULT)
            if len(done) < count:
                for idle in sorted(self.active - set(self.assigned)):
                    self._give(idle, step, waiting, done, copies)
        return grad_sum, loss_sum

    def _late_after(self) -> float | None:
        """Seconds after which a portion still out is late: --backup-after × the median portion time
        (None while no portion has come back, when nothing can be called late yet)."""
        if self.run.options.backup_after == 0:
            return 0.0
        if not self.portion_seconds:
            return None
        return self.run.options.backup_after * float(np.median(self.portion_seconds))

    def _backup_candidates(self, step: int, done: set, copies: dict) -> dict[int, float]:
        """Unfinished portions of ``step`` that may get one more copy, each with when its oldest copy went out."""
        out_since = {}
        for task_step, portion, when in self.assigned.values():
            if task_step == step and portion not in done and copies[portion] < self.run.options.max_copies:
                out_since[portion] = min(when, out_since.get(portion, when))
        return out_since

    def _patience(self, step: int, done: set, copies: dict) -> float:
        """How long to wait for a result: a second at most, less if an idle worker could back up a
        portion that turns late sooner."""
        patience, late_after = min(1.0, self.world.timeout), self._late_after()
        if late_after is None or not self.active - set(self.assigned):
            return patience
        now = time.monotonic()
        for since in self._backup_candidates(step, done, copies).values():
            patience = min(patience, max(since + late_after - now, 0.0))
        return patience

    def _give(self, worker: int, step: int, waiting: list, done: set, copies: dict) -> None:
        """The next unstarted portion, else a duplicate of the least-copied late one, else nothing."""
        if waiting:
            portion = waiting.pop(0)
        else:
            out_since = self._backup_candidates(step, done, copies)
            if not out_since:
                return
            self.idle_with_portions_out += 1
            portion = choose_backup(out_since, copies, self._late_after(), time.monotonic())
            if portion is None:
                return
            self.duplicates += 1
        copies[portion] += 1
        task = self.tasks[worker]
        with self.timer.phase(DISTRIBUTE, label="send task"):
            self.world.wait([self.sends[worker]], "receipt of the previous task", peers=[worker])
            fresh = self.worker_version[worker] != self.version
            task.header[:6] = step, portion, self.bounds[portion], self.bounds[portion + 1], self.version, \
                HAS_WEIGHTS * fresh
            if fresh:
                task.payload[...] = self.opt.params
                self.worker_version[worker] = self.version
            self.sends[worker] = self.comm.Isend(task.buffer if fresh else task.header_only(), dest=worker, tag=TAG_TASK)
        self.assigned[worker] = (step, portion, time.monotonic())

    def _drop_silent(self, step: int, waiting: list, done: set, copies: dict) -> None:
        """Workers holding a portion for longer than the timeout are lost; their portion goes back in
        the queue. Then idle workers get what there is: such a portion, or a copy of a late one."""
        now = time.monotonic()
        for worker, (task_step, portion, since) in sorted(self.assigned.items()):
            if now - since > self.world.timeout:
                del self.assigned[worker]
                self.active.discard(worker)
                self.world.lost.add(worker)
                index = self.workers.index(worker)
                self.receives[index].Cancel()
                self.receives[index] = MPI.REQUEST_NULL
                if task_step == step:
                    copies[portion] -= 1
                    if portion not in done and copies[portion] == 0:
                        waiting.append(portion)
                self.world.warn(f"sandblaster: rank {worker} kept portion {portion} for {self.world.timeout:g} s "
                                f"without answering — lost; carrying on with rank(s) "
                                f"{', '.join(map(str, sorted(self.active))) or 'none'}")
        if not self.active:
            raise PeerLost("sandblaster: every worker is lost")
        for idle in sorted(self.active - set(self.assigned)):
            self._give(idle, step, waiting, done, copies)

    def _stop_workers(self) -> None:
        """Tell every remaining worker to stop (after the results still in flight have come back)."""
        for worker in sorted(self.active):
            if worker in self.assigned:
                index = self.workers.index(worker)
                try:
                    self.world.wait([self.receives[index]], "last result", peers=[worker])
                except PeerLost:
                    self.world.lost.add(worker)
                    self.world.warn(f"sandblaster: rank {worker} never returned its last portion — lost")
                    continue
            self.world.wait([self.sends[worker]], "receipt of the last task", peers=[worker])
            self.tasks[worker].header[FLAGS] = STOP_WORKING
            self.sends[worker] = self.comm.Isend(self.tasks[worker].header_only(), dest=worker, tag=TAG_TASK)
        self.world.wait([self.sends[w] for w in sorted(self.active - self.world.lost)], "receipt of the stop",
                        peers=sorted(self.active - self.world.lost))


def work(run: Run, stage) -> dict:
    """Wait for a task, compute the portion's summed gradient, send it back; until told to stop."""
    world, timer, comm = run.world, run.timer, run.world.comm
    size = run.net.num_params
    task, result = Packet(size, run.dtype), Packet(size, run.dtype)
    send, tasks_done, images = MPI.REQUEST_NULL, 0, 0
    while True:
        with timer.phase("waiting for a task"):   # longer than the coordinator takes to replace a lost worker
            world.wait([comm.Irecv(task.buffer, source=0, tag=TAG_TASK)], "task", peers=[0], patience=2)
        if int(task.header[FLAGS]) & STOP_WORKING:
            break
        world.maybe_die(tasks_done)
        if int(task.header[FLAGS]) & HAS_WEIGHTS:
            stage.set_params(task.payload)
        step, start, stop = int(task.header[STEP]), int(task.header[START]), int(task.header[STOP])
        with timer.phase(COMPUTE):
            loss, grad = stage.loss_and_grad(*run.global_range(step, start, stop))
        world.maybe_straggle(timer.current[COMPUTE])
        with timer.phase(FETCH, label="send result"):
            world.wait([send], "receipt of the previous result", peers=[0])
            result.header[:4] = step, task.header[PORTION], loss * (stop - start), stop - start
            result.payload[...] = grad * (stop - start)
            send = comm.Isend(result.buffer, dest=0, tag=TAG_RESULT)
        tasks_done, images = tasks_done + 1, images + stop - start
        run.end_step(tasks_done - 1, None, None)
    world.wait([send], "receipt of the last result", peers=[0])
    run.training_done()
    return {"rank_extra": {"tasks": tasks_done, "images": images}}
