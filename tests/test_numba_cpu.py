"""Stage 3 ``numba-cpu`` equal to the reference stages, op by op and network by network.

Also here: PyTorch on the identical network and parameters gives stage ``numpy``'s loss and
gradient (skipped without torch), which is what makes the benchmark's comparison fair.
Cold (no Numba cache) the file spends most of its time compiling the kernels for float64
and float32.
"""

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from cnn.gradcheck import rel_error
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, alexnet_small, lenet5
from cnn.stages import get_stage
from cnn.stages.s1_loops import LoopsStage
from cnn.stages.s2_numpy import NumpyStage
from cnn.stages.s3_numba_cpu import NumbaCpuStage, fusion_plan
from test_stages_reference import ODD_NETWORKS, make_stage, random_batch

# Conv followed by MaxPool *without* ReLU (unfused conv, standalone pool and ReLU kernels),
# then a fused block with an even kernel, pad 1 and an overlapping 3x3/s2 pool.
UNFUSED = Network("odd-c", (3, 9, 7), (
    Conv(3, 4, 3, stride=2, pad=1), MaxPool(2, 1), ReLU(),    # 4x5x4 -> 4x4x3
    Conv(4, 5, 2, pad=1), ReLU(), MaxPool(3, 2),               # 5x5x4 -> 5x2x1
    Flatten(), Dense(10, 6), ReLU(), Dense(6, 3)))

# a conv + ReLU + pool that the stage's forward takes by Winograd's F(2x2, 5x5): 16 channels, an output of
# even height and width, a filter count not a multiple of 4
WINOGRAD = Network("winograd", (16, 6, 8), (
    Conv(16, 6, 5, pad=2), ReLU(), MaxPool(2, 2),             # 6x6x8 -> 6x3x4
    Flatten(), Dense(72, 3)))

NETWORKS = {**ODD_NETWORKS, "unfused": UNFUSED, "winograd": WINOGRAD, "lenet5": lenet5()}
TOLERANCE = {np.float64: 1e-10, np.float32: 1e-4}


