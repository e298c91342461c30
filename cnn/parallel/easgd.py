"""Strategy ``easgd``: elastic averaging SGD (Zhang, Choromanska & LeCun 2015), seed 001's equations.

Rank 0 (the master) holds the center variable W̄; ranks 1…P−1 (the workers) each train their own
W^i, tied to the center by an elastic force of strength ρ. At an exchange step t (every τ steps)::

    (1)  W^i_{t+1} = W^i_t − η·(ΔW^i_t + ρ·(W^i_t − W̄_t))           on worker i
    (2)  W̄_{t+1}  = W̄_t  + η·Σ_i ρ·(W^i_t − W̄_t)                    on the master

ΔW^i_t is the worker's SGD direction (the gradient; with ``--momentum`` the momentum direction
v = μ·v + g + λ·W, which is the gradient itself when μ = λ = 0). Between exchanges the workers take
plain SGD steps. The workers explore on their own and the center averages them; the elastic term
pulls both together (α = η·ρ; the default ρ makes P_workers·α = 0.9, the β of the paper).

- ``--easgd-mode sync``: at every exchange step the master sends W̄_t to all workers and receives
  all W^i_t, then applies (2) with the sum over all workers.
- ``--easgd-mode round-robin`` (seed 001's Algorithm 1): the master serves one worker at a time in
  the order i = t mod P_workers: it receives W^i_t, sends back W̄_t and applies (2) with that
  worker's term alone. A worker waits only for its own turn — but the turns come in a fixed order,
  so the workers still move in lock-step: with one worker 3× slower, every worker ran 52.8–52.9 ms
  a step, the wall time of the synchronous version.
- ``--easgd-mode async`` (Zhang et al.'s asynchronous EASGD): each worker talks to the master every
  τ of its *own* steps, whenever it gets there; the master answers whoever arrives first and
  applies (2) with that worker's term. A slow worker holds up nobody; it exchanges less often, and
  each of its exchanges finds more center updates since its previous one — its *staleness*,
  reported per worker, with ``steps_when_first_worker_finished`` (how far each worker had got when
  the first one finished: with one 3× slower worker the fast ones are done while it is a third of
  the way).

Workers send W^i_t while they compute the gradient (the exchange overlaps the computation). The
model that is evaluated is the center W̄.

Checkpoints: at the start of every ``--checkpoint-every``-th step (else of every epoch) and at the
end, each worker sends its W^i and momentum v^i to the master, which saves them with the center W̄
as it stands before that step's exchange. Everything the next step reads is then on disk, so
``--resume`` continues exactly as if the run had not stopped in the sync and round-robin modes
(the tests check it). In the async mode a checkpoint is the one moment the workers wait for each
other (the master serves every exchange before the checkpoint step, and none after, until it has
saved); the order of the exchanges after a resume is the order the workers arrive in, as it
always is there.
"""

from __future__ import annotations

import numpy as np

from cnn.parallel import resume
from mpi4py import MPI

from cnn.parallel.common import Run, staleness_stats
from cnn.parallel.optimizers import HostSGD
from cnn.parallel.timing import COMPUTE, DISTRIBUTE, FETCH, UPDATE
from cnn.parallel.world import PeerLost
from cnn.stages.base import sgd_momentum_update

TAG_WORKER, TAG_CENTER, TAG_STATE = 30, 31, 32
MODES = ("sync", "round-robin", "async")


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    if size < 2:
        raise ValueError("easgd needs at least 2 ranks: a master and a worker")
    return size - 1, {0: "master"}


def elastic_rate(run: Run) -> float:
    """ρ: as given, or such that workers · η · ρ = 0.9."""
    return run.options.rho if run.options.rho is not None else 0.9 / (run.workers * run.config.lr)


def exchange_steps(run: Run, start: int = 0) -> list[int]:
    return [step for step in range(start, run.total_steps) if step % run.options.tau == 0]


