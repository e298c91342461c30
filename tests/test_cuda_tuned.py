"""Stage 7 ``cuda-tuned``: every fix, alone and all together, against stage 2 (``numpy``).

Each fix is a switch (``CudaTunedStage(net, fixes=...)``), so each is checked on its own on a
tiny network in the simulator, and all of them together on the reduced LeNet-5 / AlexNet-small and
on a network that breaks the fusion patterns. The epoch API (``load_dataset``, ``begin_epoch``,
``run_steps``, ``test_scores``: resident data, the loop on the device, the overlapped copies) is
checked against stage 2 fed the same batches, and so is the trainer driving it. In the simulator
``cuda-graph`` runs its steps eagerly (there is nothing to capture); the tests marked ``gpu``
prove that the replayed graphs equal the eager steps bit for bit. Timings are never asserted:
the ablation that measures the fixes refuses to run here.
"""

from contextlib import contextmanager
from functools import partial

import numpy as np
import pytest
from test_cuda_stages import HYPER, NETWORKS, TOL, compare_training, prepared, start_params

from cnn.bench.ablation import ablation, ablation_variants
from cnn.bench.census import census_counts, census_table
from cnn.cli import main
from cnn.gradcheck import rel_error
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, alexnet_small, lenet5
from cnn.stages import get_stage
from cnn.stages.s2_numpy import NumpyStage
from cnn.stages.s7_cuda_tuned import FIXES, CudaTunedStage, with_requirements
from kernels import dense_fused
from kernels.device import cuda, simulated
from kernels.launch_config import LaunchConfig
from kernels.streams import AllocationCounter

# a fused conv block, then Dense → ReLU → Dense: the dX mask, the db-in-dW sum and the fused loss all have work
TINY = Network("tiny-mlp-head", (1, 6, 6), (Conv(1, 2, 3), ReLU(), MaxPool(2, 2), Flatten(),
                                            Dense(8, 4), ReLU(), Dense(4, 3)))
# kernels per training step with every fix (no gather: train_step copies its batch; the tiled conv blocks take
# 1 forward and 3-4 backward), and with none (= stage 6)
LAUNCHES = {"lenet5-reduced": (19, 26), "no-fusion-pattern": (20, 24)}


def tuned(*fixes):
    return partial(CudaTunedStage, fixes=with_requirements(*fixes))


EPOCH_FIXES = ("resident-data", "device-epoch", "cuda-graph")      # change nothing on the train_step path


@pytest.mark.parametrize("fix", [fix for fix in FIXES if fix not in EPOCH_FIXES])
def test_each_fix_alone_trains_like_numpy(fix):
    """(The epoch fixes act on run_steps: test_epoch_api_matches_numpy_fed_the_same_batches runs them.)"""
    compare_training(tuned(fix), TINY, batch=2)


@pytest.mark.parametrize("net_name", list(LAUNCHES))
def test_all_fixes_train_like_numpy(net_name):
    stage = compare_training(CudaTunedStage, NETWORKS[net_name], batch=2)
    assert stage.fixes == FIXES and stage.launches_per_step() == LAUNCHES[net_name][0]


def epoch_data(net, samples=5, test=3, seed=11):
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((samples + test, *net.input_shape)).astype(np.float32)
    labels = rng.integers(0, net.num_classes, samples + test)
    return images[:samples], labels[:samples], images[samples:], labels[samples:]


def run_epoch(stage, data, order, lrs, batch, requests):
    """load_dataset, begin_epoch, then run_steps for each (first, count) of ``requests``: the losses."""
    stage.load_dataset(*data)
    stage.begin_epoch(order, lrs, batch, HYPER["momentum"], HYPER["weight_decay"])
    return np.concatenate([stage.run_steps(first, count) for first, count in requests])


# kernels a step — every fix: gather 1, forward 3 (conv, dense, dense + loss), backward 7 (the conv's dz, dW and
# the sum of its splits; dW and dX of each dense), SGD 1, loss log 1; resident data: gather + stage 6's 16
# (forward 6, backward 9, update 1); the others copy their batch: stage 6's 16
@pytest.mark.parametrize("fixes, launches", [(FIXES, 13), (("resident-data",), 17),
                                             (("pinned-buffers", "overlap-copies"), 16), ((), 16)],
                         ids=["all-fixes", "resident-data", "overlap-copies", "none"])
