"""Stages 4 ``cuda`` and 5 ``cuda-fused`` against stage 2 (``numpy``, float64) on whole networks.

In the simulator (no GPU) LeNet-5 and AlexNet-small run as reduced-width copies built from the
same specs — the same layer kinds, kernels, strides, pads and pools, fewer channels and a smaller
input — because every simulated thread costs a fraction of a millisecond. The real networks are
checked by the tests marked ``gpu``. One more network breaks the fusion pattern on purpose: a
Conv with no ReLU after it, a MaxPool before its ReLU, overlapping windows everywhere.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from cnn.gradcheck import rel_error
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, alexnet_small, get_network, init_params, lenet5
from cnn.stages import get_stage, stage_names
from cnn.stages.s2_numpy import NumpyStage
from cnn.stages.s4_cuda import CudaStage
from cnn.stages.s5_cuda_fused import CudaFusedStage, memory_saved

TOL = 1e-5
HYPER = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)


NETWORKS = {
    "lenet5-reduced": get_network("lenet5", reduced_copy=True),
    "alexnet-small-reduced": get_network("alexnet-small", reduced_copy=True),
    "no-fusion-pattern": Network("no-fusion-pattern", (2, 9, 9), (
        Conv(2, 3, 3, stride=2, pad=1), ReLU(), MaxPool(3, 1),    # fusable: conv kernel > stride, pools overlap
        Conv(3, 2, 2), MaxPool(2, 1), ReLU(),                      # a Conv with no ReLU, a ReLU after its pool
        Flatten(), Dense(2, 4), Dense(4, 3))),                     # a Dense with no ReLU
}
BATCHES = {"lenet5-reduced": 1, "alexnet-small-reduced": 3, "no-fusion-pattern": 2}
BLOCKS = {  # what stage 5 makes of each network
    "lenet5-reduced": ["FusedConvPool", "FusedConvPool", "Flatten", "Dense", "Dense", "Dense"],
    "alexnet-small-reduced": ["FusedConvPool"] * 3 + ["Flatten", "Dense", "Dense", "Dense"],
    "no-fusion-pattern": ["FusedConvPool", "Conv", "Pool", "Relu", "Flatten", "Dense", "Dense"],
}
# kernels per training step: stage 4 = conv 2+4, pool 1+1, dense 2+4 (3 without ReLU, 1 fewer without dX), loss, update
LAUNCHES = {"lenet5-reduced": {"cuda": 34, "cuda-fused": 26},
            "alexnet-small-reduced": {"cuda": 42, "cuda-fused": 30}}


def random_batch(net, batch, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, *net.input_shape)).astype(np.float32), rng.integers(0, net.num_classes, batch)


def start_params(net, seed=1):
    """Xavier weights plus random biases, so bias terms and their gradients are really exercised."""
    params = init_params(net, "xavier", seed, np.float64)
    return params + np.random.default_rng(seed + 100).normal(0, 0.05, params.shape)


def prepared(stage_class, net, dtype, params):
    stage = stage_class(net, dtype)
    stage.set_params(params)
    stage.set_momentum(np.zeros_like(params))
    return stage


def compare_training(stage_class, net, batch, steps=1, tol=TOL):
    """``steps`` SGD steps side by side with the numpy stage: loss, gradient, parameters, momentum, logits.

    One step in the simulator: the update with a non-zero momentum is checked by test_kernels.test_sgd_momentum.
    """
    params = start_params(net)
    gpu, ref = prepared(stage_class, net, np.float32, params), prepared(NumpyStage, net, np.float64, params)
    for step in range(steps):
        images, labels = random_batch(net, batch, seed=step)
        loss = gpu.train_step(images, labels, **HYPER)
        loss_ref = ref.train_step(images.astype(np.float64), labels, **HYPER)
        for what, got, expected in [("loss", loss, loss_ref), ("grad", gpu.get_grad(), ref.get_grad()),
                                    ("params", gpu.get_params(), ref.get_params()),
                                    ("momentum", gpu.get_momentum(), ref.get_momentum())]:
            assert rel_error(got, expected) < tol, f"step {step}, {what}: rel error {rel_error(got, expected):.2e}"
    images, _ = random_batch(net, batch, seed=99)
    assert rel_error(gpu.predict(images), ref.predict(images.astype(np.float64))) < tol
    return gpu


@pytest.mark.parametrize("stage_class", [CudaStage, CudaFusedStage], ids=lambda cls: cls.name)
@pytest.mark.parametrize("net_name", list(NETWORKS))
def test_stage_trains_like_numpy(stage_class, net_name):
    stage = compare_training(stage_class, NETWORKS[net_name], BATCHES[net_name])
    if net_name in LAUNCHES:
        assert stage.launches_per_step() == LAUNCHES[net_name][stage_class.name]


@pytest.mark.parametrize("net_name", list(BLOCKS))
def test_fused_stage_fuses_exactly_conv_relu_pool(net_name):
    stage = CudaFusedStage(NETWORKS[net_name])
    assert [type(block).__name__.removesuffix("Block") for block in stage.blocks] == BLOCKS[net_name]


def test_registry_and_float32_only():
    names = stage_names()
    assert names[names.index("numpy") + 1:names.index("numpy") + 4] == ["numba-cpu", "cuda", "cuda-fused"]
    assert get_stage("cuda") is CudaStage and get_stage("cuda-fused") is CudaFusedStage
    with pytest.raises(ValueError, match="float64"):
        CudaStage(NETWORKS["lenet5-reduced"], np.float64)


def test_bad_batches_are_refused_in_one_line():
    stage = CudaStage(NETWORKS["lenet5-reduced"]).init()
    images, labels = random_batch(stage.net, 2, seed=0)
    with pytest.raises(ValueError, match=r"expects \(N, 1, 16, 16\)"):
        stage.load_batch(images[:, :, :8], labels)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        stage.load_batch(images, labels + 10)
    with pytest.raises(ValueError, match="params has shape"):
        stage.set_params(np.zeros(3))
    with pytest.raises(RuntimeError, match="train_step"):
        stage.launches_per_step()


def test_device_reports_the_simulator_as_usable():
    from kernels.device import gpu_unavailable_reason, simulated
    assert simulated() == (os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"))
    if simulated():
        assert gpu_unavailable_reason() is None


@pytest.mark.skipif(os.path.isdir("/proc/driver/nvidia/gpus"), reason="this machine has an NVIDIA GPU")
def test_without_gpu_or_simulator_the_registry_refuses_in_one_line():
    code = ("from cnn.stages import get_stage, StageUnavailable\n"
            "try:\n    get_stage('cuda-fused')\nexcept StageUnavailable as err:\n    print(err)\n")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert "\n" not in message and "no CUDA GPU found" in message and "NUMBA_ENABLE_CUDASIM=1" in message


def test_memory_saved_from_shapes():
    # LeNet-5, one sample: conv outputs 6·24·24 and 16·8·8 floats, two buffers each
    lenet = memory_saved("lenet5", 1)
    assert lenet["footprint_bytes"] == 4 * 2 * (6 * 24 * 24 + 16 * 8 * 8)
    assert lenet["forward_traffic_bytes"] == 4 * 4 * (6 * 24 * 24 + 16 * 8 * 8)
    alexnet = memory_saved(alexnet_small(), 128)
    assert alexnet["footprint_bytes"] == 128 * 4 * 2 * (32 * 32 * 32 + 32 * 16 * 16 + 64 * 8 * 8)
    assert [row["writers_per_weight"] for row in alexnet["blocks"]] == [128 * 256, 128 * 64, 128 * 16]
    assert memory_saved(NETWORKS["no-fusion-pattern"], 2)["footprint_bytes"] == 4 * 2 * 2 * 3 * 5 * 5


@pytest.mark.gpu
@pytest.mark.parametrize("stage_class", [CudaStage, CudaFusedStage], ids=lambda cls: cls.name)
@pytest.mark.parametrize("net, batch", [(lenet5(), 16), (alexnet_small(), 8)], ids=["lenet5", "alexnet-small"])
def test_full_size_networks_train_like_numpy(stage_class, net, batch):
    stage = compare_training(stage_class, net, batch, steps=3, tol=1e-4)
    assert stage.launches_per_step() == LAUNCHES[f"{net.name}-reduced"][stage_class.name]