def checkpoint_steps(run: Run, start: int) -> set[int]:
    """Steps at whose start the workers' states are saved: every --checkpoint-every steps (else
    every epoch) after ``start``, and the end."""
    return {step for step in range(start + 1, run.total_steps) if run.checkpoint_due(step)} | {run.total_steps}


def train(run: Run) -> dict:
    rho = elastic_rate(run)
    run.announce(f"easgd {run.options.easgd_mode}: ρ = {rho:g}, η·ρ = {rho * run.config.lr:g}, "
                 f"exchange every τ = {run.options.tau} step(s)")
    stage = run.make_stage()
    params = run.initial_params(stage)
    workers = list(range(1, run.world.size))
    resumed = resume.load(run)
    start = resumed.step if resumed else 0
    if run.rank != 0:
        local = HostSGD(params, run.config)
        if resumed:
            resume.scatter(run, resumed, "params", local.params, workers)
            resume.scatter(run, resumed, "momentum", local.velocity, workers)
        return work(run, stage, local, rho, start)
    if resumed:
        params[...] = resumed.saved.params
        resume.scatter(run, resumed, "params", None, workers)
        resume.scatter(run, resumed, "momentum", None, workers)
    master = {"sync": master_sync, "round-robin": master_round_robin, "async": master_async}[run.options.easgd_mode]
    center, report = master(run, params, rho, start)
    run.training_done()
    rows = worker_states(run, workers)
    run.evaluate_final(stage, center.params, "master, the center", run.total_steps)
    run.save(run.total_steps, model=center, rows=rows)
    return {"extra": {"rho": rho, "tau": run.options.tau, "mode": run.options.easgd_mode, **report}}


def worker_states(run: Run, workers: list[int]) -> dict[str, np.ndarray]:
    """The master: every worker's W^i and v^i, one row per worker (what ``send_state`` sends)."""
    world, size = run.world, run.net.num_params
    states = np.empty((len(workers), 2 * size), run.dtype)
    world.wait([world.comm.Irecv(states[i], source=w, tag=TAG_STATE) for i, w in enumerate(workers)],
               "worker state for the checkpoint", peers=workers)
    return {"params": states[:, :size], "momentum": states[:, size:]}


def save_with_workers(run: Run, center: HostSGD, step: int, workers: list[int]) -> None:
    """The master, at the start of ``step``: save W̄ with every worker's W^i and v^i."""
    run.save(step, model=center, rows=worker_states(run, workers))


def send_state(run: Run, local: HostSGD) -> None:
    """A worker: its [W^i | v^i] to the master, for the checkpoint."""
    state = np.concatenate([local.params, local.velocity])
    run.world.wait([run.world.comm.Isend(state, dest=0, tag=TAG_STATE)], "receipt of the worker state", peers=[0],
                   patience=10)      # async: a fast worker may wait here for a slow one to reach the checkpoint


def master_sync(run: Run, params: np.ndarray, rho: float, start: int) -> tuple[HostSGD, dict]:
    """Every exchange step: send W̄_t to all workers, receive every W^i_t, apply (2) with the sum."""
    world, timer, comm = run.world, run.timer, run.world.comm
    workers, size = list(range(1, world.size)), len(params)
    center = HostSGD(params, run.config)
    run.rescue_note = "the master holds the center, not the workers' own weights"
    inbox = np.empty((len(workers), size + 1), run.dtype)               # [W^i_t | t] per worker
    saves = checkpoint_steps(run, start) - {run.total_steps}
    for step in range(start, run.total_steps):
        if step in saves:
            save_with_workers(run, center, step, workers)
        if step % run.options.tau:
            continue
        lr = run.lr(step)
        with timer.phase(DISTRIBUTE, label="send center"):
            sends = [comm.Isend(center.params, dest=w, tag=TAG_CENTER) for w in workers]
        with timer.phase(FETCH, label="receive worker weights"):
            world.wait([comm.Irecv(inbox[i], source=w, tag=TAG_WORKER) for i, w in enumerate(workers)],
                       "worker weights", peers=workers)
            world.wait(sends, "receipt of the center", peers=workers)
        with timer.phase(UPDATE, label="elastic update of the center (2)"):
            center.params += lr * rho * (inbox[:, :size].sum(axis=0) - len(workers) * center.params)
        run.completed_steps = step + 1
        run.end_step(step, None, lr)
    return center, {}


