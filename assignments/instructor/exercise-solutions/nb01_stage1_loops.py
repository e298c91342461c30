"""Notebook 01, stage 1 `loops`: worked solutions of its three exercises."""

from __future__ import annotations

import time

import numpy as np

from cnn.gradcheck import numerical_gradient, rel_error
from cnn.model import Conv, Dense, lenet5
from cnn.stages import get_stage, s1_loops
from common import random_array


def maxpool_backward_push(dy, argmax, x_shape, accumulate=True):
    """dx from dy in push form: each pooled output adds its gradient onto its window's winner.

    ``argmax[n, c, i, j]`` is the winner's flat index h·W + w in its H×W plane. ``accumulate=False``
    writes ``=`` instead of ``+=`` — the bug the exercise asks about."""
    N, C, H, W = x_shape
    dx = np.zeros(x_shape, dtype=dy.dtype)
    for n in range(N):
        for c in range(C):
            for i in range(dy.shape[2]):
                for j in range(dy.shape[3]):
                    h, w = divmod(int(argmax[n, c, i, j]), W)
                    if accumulate:
                        dx[n, c, h, w] += dy[n, c, i, j]
                    else:
                        dx[n, c, h, w] = dy[n, c, i, j]
    return dx


def exercise_1(fast: bool) -> None:
    """Write maxpool_backward in push form; check it with overlapping windows; `=` instead of `+=`?

    Answer. The push form loops over the pooled outputs and adds each dy[n, c, i, j] onto its winner,
    dx[n, c, argmax // W, argmax % W] += dy (function `maxpool_backward_push` above). It agrees with
    `s1_loops.maxpool_backward` to rounding with 3×3 windows at stride 1. With `=` it fails there: with
    overlapping windows one pixel can win several windows (a large value wins every window that contains
    it, up to nine at 3×3 / stride 1), and `=` keeps only the last window's gradient instead of their sum.
    With 2×2 windows at stride 2 the `=` version still passes: the windows do not overlap, each pixel
    belongs to exactly one window and so wins at most once — nothing is ever overwritten. That is why the
    course's tests always include overlapping windows: the 2×2 / stride 2 case of LeNet-5 cannot catch it.
    """
    rng = np.random.default_rng(1)
    results = {}
    for size, stride in ((3, 1), (2, 2)):
        x = random_array(rng, 2, 3, 6, 6)
        y, argmax = s1_loops.maxpool_forward(x, size, stride)
        dy = random_array(rng, *y.shape)
        expected = s1_loops.maxpool_backward(dy, argmax, x.shape, size, stride)
        errors = [rel_error(maxpool_backward_push(dy, argmax, x.shape, accumulate), expected)
                  for accumulate in (True, False)]
        repeated = argmax.size - sum(len(np.unique(plane)) for plane in argmax.reshape(-1, argmax[0, 0].size))
        print(f"{size}×{size} stride {stride}: push with += rel_error {errors[0]:.1e}, with = {errors[1]:.1e} "
              f"({repeated} windows share their winner with another)")
        results[size, stride] = errors, repeated
    assert results[3, 1][0][0] < 1e-12 and results[3, 1][1] > 0 and results[3, 1][0][1] > 1e-3
    assert results[2, 2][0][0] < 1e-12 and results[2, 2][1] == 0 and results[2, 2][0][1] < 1e-12


