"""Stage 7's tiled implicit-GEMM kernels (``tiled-conv``) against stage 1, on tile-boundary shapes.

The tiles are 8–32 rows by 8·TN–32·TN columns, so the shapes below leave partial tiles on both
edges (filters and channels that are not a multiple of anything, positions that do not fill a
block), and cover batch 1, stride 2, padding 2 and overlapping pooling windows (3 × 3 every 1 or 2),
where one conv output is the winner of several windows. Inputs are fresh random numbers; the
reference runs in float64 on the same float32 inputs.
"""

import numpy as np
import pytest

from cnn.gradcheck import rel_error
from cnn.model import Conv, alexnet_small, lenet5
from cnn.stages import s1_loops as loops
from cnn.stages import s2_numpy
from kernels import conv_gemm, dense_gemm
from kernels.conv_gemm import ConvGeometry
from kernels.device import cuda
from kernels.implicit_gemm import PREFETCH, Tiles

TOL = 1e-5

# name: ((N, C, H, W, F, K, stride, pad), pool size, pool stride)
CASES = {
    "lenet-like": ((2, 2, 8, 8, 3, 3, 1, 0), 2, 2),
    "batch1-pad2-alexnet-like": ((1, 3, 6, 6, 2, 5, 1, 2), 2, 2),
    "overlapping-pool-3s1": ((2, 2, 7, 7, 3, 3, 1, 1), 3, 1),
    "stride2-pool-3s2-odd": ((1, 3, 9, 9, 2, 3, 2, 1), 3, 2),
    "filters-over-one-tile": ((1, 2, 6, 6, 35, 3, 1, 1), 2, 2),
    "channels-over-one-tile": ((1, 37, 6, 6, 2, 3, 1, 1), 2, 2),
    "positions-over-one-split": ((3, 2, 10, 10, 3, 3, 1, 1), 2, 2),
}


def random(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def f64(*arrays):
    return [a.astype(np.float64) for a in arrays]


def poisoned(shape, dtype=np.float32):
    """A device array full of NaN (or −1 for integers): an element a kernel forgets to write shows."""
    return cuda.to_device(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype))


def reference(x, W, b, stride, pad, size, pool_stride, dy):
    """Stage 1: (y, switches) forward and (dx, dW, db) backward through conv → ReLU → max-pool."""
    x, W, b = f64(x, W, b)
    conv = loops.relu_forward(loops.conv_forward(x, W, b, stride, pad))
    y, switches = loops.maxpool_forward(conv, size, pool_stride)
    dconv = loops.relu_backward(loops.maxpool_backward(dy.astype(np.float64), switches, conv.shape, size, pool_stride),
                                conv)
    return (y, switches), loops.conv_backward(dconv, x, W, stride, pad)


def tiled_conv_relu_pool(x, W, b, stride, pad, size, pool_stride, dy=None, with_dx=True):
    """The tiled kernels on device copies: (y, switches), and (dx, dW, db) when dy is given."""
    g = ConvGeometry.of(x.shape, W.shape, stride, pad, size, pool_stride)
    d_x, d_w, d_b = (cuda.to_device(a) for a in (x, W, b))
    y, switches = poisoned((g.batch, g.filters, g.pooled_h, g.pooled_w)), poisoned(
        (g.batch, g.filters, g.pooled_h, g.pooled_w), np.int32)
    tables = conv_gemm.conv_tables(g)
    conv_gemm.conv_relu_pool_forward_tiled(d_x, d_w, d_b, y, switches, g, tables)
    if dy is None:
        return y.copy_to_host(), switches.copy_to_host()
    dx, dW, db = poisoned(x.shape), poisoned(W.shape), poisoned(b.shape)
    dz, partial = poisoned((g.batch, g.filters, g.conv_h, g.conv_w)), poisoned(conv_gemm.partial_shape(g))
    conv_gemm.conv_relu_pool_backward_tiled(cuda.to_device(dy), y, switches, d_x, d_w, dx, dW, db, dz, partial, g,
                                            tables, with_dx)
    return (y.copy_to_host(), switches.copy_to_host()), (dx.copy_to_host(), dW.copy_to_host(), db.copy_to_host())


def case_inputs(case, seed):
    (N, C, H, W, F, K, stride, pad), size, pool_stride = CASES[case]
    rng = np.random.default_rng(seed)
    x, weights, b = random(rng, N, C, H, W), random(rng, F, C, K, K), random(rng, F)
    b[-1] = -50.0                     # the last filter's ReLU is off everywhere: its windows all tie at 0
    return (x, weights, b, stride, pad, size, pool_stride), rng


