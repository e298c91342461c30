"""Assignment 7's tests: the dense layer, softmax + cross-entropy, and max-pool forward with its switches.

Compared with stage 1's layers and ``softmax_cross_entropy`` (``cnn.stages.base``) in float64, and the
backward passes with central differences of the *reference* forward passes. Scores as large as 1000
(past 709.78, where np.exp overflows in float64), then 300, catch a softmax that forgets to subtract
each row's maximum, and one that subtracts it but takes the loss as np.log(p): a label's probability
e^-1000 rounds to 0.
"""

from functools import partial

import numpy as np

from cnn.gradcheck import numerical_gradient
from cnn.grading.family import Case, Family, Verdict, close, normal
from cnn.grading.runners import call
from cnn.stages import s1_loops
from cnn.stages.base import softmax_cross_entropy


def dense_forward_cases(rng, config, memory):
    for N, inputs, outputs in [(4, 5, 3), (1, 7, 4), (3, 1, 1), (2, 64, 10)]:    # batch 1, one input, one output, wide
        x, w, b = normal(rng, N, inputs), normal(rng, outputs, inputs), normal(rng, outputs)
        what = f"dense forward, x {x.shape}, W {w.shape}"
        yield Case(what, {"args": [x, w, b]}, [close("y", s1_loops.dense_forward(x, w, b), 1e-12, what)])


def dense_backward_cases(rng, config, memory):
    for N, inputs, outputs in [(4, 5, 3), (1, 7, 4), (3, 1, 1), (5, 16, 10)]:
        x, w, dy = normal(rng, N, inputs), normal(rng, outputs, inputs), normal(rng, N, outputs)
        label = f"x {x.shape}, W {w.shape}"
        yield Case(label, {"args": [dy, x, w]}, [close(name, value, 1e-12, f"{name}, {label}") for name, value
                                                  in zip(("dx", "dW", "db"), s1_loops.dense_backward(dy, x, w))])


def dense_gradient_check_cases(rng, config, memory):
    """The backward pass against central differences of the reference forward pass, L = Σ y·dy."""
    x, w, b, dy = normal(rng, 3, 6), normal(rng, 4, 6), normal(rng, 4), normal(rng, 3, 4)
    inputs = {"args": [dy, x.copy(), w.copy()]}
    loss = lambda _: float(np.sum(s1_loops.dense_forward(x, w, b) * dy))       # noqa: E731
    yield Case("dense", inputs, [close(name, numerical_gradient(loss, value), 1e-8, f"{name} vs numerical")
                                 for name, value in (("dx", x), ("dW", w), ("db", b))])


def softmax_cases(rng, config, memory):
    for N, classes in [(1, 10), (5, 10), (8, 2), (3, 7)]:        # batch 1, ten classes, two classes
        logits, labels = normal(rng, N, classes), rng.integers(0, classes, N)
        loss, dlogits = softmax_cross_entropy(logits, labels)
        yield Case(f"logits {logits.shape}", {"args": [logits, labels]},
                   [close("loss", loss, 1e-12, f"loss, logits {logits.shape}"),
                    close("dlogits", dlogits, 1e-12, f"dlogits, logits {logits.shape}")])


def finite(scale: float):
    """A judge: the loss and its gradient finite for scores as large as ``scale``."""
    def judge(outputs):
        loss, dlogits = outputs.get("loss"), outputs.get("dlogits")
        try:
            ok = bool(np.isfinite(loss) and np.all(np.isfinite(dlogits)))
        except TypeError:
            ok = False
        return Verdict(ok, message=f"softmax_loss returned loss {loss} for scores as large as {scale:g}: np.exp overflowed, "
                                   f"or a probability rounded to 0 was logged. Subtract each row's maximum before np.exp, "
                                   f"and take log p = z - max z - log sum exp(z - max z) instead of np.log(p)")
    return judge


