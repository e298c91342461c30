"""Stage 3's Winograd forward (kernels/cpu/winograd.py): its F(2 × 2, 5 × 5) matrices, the conv + pool against
stage 2's ops, and benchmarks/conv_forward_paths.py's paths agreeing with each other."""

import numpy as np
import pytest

from cnn.gradcheck import rel_error
from cnn.stages.s2_numpy import NumpyStage
from kernels.cpu import winograd
from test_reliability import load_script


def test_the_matrices_give_the_correlation_in_one_and_two_dimensions():
    """y_i = Σ_k g_k·d_{i+k} (two outputs, five taps) = Aᵀ[(G g) ⊙ (Bᵀ d)], and nested for a 2 × 2 tile (float64)."""
    rng = np.random.default_rng()
    AT, G, BT = winograd.A_T, winograd.G_MATRIX, winograd.B_T
    g, d = rng.normal(size=5), rng.normal(size=6)
    direct = np.array([g @ d[i:i + 5] for i in range(2)])
    assert rel_error(AT @ ((G @ g) * (BT @ d)), direct) < 1e-13
    g2, d2 = rng.normal(size=(5, 5)), rng.normal(size=(6, 6))
    direct2 = np.array([[np.sum(g2 * d2[i:i + 5, j:j + 5]) for j in range(2)] for i in range(2)])
    assert rel_error(AT @ ((G @ g2 @ G.T) * (BT @ d2 @ BT.T)) @ AT.T, direct2) < 1e-13
    assert np.count_nonzero(BT, axis=1).max() <= 4          # what combine4 relies on


def test_points_must_be_distinct_and_as_many_as_the_tile_needs():
    with pytest.raises(ValueError, match="needs 5 distinct points"):
        winograd.winograd_matrices(points=(0.0, 1.0, 1.0, 2.0, -2.0))
    with pytest.raises(ValueError, match="needs 5 distinct points"):
        winograd.winograd_matrices(points=(0.0, 1.0, -1.0, 2.0))


@pytest.mark.parametrize("samples,channels,height,width,filters,pad,relu", [
    (3, 5, 10, 8, 6, 2, True),       # one block; channels and filters not multiples of four; a plane not square
    (5, 24, 16, 16, 6, 2, False),    # blocks of 3 samples, the last one short
    (2, 4, 12, 14, 4, 0, True),      # no padding
])
def test_winograd_forward_equals_numpy(samples, channels, height, width, filters, pad, relu):
    """Conv 5 × 5 + bias (+ ReLU) + 2 × 2/2 pool by F(2 × 2, 5 × 5), called directly (the stage takes it from
    MIN_CHANNELS channels), against stage 2's ops on fresh random inputs, float64."""
    rng = np.random.default_rng()
    ref = NumpyStage.ops
    x = rng.normal(size=(samples, channels, height, width))
    W, b = rng.normal(size=(filters, channels, 5, 5)), rng.normal(size=filters)
    z = ref.conv_forward(x, W, b, 1, pad)
    y, switch = ref.maxpool_forward(ref.relu_forward(z) if relu else z, 2, 2)
    U = np.zeros(winograd.weights_shape(filters, channels))
    winograd.winograd_weights(W, U)
    out, got = np.full_like(y, np.nan), np.full(switch.shape, -1)
    winograd.winograd_forward(x, U, b, pad, relu, out, got, 0, winograd.tile_blocks(x, pad))
    passed = y > 0 if relu else np.ones(y.shape, bool)      # a window all ReLU-zero passes nothing back: any switch
    print(f"rel_error {rel_error(out, y):.1e}")
    assert rel_error(out, y) < 1e-12 and np.array_equal(got[passed], switch[passed])


def test_the_benchmarks_paths_agree():
    """benchmarks/conv_forward_paths.py on AlexNet-small's conv 3 (one repeat): every path within float32
    rounding of the planes; and a bad flag is one line."""
    script = load_script("conv_forward_paths")
    paths, _ = script.time_paths(32, 8, 64, 3, 1, np.random.default_rng())
    assert set(paths) == {"planes", "windows", "winograd"}
    assert all(difference < 2e-5 for _, difference in paths.values())
    with pytest.raises(SystemExit):
        script.main(["--samples", "0"])