@pytest.mark.parametrize("case", CASES)
def test_tiled_conv_relu_pool_forward_and_backward(case):
    args, rng = case_inputs(case, seed=41)
    x, W = args[0], args[1]
    g = ConvGeometry.of(x.shape, W.shape, *args[3:])
    dy = random(rng, g.batch, g.filters, g.pooled_h, g.pooled_w)
    (y_ref, switches_ref), expected = reference(*args, dy)
    (y, switches), got = tiled_conv_relu_pool(*args, dy)
    assert rel_error(y, y_ref) < TOL
    np.testing.assert_array_equal(switches, switches_ref)
    for name, value, want in zip(("dx", "dW", "db"), got, expected):
        assert np.isfinite(value).all(), f"{name}: some elements were never written"
        assert rel_error(value, want) < TOL, f"{name}: rel_error {rel_error(value, want):.2e}"


def test_tiled_backward_without_dx_leaves_dx_alone():
    """The network's first layer skips dX: the kernels must not touch it (it stays poisoned)."""
    args, rng = case_inputs("lenet-like", seed=42)
    g = ConvGeometry.of(args[0].shape, args[1].shape, *args[3:])
    dy = random(rng, g.batch, g.filters, g.pooled_h, g.pooled_w)
    _, (dx, dW, db) = tiled_conv_relu_pool(*args, dy, with_dx=False)
    _, (_, dW_ref, db_ref) = reference(*args, dy)
    assert np.isnan(dx).all()
    assert rel_error(dW, dW_ref) < TOL and rel_error(db, db_ref) < TOL


def test_weight_grads_split_over_positions_equal_one_block():
    """Split-K: the sum over positions cut into chunks and added in order gives the unsplit sum."""
    args, rng = case_inputs("positions-over-one-split", seed=43)
    g = ConvGeometry.of(args[0].shape, args[1].shape, *args[3:])
    assert conv_gemm.partial_shape(g)[0] > 1, "the case should split the sum over positions"
    dy = random(rng, g.batch, g.filters, g.pooled_h, g.pooled_w)
    _, (_, dW, db) = tiled_conv_relu_pool(*args, dy)
    _, (_, dW_ref, db_ref) = reference(*args, dy)
    assert rel_error(dW, dW_ref) < TOL and rel_error(db, db_ref) < TOL


