"""The algorithms of the distributed strategies, each run over MPI against what it must equal.

- Sandblaster's L-BFGS (the line search's trial points evaluated by the workers' portions, a
  straggler's duplicates included) equals the same L-BFGS in one process, in float64.
- Asynchronous EASGD with a 20× slow worker: the fast one does not wait for it (it finishes while
  the slow one is far short) and the center's staleness is reported and > 0.
- The allreduce overlapped with the backward pass equals the one after the backward (float64).
- Model parallelism with the cut balanced by measured cost and a convolution split by output
  channels, pipelined, equals one process.
- GPU ranks (cuda-tuned, in Numba's simulator) train as CPU ranks do.

2 or 3 ranks on the tiny dataset of ``test_parallel``, a few steps each: the suite's time counts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from cnn.model import get_network  # noqa: E402
from cnn.parallel import lbfgs  # noqa: E402
from cnn.stages import get_stage  # noqa: E402
from cnn.train import TrainConfig, load_dataset  # noqa: E402
from test_parallel import (MPIEXEC, assert_ran_to_the_end, checkpoint_of, data_dir,  # noqa: E402,F401
                           relative_error, run_parallel)

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")]


def run_batches(config: TrainConfig, global_batch: int, steps: int, epoch_size: int):
    """The images of each global step, as ``cnn.parallel.common.Run`` draws them (one permutation an epoch)."""
    rng, batches = np.random.default_rng(config.seed), []
    steps_per_epoch = epoch_size // global_batch
    orders = [rng.permutation(epoch_size) for _ in range(-(-steps // steps_per_epoch))]
    for step in range(steps):
        epoch, batch = divmod(step, steps_per_epoch)
        batches.append(orders[epoch][batch * global_batch:(batch + 1) * global_batch])
    return batches


def test_sandblaster_lbfgs_equals_lbfgs_in_one_process(data_dir, tmp_path):
    """Every round's loss and gradient is summed from portions the workers computed (some twice: a
    straggler gets duplicates): the weights equal one process's L-BFGS on the same batches, in float64."""
    settings = dict(limit_train=96, dtype="float64", lr=0.05, history=4)
    result = run_parallel("sandblaster", 3, data_dir, tmp_path, portions=3, slow_rank=2, slow_down=3, **settings)
    assert_ran_to_the_end(result)
    summary = result.summary
    assert summary["optimizer"] == "lbfgs" and summary["evaluations"] >= 2 * summary["steps"]
    config = TrainConfig(data_dir=str(data_dir), limit_train=96, dtype="float64", progress=False)
    train_x, train_y, _, _ = load_dataset(config)
    stage = get_stage("numpy")(get_network("lenet5"), np.float64).init(config.init, config.seed)
    initial = stage.get_params()

    def evaluate(rows, params):
        stage.set_params(params)
        return stage.loss_and_grad(train_x[rows], train_y[rows])

    batches = run_batches(config, 16, summary["steps"], 96)
    expected, reports = lbfgs.minimize_batches(initial, evaluate, batches, history=4, first_step=0.05,
                                               weight_decay=config.weight_decay)
    got = checkpoint_of(tmp_path / "run.npz")["params"]
    assert relative_error(got, expected.params) < 1e-10, relative_error(got, expected.params)
    assert relative_error(expected.params, initial) > 1e-2
    np.testing.assert_allclose([step[1] for step in summary["history"]["steps"]],
                               [report.loss for report in reports], rtol=1e-10)
    assert summary["lbfgs"]["unit_steps"] >= 1             # the quasi-Newton step was taken whole at least once


def test_async_easgd_does_not_wait_for_a_slow_worker(data_dir, tmp_path):
    """One worker 20 times slower (it sleeps 19 times its own compute, so a busy machine slows it as
    much as the other): in the async mode the fast worker finishes its steps while the slow one is
    far short of them (expected: about a twentieth of the way; asserted: under three quarters), at a
    fraction of its time per step (expected about 1/20; asserted: under 3/4), and the slow worker's
    exchanges find the center moved since its previous one: staleness > 0 (counted, not timed).
    Round-robin would hold both to the slow one's pace. (With a 5× straggler and batch 4 the step
    times were milliseconds apart and a loaded machine's noise made the test fail 2 runs in 10.)"""
    result = run_parallel("easgd", 3, data_dir, tmp_path, easgd_mode="async", tau=1, batch_size=4, slow_rank=1,
                          slow_down=20, init="xavier", momentum=0.5)
    assert_ran_to_the_end(result)
    summary = result.summary
    steps = summary["steps"]
    progress = summary["steps_when_first_worker_finished"]
    assert progress["2"] >= steps - 1 and progress["1"] <= 0.75 * steps, progress
    step_time = {rank: summary["breakdown_per_rank"][rank]["step"] for rank in ("1", "2")}
    assert step_time["2"] < 0.75 * step_time["1"], step_time
    assert summary["staleness_mean_per_worker"]["1"] > 0 and summary["staleness"]["max"] >= 1
    assert summary["staleness"]["count"] == 2 * steps                       # every exchange of both workers