def test_epoch_api_matches_numpy_fed_the_same_batches(fixes, launches):
    """5 steps of batch 2 over 10 orderings of 5 samples, asked for in requests of 2, 2 and 1 steps."""
    net, params, data = TINY, start_params(TINY), epoch_data(TINY)
    order, lrs = np.random.default_rng(5).permutation(10) % 5, np.linspace(HYPER["lr"], HYPER["lr"] / 4, 5)
    ref = prepared(NumpyStage, net, np.float64, params)
    expected = run_epoch(ref, data, order, lrs, 2, [(0, 5)])
    stage = prepared(partial(CudaTunedStage, fixes=with_requirements(*fixes)), net, np.float32, params)
    losses = run_epoch(stage, data, order, lrs, 2, [(0, 2)])
    with AllocationCounter() as allocations:           # buffers, graphs' inputs, both input sets exist by now
        losses = np.concatenate([losses, stage.run_steps(2, 2), stage.run_steps(4, 1)])
    assert allocations.count == 0, allocations.calls
    assert rel_error(losses, expected) < TOL
    assert rel_error(stage.get_params(), ref.get_params()) < TOL
    correct, loss_sum = stage.test_scores()
    assert correct == ref.test_scores()[0] and loss_sum == pytest.approx(ref.test_scores()[1], rel=TOL)
    assert stage.launches_per_step() == launches


@pytest.mark.filterwarnings("ignore::RuntimeWarning")    # the simulator computes the overflow with numpy scalars
def test_device_epoch_flags_the_first_non_finite_loss():
    """A rate that blows up: the loss log turns NaN/inf, and the device's flag names the first such step."""
    data = epoch_data(TINY, samples=6)
    stage = prepared(CudaTunedStage, TINY, np.float32, start_params(TINY))
    losses = run_epoch(stage, data, np.arange(6), np.array([0.05, 1e30, 0.05]), 2, [(0, 3)])
    assert np.isfinite(losses[:2]).all() and not np.isfinite(losses[2])
    assert stage.epoch_state.first_bad_step() == 2


class StopAtRequest:
    """Wraps a stage: its ``requests``-th ``run_steps`` request raises KeyboardInterrupt (a run killed there)."""

    def __init__(self, stage, requests):
        self.stage, self.requests_left = stage, requests

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def run_steps(self, first, count):
        self.requests_left -= 1
        if self.requests_left < 0:
            raise KeyboardInterrupt
        return self.stage.run_steps(first, count)


def test_trainer_drives_the_device_epoch_like_numpy(tmp_path, monkeypatch):
    """cnn.train.train with cuda-tuned (requests of SYNC_EVERY steps, cut at every checkpoint) = with numpy;
    and a run stopped after its first checkpoint resumes mid-epoch to the same result, bit for bit.
    TINY, 2 epochs of 3 steps, a checkpoint every 2: requests of 2 and 1 steps, then 1 and 2."""
    from cnn import checkpoint_schema
    from cnn.train import TrainConfig, train

    monkeypatch.setattr(checkpoint_schema, "get_network", lambda name, *rest: TINY)  # TINY's checkpoints load
    data = epoch_data(TINY, samples=6, test=3)
    config = dict(model="lenet5", epochs=2, batch_size=2, lr=0.05, progress=False, checkpoint_every=2)
    runs, stages = {}, {}
    for name, stage_class, dtype in [("numpy", NumpyStage, np.float64), ("cuda-tuned", CudaTunedStage, np.float32)]:
        stages[name] = prepared(stage_class, TINY, dtype, start_params(TINY))
        runs[name] = train(TrainConfig(**config, checkpoint=str(tmp_path / f"{name}.npz")), data, stage=stages[name])
    losses = {name: np.array([step[1] for step in run["steps"]]) for name, run in runs.items()}
    assert len(losses["cuda-tuned"]) == 6 and rel_error(losses["cuda-tuned"], losses["numpy"]) < TOL
    assert runs["cuda-tuned"]["epochs"][-1]["test_accuracy"] == runs["numpy"]["epochs"][-1]["test_accuracy"]

    checkpoint = str(tmp_path / "stopped.npz")
    stopped = StopAtRequest(prepared(CudaTunedStage, TINY, np.float32, start_params(TINY)), requests=1)
    with pytest.raises(KeyboardInterrupt):                      # after the checkpoint at step 2, mid-epoch
        train(TrainConfig(**config, checkpoint=checkpoint), data, stage=stopped)
    resumed = prepared(CudaTunedStage, TINY, np.float32, start_params(TINY, seed=7))    # overwritten on resume
    history = train(TrainConfig(**config, checkpoint=checkpoint, resume=True), data, stage=resumed)
    assert [step[1] for step in history["steps"]] == [step[1] for step in runs["cuda-tuned"]["steps"]]
    assert np.array_equal(resumed.get_params(), stages["cuda-tuned"].get_params())


