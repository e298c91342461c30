"""Stage 8 ``cuda-fused-net`` against stage 2 (``numpy``, float64), in the simulator on small networks.

The whole step of a group of samples is one kernel walking a layer table, so every layer kind and
every way the table builder joins layers into rows is exercised here: both reduced networks, the
networks of tests/test_stages_reference.py (stride 2, padding 2, overlapping pools, a Conv with no
pool after it), stage 5's network with no fusion pattern (a Conv → MaxPool → ReLU, a Dense with no
ReLU) and one that opens with a ReLU and stacks two pools (rows with no convolution). Batches of 1,
and of 3 in blocks of 2 samples (the last block half full). Every path of the kernels is taken by
some case, and ``test_the_cases_take_every_path`` says which: convolutions split into slices and
unsplit, pooling windows of more than 4 positions, dW split into parts, inputs with a zero border,
filter and channel counts past a tile of 8 and not a multiple of it, weights staged in several
steps (a block given little shared memory), blocks of several rounds of items. Shared memory
starts as NaN in the simulator (``poison``), so a value read before it is written fails the
comparison. The tests marked ``gpu`` repeat the comparison at full size, and check that graph
replays equal eager steps bit for bit.
"""

from functools import partial

import numpy as np
import pytest
from test_cuda_stages import HYPER, NETWORKS, TOL, compare_training, prepared, start_params
from test_cuda_tuned import epoch_data, run_epoch
from test_stages_reference import ODD_NETWORKS

from cnn.gradcheck import rel_error
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, alexnet_small, lenet5
from cnn.stages import get_stage
from cnn.stages.s2_numpy import NumpyStage
from cnn.stages.s8_cuda_fused_net import CudaFusedNetStage, layer_table
from kernels import fused_net_cost
from kernels.fused_net_cost import predict
from kernels.fused_net_step import H100_SHARED_LIMIT
from kernels.fused_net_step import THREADS as GPU_THREADS
from kernels.fused_net_table import (DENSE, DW_PARTS, DX_FILTERS, KIND, OPAD, PAD, SLICES, STEP_ROWS, WINDOW, WORD,
                                     C, F, K, POOL, RELU)
from kernels.streams import AllocationCounter

FUSED_NETWORKS = {
    **NETWORKS, **ODD_NETWORKS,
    "relu-first-pool-after-pool": Network("relu-first", (2, 8, 8), (
        ReLU(), MaxPool(2, 2),                                # a row without convolution: ReLU + pool
        Conv(2, 3, 3, pad=1), MaxPool(2, 1), MaxPool(2, 1),   # a conv with a pool and no ReLU; a pool of its own
        ReLU(), Flatten(), Dense(12, 4), ReLU(), Dense(4, 3))),
}
# (network, batch, samples a block): None = the stage's own choice (1 at these batch sizes)
CASES = [("lenet5-reduced", 1, None), ("alexnet-small-reduced", 3, 2), ("no-fusion-pattern", 2, None),
         ("stride2-pool3s2", 3, 2), ("pad2-pool2s1", 3, 2), ("relu-first-pool-after-pool", 2, None)]
THREADS = 32                  # a block in the simulator (any count gives the same bits; see below)
# 9 and 10 channels and filters: two tiles of 8, the second one short; given too little shared memory to stage
# a convolution's weights at once (``staged_in_steps``)
TILES = Network("tiles", (9, 6, 6), (Conv(9, 10, 3, pad=1), ReLU(), MaxPool(2, 2), Conv(10, 9, 3, pad=1), ReLU(),
                                     Flatten(), Dense(81, 3)))


def fused(samples=None, threads=THREADS, **options):
    return partial(CudaFusedNetStage, samples_per_block=samples, threads=threads, **options)


def staged_in_steps(net, samples=1, room=600):
    """Bytes of shared memory that leave ``room`` words for the staging area: every weight staged in steps."""
    regions = layer_table(net).plan(samples, 2**30).regions
    return WORD * (sum(words for name, words in regions.items() if name != "staging") + room)


@pytest.mark.parametrize("net_name, batch, samples", CASES, ids=[case[0] for case in CASES])
def test_training_steps_equal_numpy(net_name, batch, samples):
    """Loss, gradient, parameters and momentum after each of 2 SGD steps, then the logits."""
    stage = compare_training(fused(samples), FUSED_NETWORKS[net_name], batch, steps=2)
    assert stage.launches_per_step() == 3                  # fused step, sum of the partials, SGD


