"""Assignment 4's tests: one CUDA kernel for convolution + bias + ReLU + max-pool, with the switches.

Compared with stage 1's three layers in a row (convolution, ReLU, max-pool) in float64. A switch is
right wherever it points inside its own window at a value equal to the pooled maximum — any maximum
(after the ReLU a window of negatives is all zeros). The student may call the library's device function
``kernels.conv2d.conv_window_sum``, not its fused kernel.
"""

from functools import partial

import numpy as np

from cnn.grading.family import Case, Family, LIBRARY, OwnWork, close, normal, switches
from cnn.grading.runners import launch_1d
from cnn.stages import s1_loops

# (N, C, H, W, F, K, stride, pad, pooling size, pooling stride)
SHAPES = {
    "lenet": [(2, 2, 8, 8, 3, 3, 1, 0, 2, 2), (1, 1, 9, 9, 2, 5, 1, 0, 2, 2)],   # LeNet's 2×2 pools, 3×3 and 5×5 filters
    "overlapping stride 1": [(2, 2, 7, 7, 3, 3, 1, 0, 3, 1)],    # a conv output belongs to up to nine windows
    "overlapping stride 2": [(1, 2, 9, 9, 2, 3, 1, 0, 3, 2)],    # neighbouring windows share a row or a column
    "padded": [(2, 2, 6, 6, 3, 3, 1, 1, 2, 2), (1, 2, 6, 6, 2, 5, 1, 2, 2, 2)],
    "strided": [(1, 3, 9, 9, 2, 3, 2, 0, 2, 2)],
}


def out_size(size, K, stride, pad=0):
    return (size + 2 * pad - K) // stride + 1


def fused_cases(rng, config, memory, family):
    for N, C, H, W, F, K, stride, pad, size, pool_stride in SHAPES[family]:
        x, w, b = (normal(rng, N, C, H, W, dtype=np.float32), normal(rng, F, C, K, K, dtype=np.float32),
                   normal(rng, F, dtype=np.float32))
        relu = s1_loops.relu_forward(s1_loops.conv_forward(x.astype(np.float64), w.astype(np.float64),
                                                           b.astype(np.float64), stride, pad))
        expected, _ = s1_loops.maxpool_forward(relu, size, pool_stride)
        label = f"x {x.shape}, K={K} s={stride} p={pad}, pool {size}×{size} s={pool_stride}"
        args = [x, w, b, np.full(expected.shape, np.nan, np.float32), np.full(expected.shape, -1, np.int32),
                stride, pad, size, pool_stride, relu.shape[3]]
        yield Case(label, {"args": args}, [close("y", expected, 1e-5, f"y, {label}"),
                                           switches("switches", relu, expected, size, pool_stride, 1e-5, f"switches, {label}")])


OWN_WORK = OwnWork(rules=LIBRARY + (("kernels.conv2d.conv_window_sum", True),))
FUSED = launch_1d(3, y=3, switches=4)
FAMILIES = {
    grade_id: Family(partial(fused_cases, family=family), FUSED, OWN_WORK)
    for grade_id, family in (("test_lenet_case", "lenet"), ("test_overlapping_pools_stride1", "overlapping stride 1"),
                             ("test_overlapping_pools_stride2", "overlapping stride 2"), ("test_padded_conv", "padded"),
                             ("test_strided_conv", "strided"))
}
