"""Strategy ``hogwild``: several processes update ONE weight vector in shared memory, without any lock
(Niu, Recht, Ré & Wright 2011; seed 001).

The weights live in an MPI shared-memory window (``MPI.Win.Allocate_shared``): rank 0 allocates
the memory, every rank on the node maps it and sees it as an ordinary numpy array. Each process::

    θ_read = copy of the shared θ                     (other processes may be writing meanwhile)
    g = ∇L(θ_read) on its next batch
    v ← μ·v + g + λ·θ;  θ_shared ← θ_shared − η·v      (in place, element by element, no lock)

Two processes may write the same element at the same time and one update can partly overwrite
another; Hogwild's argument is that with sparse updates such collisions are rare and harmless. A
CNN's gradient is dense, so here they are not rare — yet training still converges, which is the
lesson. How many updates landed between a process's read and its write (its *staleness*) is
counted with one counter per rank in a second window: each rank writes only its own counter, so
counting needs no lock either.

On cache-coherent hardware plain loads and stores are seen by the other processes; MPI's
``Win.Sync`` would make that portable. Shared memory exists within one node only, so every rank
must be on the same node.

A checkpoint (every ``--checkpoint-every`` steps, else every epoch, and at the end) is the one
moment the processes wait for each other: all stop at the same step, rank 0 saves the shared
weights with every process's momentum, update count and staleness values, and all go on.
``--resume`` restores exactly that.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from cnn.parallel import resume
from cnn.parallel.common import Run, staleness_stats
from cnn.parallel.timing import COMPUTE, DISTRIBUTE, UPDATE
from cnn.stages.base import sgd_momentum_update


def layout(size: int, options) -> tuple[int, dict[int, str]]:
    return size, {}


def shared_array(node, length: int, dtype) -> tuple[MPI.Win, np.ndarray]:
    """A ``length``-element array in memory shared by every rank of ``node`` (rank 0 allocates it)."""
    dtype = np.dtype(dtype)
    window = MPI.Win.Allocate_shared(length * dtype.itemsize if node.Get_rank() == 0 else 0,
                                     dtype.itemsize, comm=node)
    memory, _ = window.Shared_query(0)
    return window, np.ndarray((length,), dtype=dtype, buffer=memory)


class SharedWeights:
    """What a checkpoint saves as the model: a copy of the shared weights (the momenta are saved per process)."""

    def __init__(self, shared: np.ndarray):
        self.shared = shared

    def get_params(self):
        return self.shared.copy()

    def get_momentum(self):
        return np.zeros_like(self.shared)


def save_together(run: Run, step: int, shared: np.ndarray, velocity: np.ndarray, staleness: list[int],
                  updates: np.ndarray) -> dict | None:
    """Every process stops at ``step``; rank 0 saves the shared weights with each process's
    momentum, update count and staleness values (and returns the staleness values of all)."""
    world = run.world
    world.wait([world.comm.Ibarrier()], f"checkpoint barrier at step {step}")
    everyone = world.gather_objects((velocity, staleness), patience=1.0)
    if world.rank == 0:
        ranks = range(world.size)
        run.save(step, model=SharedWeights(shared), rows={"momentum": np.stack([everyone[r][0] for r in ranks])},
                 state={"staleness": {str(r): everyone[r][1] for r in ranks}, "updates": updates.tolist()})
    world.wait([world.comm.Ibarrier()], f"barrier after the checkpoint at step {step}")
    return {r: values for r, (_, values) in everyone.items()} if everyone else None


def train(run: Run) -> dict:
    world, timer, config = run.world, run.timer, run.config
    node = world.comm.Split_type(MPI.COMM_TYPE_SHARED)
    if node.Get_size() != world.size:
        raise ValueError(f"hogwild shares one weight vector in one node's memory: the {world.size} ranks "
                         f"must run on one node (this node holds {node.Get_size()})")
    run.announce("one weight vector in shared memory, no locks")
    stage = run.make_stage()
    params = run.initial_params(stage)
    weights_window, shared = shared_array(node, run.net.num_params, run.dtype)
    counts_window, updates = shared_array(node, world.size, np.int64)
    velocity, staleness, start = np.zeros_like(params), [], 0
    resumed = resume.load(run)
    if world.rank == 0:
        shared[...], updates[...] = (resumed.saved.params, resumed.state["updates"]) if resumed else (params, 0)
    if resumed:
        resume.scatter(run, resumed, "momentum", velocity, list(range(world.size)))
        staleness, start = list(resumed.state["staleness"][str(world.rank)]), resumed.step
    run.state, run.rescue_note = None, "every process's momentum is needed as well as the shared weights"
    world.wait([world.comm.Ibarrier()], "start barrier")
    for step in range(start, run.total_steps):
        if step > start and run.checkpoint_due(step):
            save_together(run, step, shared, velocity, staleness, updates)
        world.maybe_die(step)
        lr = run.lr(step)
        with timer.phase(DISTRIBUTE, label="read shared weights"):
            seen = int(updates.sum())
            stage.set_params(shared)
        with timer.phase(COMPUTE):
            loss, grad = stage.loss_and_grad(*run.shard(step, world.rank))
        world.maybe_straggle(timer.current[COMPUTE])
        with timer.phase(UPDATE, label="unlocked update of shared weights"):
            sgd_momentum_update(shared, velocity, grad, lr, config.momentum, config.weight_decay)
        staleness.append(int(updates.sum()) - seen)
        updates[world.rank] += 1
        run.completed_steps = step + 1
        run.end_step(step, loss, lr)
    run.training_done()
    everyone = save_together(run, run.total_steps, shared, velocity, staleness, updates)
    stage.set_params(shared)
    accuracy, loss = run.evaluate_sharded(stage)
    run.record_final(accuracy, loss, run.total_steps)
    world.log(f"hogwild: {int(updates.sum())} unlocked updates; test accuracy {accuracy:.2%}, test loss {loss:.4f}")
    world.wait([world.comm.Ibarrier()], "barrier before freeing the windows")
    weights_window.Free()
    counts_window.Free()
    if world.rank != 0:
        return {}
    return {"extra": {"updates": sum(len(values) for values in everyone.values()),
                      "staleness": staleness_stats([s for values in everyone.values() for s in values])}}