def test_the_table_joins_layers_into_rows():
    """LeNet-5: two conv rows with ReLU and pool, three dense rows; the odd network: a ReLU + pool row with
    no convolution, a conv row with a pool and no ReLU, a pool row of its own that takes the last ReLU."""
    rows = lambda net: [(r[KIND], r[K], r[POOL], r[RELU]) for r in layer_table(net).plan(1, 2**30).table[1:]]
    assert rows(lenet5()) == [(WINDOW, 5, 2, 1)] * 2 + [(DENSE, 0, 1, 1)] * 2 + [(DENSE, 0, 1, 0)]
    assert rows(FUSED_NETWORKS["relu-first-pool-after-pool"]) == [
        (WINDOW, 0, 2, 1), (WINDOW, 3, 2, 0), (WINDOW, 0, 2, 1), (DENSE, 0, 1, 1), (DENSE, 0, 1, 0)]


def test_weights_staged_in_several_steps_train_like_numpy():
    """Too little shared memory to stage a convolution's weights at once: the forward pass stages filter rows in
    3 and 5 steps, dL/dx filters in 3, every thread passing every barrier (rounds of items); 9 and 10 channels
    and filters leave the second tile of 8 short."""
    limit = staged_in_steps(TILES)
    table = layer_table(TILES).plan(1, limit).table
    convs = [row for row in table[1:] if row[KIND] == WINDOW]
    assert [row[C] * row[K] // row[SLICES] // row[STEP_ROWS] for row in convs] == [3, 5]
    assert convs[1][F] // convs[1][DX_FILTERS] == 3
    compare_training(fused(shared_bytes=limit), TILES, 2, steps=1)


def test_the_cases_take_every_path():
    """The networks above, as the stage plans them, take each path of kernels/fused_net_window.py somewhere."""
    rows = [row for name, batch, samples in CASES
            for row in layer_table(FUSED_NETWORKS[name]).plan(samples or 1, H100_SHARED_LIMIT).table[1:]
            if row[KIND] == WINDOW and row[K] > 0]
    assert any(row[SLICES] > 1 for row in rows) and any(row[SLICES] == 1 and row[POOL] <= 2 for row in rows)
    assert any(row[POOL] ** 2 > 4 for row in rows)                       # several groups of 4 window positions
    assert any(row[DW_PARTS] > 1 for row in rows) and any(row[DW_PARTS] == 1 for row in rows)
    assert any(row[PAD] > 0 for row in rows) and any(row[OPAD] > 0 for row in rows)
    assert any(row[K] % 2 == 0 for row in rows) and any(row[POOL] == 1 for row in rows)


def test_shared_memory_budget_of_both_networks():
    """The figures of the module docstring: one sample a block takes 52.7 KiB (LeNet-5) and 214.2 KiB
    (AlexNet-small) of the 227 KiB an H100 block may have; two AlexNet-small samples do not fit."""
    assert layer_table(lenet5()).plan(1, H100_SHARED_LIMIT).shared_bytes == 53972
    assert layer_table(alexnet_small()).plan(1, H100_SHARED_LIMIT).shared_bytes == 219308
    with pytest.raises(ValueError, match=r"^2 sample\(s\) a block need 328\.4 KiB"):
        layer_table(alexnet_small()).plan(2, H100_SHARED_LIMIT)


def test_a_network_that_does_not_fit_is_refused_in_one_line():
    wide = Network("wide", (3, 64, 64), (Conv(3, 64, 3, pad=1), ReLU(), Flatten(), Dense(64 * 64 * 64, 10)))
    with pytest.raises(ValueError, match="stage 'cuda-fused-net': network 'wide' cannot be fused: 1 sample") as err:
        CudaFusedNetStage(wide)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="samples_per_block must be at least 1"):
        CudaFusedNetStage(NETWORKS["lenet5-reduced"], samples_per_block=0)
    with pytest.raises(ValueError, match="threads must be a positive multiple of 32, got 48"):
        CudaFusedNetStage(NETWORKS["lenet5-reduced"], threads=48)
    wide_pool = Network("wide-pool", (1, 40, 40), (MaxPool(20, 20), Flatten(), Dense(4, 2)))
    with pytest.raises(ValueError, match="network 'wide-pool' cannot be fused: a 20x20 pool: a switch holds"):
        CudaFusedNetStage(wide_pool)