def test_tiled_training_is_reproducible_bit_for_bit():
    """No atomics anywhere in the step: two runs from the same start end in the same bits (on a GPU, where
    stage 5's atomics land in a different order every run, this is what tiled-conv buys)."""
    net, data = NETWORKS["lenet5-reduced"], epoch_data(NETWORKS["lenet5-reduced"], samples=4)
    results = []
    for _ in range(2):
        stage = prepared(CudaTunedStage, net, np.float32, start_params(net))
        losses = run_epoch(stage, data, np.arange(4), np.full(2, HYPER["lr"]), 2, [(0, 2)])
        results.append((losses, stage.get_params()))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


@contextmanager
def multi_block_kernels_counted_not_run():
    """In Numba's simulator: launches of more than one block are made (counted, their arguments passed) but not
    run, as the static report records a step (cnn/bench/static_record.py) — launches, arguments, copies and
    allocations are the host's, whatever the kernels compute; the one-block kernels run (the step counter, the
    flags and the loss log the host reads back). On a GPU: nothing changes."""
    if not simulated():
        yield
        return
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    run = FakeCUDAKernel.__call__

    def launch(kernel, *args):
        if kernel._device or tuple(kernel.grid_dim) == (1, 1, 1):
            return run(kernel, *args)
        return None

    FakeCUDAKernel.__call__ = launch
    try:
        yield
    finally:
        FakeCUDAKernel.__call__ = run


@pytest.fixture(scope="module")
def census():
    """cnn/bench/census.py's counts of cuda-ring and cuda-tuned on both full-size networks, batch 2, one request
    of 4 steps (the docstring's table), shared by the tests below: ~10 s where running every kernel in the
    simulator took minutes even on the narrow copies."""
    with multi_block_kernels_counted_not_run():
        return census_counts(batch_size=2, steps=4)


def test_counts_per_step_after(census):
    """The profile's counts with every fix, over one request of 4 steps: no allocation; one upload (the step
    counter) and two downloads (the loss log and the flags) for the whole request, where stage 6 copies 2 and 1
    every step; the host's launch cost priced at numba-cuda#288's rate."""
    for model in ("lenet5", "alexnet-small"):
        ring, tuned = census[model, "cuda-ring"], census[model, "cuda-tuned"]
        assert ring["device_allocations"] == tuned["device_allocations"] == 0
        assert (ring["copies_to_device"], ring["copies_to_host"]) == (2, 1)
        assert (tuned["copies_to_device"], tuned["copies_to_host"]) == (1 / 4, 2 / 4)
        assert tuned["bytes_to_device"] == 8 / 4                       # the step counter, once a request
        assert tuned["modelled_launch_us"] == pytest.approx(6.6 * tuned["launches"] + 3.5 * tuned["array_args"])


def test_census_table_in_the_docstring_is_what_the_code_counts(census):
    """The docstring's before/after counts, every row (the bytes too: counted at full size)."""
    import cnn.stages.s7_cuda_tuned as s7

    documented = [line.strip() for line in s7.__doc__.splitlines()]
    for row in census_table(census, batch_size=2).splitlines()[1:]:
        label, counted = row[:40].strip(), row[40:].split()
        line = next(line for line in documented if line.startswith(label))
        assert [float(v) for v in line[len(label):].split()] == pytest.approx([float(v) for v in counted]), label


def test_fix_switches_are_checked_in_one_line():
    with pytest.raises(ValueError, match="unknown fix 'warp-shuffles'"):
        CudaTunedStage(TINY, fixes=("warp-shuffles",))
    with pytest.raises(ValueError, match="'overlap-copies' needs pinned-buffers"):
        CudaTunedStage(TINY, fixes=("overlap-copies",))
    assert get_stage("cuda-tuned") is CudaTunedStage
    assert CudaTunedStage(TINY, fixes=()).fixes == ()


def test_ablation_measures_each_fix_against_a_baseline_one_fix_away():
    rows = ablation_variants()
    alone = [row for row in rows if row[0].endswith("alone")]
    assert [row[0] for row in alone] == [f"+ {fix} alone" for fix in FIXES]
    for label, baseline, fixes in rows[1:]:
        assert len(set(fixes) - set(baseline)) == 1, label
    assert rows[-1][2] == FIXES


def test_ablation_refuses_to_time_in_the_simulator():
    if not simulated():
        pytest.skip("a real GPU runs the ablation")
    with pytest.raises(RuntimeError, match="simulator"):
        ablation("lenet5", 64)
    assert main(["bench", "--ablation"]) == 2