def exercise_2(fast: bool) -> None:
    """The gradient check in float32: why ~1e-2? Which h is better, and why never as good as float64?

    Answer. The central difference (L(θ+h) − L(θ−h)) / 2h has two errors: truncation, of order h²·|L‴|,
    and rounding: each L is known only to about ε·|L| (ε = 6e-8 in float32, 1e-16 in float64), and the
    division by 2h turns that into ε·|L|/h. With h = 1e-6 in float32 the rounding term is about
    6e-8·|L|/1e-6, several percent of a typical gradient component: relative errors of 1e-2 to 1e-1 (and
    θ ± 1e-6 is not even representable for |θ| ~ 1, where float32's spacing is 1.2e-7, so the step itself
    is rounded). The total h²·|L‴| + ε·|L|/h is smallest at h ≈ ε^(1/3) ≈ 4e-3 for float32, where it is
    about ε^(2/3) ≈ 1e-5 relative: the check below on a smooth nonlinear loss (tanh of a convolution)
    finds its best h between 1e-3 and 3e-2, with an error around 1e-5..1e-4. (The layer check of the
    notebook, L = Σ conv(x, W)·dy, is *linear* in W: it has no truncation error at all, so there the
    largest h is best — but real losses are not linear, and a ReLU or max-pool kink limits h as well.)
    It can never be as good as float64: float32's best is about ε^(2/3) = 1.5e-5, float64's about
    2e-11 — the digits are not in the numbers. That is why gradient checks run in float64 (as
    `check_stage_gradients` does) and float32 stages are compared with float64 references at about 1e-5.
    """
    rng = np.random.default_rng(2)
    x64, W64, b64 = random_array(rng, 2, 2, 6, 6), random_array(rng, 3, 2, 3, 3) / 3, random_array(rng, 3)
    y64 = s1_loops.conv_forward(x64, W64, b64, 1, 1)
    dy64 = random_array(rng, *y64.shape)
    _, dW_exact, _ = s1_loops.conv_backward(dy64 * (1 - np.tanh(y64) ** 2), x64, W64, 1, 1)   # d/dW Σ tanh(y)·dy
    x, W, b, dy = (a.astype(np.float32) for a in (x64, W64, b64, dy64))

    def loss(_):
        return float(np.sum(np.tanh(s1_loops.conv_forward(x, W, b, 1, 1)) * dy, dtype=np.float32))

    def loss64(_):
        return float(np.sum(np.tanh(s1_loops.conv_forward(x64, W64, b64, 1, 1)) * dy64))
    errors = {}
    for h in (1e-6, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1):
        errors[h] = rel_error(numerical_gradient(loss, W, h=h), dW_exact)
        print(f"float32, h = {h:g}: rel_error of dW {errors[h]:.1e}")
    best = min(errors, key=errors.get)
    exact64 = rel_error(numerical_gradient(loss64, W64), dW_exact)
    print(f"best h {best:g}: {errors[best]:.1e};  float64 with h = 1e-6 reaches {exact64:.1e}")
    assert errors[1e-6] > 1e-3, "h = 1e-6 is far too small for float32"
    assert 1e-3 <= best <= 3e-2 and errors[best] < errors[1e-6] / 10, "the best h is near ε^(1/3)"
    assert errors[best] > 100 * exact64, "float32 can never reach float64's accuracy"


def forward_multiply_adds(net) -> dict:
    """Multiply-adds of one image's forward pass by layer: F·C·K²·Ho·Wo a convolution, in·out a dense layer."""
    shapes, counts = net.activation_shapes(), {}
    for index, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            _, out_h, out_w = shapes[index + 1]
            counts[f"{index}: conv {layer.in_channels}→{layer.out_channels}"] = (
                layer.out_channels * layer.in_channels * layer.kernel ** 2 * out_h * out_w)
        elif isinstance(layer, Dense):
            name = f"{index}: dense {layer.in_features}→{layer.out_features}"
            counts[name] = layer.in_features * layer.out_features
    return counts


def exercise_3(fast: bool) -> None:
    """Count the multiply-adds of one LeNet-5 forward pass; how many per second does stage loops manage?

    Answer. conv 1→6: 6·1·25·24·24 = 86 400; conv 6→16: 16·6·25·8·8 = 153 600; the dense layers add
    256·120 + 120·84 + 84·10 = 41 640: 281 640 multiply-adds an image, 240 000 of them in the two
    convolutions. Stage `loops` runs the forward pass of one image in tens of milliseconds (it calls numpy
    once per output pixel and filter: 5 952 window sums for conv 1 and conv 2 together, each a few µs of
    interpreter and call overhead for 25 to 150 multiply-adds), i.e. a few million multiply-adds per
    second — while one core of a current CPU does a few *billion* floating-point operations per second
    (a few GFLOP/s, and tens with SIMD): stage 1 runs at a thousandth of the machine or less. The
    time goes to the interpreter, not the arithmetic — which is what stage 2 fixes.
    """
    net = lenet5()
    counts = forward_multiply_adds(net)
    for name, count in counts.items():
        print(f"{name:<22} {count:>9,} multiply-adds per image")
    total = sum(counts.values())
    print(f"total {total:,} (convolutions {sum(c for n, c in counts.items() if 'conv' in n):,})")
    assert total == 86_400 + 153_600 + 41_640
    batch = 1 if fast else 8
    stage = get_stage("loops")(net).init("he", seed=0)
    rng = np.random.default_rng(3)
    stage.load_batch(random_array(rng, batch, 1, 28, 28, dtype=np.float32), rng.integers(0, 10, batch))
    started = time.perf_counter()
    stage.forward()
    seconds = time.perf_counter() - started
    rate = total * batch / seconds
    print(f"stage loops: forward of {batch} image(s) in {seconds * 1e3:.0f} ms = {rate / 1e6:.1f} M multiply-adds/s, "
          f"{2 * rate / 1e9:.4f} GFLOP/s — against a few GFLOP/s per core")
