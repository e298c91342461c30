"""Stages 1 and 2: gradient checks by finite differences, and stage 2 equal to stage 1.

The shapes are chosen to break the usual backward-pass bugs: overlapping pooling windows
(3×3 stride 2, 2×2 stride 1) and convolution windows (kernel > stride), padding > 0,
stride > 1, odd sizes, batch 1. The 2×2/stride-2 case alone hides ``=``-for-``+=`` bugs.
"""

import numpy as np
import pytest

from cnn.gradcheck import check_stage_gradients, rel_error
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, alexnet_small, init_params, lenet5
from cnn.stages import get_stage
from cnn.stages.s1_loops import LoopsStage
from cnn.stages.s2_numpy import NumpyStage

ODD_NETWORKS = {
    # stride 2 + pad 1 conv, overlapping 3x3/s2 pool, odd 11x11 input
    "stride2-pool3s2": Network("odd-a", (2, 11, 11), (
        Conv(2, 3, 3, stride=2, pad=1), ReLU(), MaxPool(3, 2),
        Flatten(), Dense(12, 5), ReLU(), Dense(5, 4))),
    # pad 2 conv, 2x2/s1 pool, conv without pool after it, non-square-friendly channel counts
    "pad2-pool2s1": Network("odd-b", (3, 7, 7), (
        Conv(3, 5, 5, pad=2), ReLU(), MaxPool(2, 1),
        Conv(5, 3, 3, stride=2), ReLU(),
        Flatten(), Dense(12, 3))),
}


def random_batch(net, batch, dtype, seed):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch, *net.input_shape)).astype(dtype)
    labels = rng.integers(0, net.num_classes, batch)
    return images, labels


def make_stage(stage_class, net, dtype, seed=1):
    stage = stage_class(net, dtype)
    params = init_params(net, "xavier", seed, dtype)
    # non-zero biases so that bias gradients and bias terms are really exercised
    params += np.random.default_rng(seed + 100).normal(0, 0.05, params.shape).astype(dtype)
    stage.set_params(params)
    stage.set_momentum(np.zeros_like(params))
    return stage