def master_round_robin(run: Run, params: np.ndarray, rho: float, start: int) -> tuple[HostSGD, dict]:
    """Serve worker j = t mod P_workers: receive W^j_t, send W̄_t back, apply (2) with j's term."""
    world, timer, comm = run.world, run.timer, run.world.comm
    workers, size = list(range(1, world.size)), len(params)
    center = HostSGD(params, run.config)
    run.rescue_note = "the master holds the center, not the workers' own weights"
    incoming, outgoing = np.empty(size + 1, run.dtype), np.empty_like(params)
    saves = checkpoint_steps(run, start) - {run.total_steps}
    total_turns = len(exchange_steps(run)) * len(workers)
    turn = (len(exchange_steps(run)) - len(exchange_steps(run, start))) * len(workers)
    for step in range(start, run.total_steps):
        if step in saves:
            save_with_workers(run, center, step, workers)
        if step % run.options.tau:
            continue
        lr = run.lr(step)
        for worker in workers:
            with timer.phase(FETCH, label=f"receive W from rank {worker}"):
                world.wait([comm.Irecv(incoming, source=worker, tag=TAG_WORKER)], "worker weights", peers=[worker])
            with timer.phase(DISTRIBUTE, label=f"send center to rank {worker}"):
                outgoing[...] = center.params
                world.wait([comm.Isend(outgoing, dest=worker, tag=TAG_CENTER)], "receipt of the center",
                           peers=[worker])
            with timer.phase(UPDATE, label="elastic update of the center (2)"):
                center.params += lr * rho * (incoming[:size] - center.params)
            run.completed_steps = step + 1
            run.end_step(turn, None, lr, total=total_turns)
            turn += 1
    return center, {}