def test_dense_epilogues_on_several_tiles():
    """The fused dense kernels on shapes spanning 3 × 3 tiles of 8: bias + ReLU, db in the dW launch, masked dX."""
    rng = np.random.default_rng(3)
    x, w, b, dz = (rng.standard_normal(shape).astype(np.float32) for shape in [(3, 19), (17, 19), (17,), (3, 17)])
    d = {name: cuda.to_device(value) for name, value in dict(x=x, w=w, b=b, dz=dz).items()}
    y, dw, db, dx = (cuda.device_array(shape, dtype=np.float32) for shape in [(3, 17), (17, 19), (17,), (3, 19)])
    dense_fused.dense_forward(d["x"], d["w"], d["b"], y, True, tile=8)
    dense_fused.dense_backward_params(d["dz"], d["x"], dw, db, tile=8)
    dense_fused.dense_backward_data(d["dz"], d["w"], dx, tile=8, mask=d["x"])
    x64, w64, dz64 = x.astype(np.float64), w.astype(np.float64), dz.astype(np.float64)
    assert rel_error(y.copy_to_host(), np.maximum(x64 @ w64.T + b, 0)) < TOL
    assert rel_error(dw.copy_to_host(), dz64.T @ x64) < TOL
    assert rel_error(db.copy_to_host(), dz64.sum(axis=0)) < TOL
    assert rel_error(dx.copy_to_host(), (dz64 @ w64) * (x > 0)) < TOL


def test_launch_config_follows_the_layer_shape():
    config, fixed = LaunchConfig(True, sms=132), LaunchConfig(False)
    assert fixed.threads(10**6) == 128 and fixed.tile(10, 10) == 16
    assert config.threads(10**6) == 256          # plenty of work: big blocks
    assert config.threads(64 * 16 * 16) == 32    # conv2 of LeNet-5 at batch 64: small blocks to fill 132 SMs
    assert config.tile(1024, 1024) == 16 and config.tile(120, 256) == 8


# -- full size, on a GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fixes", [FIXES, ()], ids=["all-fixes", "no-fixes"])
@pytest.mark.parametrize("net, batch", [(lenet5(), 16), (alexnet_small(), 8)], ids=["lenet5", "alexnet-small"])
def test_full_size_networks_train_like_numpy(net, batch, fixes):
    compare_training(partial(CudaTunedStage, fixes=fixes), net, batch, steps=3, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("net", [lenet5(), alexnet_small()], ids=lambda net: net.name)
def test_full_size_epoch_on_the_device_equals_host_batches(net):
    """All fixes (graphs replayed from the third step on) against no fix, 12 steps of batch 64 at full size.

    Stage 6's atomics add in a different order every run, so the two trajectories part by float32
    rounding that grows step by step: the first steps agree to 1e-6, all twelve to 1e-3."""
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((768, *net.input_shape)).astype(np.float32), rng.integers(0, 10, 768), None, None)
    order, lrs = rng.permutation(768), np.full(12, 0.01)
    losses = {}
    for fixes in (FIXES, ()):
        stage = CudaTunedStage(net, fixes=fixes).init("he", 0)
        losses[fixes] = run_epoch(stage, data, order, lrs, 64, [(0, 5), (5, 7)])
    assert rel_error(losses[FIXES][:3], losses[()][:3]) < 1e-6
    assert rel_error(losses[FIXES], losses[()]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("net", [lenet5(), alexnet_small()], ids=lambda net: net.name)
def test_graph_replays_equal_eager_steps_bit_for_bit(net):
    """cuda-graph against the same step queued kernel by kernel: identical losses and parameters after
    30 steps (tiled-conv has no atomics, so the two can be compared bit for bit)."""
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((640, *net.input_shape)).astype(np.float32), rng.integers(0, 10, 640), None, None)
    order, lrs = rng.permutation(640), np.linspace(0.02, 0.01, 30)
    results = {}
    for fixes in (FIXES, tuple(fix for fix in FIXES if fix != "cuda-graph")):
        stage = CudaTunedStage(net, fixes=fixes).init("he", 0)
        stage.load_dataset(*data)
        stage.begin_epoch(np.concatenate([order] * 3), lrs, 64, 0.9, 5e-4)
        losses = np.concatenate([stage.run_steps(first, 10) for first in (0, 10, 20)])
        results[fixes] = (losses, stage.get_params(), stage.launches_per_step())
    graph, eager = results[FIXES], results[tuple(fix for fix in FIXES if fix != "cuda-graph")]
    assert graph[2] == 1 and eager[2] > 10
    assert np.array_equal(graph[0], eager[0]) and np.array_equal(graph[1], eager[1])