@pytest.mark.parametrize("stage_class", [LoopsStage, NumpyStage])
@pytest.mark.parametrize("net_name", list(ODD_NETWORKS))
@pytest.mark.parametrize("batch", [1, 3])
def test_gradient_check_float64(stage_class, net_name, batch):
    net = ODD_NETWORKS[net_name]
    stage = make_stage(stage_class, net, np.float64)
    images, labels = random_batch(net, batch, np.float64, seed=batch)
    errors = check_stage_gradients(stage, images, labels, max_per_group=40)
    print(stage_class.name, net_name, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("net_name", list(ODD_NETWORKS))
@pytest.mark.parametrize("dtype,tolerance", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_numpy_equals_loops(net_name, dtype, tolerance):
    net = ODD_NETWORKS[net_name]
    loops, vectorized = make_stage(LoopsStage, net, dtype), make_stage(NumpyStage, net, dtype)
    images, labels = random_batch(net, 4, dtype, seed=7)
    loss1, grad1 = loops.loss_and_grad(images, labels)
    loss2, grad2 = vectorized.loss_and_grad(images, labels)
    assert rel_error(loss1, loss2) < tolerance
    assert rel_error(grad1, grad2) < tolerance
    assert rel_error(loops.input_grad, vectorized.input_grad) < tolerance
    assert rel_error(loops.predict(images), vectorized.predict(images)) < tolerance


def test_numpy_equals_loops_on_lenet5_float32():
    net = lenet5()
    loops, vectorized = make_stage(LoopsStage, net, np.float32), make_stage(NumpyStage, net, np.float32)
    images, labels = random_batch(net, 2, np.float32, seed=3)
    loss1, grad1 = loops.loss_and_grad(images, labels)
    loss2, grad2 = vectorized.loss_and_grad(images, labels)
    assert rel_error(loss1, loss2) < 1e-5
    assert rel_error(grad1, grad2) < 1e-5


def test_numpy_gradient_check_alexnet_small():
    """The seed-000 network, padding 2 in every conv: sampled finite differences in float64."""
    net = alexnet_small()
    stage = make_stage(NumpyStage, net, np.float64)
    images, labels = random_batch(net, 2, np.float64, seed=5)
    errors = check_stage_gradients(stage, images, labels, max_per_group=6)
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("op", ["conv", "maxpool"])
@pytest.mark.parametrize("size,stride,pad", [(3, 1, 1), (3, 2, 0), (2, 1, 0), (2, 2, 2), (5, 3, 2)])
def test_ops_agree_one_by_one(op, size, stride, pad):
    """Each op of stage 2 equal to stage 1's, forward and backward, on one layer at a time."""
    rng = np.random.default_rng(size * 10 + stride)
    x = rng.normal(size=(2, 3, 9, 8))
    one, two = LoopsStage.ops, NumpyStage.ops
    if op == "conv":
        W, b = rng.normal(size=(4, 3, size, size)), rng.normal(size=4)
        y1, y2 = one.conv_forward(x, W, b, stride, pad), two.conv_forward(x, W, b, stride, pad)
        dy = rng.normal(size=y1.shape)
        for grad1, grad2 in zip(one.conv_backward(dy, x, W, stride, pad), two.conv_backward(dy, x, W, stride, pad)):
            assert rel_error(grad1, grad2) < 1e-12
    else:
        (y1, argmax1), (y2, argmax2) = one.maxpool_forward(x, size, stride), two.maxpool_forward(x, size, stride)
        assert np.array_equal(argmax1, argmax2)
        dy = rng.normal(size=y1.shape)
        dx1 = one.maxpool_backward(dy, argmax1, x.shape, size, stride)
        assert rel_error(dx1, two.maxpool_backward(dy, argmax2, x.shape, size, stride)) < 1e-12
        assert np.isclose(dx1.sum(), dy.sum())   # every upstream gradient lands somewhere, once
    assert rel_error(y1, y2) < 1e-12


def test_overlapping_pool_backward_accumulates():
    """A pixel that wins two overlapping windows gets both gradients (the `=` vs `+=` bug)."""
    x = np.array([[[[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]]])
    dy = np.array([[[[2.0, 3.0], [5.0, 7.0]]]])
    for ops in (LoopsStage.ops, NumpyStage.ops):
        _, argmax = ops.maxpool_forward(x, 2, 1)
        dx = ops.maxpool_backward(dy, argmax, x.shape, 2, 1)
        assert dx[0, 0, 0, 1] == 5.0            # won the two top windows: 2 + 3


def test_update_is_sgd_with_momentum_and_weight_decay():
    net = ODD_NETWORKS["stride2-pool3s2"]
    stage = make_stage(NumpyStage, net, np.float64)
    images, labels = random_batch(net, 2, np.float64, seed=11)
    w0, v0 = stage.get_params(), np.random.default_rng(0).normal(size=net.num_params)
    stage.set_momentum(v0)
    _, grad = stage.loss_and_grad(images, labels)
    stage.train_step(images, labels, lr=0.1, momentum=0.9, weight_decay=0.01)
    v1 = 0.9 * v0 + grad + 0.01 * w0
    assert rel_error(stage.get_momentum(), v1) < 1e-12
    assert rel_error(stage.get_params(), w0 - 0.1 * v1) < 1e-12


def test_registry_and_unknown_stage():
    assert get_stage("numpy") is NumpyStage
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        get_stage("nope")


def test_rel_error_refuses_nan_and_infinity():
    """A kernel that never writes its output (NaN-poisoned buffers) or blows up must fail every check."""
    ones = np.ones(4)
    assert rel_error(ones, ones) == 0.0 and rel_error(ones, 2 * ones) == 0.5
    for bad in (np.nan, np.inf, -np.inf):
        broken = ones.copy()
        broken[2] = bad
        assert rel_error(broken, ones) == float("inf") and rel_error(ones, broken) == float("inf")