def master_async(run: Run, params: np.ndarray, rho: float, start: int) -> tuple[HostSGD, dict]:
    """Serve whichever worker arrives: receive W^j_t, send W̄ back, apply (2) with j's term.

    No order, no turns: a worker that reaches its exchange step is answered at once, so a slow
    worker delays nobody. Its *staleness* at an exchange is the number of center updates since
    its previous one (the other workers' exchanges in between). A checkpoint is a consistent cut:
    the master stops listening to each worker once it has served that worker's exchanges before
    the checkpoint step, then collects every worker's state, saves, and listens again.
    """
    world, timer, comm = run.world, run.timer, run.world.comm
    workers, size = list(range(1, world.size)), len(params)
    center = HostSGD(params, run.config)
    run.rescue_note = "the master holds the center, not the workers' own weights"
    inbox = {w: np.empty(size + 1, run.dtype) for w in workers}          # [W^j_t | t]
    outbox = {w: np.empty_like(params) for w in workers}
    sends = {w: MPI.REQUEST_NULL for w in workers}
    exchanges = exchange_steps(run, start)
    boundaries = sorted(checkpoint_steps(run, start) - {run.total_steps})
    served, updates, seen = {w: 0 for w in workers}, 0, {w: 0 for w in workers}
    staleness, progress, at_first_finish = {w: [] for w in workers}, {w: start for w in workers}, None
    total_turns = len(exchange_steps(run)) * len(workers)
    turn = total_turns - len(exchanges) * len(workers)

    def owed(worker: int) -> int:
        """Exchanges of ``worker`` still to serve before the next checkpoint step (or the end)."""
        limit = sum(step < boundaries[0] for step in exchanges) if boundaries else len(exchanges)
        return limit - served[worker]

    receives = {w: comm.Irecv(inbox[w], source=w, tag=TAG_WORKER) for w in workers}
    while True:
        if not any(owed(w) for w in workers):               # every worker is at the cut, or done
            if not boundaries:
                break
            save_with_workers(run, center, boundaries.pop(0), workers)
            continue
        requests = [receives[w] if owed(w) else MPI.REQUEST_NULL for w in workers]
        with timer.phase(FETCH, label="waiting for any worker"):
            index = world.poll_any(requests, patience=world.timeout)
        if index is None:
            late = [w for w in workers if owed(w)]
            raise PeerLost(f"rank 0: no worker weights from rank(s) {', '.join(map(str, late))} "
                           f"within {world.timeout:g} s", late)
        worker = workers[index]
        step = int(inbox[worker][size])
        lr = run.lr(step)
        with timer.phase(DISTRIBUTE, label=f"send center to rank {worker}"):
            world.wait([sends[worker]], "receipt of the previous center", peers=[worker])
            outbox[worker][...] = center.params                       # W̄ before (2): what (1) uses
            sends[worker] = comm.Isend(outbox[worker], dest=worker, tag=TAG_CENTER)
        with timer.phase(UPDATE, label="elastic update of the center (2)"):
            center.params += lr * rho * (inbox[worker][:size] - center.params)
        staleness[worker].append(updates - seen[worker])
        updates += 1
        seen[worker], served[worker], progress[worker] = updates, served[worker] + 1, step
        if served[worker] < len(exchanges):
            receives[worker] = comm.Irecv(inbox[worker], source=worker, tag=TAG_WORKER)
        elif at_first_finish is None:                             # the first worker made its last exchange
            at_first_finish = {str(w): progress[w] + 1 for w in workers}
        run.completed_steps = step + 1
        run.end_step(turn, None, lr, total=total_turns)
        turn += 1
    world.wait(list(sends.values()), "receipt of the center", peers=workers)
    return center, {"staleness": staleness_stats([s for values in staleness.values() for s in values]),
                    "staleness_mean_per_worker": {str(w): float(np.mean(v)) if v else None
                                                  for w, v in staleness.items()},
                    "steps_when_first_worker_finished": at_first_finish}


def work(run: Run, stage, local: HostSGD, rho: float, start: int) -> dict:
    """Local SGD steps; at exchange steps send W^i_t, receive W̄_t and apply (1)."""
    world, timer, comm, config = run.world, run.timer, run.world.comm, run.config
    run.rescue_note = "the master, rank 0, held the center"
    size = len(local.params)
    mine, center = np.empty(size + 1, local.params.dtype), np.empty_like(local.params)
    worker = world.rank - 1
    saves = checkpoint_steps(run, start)
    stage.set_params(local.params)
    for step in range(start, run.total_steps):
        if step in saves:
            send_state(run, local)
        world.maybe_die(step)
        lr = run.lr(step)
        exchange = step % run.options.tau == 0
        if exchange:
            mine[:size], mine[size] = local.params, step               # W^i_t, before this step's update
            requests = [comm.Isend(mine, dest=0, tag=TAG_WORKER), comm.Irecv(center, source=0, tag=TAG_CENTER)]
        with timer.phase(COMPUTE):
            loss, grad = stage.loss_and_grad(*run.shard(step, worker))
        world.maybe_straggle(timer.current[COMPUTE])
        if exchange:
            with timer.phase(DISTRIBUTE, label="exchange with the master"):
                world.wait(requests, "center", peers=[0, 0])
        with timer.phase(UPDATE):
            elastic = lr * rho * (local.params - center) if exchange else 0.0
            sgd_momentum_update(local.params, local.velocity, grad, lr, config.momentum, config.weight_decay)
            local.params -= elastic                                     # (1): −η·ΔW − η·ρ·(W^i_t − W̄_t)
        stage.set_params(local.params)
        run.completed_steps = step + 1
        run.end_step(step, loss, lr)
    run.training_done()
    send_state(run, local)
    return {}