def assert_same_step(reference, stage, images, labels, tolerance):
    loss1, grad1 = reference.loss_and_grad(images, labels)
    loss2, grad2 = stage.loss_and_grad(images, labels)
    assert rel_error(loss1, loss2) < tolerance
    assert rel_error(grad1, grad2) < tolerance
    assert rel_error(reference.input_grad, stage.input_grad) < tolerance
    assert rel_error(reference.predict(images), stage.predict(images)) < tolerance


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("net_name", list(NETWORKS))
def test_equals_loops(net_name, dtype):
    net = NETWORKS[net_name]
    batch = 2 if net_name == "lenet5" else 3
    images, labels = random_batch(net, batch, dtype, seed=batch + len(net_name))
    assert_same_step(make_stage(LoopsStage, net, dtype), make_stage(NumbaCpuStage, net, dtype),
                     images, labels, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("net_name,batch", [("stride2-pool3s2", 1), ("unfused", 1), ("alexnet-small", 2)])
def test_equals_numpy(net_name, batch, dtype):
    net = alexnet_small() if net_name == "alexnet-small" else NETWORKS[net_name]
    images, labels = random_batch(net, batch, dtype, seed=21)
    assert_same_step(make_stage(NumpyStage, net, dtype), make_stage(NumbaCpuStage, net, dtype),
                     images, labels, TOLERANCE[dtype])


def test_lenet5_at_a_training_batch_size():
    """Batch 37: several sample blocks per thread, a partial last block, uneven thread shares."""
    net = lenet5()
    images, labels = random_batch(net, 37, np.float64, seed=4)
    assert_same_step(make_stage(NumpyStage, net, np.float64), make_stage(NumbaCpuStage, net, np.float64),
                     images, labels, 1e-10)


def _random_op_inputs(rng, size, stride, pad):
    x = rng.normal(size=(3, 5, 11, 8))
    W, b = rng.normal(size=(7, 5, size, size)), rng.normal(size=7)
    return x, W, b


@pytest.mark.parametrize("size,stride,pad", [(3, 1, 1), (3, 2, 0), (2, 1, 0), (2, 2, 2), (5, 3, 2), (1, 1, 0)])
def test_each_op_equals_numpy(size, stride, pad):
    rng = np.random.default_rng(size * 100 + stride * 10 + pad)
    mine, ref = NumbaCpuStage.ops, NumpyStage.ops
    x, W, b = _random_op_inputs(rng, size, stride, pad)

    y = mine.conv_forward(x, W, b, stride, pad)
    assert rel_error(y, ref.conv_forward(x, W, b, stride, pad)) < 1e-12
    dy = rng.normal(size=y.shape)
    for got, want in zip(mine.conv_backward(dy, x, W, stride, pad), ref.conv_backward(dy, x, W, stride, pad)):
        assert rel_error(got, want) < 1e-12

    pooled, argmax = mine.maxpool_forward(x, size, stride)
    pooled_ref, argmax_ref = ref.maxpool_forward(x, size, stride)
    assert np.array_equal(argmax, argmax_ref) and rel_error(pooled, pooled_ref) == 0
    dpooled = rng.normal(size=pooled.shape)
    assert rel_error(mine.maxpool_backward(dpooled, argmax, x.shape, size, stride),
                     ref.maxpool_backward(dpooled, argmax, x.shape, size, stride)) < 1e-14

    assert rel_error(mine.relu_forward(x), ref.relu_forward(x)) == 0
    assert rel_error(mine.relu_backward(dy, y), ref.relu_backward(dy, y)) == 0

    flat, Wd, bd = x.reshape(3, -1), rng.normal(size=(6, 440)), rng.normal(size=6)
    assert rel_error(mine.dense_forward(flat, Wd, bd), ref.dense_forward(flat, Wd, bd)) < 1e-12
    dout = rng.normal(size=(3, 6))
    for got, want in zip(mine.dense_backward(dout, flat, Wd), ref.dense_backward(dout, flat, Wd)):
        assert rel_error(got, want) < 1e-12


def test_ops_in_float32():
    rng = np.random.default_rng(5)
    x, W, b = (a.astype(np.float32) for a in _random_op_inputs(rng, 3, 1, 1))
    y = NumbaCpuStage.ops.conv_forward(x, W, b, 1, 1)
    assert y.dtype == np.float32
    assert rel_error(y, NumpyStage.ops.conv_forward(x, W, b, 1, 1)) < 1e-5
    dy = rng.normal(size=y.shape).astype(np.float32)
    for got, want in zip(NumbaCpuStage.ops.conv_backward(dy, x, W, 1, 1), NumpyStage.ops.conv_backward(dy, x, W, 1, 1)):
        assert got.dtype == np.float32 and rel_error(got, want) < 1e-5


def test_train_steps_equal_numpy():
    """Three SGD steps with momentum and weight decay: same parameters and momentum as stage numpy."""
    net = ODD_NETWORKS["pad2-pool2s1"]
    ref, mine = make_stage(NumpyStage, net, np.float64), make_stage(NumbaCpuStage, net, np.float64)
    for step in range(3):
        images, labels = random_batch(net, 4, np.float64, seed=30 + step)
        loss1 = ref.train_step(images, labels, lr=0.05, momentum=0.9, weight_decay=1e-3)
        loss2 = mine.train_step(images, labels, lr=0.05, momentum=0.9, weight_decay=1e-3)
        assert rel_error(loss1, loss2) < 1e-10
    assert rel_error(ref.get_params(), mine.get_params()) < 1e-10
    assert rel_error(ref.get_momentum(), mine.get_momentum()) < 1e-10


def test_predict_between_forward_and_backward_changes_nothing():
    """predict() at another batch size uses its own buffers: the pending backward is unaffected."""
    net = lenet5()
    ref, mine = make_stage(NumpyStage, net, np.float64), make_stage(NumbaCpuStage, net, np.float64)
    images, labels = random_batch(net, 3, np.float64, seed=8)
    others, _ = random_batch(net, 5, np.float64, seed=9)
    _, grad = ref.loss_and_grad(images, labels)
    mine.load_batch(images, labels)
    mine.forward()
    mine.predict(others)
    mine.predict(images)
    mine.backward()
    assert rel_error(mine.get_grad(), grad) < 1e-10


def on_all_threads_then_one(stage, images, labels):
    """(loss, gradient) on all of Numba's threads, then on one."""
    on_all = stage.loss_and_grad(images, labels)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        return on_all, stage.loss_and_grad(images, labels)
    finally:
        numba.set_num_threads(threads)


def test_layer_schedule_gradient_does_not_depend_on_thread_count():
    """The per-layer kernels' per-thread gradient copies, summed at the end: 1 thread and all threads agree."""
    net = lenet5()
    stage = NumbaCpuStage(net, np.float64, schedule="layers")
    stage.set_params(make_stage(NumbaCpuStage, net, np.float64).get_params())
    images, labels = random_batch(net, 9, np.float64, seed=12)
    (_, grad_all), (_, grad_one) = on_all_threads_then_one(stage, images, labels)
    assert rel_error(grad_one, grad_all) < 1e-12


def test_fuse_false_gives_the_same_step():
    """The unfused plan the benchmark compares against computes the same thing."""
    net = lenet5()
    fused = make_stage(NumbaCpuStage, net, np.float64)
    unfused = NumbaCpuStage(net, np.float64, fuse=False)
    unfused.set_params(fused.get_params())
    assert [step.kind for step in unfused.kernel_calls][:3] == ["conv", "relu", "maxpool"]
    images, labels = random_batch(net, 3, np.float64, seed=14)
    assert_same_step(fused, unfused, images, labels, 1e-12)


def test_fusion_plan():
    assert [step.kind for step in fusion_plan(lenet5())] == [
        "conv_relu_pool", "conv_relu_pool", "flatten", "dense", "relu", "dense", "relu", "dense"]
    assert [step.kind for step in fusion_plan(UNFUSED)][:5] == ["conv", "maxpool", "relu", "conv_relu_pool", "flatten"]


def test_input_grad_only_until_update():
    net = ODD_NETWORKS["stride2-pool3s2"]
    stage = make_stage(NumbaCpuStage, net, np.float64)
    images, labels = random_batch(net, 2, np.float64, seed=2)
    stage.loss_and_grad(images, labels)
    assert stage.input_grad.shape == images.shape
    stage.update(0.1, 0.9, 0.0)
    with pytest.raises(RuntimeError, match="between backward"):
        stage.input_grad


def test_registered():
    assert get_stage("numba-cpu") is NumbaCpuStage


@pytest.mark.parametrize("net_name", ["lenet5", "pad2-pool2s1"])
def test_torch_equals_numpy(net_name):
    """PyTorch on the identical network and parameters: same loss and flat gradient (float32)."""
    pytest.importorskip("torch")
    from cnn.reference_torch import load_flat_params, torch_loss_and_grad, torch_model

    net = NETWORKS[net_name]
    stage = make_stage(NumpyStage, net, np.float32)
    images, labels = random_batch(net, 8, np.float32, seed=13)
    model = torch_model(net)
    load_flat_params(model, stage.get_params())
    loss_torch, grad_torch = torch_loss_and_grad(model, images, labels)
    loss, grad = stage.loss_and_grad(images, labels)
    assert rel_error(loss_torch, loss) < 1e-4
    assert rel_error(grad_torch, grad) < 1e-4


def test_torch_train_steps_equal_numpy():
    """torch_train_step + sgd_optimizer apply our update rule: same parameters after two steps (float64)."""
    pytest.importorskip("torch")
    from cnn.reference_torch import flat_params, load_flat_params, sgd_optimizer, torch_model, torch_train_step

    net = ODD_NETWORKS["pad2-pool2s1"]
    stage = make_stage(NumpyStage, net, np.float64)
    model = torch_model(net, np.float64)
    load_flat_params(model, stage.get_params())
    optimizer = sgd_optimizer(model, lr=0.05, momentum=0.9, weight_decay=1e-3)
    for step in range(2):
        images, labels = random_batch(net, 4, np.float64, seed=40 + step)
        loss = stage.train_step(images, labels, lr=0.05, momentum=0.9, weight_decay=1e-3)
        assert rel_error(torch_train_step(model, optimizer, images, labels), loss) < 1e-10
    assert rel_error(flat_params(model), stage.get_params()) < 1e-10


def test_torch_missing_is_one_line(monkeypatch):
    from cnn.reference_torch import torch_model

    monkeypatch.setitem(sys.modules, "torch", None)     # what an install without torch looks like
    with pytest.raises(ImportError, match=r"^PyTorch is optional: pip install -e '\.\[bench\]'$"):
        torch_model(lenet5())


# -- the block schedule (kernels/cpu/network.py) and the thread count -------------------------------------

@pytest.mark.parametrize("net_name", ["unfused", "winograd", "lenet5"])
def test_layer_schedule_gives_the_same_step(net_name):
    """The stage's first schedule (a parallel region a layer) and the block schedule compute the same thing."""
    net = NETWORKS[net_name]
    blocks = make_stage(NumbaCpuStage, net, np.float64)
    layers = NumbaCpuStage(net, np.float64, schedule="layers")
    layers.set_params(blocks.get_params())
    images, labels = random_batch(net, 11, np.float64, seed=15)
    assert_same_step(blocks, layers, images, labels, 1e-12)


def test_block_gradient_is_the_same_bit_for_bit_on_any_thread_count():
    """Blocks of a fixed size, each with its own gradient copy, added in block order: threads change nothing."""
    net = lenet5()
    stage = make_stage(NumbaCpuStage, net, np.float64)
    stage.free_cores = numba.get_num_threads            # every thread, whatever the machine's load
    images, labels = random_batch(net, 37, np.float64, seed=16)      # 5 blocks, the last one short
    (loss_all, grad_all), (loss_one, grad_one) = on_all_threads_then_one(stage, images, labels)
    assert loss_one == loss_all and np.array_equal(grad_one, grad_all)


def test_free_cores_leaves_busy_cores_alone():
    from cnn.stages.s3_numba_cpu import FreeCores

    idle = FreeCores()
    assert [idle.choose(4, 4, 1) for _ in range(5)] == [4] * 5          # only this thread runs: every core
    busy = FreeCores()
    chosen = [busy.choose(4, 4, 1 + 4) for _ in range(12)]               # four other threads ready to run
    assert chosen[0] == 3 and chosen[-1] == 1 and chosen == sorted(chosen, reverse=True)
    one_busy = FreeCores()
    assert [one_busy.choose(2, 2, 2) for _ in range(12)][-1] == 1       # one core kept busy elsewhere
    assert FreeCores().choose(4, 4, None) == 4 and FreeCores().choose(1, 4, 9) == 1


def test_block_program_chains_the_segments():
    from kernels.cpu import network

    program = NumbaCpuStage(lenet5(), np.float32).program
    assert list(program[:, network.KIND]) == [network.CONV, network.CONV, network.DENSE, network.RELU,
                                              network.DENSE, network.RELU, network.DENSE]
    assert program[0, network.IN_START] == -1                        # the images
    assert list(program[1:, network.IN_START]) == list(program[:-1, network.OUT_START])
    assert list(program[:2, network.APPLY_RELU]) == [1, 1] and list(program[:2, network.POOL_SIZE]) == [2, 2]


def test_unknown_schedule_is_one_line():
    with pytest.raises(ValueError, match=r"^stage 'numba-cpu': schedule must be one of \('blocks', 'layers'\), "
                                         r"not 'rows'$"):
        NumbaCpuStage(lenet5(), np.float32, schedule="rows")


@pytest.mark.parametrize("schedule", ["blocks", "layers"])
def test_input_grad_needs_this_batchs_backward(schedule):
    """forward() of a new batch (or predict() between the phases) leaves no stale input_grad to read."""
    net = ODD_NETWORKS["stride2-pool3s2"]
    stage = NumbaCpuStage(net, np.float64, schedule=schedule)
    stage.set_params(make_stage(NumbaCpuStage, net, np.float64).get_params())
    images, labels = random_batch(net, 2, np.float64, seed=3)
    stage.loss_and_grad(images, labels)
    stage.predict(images)
    assert stage.input_grad.shape == images.shape
    stage.load_batch(images, labels)
    stage.forward()
    with pytest.raises(RuntimeError, match="between backward"):
        stage.input_grad


# -- the backward from the winners' patches (kernels/cpu/conv_patches.py) ---------------------------------

@pytest.mark.parametrize("size,stride,pad,pool,relu", [
    (3, 1, 1, (2, 2), True),        # the common case: 2x2 windows every 2 pixels
    (3, 2, 1, (3, 2), True),        # stride-2 conv, overlapping 3x3/s2 windows: a pixel may win two windows
    (5, 1, 2, (2, 1), False),       # overlapping 2x2/s1 windows, no ReLU
    (2, 1, 0, None, False),         # no pooling: every position is a window of one
    (3, 1, 1, None, True)])
@pytest.mark.parametrize("runs_in_place", [False, True])
def test_patch_backward_equals_numpy(size, stride, pad, pool, relu, runs_in_place):
    """The backward from the winners' patches, on any conv/ReLU/pool combination, against stage 2's ops one by one
    (the stage takes it only for long patches: here it is called directly, on short ones), with its patches
    unfolded (runs of K·C numbers shorter than RUN_MIN_NUMBERS) and read in place (as long as that)."""
    from kernels.cpu.conv_patches import RUN_MIN_NUMBERS, patch_backward

    channels = -(-RUN_MIN_NUMBERS // size) if runs_in_place else 5
    rng = np.random.default_rng(size * 100 + stride * 10 + pad + channels)
    ref = NumpyStage.ops
    x, W, b = rng.normal(size=(3, channels, 9, 8)), rng.normal(size=(6, channels, size, size)), rng.normal(size=6)
    z = ref.conv_forward(x, W, b, stride, pad)
    y = ref.relu_forward(z) if relu else z
    switch = np.empty((*y.shape[:2], 0, 0), np.int64)
    if pool:
        y, switch = ref.maxpool_forward(y, *pool)
    dy = rng.normal(size=y.shape)
    dz = ref.maxpool_backward(dy, switch, z.shape, *pool) if pool else dy
    dz = ref.relu_backward(dz, z) if relu else dz
    dx_ref, dW_ref, db_ref = ref.conv_backward(dz, x, W, stride, pad)
    dx, dW, db = np.full_like(x, np.nan), np.zeros_like(W), np.zeros_like(b)
    patch_backward(dy, y, switch, x, W, stride, pad, relu, pool is not None, dW, db, dx, True, 0, x.shape[0])
    assert rel_error(dx, dx_ref) < 1e-12 and rel_error(dW, dW_ref) < 1e-12 and rel_error(db, db_ref) < 1e-12


@pytest.mark.parametrize("size,pad,relu", [(3, 1, True), (2, 0, False), (5, 2, True)])
def test_window_forward_equals_numpy(size, pad, relu):
    """Conv + 2x2/2 pool a pooling window at a time (the stage takes it for wide layers on small planes), called
    directly on an odd plane (the last row and column are no window's) with a filter count not a multiple of 4."""
    from kernels.cpu.conv_patches import window_forward

    rng = np.random.default_rng(size * 10 + pad)
    ref = NumpyStage.ops
    x, W, b = rng.normal(size=(3, 5, 9, 8)), rng.normal(size=(6, 5, size, size)), rng.normal(size=6)
    z = ref.conv_forward(x, W, b, 1, pad)
    y, switch = ref.maxpool_forward(ref.relu_forward(z) if relu else z, 2, 2)
    out, got = np.full_like(y, np.nan), np.full(switch.shape, -1)
    window_forward(x, W, b, pad, relu, out, got, 0, x.shape[0])
    passed = y > 0 if relu else np.ones(y.shape, bool)      # a window all ReLU-zero passes nothing back: any switch
    assert rel_error(out, y) < 1e-12 and np.array_equal(got[passed], switch[passed])


def test_other_openmp_defaults_takes_our_wait_policy_away_meanwhile(monkeypatch):
    """While a library with its own OpenMP (PyTorch) is imported, stage 3's passive wait policy is out of the
    environment, and back afterwards; a policy the user set stays throughout."""
    from kernels.cpu import thread_pool

    monkeypatch.setattr(thread_pool, "policy_set_here", True)
    monkeypatch.setenv("OMP_WAIT_POLICY", thread_pool.WAIT_POLICY)
    with thread_pool.other_openmp_defaults():
        assert "OMP_WAIT_POLICY" not in os.environ
    assert os.environ["OMP_WAIT_POLICY"] == thread_pool.WAIT_POLICY
    monkeypatch.setattr(thread_pool, "policy_set_here", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    with thread_pool.other_openmp_defaults():
        assert os.environ["OMP_WAIT_POLICY"] == "active"


@pytest.mark.parametrize("numba_first", [True, False])
def test_a_late_import_of_the_kernels_says_the_wait_policy_came_too_late(numba_first):
    """Imported after Numba's threads started, kernels.cpu warns (one line) that its passive policy does not apply;
    imported first, it says nothing."""
    start = "import numba; numba.set_num_threads(1)"
    program = f"{start}; import kernels.cpu" if numba_first else f"import kernels.cpu; {start}"
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    child = subprocess.run([sys.executable, "-W", "always", "-c", program], capture_output=True, text=True, env=env,
                           cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert child.returncode == 0, child.stderr
    assert ("wait policy" in child.stderr) == numba_first, child.stderr
