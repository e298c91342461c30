"""Assignment 3's tests: three Numba CUDA kernels of a convolution, one thread per output element.

Each kernel is launched with a 1-D grid (``grid_1d``) on float32 inputs, its output pre-filled with NaN
so that an element it forgets shows up, and compared with stage 1 (``cnn.stages.s1_loops``) computed in
float64 on the same numbers; float32 arithmetic earns a tolerance of 1e-5.
"""

from functools import partial

import numpy as np

from cnn.grading.family import Case, Family, close, normal
from cnn.grading.runners import launch_1d
from cnn.stages import s1_loops

# (N, C, H, W, F, K, stride, pad) — tiny, for the simulator
SHAPES = {
    "stride 1": [(2, 2, 6, 5, 3, 3, 1, 0)],                               # overlapping windows (K > stride)
    "stride 2": [(2, 1, 6, 6, 2, 2, 2, 0), (1, 2, 7, 7, 2, 3, 2, 1)],     # windows that touch; stride 2 with padding
    "padding": [(1, 3, 6, 6, 2, 5, 1, 2)],                                # stride 1, K = 5, pad 2
}


def out_size(size, K, stride, pad):
    return (size + 2 * pad - K) // stride + 1


def nan(shape) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def kernel_cases(rng, config, memory, family, kernel):
    """Cases of one ``kernel`` — "forward", "filter" (dw) or "data" (dx) — on the shapes of ``family``: float32
    inputs, the output filled with NaN, stage 1's answer computed in float64 on the same numbers."""
    for N, C, H, W, F, K, stride, pad in SHAPES[family]:
        x, w = normal(rng, N, C, H, W, dtype=np.float32), normal(rng, F, C, K, K, dtype=np.float32)
        dy = normal(rng, N, F, out_size(H, K, stride, pad), out_size(W, K, stride, pad), dtype=np.float32)
        label = f"x {x.shape}, w {w.shape}, s={stride} p={pad}"
        x64, w64, dy64 = (array.astype(np.float64) for array in (x, w, dy))
        if kernel == "forward":
            name, args, expected = "y", [x, w, nan(dy.shape)], s1_loops.conv_forward(x64, w64, np.zeros(F), stride, pad)
        elif kernel == "filter":
            name, args, expected = "dw", [dy, x, nan(w.shape)], s1_loops.conv_backward(dy64, x64, w64, stride, pad)[1]
        else:
            name, args, expected = "dx", [dy, w, nan(x.shape)], s1_loops.conv_backward(dy64, x64, w64, stride, pad)[0]
        what = f"{'forward' if kernel == 'forward' else name}, {label}"
        yield Case(label, {"args": [*args, stride, pad]}, [close(name, expected, 1e-5, what)])


FAMILIES = {
    f"test_{kernel}_{key}": Family(partial(kernel_cases, family=family, kernel=kernel), launch_1d(2, **{output: 2}))
    for kernel, output in (("forward", "y"), ("filter", "dw"), ("data", "dx"))
    for key, family in (("stride1", "stride 1"), ("stride2", "stride 2"), ("padding", "padding"))
}
