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
- ``--easgd-mode async`` (round-robin, seed 001's Algorithm 1): the master serves one worker at a
  time in the order i = t mod P_workers: it receives W^i_t, sends back W̄_t and applies (2) with
  that worker's term alone. A worker waits only for its own turn, never for all the others.

Workers send W^i_t while they compute the gradient (the exchange overlaps the computation). The
model that is evaluated is the center W̄.

Checkpoints: at the start of every ``--checkpoint-every``-th step (else of every epoch) and at the
end, each worker sends its W^i and momentum v^i to the master, which saves them with the center W̄
as it stands before that step's exchange. Everything the next step reads is then on disk, so
``--resume`` continues exactly as if the run had not stopped (the tests check it).
"""

from __future__ import annotations

import numpy as np

from cnn.parallel import resume
from cnn.parallel.common import HostSGD, Run
from cnn.parallel.timing import COMPUTE, DISTRIBUTE, FETCH, UPDATE
from cnn.stages.base import sgd_momentum_update

TAG_WORKER, TAG_CENTER, TAG_STATE = 30, 31, 32
MODES = ("sync", "async")


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
    master = master_sync if run.options.easgd_mode == "sync" else master_round_robin
    center = master(run, params, rho, start)
    run.training_done()
    rows = worker_states(run, workers)
    run.evaluate_final(stage, center.params, "master, the center", run.total_steps)
    run.save(run.total_steps, model=center, rows=rows)
    return {"extra": {"rho": rho, "tau": run.options.tau, "mode": run.options.easgd_mode}}


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
    run.world.wait([run.world.comm.Isend(state, dest=0, tag=TAG_STATE)], "receipt of the worker state", peers=[0])


def master_sync(run: Run, params: np.ndarray, rho: float, start: int) -> HostSGD:
    """Every exchange step: send W̄_t to all workers, receive every W^i_t, apply (2) with the sum."""
    world, timer, comm = run.world, run.timer, run.world.comm
    workers = list(range(1, world.size))
    center = HostSGD(params, run.config)
    run.rescue_note = "the master holds the center, not the workers' own weights"
    inbox = np.empty((len(workers), len(params)), run.dtype)
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
            center.params += lr * rho * (inbox.sum(axis=0) - len(workers) * center.params)
        run.completed_steps = step + 1
        run.end_step(step, None, lr)
    return center


def master_round_robin(run: Run, params: np.ndarray, rho: float, start: int) -> HostSGD:
    """Serve worker j = t mod P_workers: receive W^j_t, send W̄_t back, apply (2) with j's term."""
    world, timer, comm = run.world, run.timer, run.world.comm
    workers = list(range(1, world.size))
    center = HostSGD(params, run.config)
    run.rescue_note = "the master holds the center, not the workers' own weights"
    incoming, outgoing = np.empty_like(params), np.empty_like(params)
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
                center.params += lr * rho * (incoming - center.params)
            run.completed_steps = step + 1
            run.end_step(turn, None, lr, total=total_turns)
            turn += 1
    return center


def work(run: Run, stage, local: HostSGD, rho: float, start: int) -> dict:
    """Local SGD steps; at exchange steps send W^i_t, receive W̄_t and apply (1)."""
    world, timer, comm, config = run.world, run.timer, run.world.comm, run.config
    run.rescue_note = "the master, rank 0, held the center"
    mine, center = np.empty_like(local.params), np.empty_like(local.params)
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
            mine[...] = local.params                                   # W^i_t, before this step's update
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