def test_samples_a_block_grow_only_with_the_batch():
    stage = CudaFusedNetStage(lenet5())
    assert [stage.samples_for(batch) for batch in (1, 64, 264, 265, 1024, 10**5)] == [1, 1, 1, 2, 4, 6]
    assert CudaFusedNetStage(alexnet_small()).samples_for(10**5) == 1


def test_epoch_api_matches_numpy_fed_the_same_batches():
    """5 steps of batch 3 in blocks of 2, asked for in requests of 2, 2 and 1: the losses the device logs,
    the parameters, the test set scored on the device; 3 kernels a step, nothing allocated after warm-up."""
    net = NETWORKS["lenet5-reduced"]
    params, data = start_params(net), epoch_data(net, samples=7, test=5)
    order, lrs = np.random.default_rng(5).permutation(15) % 7, np.linspace(HYPER["lr"], HYPER["lr"] / 4, 5)
    ref = prepared(NumpyStage, net, np.float64, params)
    expected = run_epoch(ref, data, order, lrs, 3, [(0, 5)])
    stage = prepared(fused(2), net, np.float32, params)
    losses = run_epoch(stage, data, order, lrs, 3, [(0, 2)])
    with AllocationCounter() as allocations:
        losses = np.concatenate([losses, stage.run_steps(2, 2), stage.run_steps(4, 1)])
    assert allocations.count == 0, allocations.calls
    assert rel_error(losses, expected) < TOL
    assert rel_error(stage.get_params(), ref.get_params()) < TOL
    assert rel_error(stage.get_momentum(), ref.get_momentum()) < TOL
    (correct, loss_sum), (ref_correct, ref_loss_sum) = stage.test_scores(), ref.test_scores()
    assert correct == ref_correct and loss_sum == pytest.approx(ref_loss_sum, rel=TOL)
    assert stage.launches_per_step() == 3                  # fused step, sum + SGD, the loss logged


def test_training_is_reproducible_bit_for_bit_whatever_the_block_size():
    """No atomics: two runs of 3 steps end in the same bits — and so does a run with blocks of another size,
    since every value is summed by one thread in a fixed order."""
    net = NETWORKS["alexnet-small-reduced"]
    data = epoch_data(net, samples=6)
    results = []
    for threads in (THREADS, THREADS, 2 * THREADS):
        stage = prepared(fused(2, threads), net, np.float32, start_params(net))
        losses = run_epoch(stage, data, np.arange(9) % 6, np.full(3, HYPER["lr"]), 3, [(0, 3)])
        results.append((losses, stage.get_params(), stage.get_momentum()))
    for losses, params, momentum in results[1:]:
        assert np.array_equal(losses, results[0][0]) and np.array_equal(params, results[0][1])
        assert np.array_equal(momentum, results[0][2])


def test_trainer_drives_the_stage_like_numpy(tmp_path):
    """cnn.train.train with cuda-fused-net (requests cut at every checkpoint) = with numpy: the same losses,
    and the test accuracy the device counted = the one the host counted."""
    from cnn.train import TrainConfig, train

    net = NETWORKS["lenet5-reduced"]
    data = epoch_data(net, samples=8, test=4)
    config = dict(model="lenet5", epochs=2, batch_size=2, lr=0.05, progress=False, checkpoint_every=3)
    runs = {}
    for name, stage_class, dtype in [("numpy", NumpyStage, np.float64), ("cuda-fused-net", fused(), np.float32)]:
        stage = prepared(stage_class, net, dtype, start_params(net))
        runs[name] = train(TrainConfig(**config, checkpoint=str(tmp_path / f"{name}.npz")), data, stage=stage)
    losses = {name: np.array([step[1] for step in run["steps"]]) for name, run in runs.items()}
    assert len(losses["cuda-fused-net"]) == 8 and rel_error(losses["cuda-fused-net"], losses["numpy"]) < TOL
    assert runs["cuda-fused-net"]["epochs"][-1]["test_accuracy"] == runs["numpy"]["epochs"][-1]["test_accuracy"]


def test_registry_and_bad_data_in_one_line():
    assert get_stage("cuda-fused-net") is CudaFusedNetStage
    stage = CudaFusedNetStage(NETWORKS["lenet5-reduced"])
    images, labels, _, _ = epoch_data(stage.net, samples=2, test=0)
    with pytest.raises(ValueError, match=r"the training images have shape \(2, 1, 8, 8\)"):
        stage.load_dataset(images[:, :, :8, :8], labels)
    with pytest.raises(ValueError, match=r"the training labels must lie in \[0, 10\)"):
        stage.load_dataset(images, labels + 10)
    with pytest.raises(RuntimeError, match="load_dataset first"):
        stage.run_steps(0, 1)


