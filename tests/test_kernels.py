"""Every CUDA kernel against the CPU reference (stage 1 ``loops``), on fresh random inputs.

Runs in Numba's CUDA simulator when there is no GPU (tests/conftest.py), so the shapes are tiny
— but chosen to break the usual bugs: batch 1, odd sizes, channel counts that are not a multiple
of anything, padding 2, stride > 1, and windows that overlap (convolution kernel > stride,
pooling stride < size), which is where the push-style kernels' threads really collide.
The references run in float64 on the same float32 inputs; the kernels compute in float32.
Full-size layer shapes are checked by the tests marked ``gpu``.
"""

import numpy as np
import pytest

from cnn.gradcheck import rel_error
from cnn.model import alexnet_small, lenet5
from cnn.stages import s1_loops as loops
from cnn.stages import s2_numpy
from cnn.stages.base import sgd_momentum_update, softmax_cross_entropy
from cnn.stages.s4_cuda import CudaStage, device_zeros, to_device
from cnn.stages.s5_cuda_fused import CudaFusedStage, conv_relu_pool_backward, conv_relu_pool_forward
from kernels.bias_relu import bias_grad
from kernels.dense import TILE
from kernels.device import cuda, simulated
from kernels.fill import fill
from kernels.sgd import sgd_momentum
from kernels.softmax_xent import softmax_xent

TOL = 1e-5          # float32 kernels against a float64 reference, tiny shapes

# name: (N, C, H, W, F, K, stride, pad)
CONV_CASES = {
    "batch1-k3": (1, 3, 7, 6, 2, 3, 1, 0),
    "pad2-stride2": (2, 2, 6, 7, 3, 5, 2, 2),
    "k2-stride2-pad1": (1, 1, 5, 5, 2, 2, 2, 1),
    "k3-stride2-odd": (2, 5, 9, 8, 3, 3, 2, 1),
}
# name: (x shape, size, stride)
POOL_CASES = {
    "2x2-s2": ((2, 3, 6, 6), 2, 2),
    "3x3-s1-overlap": ((1, 2, 5, 6), 3, 1),
    "3x3-s2-overlap-odd": ((2, 3, 7, 7), 3, 2),
    "2x2-s1-overlap": ((1, 3, 5, 4), 2, 1),
}
# name: (conv case as above, pool size, pool stride)
FUSED_CASES = {
    "lenet-like": ((2, 2, 8, 8, 3, 3, 1, 0), 2, 2),
    "alexnet-like-pad2-batch1": ((1, 3, 6, 6, 2, 5, 1, 2), 2, 2),
    "overlapping-conv-and-pool-3s1": ((2, 2, 7, 7, 3, 3, 1, 1), 3, 1),
    "strided-conv-pool-3s2-odd": ((1, 3, 9, 9, 2, 3, 2, 1), 3, 2),
}
STAGES = {"cuda (pull)": CudaStage, "cuda-fused (push)": CudaFusedStage}