def test_offset_tables_address_the_arrays_the_loaders_read():
    """Each table's offsets are the flat indices of the elements they stand for (stride 2, padding 1)."""
    g = ConvGeometry.of((2, 3, 9, 9), (4, 3, 3, 3), 2, 1, 2, 2)
    taps, filter_taps, positions, geometry = (table.copy_to_host() for table in conv_gemm.conv_tables(g))
    assert tuple(geometry) == tuple(g) and geometry[conv_gemm.CONV_W] == g.conv_w     # the kernels' g[CONV_W]
    x, dz = np.arange(2 * 3 * 9 * 9).reshape(2, 3, 9, 9), np.arange(2 * 4 * g.conv_h * g.conv_w).reshape(
        2, 4, g.conv_h, g.conv_w)
    n, c, ci, cj, p, q = 1, 2, 3, 1, 2, 0                       # a tap of a position inside the image
    t, k = (c * 3 + p) * 3 + q, (n * g.conv_h + ci) * g.conv_w + cj
    assert x.ravel()[positions[k, 1] + taps[t, 0]] == x[n, c, ci * 2 - 1 + p, cj * 2 - 1 + q]
    assert dz.ravel()[positions[k, 0] + 3 * g.conv_h * g.conv_w] == dz[n, 3, ci, cj]
    f = 3
    kx = (f * 3 + p) * 3 + q
    assert filter_taps[kx, 0] == np.ravel_multi_index((f, 0, p, q), (4, 3, 3, 3))
    h, w = ci * 2 - 1 + p, cj * 2 - 1 + q                       # the pixel this tap of (ci, cj) reads
    packed = filter_taps[kx, 2]
    assert ((h + 1) // 2 - (packed >> 24), (w + 1) // 2 - ((packed >> 16) & 255)) == (ci, cj)
    assert (((packed >> 8) & 255), packed & 255) == ((h + 1) % 2, (w + 1) % 2)
    with pytest.raises(ValueError, match="sides < 256"):
        ConvGeometry.of((1, 1, 300, 300), (1, 1, 3, 3), 1, 0, 2, 2).check_codes()


def test_tiles_refuse_shapes_that_leave_a_thread_without_a_row():
    with pytest.raises(ValueError, match="multiple of BM"):
        Tiles(bm=8, bn=32, bk=8, tm=4, tn=4).checked()
    tiles = Tiles.for_rows(6, tn=4, threads_n=8)
    assert tiles.bm >= 6 and tiles.threads % tiles.bm == 0 and tiles.threads % tiles.bn == 0
    for rows, cols, inner in [(6, 36864, 25), (64, 120, 256), (32, 131072, 800), (3, 5, 7)]:
        tiles = Tiles.for_shape(rows, cols, inner, tn=4)
        prefetched = -(-tiles.bk * tiles.bm // tiles.threads) - (-tiles.bk * tiles.bn // tiles.threads)
        deeper = tiles._replace(bk=2 * tiles.bk)
        assert tiles.bk * (tiles.bm + tiles.bn) * 4 <= 40 * 1024 and prefetched <= PREFETCH
        assert (inner <= 8 * tiles.bk or tiles.bk == 64       # 8 slices deep, unless twice as deep overflows
                or -(-deeper.bk * deeper.bm // deeper.threads) - (-deeper.bk * deeper.bn // deeper.threads) > PREFETCH)


# -- the dense layers through the same product -------------------------------------------------------
DENSE_CASES = {"batch1": (1, 7, 5), "odd": (3, 37, 11), "wider-than-a-tile": (5, 19, 70)}


@pytest.mark.parametrize("case", DENSE_CASES)
@pytest.mark.parametrize("relu", [False, True], ids=["no-relu", "relu"])
def test_tiled_dense_forward_and_backward(case, relu):
    batch, features, outputs = DENSE_CASES[case]
    rng = np.random.default_rng(44)
    x, W, b, dz = random(rng, batch, features), random(rng, outputs, features), random(rng, outputs), random(
        rng, batch, outputs)
    y_ref = loops.dense_forward(*f64(x, W, b))
    if relu:
        y_ref = loops.relu_forward(y_ref)
    dx_ref, dW_ref, db_ref = loops.dense_backward(*f64(dz, x, W))

    d_x, d_w, d_b, d_dz = (cuda.to_device(a) for a in (x, W, b, dz))
    y, dx, dW, db = poisoned(y_ref.shape), poisoned(x.shape), poisoned(W.shape), poisoned(b.shape)
    dense_gemm.dense_forward(d_x, d_w, d_b, y, relu)
    dense_gemm.dense_backward_params(d_dz, d_x, dW, db)
    dense_gemm.dense_backward_data(d_dz, d_w, dx)
    assert rel_error(y.copy_to_host(), y_ref) < TOL
    for name, value, want in (("dx", dx, dx_ref), ("dW", dW, dW_ref), ("db", db, db_ref)):
        assert rel_error(value.copy_to_host(), want) < TOL, name

    masked = poisoned(x.shape)
    dense_gemm.dense_backward_data(d_dz, d_w, masked, mask=d_x)    # the ReLU below folded into dX
    assert rel_error(masked.copy_to_host(), np.where(x > 0, dx_ref, 0.0)) < TOL


# -- full size, on a GPU ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("net", [lenet5(), alexnet_small()], ids=lambda net: net.name)
def test_tiled_conv_blocks_at_full_size(net):
    """Every Conv → ReLU → MaxPool block of the real networks at batch 64, against stage 2 (float64):
    the tiles, splits and grids of the real shapes, which the simulator's tiny cases cannot reach."""
    rng, shapes = np.random.default_rng(45), net.activation_shapes()
    for index, layer in enumerate(net.layers):
        if not isinstance(layer, Conv):
            continue
        pool = net.layers[index + 2]
        x, W, b = random(rng, 64, *shapes[index]), 0.1 * random(rng, *layer.param_shapes()["W"]), random(
            rng, layer.out_channels)
        x64, W64, b64 = f64(x, W, b)
        conv = s2_numpy.relu_forward(s2_numpy.conv_forward(x64, W64, b64, layer.stride, layer.pad))
        y_ref, switches_ref = s2_numpy.maxpool_forward(conv, pool.size, pool.stride)
        dy = random(rng, *y_ref.shape)
        dconv = s2_numpy.relu_backward(s2_numpy.maxpool_backward(dy.astype(np.float64), switches_ref, conv.shape,
                                                                 pool.size, pool.stride), conv)
        expected = s2_numpy.conv_backward(dconv, x64, W64, layer.stride, layer.pad)
        (y, switches), got = tiled_conv_relu_pool(x, W, b, layer.stride, layer.pad, pool.size, pool.stride, dy)
        assert rel_error(y, y_ref) < 1e-4, f"layer {index}: y"
        assert (switches == switches_ref).mean() > 0.999, f"layer {index}: switches (a few float32 near-ties may flip)"
        for name, value, want in zip(("dx", "dW", "db"), got, expected):
            assert rel_error(value, want) < 1e-4, f"layer {index}: {name} rel_error {rel_error(value, want):.2e}"
