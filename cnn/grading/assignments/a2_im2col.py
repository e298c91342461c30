"""Assignment 2's tests: im2col, its adjoint col2im, and a convolution built on them.

``im2col`` and ``col2im`` are compared with stage 2's (``cnn.stages.s2_numpy``); ``col2im`` also with the
defining property of an adjoint, ⟨im2col(x), C⟩ = ⟨x, col2im(C)⟩; the convolution's forward and backward
passes with stage 1. Parts 3 and 4 use the student's im2col and col2im — or the library's, when part 1
or 2 was left blank, so that each part is graded alone.
"""

from functools import partial

import numpy as np

from cnn.grading.family import Case, Family, OwnWork, Verdict, close, equal, normal
from cnn.grading.runners import call, library_for_blanks
from cnn.stages import s1_loops, s2_numpy

# (N, C, H, W, K, stride, pad)
SHAPES = {
    "stride 1": [(2, 3, 7, 7, 3, 1, 0), (1, 2, 3, 3, 3, 1, 0)],    # overlapping windows (K > stride); a 1×1 output
    "stride 2": [(2, 1, 5, 5, 2, 2, 0), (1, 2, 6, 5, 3, 2, 1)],    # windows that touch; stride 2 with padding
    "padding": [(1, 3, 8, 8, 5, 1, 2), (2, 1, 5, 6, 3, 1, 1)],     # stride 1, pad 2 and pad 1
}
FILTERS = 4


def _label(x, K, stride, pad):
    return f"x {x.shape}, K={K} s={stride} p={pad}"


def im2col_cases(rng, config, memory, family):
    for N, C, H, W, K, stride, pad in SHAPES[family]:
        x = normal(rng, N, C, H, W)
        cols, out_shape = s2_numpy.im2col(x, K, stride, pad)
        yield Case(_label(x, K, stride, pad), {"args": [x, K, stride, pad]},
                   [equal("out_shape", out_shape, "(Ho, Wo)"),
                    close("cols", cols, 1e-15, f"im2col, {_label(x, K, stride, pad)}")])


def adjoint(x, inner: float, what: str):
    """A judge: ⟨x, col2im(C)⟩ equal to ⟨im2col(x), C⟩, computed here from the student's col2im(C)."""
    def judge(outputs):
        dx = np.asarray(outputs.get("dx"), dtype=np.float64)
        if dx.shape != x.shape:
            return Verdict(False, message=f"{what}: col2im returned shape {dx.shape}, expected {x.shape}")
        return close("inner", inner, 1e-12, what)({"inner": float(np.sum(x * dx))})
    return judge


def col2im_cases(rng, config, memory, family):
    for N, C, H, W, K, stride, pad in SHAPES[family]:
        x = normal(rng, N, C, H, W)
        cols, _ = s2_numpy.im2col(x, K, stride, pad)
        dcols = normal(rng, *cols.shape)
        yield Case(_label(x, K, stride, pad), {"args": [dcols, x.shape, K, stride, pad]},
                   [adjoint(x, float(np.sum(cols * dcols)), f"<im2col(x), C> = <x, col2im(C)>, K={K} s={stride} p={pad}"),
                    close("dx", s2_numpy.col2im(dcols, x.shape, K, stride, pad), 1e-12,
                          f"col2im, {_label(x, K, stride, pad)}")])


def _conv_shapes(families):
    return [shape for family in families for shape in SHAPES[family]]


def forward_cases(rng, config, memory, families):
    for N, C, H, W, K, stride, pad in _conv_shapes(families):
        x, w, b = normal(rng, N, C, H, W), normal(rng, FILTERS, C, K, K), normal(rng, FILTERS)
        what = f"forward, {_label(x, K, stride, pad)}"
        yield Case(what, {"args": [x, w, b, stride, pad]}, [close("y", s1_loops.conv_forward(x, w, b, stride, pad), 1e-10, what)])


def backward_cases(rng, config, memory, families):
    for N, C, H, W, K, stride, pad in _conv_shapes(families):
        x, w = normal(rng, N, C, H, W), normal(rng, FILTERS, C, K, K)
        dy = normal(rng, *s1_loops.conv_forward(x, w, np.zeros(FILTERS), stride, pad).shape)
        label = _label(x, K, stride, pad)
        yield Case(label, {"args": [dy, x, w, stride, pad]},
                   [close(name, value, 1e-10, f"{name}, {label}")
                    for name, value in zip(("dx", "dW", "db"), s1_loops.conv_backward(dy, x, w, stride, pad))])


def with_library_parts(returns):
    """Run the convolution with the library's im2col / col2im in place of a part left blank."""
    def run(inputs, convolution, *others):
        with library_for_blanks(convolution, im2col=s2_numpy.im2col, col2im=s2_numpy.col2im):
            return call(*returns)(inputs, convolution)
    return run


IM2COL, COL2IM = call("cols", "out_shape"), call("dx")
ON_PARTS = OwnWork(other_parts=("im2col", "col2im"))         # parts 3 and 4 use parts 1 and 2
FORWARD, BACKWARD = with_library_parts(("y",)), with_library_parts(("dx", "dW", "db"))
FAMILIES = {
    "test_im2col_stride1": Family(partial(im2col_cases, family="stride 1"), IM2COL),
    "test_im2col_stride2": Family(partial(im2col_cases, family="stride 2"), IM2COL),
    "test_im2col_padding": Family(partial(im2col_cases, family="padding"), IM2COL),
    "test_col2im_stride1": Family(partial(col2im_cases, family="stride 1"), COL2IM),
    "test_col2im_stride2": Family(partial(col2im_cases, family="stride 2"), COL2IM),
    "test_col2im_padding": Family(partial(col2im_cases, family="padding"), COL2IM),
    "test_conv_forward_stride1": Family(partial(forward_cases, families=("stride 1", "padding")), FORWARD, ON_PARTS),
    "test_conv_forward_stride2": Family(partial(forward_cases, families=("stride 2",)), FORWARD, ON_PARTS),
    "test_conv_backward_stride1": Family(partial(backward_cases, families=("stride 1", "padding")), BACKWARD, ON_PARTS),
    "test_conv_backward_stride2": Family(partial(backward_cases, families=("stride 2",)), BACKWARD, ON_PARTS),
}