def test_gpu_ranks_train_as_cpu_ranks_do(data_dir, tmp_path):
    """Two cuda-tuned ranks on the reduced LeNet-5, in Numba's simulator, against two numpy ranks.

    One job, both paths: rank 0 hands MPI its device buffer (the CUDA-aware path, forced with
    CNN_MPI_CUDA_AWARE=1 — the simulator's device memory is host memory), rank 1 stages its gradient
    through the ring's pinned host copy (the path this machine's MPI gets: MPIX_Query_cuda_support() = 0).
    Both take part in the same allreduce; the weights equal the CPU ranks' to float32 rounding."""
    import subprocess
    import sys

    from cnn.parallel import launch

    flags = ["--strategy", "allreduce", "--reduced", "--data-dir", str(data_dir), "--batch-size", "1",
             "--limit-train", "4", "--limit-test", "2", "--epochs", "1", "--lr", "0.05", "--no-progress"]
    gpu = ["--stage", "cuda-tuned", "--checkpoint", str(tmp_path / "gpu.npz"), "--summary", str(tmp_path / "gpu.json")]
    rank = [sys.executable, "-m", "mpi4py", "-m", "cnn.parallel", *flags, *gpu]
    argv = [MPIEXEC, *launch.launcher_flags(MPIEXEC, 2, fault_tolerant=False), "-n", "1", "env",
            "CNN_MPI_CUDA_AWARE=1", *rank, ":", "-n", "1", *rank]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                          env=launch.environment({"NUMBA_ENABLE_CUDASIM": "1"}))
    summary = json.loads((tmp_path / "gpu.json").read_text())
    assert summary["status"] in ("completed", "did not learn"), done.stderr[-2000:]
    paths = {rank: summary["per_rank"][rank]["gpu_path"] for rank in ("0", "1")}
    assert paths["0"].startswith("CUDA-aware MPI") and paths["1"].startswith("staged: the gradient ring"), paths
    cpu = run_parallel("allreduce", 2, data_dir, tmp_path, name="cpu", reduced=True, batch_size=1, limit_train=4,
                       limit_test=2, lr=0.05)
    assert cpu.summary is not None, cpu.stderr[-2000:]
    got, expected = checkpoint_of(tmp_path / "gpu.npz")["params"], checkpoint_of(tmp_path / "cpu.npz")["params"]
    initial = get_stage("numpy")(get_network("lenet5", reduced_copy=True)).init("he", 0).get_params()
    assert relative_error(got, expected) < 1e-5, relative_error(got, expected)
    assert relative_error(expected, initial) > 1e-2
    np.testing.assert_allclose([s[1] for s in summary["history"]["steps"]],
                               [s[1] for s in cpu.summary["history"]["steps"]], rtol=1e-5)


def test_allreduce_overlapped_with_the_backward_pass_equals_the_plain_one(data_dir, tmp_path):
    """Each layer's bucket allreduced as its backward ends, the loss first: the same sums as one
    allreduce of the whole vector after the backward pass, so the same weights (float64, 3 ranks)."""
    settings = dict(limit_train=96, dtype="float64")
    plain = run_parallel("allreduce", 3, data_dir, tmp_path, name="plain", **settings)
    overlapped = run_parallel("allreduce", 3, data_dir, tmp_path, name="overlapped", overlap=True, **settings)
    for result in (plain, overlapped):
        assert_ran_to_the_end(result)
    got, expected = (checkpoint_of(tmp_path / f"{name}.npz")["params"] for name in ("overlapped", "plain"))
    assert relative_error(got, expected) < 1e-12, relative_error(got, expected)
    initial = get_stage("numpy")(get_network("lenet5"), np.float64).init("he", 0).get_params()
    assert relative_error(expected, initial) > 1e-2
    np.testing.assert_allclose([s[1] for s in overlapped.summary["history"]["steps"]],
                               [s[1] for s in plain.summary["history"]["steps"]], rtol=1e-12)
    assert overlapped.summary["options"]["overlap"] and not plain.summary["options"]["overlap"]


