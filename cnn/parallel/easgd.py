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
model that is evaluated and checkpointed is the center W̄.
"""

from __future__ import annotations

import numpy as np

from cnn.parallel.common import HostSGD, Run
from cnn.parallel.timing import COMPUTE, DISTRIBUTE, FETCH, UPDATE
from cnn.stages.base import sgd_momentum_update

TAG_WORKER, TAG_CENTER = 30, 31
MODES = ("sync", "async")


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    if size < 2:
        raise ValueError("easgd needs at least 2 ranks: a master and a worker")
    return size - 1, {0: "master"}


def elastic_rate(run: Run) -> float:
    """ρ: as given, or such that workers · η · ρ = 0.9."""
    return run.options.rho if run.options.rho is not None else 0.9 / (run.workers * run.config.lr)


def exchange_steps(run: Run) -> list[int]:
    return list(range(0, run.total_steps, run.options.tau))


def train(run: Run) -> dict:
    rho = elastic_rate(run)
    run.announce(f"easgd {run.options.easgd_mode}: ρ = {rho:g}, η·ρ = {rho * run.config.lr:g}, "
                 f"exchange every τ = {run.options.tau} step(s)")
    stage = run.make_stage()
    params = run.initial_params(stage)
    if run.rank != 0:
        return work(run, stage, params, rho)
    center = master_sync(run, params, rho) if run.options.easgd_mode == "sync" else master_round_robin(run, params, rho)
    run.training_done()
    run.evaluate_final(stage, center, "master, the center", run.total_steps)
    return {"extra": {"rho": rho, "tau": run.options.tau, "mode": run.options.easgd_mode}}


def master_sync(run: Run, params: np.ndarray, rho: float) -> np.ndarray:
    """Every exchange step: send W̄_t to all workers, receive every W^i_t, apply (2) with the sum."""
    world, timer, comm = run.world, run.timer, run.world.comm
    workers = list(range(1, world.size))
    run.state = center = HostSGD(params, run.config)
    inbox = np.empty((len(workers), len(params)), run.dtype)
    for step in exchange_steps(run):
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
    return center.params


def master_round_robin(run: Run, params: np.ndarray, rho: float) -> np.ndarray:
    """Serve worker j = t mod P_workers: receive W^j_t, send W̄_t back, apply (2) with j's term."""
    world, timer, comm = run.world, run.timer, run.world.comm
    workers = list(range(1, world.size))
    run.state = center = HostSGD(params, run.config)
    incoming, outgoing = np.empty_like(params), np.empty_like(params)
    turns = [(step, worker) for step in exchange_steps(run) for worker in workers]
    for turn, (step, worker) in enumerate(turns):
        lr = run.lr(step)
        with timer.phase(FETCH, label=f"receive W from rank {worker}"):
            world.wait([comm.Irecv(incoming, source=worker, tag=TAG_WORKER)], "worker weights", peers=[worker])
        with timer.phase(DISTRIBUTE, label=f"send center to rank {worker}"):
            outgoing[...] = center.params
            world.wait([comm.Isend(outgoing, dest=worker, tag=TAG_CENTER)], "receipt of the center", peers=[worker])
        with timer.phase(UPDATE, label="elastic update of the center (2)"):
            center.params += lr * rho * (incoming - center.params)
        run.completed_steps = step + 1
        run.end_step(turn, None, lr, total=len(turns))
    return center.params


def work(run: Run, stage, params: np.ndarray, rho: float) -> dict:
    """Local SGD steps; at exchange steps send W^i_t, receive W̄_t and apply (1)."""
    world, timer, comm, config = run.world, run.timer, run.world.comm, run.config
    run.state = local = HostSGD(params, config)
    mine, center = np.empty_like(params), np.empty_like(params)
    worker = world.rank - 1
    for step in range(run.total_steps):
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
    return {}
