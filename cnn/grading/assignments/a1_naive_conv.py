"""Assignment 1's tests: a convolution's forward and backward pass in numpy, and its gradient check.

Compared with stage 1 (``cnn.stages.s1_loops``) in float64, on fresh random inputs in three families —
stride 1, stride 2, padding — that break the usual index bugs: windows that overlap (K > stride), that
touch, stride 2 with padding, a 1×1 output. The gradient check compares the student's backward pass
with central differences of the *reference* forward pass, independent of both.
"""

from functools import partial

from cnn.gradcheck import numerical_gradient
from cnn.grading.family import Case, Family, close, normal
from cnn.grading.runners import call
from cnn.stages import s1_loops

# (N, C, H, W, F, K, stride, pad)
SHAPES = {
    "stride 1": [(2, 3, 7, 7, 4, 3, 1, 0), (1, 2, 3, 3, 3, 3, 1, 0)],       # overlapping windows; a 1×1 output
    "stride 2": [(2, 1, 5, 5, 2, 2, 2, 0), (1, 2, 7, 6, 3, 3, 2, 0),        # windows that touch, overlap,
                 (1, 2, 6, 5, 3, 3, 2, 1)],                                 # and stride 2 with padding
    "padding": [(1, 3, 8, 8, 2, 5, 1, 2), (2, 2, 5, 6, 3, 3, 1, 1)],        # stride 1, pad 2 and pad 1
}
GRADIENT_CHECKS = {"stride 1": (2, 2, 5, 5, 3, 3, 1, 1), "stride 2": (1, 2, 6, 6, 2, 3, 2, 0)}


def _layer(rng, N, C, H, W, F, K):
    return normal(rng, N, C, H, W), normal(rng, F, C, K, K), normal(rng, F)


def forward_cases(rng, config, memory, shapes):
    for N, C, H, W, F, K, stride, pad in shapes:
        x, w, b = _layer(rng, N, C, H, W, F, K)
        what = f"forward, x {x.shape}, W {w.shape}, s={stride} p={pad}"
        yield Case(what, {"args": [x, w, b, stride, pad]},
                   [close("y", s1_loops.conv_forward(x, w, b, stride, pad), 1e-10, what)])


def backward_cases(rng, config, memory, shapes):
    for N, C, H, W, F, K, stride, pad in shapes:
        x, w, b = _layer(rng, N, C, H, W, F, K)
        dy = normal(rng, *s1_loops.conv_forward(x, w, b, stride, pad).shape)
        label = f"x {x.shape}, W {w.shape}, s={stride} p={pad}"
        expected = s1_loops.conv_backward(dy, x, w, stride, pad)
        yield Case(label, {"args": [dy, x, w, stride, pad]},
                   [close(name, value, 1e-10, f"{name}, {label}") for name, value in zip(("dx", "dW", "db"), expected)])


def gradient_check_cases(rng, config, memory, shape):
    """The backward pass against central differences of the reference forward pass, L = Σ y·dy."""
    import numpy as np


    N, C, H, W, F, K, stride, pad = shape
    x, w, b = _layer(rng, N, C, H, W, F, K)
    dy = normal(rng, *s1_loops.conv_forward(x, w, b, stride, pad).shape)

    def reference_loss(_):
        return float(np.sum(s1_loops.conv_forward(x, w, b, stride, pad) * dy))
    inputs = {"args": [dy, x.copy(), w.copy(), stride, pad]}
    numerical = [numerical_gradient(reference_loss, value) for value in (x, w, b)]
    yield Case(f"s={stride} p={pad}", inputs,
               [close(name, value, 1e-7, f"{name} vs numerical, s={stride} p={pad}")
                for name, value in zip(("dx", "dW", "db"), numerical)])


FORWARD, BACKWARD = call("y"), call("dx", "dW", "db")
FAMILIES = {
    "test_forward_stride1": Family(partial(forward_cases, shapes=SHAPES["stride 1"]), FORWARD),
    "test_forward_stride2": Family(partial(forward_cases, shapes=SHAPES["stride 2"]), FORWARD),
    "test_forward_padding": Family(partial(forward_cases, shapes=SHAPES["padding"]), FORWARD),
    "test_backward_stride1": Family(partial(backward_cases, shapes=SHAPES["stride 1"]), BACKWARD),
    "test_backward_stride2": Family(partial(backward_cases, shapes=SHAPES["stride 2"]), BACKWARD),
    "test_backward_padding": Family(partial(backward_cases, shapes=SHAPES["padding"]), BACKWARD),
    "test_gradient_check_stride1": Family(partial(gradient_check_cases, shape=GRADIENT_CHECKS["stride 1"]), BACKWARD),
    "test_gradient_check_stride2": Family(partial(gradient_check_cases, shape=GRADIENT_CHECKS["stride 2"]), BACKWARD),
}