def test_overlap_needs_mpis_allreduce_and_a_host_stage():
    from cnn.parallel.allreduce import check_overlap, layer_buckets
    from cnn.parallel.common import ParallelOptions

    with pytest.raises(ValueError, match="--overlap needs --allreduce mpi"):
        check_overlap(ParallelOptions(allreduce="ring", overlap=True), get_stage("numpy"))
    net = get_network("lenet5")
    buckets = layer_buckets(net)
    assert sorted(buckets) == [0, 3, 7, 9, 11]                     # the layers with weights
    assert sum(stop - start for start, stop in buckets.values()) == net.num_params
    assert buckets[11][1] == net.num_params and buckets[0][0] == 0


def one_process_float64(data_dir, batch_size, limit_train) -> np.ndarray:
    """cnn.train's weights after one epoch with ``batch_size``, in float64."""
    from cnn.train import train

    config = TrainConfig(data_dir=str(data_dir), batch_size=batch_size, epochs=1, lr=0.02, progress=False,
                         limit_train=limit_train, dtype="float64")
    stage = get_stage("numpy")(get_network("lenet5"), np.float64).init(config.init, config.seed)
    train(config, load_dataset(config), stage)
    return stage.get_params()


@pytest.mark.parametrize("split", ["3:5", None])
def test_model_parallel_split_by_channels_or_by_cost_equals_one_process(split, data_dir, tmp_path):
    """The second convolution's 16 filters split 5 / 11 across the ranks (its ReLU and pool with them),
    or the cut the probe finds balanced; 3 micro-batches: one process's weights, in float64."""
    result = run_parallel("model-parallel", 2, data_dir, tmp_path, limit_train=48, micro_batches=3,
                          dtype="float64", split=split)
    assert_ran_to_the_end(result)
    summary = result.summary
    if split:
        assert summary["split"] == split and summary["costs_s"] is None
    else:
        from cnn.parallel import partition
        costs = partition.Costs.from_json(summary["costs_s"])
        assert len(costs.layers) == 12 and np.all(costs.layers > 0) and summary["rank_costs_s"] is not None
        assert summary["split"] == str(partition.balanced_partition(get_network("lenet5"), costs))
    expected = one_process_float64(data_dir, 8, 48)
    got = checkpoint_of(tmp_path / "run.npz")["params"]
    assert relative_error(got, expected) < 1e-12, relative_error(got, expected)


def test_cuda_aware_mpi_is_detected_and_the_answer_says_how(tmp_path, monkeypatch):
    from cnn.parallel import gpu_ranks

    fake = tmp_path / "ompi_info"
    for value in ("true", "false"):
        fake.write_text(f"#!/bin/sh\necho 'mca:opal:base:param:opal_built_with_cuda_support:value:{value}'\n"
                        f"echo 'mca:opal:base:param:opal_built_with_cuda_support:synonym:name:mpi_built_with_cuda_support'\n")
        fake.chmod(0o755)
        assert gpu_ranks.ompi_built_with_cuda(str(fake)) is (value == "true")
    fake.write_text("#!/bin/sh\necho 'nothing about CUDA'\n")
    assert gpu_ranks.ompi_built_with_cuda(str(fake)) is None
    answer = gpu_ranks.query_cuda_support()                      # MPIX_Query_cuda_support of the loaded MPI
    assert answer is None or isinstance(answer, bool)
    monkeypatch.setenv(gpu_ranks.CUDA_AWARE_VARIABLE, "1")
    assert gpu_ranks.cuda_aware_mpi() == (True, "CNN_MPI_CUDA_AWARE=1")
    monkeypatch.delenv(gpu_ranks.CUDA_AWARE_VARIABLE)
    aware, how = gpu_ranks.cuda_aware_mpi()
    assert isinstance(aware, bool) and ("MPIX_Query_cuda_support" in how or "ompi_info" in how or "neither" in how)
