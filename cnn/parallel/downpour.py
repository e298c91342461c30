"""Strategy ``downpour``: the asynchronous parameter server of Downpour SGD (Dean et al. 2012; seeds 001, 002).

Rank 0 is the server and only serves; ranks 1…P−1 are model replicas working through their own
shards at their own pace. A replica::

    every step:             g = ∇L(θ_local) on its next batch;  accumulated += g
                            a local step on θ_local with the server's rule (so the steps between
                            fetches count; Adagrad keeps its own sum of squares there)
    every n_push steps:     push `accumulated` to the server (and go on computing while it travels)
    every n_fetch steps:    fetch the server's θ and continue from it

The server takes the messages as they come, *one at a time* — that is the lock of seed 001's
"master process uses lock to avoid weight update conflicts", for free with a single server thread.
Its update rule is ``--server-rule`` (``cnn.parallel.optimizers``), with g the pushed gradients, summed:

    adagrad (default, as Downpour in Dean et al.):  G ← G + g²;  θ ← θ − η·g / (√G + ε)
    sgd:                                            v ← μ·v + g + λ·θ;  θ ← θ − η·v
    on a fetch:  send θ and its version number

The gradient a replica pushes was computed on weights fetched some updates ago: its *staleness*,
the number of updates the server applied in between, is recorded for every push and reported
(mean, max, histogram). Adagrad's per-parameter rate is what Dean et al. credit for Downpour's
robustness to staleness; ``benchmarks/parallel_staleness.py`` compares the two rules at several
``--n-fetch``. A replica that falls silent for ``--peer-timeout`` seconds is declared lost; the
server carries on with the others and the report names the lost rank.

Checkpoints (by the server, every ``--checkpoint-every`` updates, else once per epoch's worth of
updates, and at the end) hold the server's θ and its rule's state (v or G), the updates applied,
the staleness values and each replica's *next step*: the one after its last push. That is a
consistent cut — the server's state contains exactly the pushes before those steps — so
``--resume`` restarts every replica there, from the server's weights (as after a fetch; its local
state, which only steps its local copy between fetches, restarts from zero), with the same rule
(another is refused in one line). A replica lost before the end keeps its position, so resuming
the finished run does that replica's remaining steps.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from cnn.parallel import resume
from cnn.parallel.common import Packet, Run, staleness_stats
from cnn.parallel.optimizers import server_optimizer
from cnn.parallel.timing import COMPUTE, DISTRIBUTE, FETCH, UPDATE

TAG_TO_SERVER, TAG_TO_WORKER = 10, 11
PUSH, FETCH_WEIGHTS, DONE = 1, 2, 4              # flags of a replica's message
FLAGS, VERSION, STEP, LOSS = range(4)            # header slots


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    if size < 2:
        raise ValueError("downpour needs at least 2 ranks: a server and a replica")
    return size - 1, {0: "server"}


def train(run: Run) -> dict:
    run.announce(f"rank 0 serves with {run.options.server_rule}, {run.workers} replicas; push every "
                 f"{run.options.n_push}, fetch every {run.options.n_fetch} steps")
    stage = run.make_stage()
    params = run.initial_params(stage)
    return serve(run, stage, params) if run.rank == 0 else replicate(run, stage, params)


def check_rule(run: Run, resumed):
    """A checkpoint continues only with the rule that wrote it: its state vector is that rule's."""
    saved = resumed.state.get("rule", "sgd") if resumed else run.options.server_rule
    if saved != run.options.server_rule:
        raise ValueError(f"{run.checkpoint}: written by a downpour server with --server-rule {saved}, "
                         f"this run has {run.options.server_rule}; resume it with --server-rule {saved}")
    return resumed


# -- the server -------------------------------------------------------------------------------------

