"""Strategy ``sandblaster``: a coordinator hands out small portions of each batch (Dean et al. 2012; seed 002).

Rank 0 is the coordinator (and holds the weights, as a parameter server); ranks 1…P−1 are workers.
The global batch of workers × b images is cut into ``--portions`` pieces, more pieces than
workers. One *round* evaluates the batch at some weights θ::

    while some portion has no result:
        a worker that reports a result is idle: give it the next portion nobody has started,
        or, when none is left, a *duplicate* of a portion still out that is late — out for longer
        than --backup-after × the median time a portion has taken (default 0: any portion still out)
        — at most --max-copies copies at a time; the first result for a portion wins
    loss and gradient of the batch at θ = (1/B) Σ_portions (the portion's sums)

and the coordinator's optimizer decides what to evaluate next (``--optimizer``):

- ``lbfgs`` (default; DistBelief's Sandblaster runs L-BFGS): one iteration of ``cnn.parallel.lbfgs``
  per batch — the two-loop recursion gives the direction d = −H·g, and the line search's trial
  points θ + t·d are rounds on the same batch, their function values and gradients summed from the
  workers' portions like the first one's; the accepted trial's gradient gives the curvature pair.
  Usually two rounds per iteration; ``--history`` is the memory m. The learning rate is only the
  first trial step while no curvature is known (``--lr``).
- ``sgd``: one round and one SGD step with momentum per batch.

A fast worker takes more portions than a slow one, so a round is not held up by the slowest
machine, and the duplicates finish the last portions of a straggler ("backup tasks", as in
MapReduce: DistBelief copies the portions still out near the end of a batch, and so does the
default here). A result counts only for the round it was computed for. Each round equals one
process evaluating the whole batch (up to float rounding), so SGD equals ``cnn.train`` with batch B
and L-BFGS equals ``lbfgs.minimize_batches`` in one process, which the tests check. A worker that
keeps a portion for longer than ``--peer-timeout`` seconds without answering is declared lost; its
portion is finished by others and the run goes on.

Backing up at once is a bet on the tail: the copy is wasted work whenever the original comes back
first, but a worker that would otherwise idle costs nothing, and the batch ends with the faster
copy. Measured with 4 ranks on this project's 2-core machine (LeNet-5, batch 3 × 32, one epoch of
625 batches, SGD, two alternating pairs of runs), where the operating system makes any rank a
straggler now and then (each run: ``mpiexec -n 4 python -m mpi4py -m cnn.parallel --strategy
sandblaster --optimizer sgd --epochs 1 --batch-size 32 --init xavier --warmup-epochs 0.25
--backup-after X``; its summary's ``duplicates``, ``time_per_step_s`` and ``images_per_second``)::

    --backup-after   duplicates sent   step time       images/s
    0 (default)      1099, 1103        14.8, 17.2 ms   3232, 2791
    1.5              12, 56            17.5, 21.7 ms   2723, 2208

Almost every duplicate was thrown away. The eager runs were faster in both pairs (by 19 and 26 %
in images a second), but two runs a setting on a shared machine give no spread to speak of: the
gain is to be measured again with repeats. Where a duplicate takes a machine that other jobs could
use, the threshold is the cheaper choice.

A task carries the weights only when the worker's copy is out of date (once per round whose
weights changed: the first round of an L-BFGS iteration evaluates the weights the last one accepted).

The coordinator holds the whole state (θ, v or L-BFGS's curvature pairs, the step), so it alone
checkpoints, every ``--checkpoint-every`` steps, else every epoch, and at the end; ``--resume``
continues from it on any number of workers (the position is kept in images). If the coordinator is
lost, the workers stop and name that checkpoint.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import numpy as np
from mpi4py import MPI

from cnn.parallel import resume
from cnn.parallel.common import Packet, Run
from cnn.parallel.lbfgs import LBFGS
from cnn.parallel.optimizers import server_optimizer
from cnn.parallel.timing import COMPUTE, DISTRIBUTE, FETCH, UPDATE
from cnn.parallel.world import PeerLost

TAG_TASK, TAG_RESULT = 40, 41
STEP, PORTION, START, STOP, VERSION, FLAGS, ROUND = range(7)     # task header slots
LOSS_SUM, COUNT, RESULT_ROUND = 2, 3, 4                          # result header slots (after STEP, PORTION)
HAS_WEIGHTS, STOP_WORKING = 1, 2
OPTIMIZERS = ("lbfgs", "sgd")


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
    portions, options = run.options.portions or 2 * run.workers, run.options
    method = (f"L-BFGS (memory {options.history}; --lr {run.config.lr:g} is only the first trial step)"
              if options.optimizer == "lbfgs" else "SGD with momentum")
    run.announce(f"{method}; {portions} portions per batch, at most {options.max_copies} copies of one in flight",
                 rate=options.optimizer != "lbfgs")          # L-BFGS's line search sets the step, no warmup
    stage = run.make_stage()
    params = run.initial_params(stage)
    resumed = resume.load(run)
    if run.rank == 0:
        coordinator = Coordinator(run, params, portion_bounds(run.global_batch, portions))
        if resumed:
            coordinator.restore(resumed.saved)
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


def make_optimizer(run: Run, params: np.ndarray):
    """``--optimizer lbfgs``: L-BFGS with the configured memory and weight decay; ``sgd``: SGD with momentum."""
    if run.options.optimizer == "lbfgs":
        return LBFGS(params, run.options.history, run.config.lr, run.config.weight_decay)
    return server_optimizer(params, run.config)


class Coordinator:
    """Rank 0: portions to idle workers, duplicates to stragglers; one SGD update or one L-BFGS
    iteration per batch, the line search's trial points evaluated by the workers like the batch's
    gradient (each evaluation is a *round*: a result counts only for the round it was computed for)."""

    def __init__(self, run: Run, params: np.ndarray, bounds: np.ndarray):
        self.run, self.world, self.comm, self.timer = run, run.world, run.world.comm, run.timer
        self.opt = run.state = make_optimizer(run, params)
        self.bounds, self.version, self.round = bounds, 0, 0
        self.current = np.array(params, copy=True)      # the weights the workers evaluate now (version)
        self.workers = list(range(1, self.world.size))
        size = run.net.num_params
        self.tasks = {w: Packet(size, run.dtype) for w in self.workers}
        self.results = {w: Packet(size, run.dtype) for w in self.workers}
        self.sends = {w: MPI.REQUEST_NULL for w in self.workers}
        self.receives = [self.comm.Irecv(self.results[w].buffer, source=w, tag=TAG_RESULT) for w in self.workers]
        self.worker_version = {w: -1 for w in self.workers}
        self.assigned: dict[int, tuple[int, int, float]] = {}     # worker -> (round, portion, when)
        self.active = set(self.workers)
        self.duplicates = self.wasted = self.idle_with_portions_out = 0
        self.portions_done_by = defaultdict(int)
        self.portion_seconds = deque(maxlen=64)     # hand-out to result, of the latest portions
        self.evaluations = 0
        self.step_lengths = []                      # L-BFGS: the accepted step length t of each iteration

    def restore(self, saved) -> None:
        """``--resume``: the saved weights, and the momentum or L-BFGS's curvature pairs."""
        self.opt.params[...] = saved.params
        if isinstance(self.opt, LBFGS):
            self.opt.load_pairs(saved.rows)
        else:
            self.opt.set_momentum(saved.momentum)

    def coordinate(self, stage, start: int = 0) -> dict:
        run = self.run
        for step in range(start, run.total_steps):
            self.world.maybe_die(step)
            lr = run.lr(step)
            if isinstance(self.opt, LBFGS):       # no learning rate: the line search chooses the step
                loss, lr = self._lbfgs_iteration(step), None
            else:
                loss = self._sgd_step(step, lr)
            run.completed_steps = step + 1
            run.end_step(step, loss, lr, workers=len(self.active))
            if run.checkpoint_due(step + 1) and step + 1 < run.total_steps:
                self._save(step + 1)
        self._stop_workers()
        run.training_done()
        run.evaluate_final(stage, self.opt.params, f"coordinator, {self.duplicates} duplicate portions sent, "
                           f"{self.wasted} results discarded", run.total_steps)
        self._save(run.total_steps)
        return {"extra": {"optimizer": run.options.optimizer, "portions": len(self.bounds) - 1,
                          "duplicates": self.duplicates, "backup_after": self.run.options.backup_after,
                          "idle_with_portions_out": self.idle_with_portions_out,
                          "discarded_results": self.wasted, "evaluations": self.evaluations,
                          **(self._lbfgs_summary() if isinstance(self.opt, LBFGS) else {}),
                          "portions_done_by": {str(w): n for w, n in sorted(self.portions_done_by.items())}}}

    def _save(self, steps_done: int) -> None:
        self.run.save(steps_done, model=self.opt,
                      rows=self.opt.pairs_as_rows() if isinstance(self.opt, LBFGS) else None)

    def _sgd_step(self, step: int, lr: float) -> float:
        """The batch's gradient, summed from the portions; one SGD step; the batch's mean loss."""
        grad_sum, loss_sum = self._evaluate(step, self.opt.params)
        with self.timer.phase(UPDATE):
            self.opt.step(grad_sum / self.run.global_batch, lr)
        return loss_sum / self.run.global_batch

    def _lbfgs_iteration(self, step: int) -> float:
        """One L-BFGS iteration on ``step``'s batch: every evaluation of the line search is a round of
        portions; the time outside them (the two loops, the trial points) counts as the update."""
        batch, evaluating = self.run.global_batch, [0.0]

        def mean_loss_and_grad(params):
            started = time.perf_counter()
            grad_sum, loss_sum = self._evaluate(step, params)
            evaluating[0] += time.perf_counter() - started
            return loss_sum / batch, grad_sum / batch

        started = time.perf_counter()
        report = self.opt.step(mean_loss_and_grad)
        self.timer.current[UPDATE] += time.perf_counter() - started - evaluating[0]
        self.step_lengths.append(report.step_length)
        return report.loss

    def _lbfgs_summary(self) -> dict:
        lengths = np.array(self.step_lengths or [0.0])
        return {"lbfgs": {"history": self.opt.pairs.maxlen, "evaluations_per_iteration":
                          self.evaluations / max(1, len(self.step_lengths)),
                          "rejected_iterations": self.opt.rejected, "skipped_pairs": self.opt.skipped_pairs,
                          "unit_steps": int(np.sum(lengths == 1.0)), "median_step_length": float(np.median(lengths))}}

    def _evaluate(self, step: int, params: np.ndarray):
        """One round: the portions of ``step``'s batch evaluated at ``params`` until each has a result;
        the summed gradient and loss (the weights go out with a task only to a worker without them)."""
        if not np.array_equal(params, self.current):
            self.current[...] = params
            self.version += 1
        self.round += 1
        self.evaluations += 1
        current = self.round
        count = len(self.bounds) - 1
        waiting, done, copies = list(range(count)), set(), defaultdict(int)
        grad_sum, loss_sum = np.zeros(self.run.net.num_params, self.run.dtype), 0.0
        for worker in sorted(self.active):
            if worker not in self.assigned:
                self._give(worker, step, waiting, done, copies)
        while len(done) < count:
            with self.timer.phase(FETCH, label="waiting for results"):
                index = self.world.poll_any(self.receives, patience=self._patience(done, copies))
            if index is None:
                self._drop_silent(step, waiting, done, copies)
                continue
            worker = self.workers[index]
            result = self.results[worker]
            result_round, portion = int(result.header[RESULT_ROUND]), int(result.header[PORTION])
            self.portion_seconds.append(time.monotonic() - self.assigned.pop(worker)[2])
            if result_round == current:
                copies[portion] -= 1
            if result_round == current and portion not in done:
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

    def _backup_candidates(self, done: set, copies: dict) -> dict[int, float]:
        """Unfinished portions of this round that may get one more copy, each with when its oldest copy went out."""
        out_since = {}
        for task_round, portion, when in self.assigned.values():
            if task_round == self.round and portion not in done and copies[portion] < self.run.options.max_copies:
                out_since[portion] = min(when, out_since.get(portion, when))
        return out_since

    def _patience(self, done: set, copies: dict) -> float:
        """How long to wait for a result: a second (a quarter of the timeout, if less: a silent worker
        is found within 1.25 timeouts) at most, less if an idle worker could back up a portion that
        turns late sooner."""
        patience, late_after = min(1.0, self.world.timeout / 4), self._late_after()
        if late_after is None or not self.active - set(self.assigned):
            return patience
        now = time.monotonic()
        for since in self._backup_candidates(done, copies).values():
            patience = min(patience, max(since + late_after - now, 0.0))
        return patience

    def _give(self, worker: int, step: int, waiting: list, done: set, copies: dict) -> None:
        """The next unstarted portion of this round (on ``step``'s batch), else a duplicate of the
        least-copied late one, else nothing."""
        if waiting:
            portion = waiting.pop(0)
        else:
            out_since = self._backup_candidates(done, copies)
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
            task.header[:7] = step, portion, self.bounds[portion], self.bounds[portion + 1], self.version, \
                HAS_WEIGHTS * fresh, self.round
            if fresh:
                task.payload[...] = self.current
                self.worker_version[worker] = self.version
            self.sends[worker] = self.comm.Isend(task.buffer if fresh else task.header_only(), dest=worker, tag=TAG_TASK)
        self.assigned[worker] = (self.round, portion, time.monotonic())

    def _drop_silent(self, step: int, waiting: list, done: set, copies: dict) -> None:
        """Workers holding a portion for longer than the timeout are lost; their portion goes back in
        the queue. Then idle workers get what there is: such a portion, or a copy of a late one."""
        now = time.monotonic()
        for worker, (task_round, portion, since) in sorted(self.assigned.items()):
            if now - since > self.world.timeout:
                del self.assigned[worker]
                self.active.discard(worker)
                self.world.lost.add(worker)
                index = self.workers.index(worker)
                self.world.cancel(self.receives[index], f"receive from rank {worker}")
                self.receives[index] = MPI.REQUEST_NULL
                if task_round == self.round:
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
            result.header[:5] = step, task.header[PORTION], loss * (stop - start), stop - start, task.header[ROUND]
            result.payload[...] = grad * (stop - start)
            send = comm.Isend(result.buffer, dest=0, tag=TAG_RESULT)
        tasks_done, images = tasks_done + 1, images + stop - start
        run.end_step(tasks_done - 1, None, None)
    world.wait([send], "receipt of the last result", peers=[0])
    run.training_done()
    return {"rank_extra": {"tasks": tasks_done, "images": images}}
