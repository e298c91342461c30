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


def _problem(rng, N, C, H, W, F, K, stride, pad):
    """float32 x, w and dy of one case, and the label of its lines."""
    x, w = normal(rng, N, C, H, W, dtype=np.float32), normal(rng, F, C, K, K, dtype=np.float32)
    dy = normal(rng, N, F, out_size(H, K, stride, pad), out_size(W, K, stride, pad), dtype=np.float32)
    return x, w, dy, f"x {x.shape}, w {w.shape}, s={stride} p={pad}"


def nan(shape) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def forward_cases(rng, config, memory, family):
    for N, C, H, W, F, K, stride, pad in SHAPES[family]:
        x, w, dy, label = _problem(rng, N, C, H, W, F, K, stride, pad)
        expected = s1_loops.conv_forward(x.astype(np.float64), w.astype(np.float64), np.zeros(F), stride, pad)
        yield Case(label, {"args": [x, w, nan(expected.shape), stride, pad]}, [close("y", expected, 1e-5, f"forward, {label}")])


def filter_cases(rng, config, memory, family):
    for N, C, H, W, F, K, stride, pad in SHAPES[family]:
        x, w, dy, label = _problem(rng, N, C, H, W, F, K, stride, pad)
        _, expected, _ = s1_loops.conv_backward(dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
                                                stride, pad)
        yield Case(label, {"args": [dy, x, nan(w.shape), stride, pad]}, [close("dw", expected, 1e-5, f"dw, {label}")])


def data_cases(rng, config, memory, family):
    for N, C, H, W, F, K, stride, pad in SHAPES[family]:
        x, w, dy, label = _problem(rng, N, C, H, W, F, K, stride, pad)
        expected, _, _ = s1_loops.conv_backward(dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
                                                stride, pad)
        yield Case(label, {"args": [dy, w, nan(x.shape), stride, pad]}, [close("dx", expected, 1e-5, f"dx, {label}")])


FORWARD, FILTER, DATA = launch_1d(2, y=2), launch_1d(2, dw=2), launch_1d(2, dx=2)
FAMILIES = {
    f"test_{kind}_{key}": Family(partial(cases, family=family), run)
    for kind, cases, run in (("forward", forward_cases, FORWARD), ("filter", filter_cases, FILTER),
                             ("data", data_cases, DATA))
    for key, family in (("stride1", "stride 1"), ("stride2", "stride 2"), ("padding", "padding"))
}