def serve(run: Run, stage, params: np.ndarray) -> dict:
    world, timer, comm = run.world, run.timer, run.world.comm
    opt = server_optimizer(params, run.config, run.options.server_rule)
    run.rescue_note = "the server's state makes sense only with the replicas' positions its checkpoints save"
    size = run.net.num_params
    replicas = list(range(1, world.size))
    version, staleness, next_step = 0, [], {r: 0 for r in replicas}
    resumed = check_rule(run, resume.load(run))
    if resumed:
        resume.broadcast(run, resumed, "params", opt.params)
        opt.set_momentum(resumed.saved.momentum)
        version, staleness = resumed.state["updates"], list(resumed.state["staleness"])
        next_step = {int(r): step for r, step in resumed.state["next_step"].items()}

    def save() -> None:
        run.save(min(next_step.values()), model=opt, state={"updates": version, "staleness": staleness,
                                                            "next_step": next_step, "rule": opt.rule})

    inbox = {r: Packet(size, run.dtype) for r in replicas}
    outbox = {r: Packet(size, run.dtype) for r in replicas}
    sends = {r: MPI.REQUEST_NULL for r in replicas}
    requests = [comm.Irecv(inbox[r].buffer, source=r, tag=TAG_TO_SERVER) for r in replicas]
    active, last_heard = set(replicas), {r: time.monotonic() for r in replicas}
    updates_per_epoch = max(1, run.steps_per_epoch * run.workers // run.options.n_push)
    while active:
        with timer.phase("waiting"):
            index = world.poll_any(requests, patience=min(1.0, world.timeout / 4))   # a silent replica: found within 1.25 timeouts
        if index is None:
            _drop_silent(run, active, last_heard, requests, replicas)
            continue
        replica = replicas[index]
        last_heard[replica] = time.monotonic()
        header, flags = inbox[replica].header, int(inbox[replica].header[FLAGS])
        if flags & PUSH:
            staleness.append(version - int(header[VERSION]))
            lr = run.lr(version, updates_per_epoch)
            with timer.phase(UPDATE):
                opt.step(inbox[replica].payload, lr)
            version += 1
            next_step[replica] = int(header[STEP]) + 1
            run.end_step(version - 1, float(header[LOSS]), lr, total=updates_per_epoch * run.config.epochs)
            if run.checkpoint_due(version, updates_per_epoch):
                save()
            world.maybe_die(version)
        if flags & FETCH_WEIGHTS:
            with timer.phase(DISTRIBUTE):
                world.wait([sends[replica]], "receipt of the previous weights", peers=[replica])
                outbox[replica].payload[...] = opt.params
                outbox[replica].header[VERSION] = version
                sends[replica] = comm.Isend(outbox[replica].buffer, dest=replica, tag=TAG_TO_WORKER)
        if flags & DONE:
            active.discard(replica)
            requests[index] = MPI.REQUEST_NULL
        else:
            requests[index] = comm.Irecv(inbox[replica].buffer, source=replica, tag=TAG_TO_SERVER)
    run.training_done()
    run.evaluate_final(stage, opt.params, f"server, after {version} updates", version)
    save()
    return {"extra": {"updates": version, "staleness": staleness_stats(staleness), "server_rule": opt.rule}}


def _drop_silent(run: Run, active: set, last_heard: dict, requests: list, replicas: list) -> None:
    """Replicas silent for longer than the timeout are lost: stop listening to them and carry on."""
    world, now = run.world, time.monotonic()
    for replica in sorted(active):
        if now - last_heard[replica] > world.timeout:
            active.discard(replica)
            world.lost.add(replica)
            index = replicas.index(replica)
            world.cancel(requests[index], f"receive from rank {replica}")
            requests[index] = MPI.REQUEST_NULL
            others = ", ".join(map(str, sorted(active)))
            world.warn(f"downpour: rank {replica} silent for {world.timeout:g} s — lost; "
                       + (f"carrying on with rank(s) {others}" if others else "the other replicas have finished"))


# -- a replica --------------------------------------------------------------------------------------

def replicate(run: Run, stage, params: np.ndarray) -> dict:
    world, timer, comm, options = run.world, run.timer, run.world.comm, run.options
    local = server_optimizer(params, run.config, options.server_rule)
    run.rescue_note = "the server, rank 0, held the model"
    size = run.net.num_params
    outgoing, reply = Packet(size, run.dtype), Packet(size, run.dtype)
    send, version, pushed, start = MPI.REQUEST_NULL, 0, 0, 0
    resumed = check_rule(run, resume.load(run))
    if resumed:                       # continue from the server's weights, at this replica's next step
        resume.broadcast(run, resumed, "params", local.params)
        version, start = resumed.state["updates"], resumed.state["next_step"][str(world.rank)]
        stage.set_params(local.params)
    accumulated = np.zeros(size, run.dtype)
    worker = world.rank - 1
    for step in range(start, run.total_steps):
        world.maybe_die(step)
        lr = run.lr(step)
        with timer.phase(COMPUTE):
            loss, grad = stage.loss_and_grad(*run.shard(step, worker))
        world.maybe_straggle(timer.current[COMPUTE])
        with timer.phase(UPDATE):
            accumulated += grad
            local.step(grad, lr)
        last = step == run.total_steps - 1
        push = (step + 1) % options.n_push == 0 or last
        fetch = (step + 1) % options.n_fetch == 0 and not last
        if push or fetch or last:
            with timer.phase(FETCH):          # handing the gradient to the server: wait for the previous push
                world.wait([send], "receipt of the previous push", peers=[0])
            outgoing.header[:4] = (PUSH * push) | (FETCH_WEIGHTS * fetch) | (DONE * last), version, step, loss
            if push:
                outgoing.payload[...] = accumulated
                accumulated[...] = 0
                pushed += 1
            send = comm.Isend(outgoing.buffer if push else outgoing.header_only(), dest=0, tag=TAG_TO_SERVER)
            if fetch:
                with timer.phase(DISTRIBUTE):
                    world.wait([comm.Irecv(reply.buffer, source=0, tag=TAG_TO_WORKER)], "weights", peers=[0])
                local.params[...] = reply.payload
                version = int(reply.header[VERSION])
        stage.set_params(local.params)
        run.completed_steps = step + 1
        run.end_step(step, loss, lr)
    if start >= run.total_steps:      # resumed with nothing left to do: say so
        outgoing.header[:4] = DONE, version, start, 0.0
        send = comm.Isend(outgoing.header_only(), dest=0, tag=TAG_TO_SERVER)
    with timer.phase(FETCH):
        world.wait([send], "receipt of the last push", peers=[0])
    run.training_done()
    return {"rank_extra": {"pushes": pushed}}
