"""Notebook 02, stage 2 `numpy` (im2col): worked solutions of its three exercises."""

from __future__ import annotations

import time

import numpy as np

from cnn.gradcheck import rel_error
from cnn.model import Conv, alexnet_small, lenet5
from cnn.stages import s1_loops, s2_numpy
from common import random_array


def exercise_1(fast: bool) -> None:
    """The size of `cols` for AlexNet-small's first layer (batch 128, 3×32×32, K=5, pad 2).

    Answer. With pad 2 and stride 1 a 5×5 window fits at every one of the 32×32 positions, so `cols` has
    N·Ho·Wo = 128·32·32 = 131 072 rows of C·K·K = 3·25 = 75 numbers: 9 830 400 floats, 39.3 MB in float32,
    against 1.57 MB for the input batch — exactly K² = 25 times larger (K²/s² in general, minus the
    border when there is no padding). And the backward pass builds a second matrix of the same size
    (dcols). Stage 3 never builds it (its compiled loops read the input in place) and stage 5 never even
    stores the convolution's output: the memory traffic of im2col is what they save.
    """
    net = alexnet_small()
    first = next(layer for layer in net.layers if isinstance(layer, Conv))
    batch, (channels, height, width) = 128, net.input_shape
    K, stride, pad = first.kernel, first.stride, first.pad
    out_h, out_w = (height + 2 * pad - K) // stride + 1, (width + 2 * pad - K) // stride + 1
    rows, columns = batch * out_h * out_w, channels * K * K
    cols_bytes, input_bytes = 4 * rows * columns, 4 * batch * channels * height * width
    print(f"{net.name}, first layer {first}: cols is ({rows:,}, {columns}) = {rows * columns:,} floats = "
          f"{cols_bytes / 1e6:.1f} MB in float32; the input batch is {input_bytes / 1e6:.2f} MB "
          f"({cols_bytes / input_bytes:.0f}×)")
    sample, (sample_h, sample_w) = s2_numpy.im2col(np.zeros((2, channels, height, width), np.float32), K, stride, pad)
    assert sample.shape == (2 * out_h * out_w, columns) and (sample_h, sample_w) == (out_h, out_w), "im2col agrees"
    assert (channels, height, width, K, stride, pad) == (3, 32, 32, 5, 1, 2), "the layer the exercise names"
    assert cols_bytes == 25 * input_bytes


def maxpool_backward_fancy(dy, argmax, x_shape):
    """The exercise's version: ``dx.reshape(-1)[plane + argmax] += dy`` (wrong when windows share a winner)."""
    N, C, H, W = x_shape
    plane = np.arange(N * C).reshape(N, C, 1, 1) * (H * W)
    dx = np.zeros(x_shape, dtype=dy.dtype)
    dx.reshape(-1)[(plane + argmax).ravel()] += dy.ravel()
    return dx


def exercise_2(fast: bool) -> None:
    """maxpool_backward with `dx.reshape(-1)[plane + argmax] += dy`: find where it fails; why not 2×2/2?

    Answer. NumPy's `a[idx] += v` is a read, an add and a write of whole arrays — `a[idx] = a[idx] + v` —
    so when an index appears twice in `idx`, both reads see the old value and the second write wins: the
    repeated additions are lost (np.add.at or np.bincount accumulate them). A repeated index is a pixel that
    wins two windows, which happens only when windows overlap: 3×3 windows at stride 1 or 2 fail. With
    2×2 windows at stride 2 every pixel lies in exactly one window, so no index repeats and the bug is
    invisible — LeNet-5's own pooling never shows it, which is why the course tests overlapping windows.
    """
    rng = np.random.default_rng(4)
    failed = {}
    for size, stride in ((2, 2), (3, 1), (3, 2)):
        x = random_array(rng, 2, 3, 9, 8)
        y, argmax = s2_numpy.maxpool_forward(x, size, stride)
        dy = random_array(rng, *y.shape)
        error = rel_error(maxpool_backward_fancy(dy, argmax, x.shape),
                          s1_loops.maxpool_backward(dy, argmax, x.shape, size, stride))
        print(f"max-pool {size}×{size} stride {stride}: fancy-index += rel_error {error:.1e}")
        failed[size, stride] = error > 1e-6
    assert failed == {(2, 2): False, (3, 1): True, (3, 2): True}


def exercise_3(fast: bool) -> None:
    """GFLOP/s of the matrix product for batch 1, 8, 64, 256: why does a small batch get less of the machine?

    Answer. For LeNet-5's second convolution `cols @ W_matᵀ` is (64·N, 150) × (150, 16): 2·64·N·150·16
    flops. At batch 1 that is 0.3 MFLOP, done in microseconds: the fixed cost of the call (Python, the
    BLAS dispatch, threads waking up, packing the operands into cache-sized blocks) is comparable to the
    arithmetic, and a 64-row matrix gives BLAS too little to split across cores or to keep its SIMD units
    and register blocks full. As N grows the work grows and the overhead does not, so the rate climbs
    towards the machine's peak (tens of GFLOP/s a core with AVX) and flattens once the product is large
    enough to be limited by the arithmetic or by memory — the same reason a GPU needs large batches. (The
    numbers printed below are this machine's, now; they are never asserted.)
    """
    net = lenet5()
    layer, shapes = net.layers[3], net.activation_shapes()
    rng = np.random.default_rng(5)
    W_mat = random_array(rng, layer.out_channels, layer.in_channels * layer.kernel ** 2, dtype=np.float32)
    for batch in ((1, 8, 64) if fast else (1, 8, 64, 256)):
        cols, _ = s2_numpy.im2col(random_array(rng, batch, *shapes[3], dtype=np.float32), layer.kernel, 1, 0)
        repeats = 3 if fast else 20
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            cols @ W_mat.T
            times.append(time.perf_counter() - started)
        flops = 2 * cols.shape[0] * cols.shape[1] * W_mat.shape[0]
        print(f"batch {batch:>3}: cols {cols.shape} @ {W_mat.T.shape}: {flops / 1e6:7.2f} MFLOP in "
              f"{np.median(times) * 1e3:7.3f} ms = {flops / np.median(times) / 1e9:6.2f} GFLOP/s")
        assert cols.shape == (batch * 64, 150)
