"""Distributed training over MPI: one process per rank, each running any single-process stage.

Launch (``python -m mpi4py`` turns an exception on one rank into ``MPI_Abort`` for the whole job)::

    mpiexec -n 4 python -m mpi4py -m cnn.parallel --strategy allreduce --epochs 1
    python -m cnn.parallel.launch -n 4 --strategy allreduce --epochs 1     # the same, with what this
                                                                            # machine needs added

From Python (a notebook), ``cnn.parallel.launch.run("allreduce", ranks=4, epochs=1)`` starts the same
command and returns the run's JSON summary as a dict.

The strategies, one module each:

==================  ==============================================================================
``ps-sync``         synchronous parameter server: gradients gathered to rank 0, averaged, applied,
                    the new weights sent back (seed 000)
``allreduce``       data-parallel with an allreduce of the flat gradient: MPI's own, or a ring
                    (reduce-scatter + all-gather) written out with point-to-point messages;
                    ``--overlap``: one allreduce per layer during the backward pass; with a CUDA
                    stage the gradient stays on the GPU (``gpu_ranks``)
``downpour``        asynchronous parameter server (Downpour SGD): push every n_push steps, fetch
                    every n_fetch steps, updates applied one at a time as they arrive, by Adagrad
                    (default) or SGD with momentum (``optimizers``)
``hogwild``         lock-free updates to one weight vector in an MPI shared-memory window
``easgd``           elastic averaging SGD: synchronous, round-robin (seed 001), or asynchronous
                    (each worker at its own pace)
``sandblaster``     a coordinator hands portions of each batch to idle workers and duplicates the
                    portions of stragglers; one L-BFGS iteration (``lbfgs``) or SGD step per batch
                    (seed 002)
``model-parallel``  the network split across two ranks where the measured cost balances, a
                    convolution's filters shared (``partition``), optional micro-batch pipelining
==================  ==============================================================================

Every strategy follows Horovod's recipe: the initial weights are broadcast from rank 0, the learning
rate of the synchronous ones is scaled by the number of workers with a per-batch warmup
(``cnn.train.lr_at``), metrics are reduced across ranks before rank 0 logs them, only rank 0 writes
checkpoints and summaries, and every rank runs the same number of steps. Every strategy checkpoints
periodically and continues with ``--resume`` (``checkpoint``, ``resume``).

No MPI call here blocks without a deadline (``World.wait``, which spins briefly as ``MPI_Wait`` does,
then naps), so a dead or silent rank is detected instead of hanging the job, and a rank waiting for a
slow one leaves its core to others. Across hosts, every job first checks that each host runs the
same interpreter, package and dataset (``hosts``). This package imports neither numpy nor
MPI at import time: the launcher sets the BLAS thread count first.
"""

STRATEGIES = {
    "ps-sync": "cnn.parallel.ps_sync",
    "allreduce": "cnn.parallel.allreduce",
    "downpour": "cnn.parallel.downpour",
    "hogwild": "cnn.parallel.hogwild",
    "easgd": "cnn.parallel.easgd",
    "sandblaster": "cnn.parallel.sandblaster",
    "model-parallel": "cnn.parallel.model_parallel",
}
