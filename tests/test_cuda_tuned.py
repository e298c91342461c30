"""Stage 7 ``cuda-tuned``: every fix, alone and all together, against stage 2 (``numpy``).

Each fix is a switch (``CudaTunedStage(net, fixes=...)``), so each is checked on its own on a
tiny network in the simulator, and all of them together on the reduced LeNet-5 / AlexNet-small and
on a network that breaks the fusion patterns. The dataset API (resident data, shuffling by index
on the device, the overlapped copies of ``train_steps``) is checked against stage 2 fed the same
batches. Timings are never asserted: the ablation that measures the fixes refuses to run here.
"""

from functools import partial

import numpy as np
import pytest
from test_cuda_stages import HYPER, NETWORKS, TOL, compare_training, prepared, start_params

from cnn.bench.ablation import ablation, ablation_variants
from cnn.bench.census import census_runner, step_census
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
# kernels per training step with every fix (no gather: train_step copies its batch), and with none (= stage 6)
LAUNCHES = {"lenet5-reduced": (15, 26), "no-fusion-pattern": (19, 24)}


def tuned(*fixes):
    return partial(CudaTunedStage, fixes=with_requirements(*fixes))


@pytest.mark.parametrize("fix", [fix for fix in FIXES if fix != "resident-data"])
def test_each_fix_alone_trains_like_numpy(fix):
    """(resident-data changes nothing on the train_step path: test_dataset_api_... runs its own.)"""
    compare_training(tuned(fix), TINY, batch=2)


@pytest.mark.parametrize("net_name", list(LAUNCHES))
def test_all_fixes_train_like_numpy(net_name):
    stage = compare_training(CudaTunedStage, NETWORKS[net_name], batch=2)
    assert stage.fixes == FIXES and stage.launches_per_step() == LAUNCHES[net_name][0]


def test_dataset_api_matches_numpy_fed_the_same_batches():
    """train_steps over 3 samples in batches of 1: 4 steps cross an epoch (a reshuffle), resident and not."""
    net, params = TINY, start_params(TINY)
    rng = np.random.default_rng(11)
    images = rng.standard_normal((3, *net.input_shape)).astype(np.float32)
    labels = rng.integers(0, net.num_classes, 3)
    ref = prepared(NumpyStage, net, np.float64, params)
    expected = []
    for epoch, batch in [(0, 0), (0, 1), (0, 2), (1, 0)]:
        chosen = np.random.default_rng(5 + epoch).permutation(3)[batch:batch + 1]
        expected.append(ref.train_step(images[chosen].astype(np.float64), labels[chosen], **HYPER))
    # kernels a step: all fixes = gather 1, forward 3, backward 6 (one zeroing, 2 + 2 dense, 1 conv), update 1;
    # pinned + overlapped copies change no kernel: stage 6's 16 (forward 6, backward 9, update 1)
    for fixes, launches in [(FIXES, 11), (("pinned-buffers", "overlap-copies"), 16)]:
        stage = prepared(partial(CudaTunedStage, fixes=fixes), net, np.float32, params)
        stage.load_dataset(images, labels, seed=5)
        losses = stage.train_steps(2, 1, **HYPER)
        with AllocationCounter() as allocations:           # both input buffer sets exist: nothing new on the device
            losses += stage.train_steps(2, 1, **HYPER)
        assert allocations.count == 0, (fixes, allocations.calls)
        assert rel_error(np.array(losses), np.array(expected)) < TOL, fixes
        assert rel_error(stage.get_params(), ref.get_params()) < TOL, fixes
        assert stage.launches_per_step() == launches, fixes
    with pytest.raises(ValueError, match="outside the 3 samples"):
        stage.load_batch_at(2, 2)


def test_counts_per_step_after():
    """The profile's counts with every fix: no host→device copy, no allocation, 11 launches (stage 6: 2 copies, 16)."""
    rng = np.random.default_rng(0)
    images, labels = rng.standard_normal((4, *TINY.input_shape)).astype(np.float32), rng.integers(0, 3, 4)
    stage = CudaTunedStage(TINY).init("he", 0)
    counts = step_census(stage, census_runner(stage, images, labels, 1, (0.01, 0.9, 0.0)), steps=1)
    assert counts["copies_to_device"] == 0 and counts["device_allocations"] == 0 and counts["launches"] == 11
    assert counts["copies_to_host"] == 1                     # the loss (the ring's gradient copy is not counted)
    assert counts["modelled_launch_us"] == pytest.approx(6.6 * 11 + 3.5 * counts["array_args"])


def test_census_table_in_the_docstring_is_what_the_code_counts(capsys):
    """The docstring's before/after counts, recounted on the narrow networks (same layers, same counts)."""
    import cnn.stages.s7_cuda_tuned as s7

    assert main(["bench", "--census", "--reduced"]) == 0
    documented = [line.strip() for line in s7.__doc__.splitlines()]
    for row in capsys.readouterr().out.splitlines()[1:]:
        label, counted = row[:40].strip(), row[40:].split()
        if label == "bytes per sample":                 # the only row that depends on the input size
            continue
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
def test_full_size_dataset_api():
    net = lenet5()
    rng = np.random.default_rng(0)
    images, labels = rng.standard_normal((256, *net.input_shape)).astype(np.float32), rng.integers(0, 10, 256)
    losses = {}
    for fixes in (FIXES, ()):
        stage = CudaTunedStage(net, fixes=fixes).init("he", 0)
        stage.load_dataset(images, labels, seed=1)
        losses[fixes] = stage.train_steps(6, 64, 0.01, 0.9, 5e-4)
    assert rel_error(np.array(losses[FIXES]), np.array(losses[()])) < 1e-4