def large_score_cases(rng, config, memory):
    # what an untrained network with a large learning rate produces; 1000 first: np.exp(1000.0) is inf, so
    # an answer that does not subtract each row's maximum always fails there, naming the overflow; and one
    # that subtracts it but takes np.log(p) fails on row 0, whose label's p rounds to 0
    for scale in (1000.0, 300.0):
        z, labels = normal(rng, 6, 10), rng.integers(0, 10, 6)
        logits = scale * (z - z.max(axis=1, keepdims=True) + 1)    # each row's largest score exactly `scale`
        labels[0] = (np.argmax(logits[0]) + 1) % 10                 # row 0: a label that is not its maximum,
        logits[0, labels[0]] = 0.0          # with probability ≈ e^-scale: 0.0 at 1000, so np.log(p) is -inf
        loss, dlogits = softmax_cross_entropy(logits, labels)
        yield Case(f"scores × {scale:g}", {"args": [logits, labels]},
                   [finite(scale), close("loss", loss, 1e-12, f"loss, scores × {scale:g}"),
                    close("dlogits", dlogits, 1e-10, f"dlogits, scores × {scale:g}")])


def softmax_gradient_check_cases(rng, config, memory):
    logits, labels = normal(rng, 4, 6), rng.integers(0, 6, 4)
    numerical = numerical_gradient(lambda z: softmax_cross_entropy(z, labels)[0], logits.copy())
    yield Case("softmax", {"args": [logits, labels]}, [close("dlogits", numerical, 1e-7, "dlogits vs numerical")])


POOLS = {"2x2": [((2, 3, 8, 8), 2, 2), ((1, 1, 4, 6), 2, 2), ((3, 2, 2, 2), 2, 2)],          # LeNet-5's pools
         "overlapping": [((2, 2, 7, 7), 3, 2), ((1, 3, 6, 5), 3, 1), ((2, 1, 9, 8), 2, 1), ((1, 2, 7, 5), 2, 2)],
         "switches": [((2, 3, 8, 8), 2, 2), ((1, 2, 7, 7), 3, 2), ((2, 1, 6, 5), 3, 1)]}


def maxpool_cases(rng, config, memory, pools):
    for shape, size, stride in POOLS[pools]:
        x = normal(rng, *shape)
        what = f"max-pool y, x {shape}, {size}×{size} s={stride}"
        yield Case(what, {"args": [x, size, stride]}, [close("y", s1_loops.maxpool_forward(x, size, stride)[0], 1e-15, what)])


def switches_judge(expected, shape, size: int, stride: int):
    """A judge: every switch equal to the reference's h·W + w, naming the usual mistake (p·size + q)."""
    def judge(outputs):
        argmax = np.asarray(outputs.get("argmax"))
        where = f"argmax, x {shape}, {size}×{size} s={stride}"
        if argmax.shape != expected.shape:
            return Verdict(False, message=f"{where}: shape {argmax.shape}, expected {expected.shape}")
        if np.array_equal(argmax, expected):
            return Verdict(True, f"{where}: every switch right")
        rows, cols = np.divmod(expected, shape[3])
        i, j = np.indices(expected.shape[2:])
        in_window = (rows - i * stride) * size + (cols - j * stride)
        hint = (": these are positions inside the window (p·size + q); give h·W + w in the input plane"
                if np.array_equal(argmax, in_window) else "")
        return Verdict(False, message=f"{where}: {np.mean(argmax != expected):.0%} of the switches point elsewhere{hint}")
    return judge


def switches_cases(rng, config, memory):
    for shape, size, stride in POOLS["switches"]:
        x = normal(rng, *shape)
        _, expected = s1_loops.maxpool_forward(x, size, stride)
        yield Case(f"x {shape}", {"args": [x, size, stride]}, [switches_judge(expected, shape, size, stride)])


DENSE_BACKWARD, SOFTMAX, MAXPOOL = call("dx", "dW", "db"), call("loss", "dlogits"), call("y", "argmax")
FAMILIES = {
    "test_dense_forward": Family(dense_forward_cases, call("y")),
    "test_dense_backward": Family(dense_backward_cases, DENSE_BACKWARD),
    "test_dense_gradient_check": Family(dense_gradient_check_cases, DENSE_BACKWARD),
    "test_softmax_values": Family(softmax_cases, SOFTMAX),
    "test_softmax_large_scores": Family(large_score_cases, SOFTMAX),
    "test_softmax_gradient_check": Family(softmax_gradient_check_cases, SOFTMAX),
    "test_maxpool_2x2": Family(partial(maxpool_cases, pools="2x2"), MAXPOOL),
    "test_maxpool_overlapping": Family(partial(maxpool_cases, pools="overlapping"), MAXPOOL),
    "test_maxpool_switches": Family(switches_cases, MAXPOOL),
}