# -- full size, on a GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("net, batch", [(lenet5(), 16), (alexnet_small(), 8)], ids=["lenet5", "alexnet-small"])
def test_full_size_networks_train_like_numpy(net, batch):
    compare_training(partial(CudaFusedNetStage, poison=True), net, batch, steps=3, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("net, batch", [(lenet5(), 64), (alexnet_small(), 128)], ids=["lenet5", "alexnet-small"])
def test_full_size_graph_replays_equal_eager_steps_bit_for_bit(net, batch):
    """30 steps replayed as one CUDA graph a step against the same steps queued kernel by kernel, and against a
    second graphed run: identical losses and parameters (no atomics anywhere)."""
    rng = np.random.default_rng(1)
    samples = 5 * batch
    data = (rng.standard_normal((samples, *net.input_shape)).astype(np.float32), rng.integers(0, 10, samples),
            None, None)
    order, lrs = rng.permutation(samples), np.linspace(0.02, 0.01, 30)
    results = []
    for graphs in (True, False, True):
        stage = CudaFusedNetStage(net, graphs=graphs).init("he", 0)
        stage.load_dataset(*data)
        stage.begin_epoch(np.concatenate([order] * 6), lrs, batch, 0.9, 5e-4)
        losses = np.concatenate([stage.run_steps(first, 10) for first in (0, 10, 20)])
        results.append((losses, stage.get_params(), stage.launches_per_step()))
    assert results[0][2] == 1 and results[1][2] == 3
    for losses, params, _ in results[1:]:
        assert np.array_equal(losses, results[0][0]) and np.array_equal(params, results[0][1])


def test_predicted_figures_in_the_docstring_are_what_the_cost_model_gives():
    """The docstring's PREDICTED step times, recomputed by kernels/fused_net_cost.py from the layer tables."""
    import cnn.stages.s8_cuda_fused_net as s8

    for label, net, batch in [("LeNet-5 b64", lenet5(), 64), ("AlexNet-small b128", alexnet_small(), 128)]:
        low, high = s8.predicted_step(net, batch).step_ms
        line = next(line for line in s8.__doc__.splitlines() if line.strip().startswith(label))
        assert line.split()[-3:] == [f"{low:.2f}", "–", f"{high:.2f}"], line


def test_one_block_a_sample_runs_in_one_wave_up_to_the_number_of_sms():
    """The cost model: 64 and 128 samples take one wave of blocks on 132 SMs (the same kernel time), 264 two (the
    high end's floor, what a kernel costs beyond its work, once)."""
    builder = layer_table(lenet5())
    times = [predict(builder, lenet5().num_params, batch, 1, GPU_THREADS).kernel_1_us for batch in (64, 128, 264)]
    floor = fused_net_cost.HIGH.floor_us
    assert times[0] == times[1] and times[2][0] == pytest.approx(2 * times[0][0])
    assert times[2][1] - floor == pytest.approx(2 * (times[0][1] - floor))


def test_the_cost_model_uses_issue_22s_calibration_and_the_sass():
    """The high end's constants are issue 22's calibrated ones, and the forward tap's instructions are those of
    the committed static report's hot loop (benchmarks/results/static-sm90-cuda-fused-net-*.json)."""
    import json
    from pathlib import Path

    from cnn.bench.predict_step import CALIBRATED

    assert fused_net_cost.ISSUE_WARPS == CALIBRATED["ISSUE_WARPS"]
    assert fused_net_cost.MEMORY_LATENCY_US == CALIBRATED["MEMORY_LATENCY"]
    assert fused_net_cost.KERNEL_FLOOR_US == CALIBRATED["KERNEL_FLOOR"]
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for model in ("lenet5-b64", "alexnet-small-b128"):
        report = json.loads((results / f"static-sm90-cuda-fused-net-{model}.json").read_text())
        kernel = next(k for k in report["kernels"] if k["function"] == "fused_net_step_kernel")
        hot = kernel["mix"]["hot"]
        taps = hot["ffma"] // (fused_net_cost.POSITIONS * fused_net_cost.FILTER_TILE)
        assert (hot["instructions"] / taps, hot["lds"] / taps) == fused_net_cost.PER_ITERATION["forward tap"]
        assert kernel["resources"]["registers"] <= 128 and kernel["resources"]["spill_stores"] == 0    # 16 warps