def random(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def conv_inputs(case, seed):
    N, C, H, W, F, K, stride, pad = case
    rng = np.random.default_rng(seed)
    return random(rng, N, C, H, W), random(rng, F, C, K, K), random(rng, F), stride, pad


def f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def assert_close(got, expected, tol=TOL):
    for name, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, f"output {name}: shape {g.shape} != {e.shape}"
        assert rel_error(g, e) < tol, f"output {name}: rel error {rel_error(g, e):.2e}"


def test_numba_cuda_is_nvidias_package():
    import numba.cuda
    assert numba.cuda.implementation == "NVIDIA"


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_forward(case):
    x, W, b, stride, pad = conv_inputs(CONV_CASES[case], seed=1)
    expected = loops.conv_forward(*f64(x, W, b), stride, pad)
    assert_close([CudaStage.ops.conv_forward(x, W, b, stride, pad)], [expected])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_backward(stage, case):
    x, W, _, stride, pad = conv_inputs(CONV_CASES[case], seed=2)
    dy = random(np.random.default_rng(3), *loops.conv_forward(x, W, np.zeros(W.shape[0], np.float32), stride, pad).shape)
    expected = loops.conv_backward(*f64(dy, x, W), stride, pad)
    assert_close(STAGES[stage].ops.conv_backward(dy, x, W, stride, pad), expected)


@pytest.mark.parametrize("case", POOL_CASES)
def test_maxpool_forward(case):
    shape, size, stride = POOL_CASES[case]
    x = random(np.random.default_rng(4), *shape)
    y, argmax = CudaStage.ops.maxpool_forward(x, size, stride)
    y_ref, argmax_ref = loops.maxpool_forward(x, size, stride)
    assert_close([y], [y_ref])
    np.testing.assert_array_equal(argmax, argmax_ref)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_maxpool_backward(stage, case):
    shape, size, stride = POOL_CASES[case]
    rng = np.random.default_rng(5)
    y, argmax = loops.maxpool_forward(random(rng, *shape), size, stride)
    dy = random(rng, *y.shape)
    expected = loops.maxpool_backward(dy.astype(np.float64), argmax, shape, size, stride)
    assert_close([STAGES[stage].ops.maxpool_backward(dy, argmax, shape, size, stride)], [expected])


def test_maxpool_backward_adds_up_where_windows_share_a_winner():
    """A 3x3/stride-1 pool over a plane with one large pixel: all 9 windows pick it."""
    x = random(np.random.default_rng(6), 1, 1, 5, 5)
    x[0, 0, 2, 2] = 100.0
    _, argmax = loops.maxpool_forward(x, 3, 1)
    dy = random(np.random.default_rng(7), 1, 1, 3, 3)
    for stage in STAGES.values():
        dx = stage.ops.maxpool_backward(dy, argmax, x.shape, 3, 1)
        assert rel_error(dx[0, 0, 2, 2], dy.sum()) < TOL


def test_relu_forward_and_backward():
    rng = np.random.default_rng(8)
    x, dy = random(rng, 2, 3, 5, 7), random(rng, 2, 3, 5, 7)
    y = CudaStage.ops.relu_forward(x)
    assert_close([y, CudaStage.ops.relu_backward(dy, y)],
                 [loops.relu_forward(x.astype(np.float64)), loops.relu_backward(dy.astype(np.float64), y)])


# (N, in, out): inside one tile; and N, in > TILE, so that each of the three products crosses tile
# edges in its inner dimension (x·Wᵀ: in, dyᵀ·x: N) or in its output (dy·W: N × in)
@pytest.mark.parametrize("N, n_in, n_out", [(1, 3, 2), (TILE + 1, TILE + 3, 2)])
def test_dense_forward_and_backward(N, n_in, n_out):
    rng = np.random.default_rng(9)
    x, W, b, dy = random(rng, N, n_in), random(rng, n_out, n_in), random(rng, n_out), random(rng, N, n_out)
    assert_close([CudaStage.ops.dense_forward(x, W, b)], [loops.dense_forward(*f64(x, W, b))])
    assert_close(CudaStage.ops.dense_backward(dy, x, W), loops.dense_backward(*f64(dy, x, W)))


@pytest.mark.parametrize("shape", [(2, 3, 10, 10), (5, 7), (1, 4, 3, 3)])
def test_bias_grad(shape):
    """db[f] = sum over all but axis 1; (2, 3, 10, 10) has 200 values per channel: more than one block's threads."""
    dz = random(np.random.default_rng(10), *shape)
    db = device_zeros(shape[1])
    bias_grad(to_device(dz), db)
    axes = tuple(axis for axis in range(dz.ndim) if axis != 1)
    assert rel_error(db.copy_to_host(), dz.astype(np.float64).sum(axis=axes)) < TOL


@pytest.mark.parametrize("batch", [1, 5, 130])
def test_softmax_xent(batch):
    """130 rows: more rows than the block has threads."""
    rng = np.random.default_rng(11)
    logits, labels = 3 * random(rng, batch, 10), rng.integers(0, 10, batch)
    loss, dlogits = device_zeros(1), device_zeros(logits.shape)
    softmax_xent(to_device(logits), to_device(labels, np.int32), loss, dlogits)
    loss_ref, dlogits_ref = softmax_cross_entropy(logits.astype(np.float64), labels)
    assert rel_error(loss.copy_to_host()[0], loss_ref) < TOL
    assert rel_error(dlogits.copy_to_host(), dlogits_ref) < TOL


def test_sgd_momentum():
    rng = np.random.default_rng(12)
    w, v, g = random(rng, 300), random(rng, 300), random(rng, 300)
    d_w, d_v = to_device(w), to_device(v)
    sgd_momentum(d_w, d_v, to_device(g), 0.05, 0.9, 1e-3)
    w_ref, v_ref = f64(w, v)
    sgd_momentum_update(w_ref, v_ref, g.astype(np.float64), 0.05, 0.9, 1e-3)
    assert_close([d_w.copy_to_host(), d_v.copy_to_host()], [w_ref, v_ref])


def test_fill_writes_only_its_view():
    values = random(np.random.default_rng(13), 50)
    d_values = to_device(values)
    fill(d_values[10:37], 0.0)
    expected = values.copy()
    expected[10:37] = 0
    np.testing.assert_array_equal(d_values.copy_to_host(), expected)


def reference_conv_relu_pool(x, W, b, stride, pad, size, pool_stride):
    conv = loops.relu_forward(loops.conv_forward(x, W, b, stride, pad))
    pooled, argmax = loops.maxpool_forward(conv, size, pool_stride)
    return conv, pooled, argmax


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_conv_relu_pool(case):
    conv_case, size, pool_stride = FUSED_CASES[case]
    x, W, b, stride, pad = conv_inputs(conv_case, seed=14)
    b[-1] = -50.0                     # the last filter's ReLU is off everywhere: its windows all tie at 0
    conv, y_ref, switches_ref = reference_conv_relu_pool(*f64(x, W, b), stride, pad, size, pool_stride)
    y, switches = conv_relu_pool_forward(x, W, b, stride, pad, size, pool_stride)
    assert_close([y], [y_ref])
    np.testing.assert_array_equal(switches, switches_ref)
    assert (conv[:, 0] > 0).any() and (conv[:, 0] == 0).any(), "filter 0 should have active and inactive ReLUs"

    dy = random(np.random.default_rng(15), *y.shape)
    dconv = loops.relu_backward(loops.maxpool_backward(dy.astype(np.float64), switches_ref, conv.shape, size, pool_stride),
                                conv)
    expected = loops.conv_backward(dconv, *f64(x, W), stride, pad)
    assert_close(conv_relu_pool_backward(dy, y, switches, x, W, stride, pad), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("net", [lenet5(), alexnet_small()], ids=lambda net: net.name)
@pytest.mark.parametrize("stage", STAGES)
def test_ops_at_full_size(net, stage):
    """Every conv and pool of the real networks at batch 8, against stage 2 (numpy)."""
    ops, rng, batch = STAGES[stage].ops, np.random.default_rng(16), 8
    shapes = net.activation_shapes()
    for index, layer in enumerate(net.layers):
        x = random(rng, batch, *shapes[index])
        if type(layer).__name__ == "Conv":
            W, b = 0.1 * random(rng, *layer.param_shapes()["W"]), random(rng, layer.out_channels)
            y = ops.conv_forward(x, W, b, layer.stride, layer.pad)
            assert_close([y], [s2_numpy.conv_forward(*f64(x, W, b), layer.stride, layer.pad)], 1e-4)
            dy = random(rng, *y.shape)
            assert_close(ops.conv_backward(dy, x, W, layer.stride, layer.pad),
                         s2_numpy.conv_backward(*f64(dy, x, W), layer.stride, layer.pad), 1e-4)
        elif type(layer).__name__ == "MaxPool":
            y, argmax = ops.maxpool_forward(x, layer.size, layer.stride)
            np.testing.assert_array_equal(argmax, s2_numpy.maxpool_forward(x, layer.size, layer.stride)[1])
            dy = random(rng, *y.shape)
            assert_close([ops.maxpool_backward(dy, argmax, x.shape, layer.size, layer.stride)],
                         [s2_numpy.maxpool_backward(dy.astype(np.float64), argmax, x.shape, layer.size, layer.stride)])


def test_the_simulator_swaps_cuda_once_a_launch_and_restores_it():
    """kernels.simulator: a kernel whose device function lives in another module (kernels.reduction.block_sum:
    cuda.blockDim, cuda.syncthreads) sums 64 random numbers right in every block, and after the launch that
    module's ``cuda`` is the real numba.cuda again — also after a launch that fails."""
    import sys

    import kernels.reduction as reduction
    from kernels import simulator

    if not simulated():
        pytest.skip("checks the simulator's patch; on a GPU the simulator is not used")
    assert simulator.install()

    @cuda.jit
    def sums_of_rows(rows, out):
        values = cuda.shared.array(64, np.float32)
        t = cuda.threadIdx.x
        values[t] = rows[cuda.blockIdx.x, t]
        reduction.block_sum(values, t)
        if t == 0:
            out[cuda.blockIdx.x] = values[0]

    rows = np.random.default_rng(7).standard_normal((3, 64)).astype(np.float32)
    out = np.zeros(3, np.float32)
    sums_of_rows[3, 64](rows, out)
    assert rel_error(out, rows.astype(np.float64).sum(axis=1)) < TOL
    real = sys.modules["numba.cuda"]
    assert reduction.cuda is real and cuda is real
    with pytest.raises(IndexError):
        sums_of_rows[3, 64](np.ascontiguousarray(rows[:, :8]), out)   # an index past the rows' end, in the launch
    assert reduction.cuda is real and cuda is real
