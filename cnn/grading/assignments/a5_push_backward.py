"""Assignment 5's tests: max-pool and convolution backward in push form, with atomics.

The values are compared with stage 1's pull-form backward passes in float64 (outputs start at zero:
the kernels add into them). Because the simulator seldom shows a race, the last two families read the
kernels instead (``cnn.grading.atomics``): every write into an output must be a ``cuda.atomic`` update.
"""

from functools import partial

import numpy as np

from cnn.grading.atomics import writes_into
from cnn.grading.bytecode import python_function
from cnn.grading.family import Case, Family, Verdict, close, normal
from cnn.grading.runners import launch_1d
from cnn.stages import s1_loops

POOLS = {"2x2": ((2, 3, 6, 6), 2, 2),                        # windows that do not overlap
         "overlapping_stride1": ((1, 2, 5, 6), 3, 1),        # one pixel can win up to nine windows
         "overlapping_stride2": ((2, 2, 7, 7), 3, 2)}        # neighbouring windows share a row or a column
# (N, C, H, W, F, K, stride, pad)
SHAPES = {
    "stride 1": [(2, 2, 6, 5, 3, 3, 1, 0)],      # overlapping windows (K > stride): threads collide on dx
    "stride 2": [(1, 2, 7, 7, 2, 3, 2, 1)],      # stride 2 with padding
    "padding": [(1, 3, 6, 6, 2, 5, 1, 2)],       # stride 1, K = 5, pad 2
}


def out_size(size, K, stride, pad=0):
    return (size + 2 * pad - K) // stride + 1


def maxpool_cases(rng, config, memory, pool):
    shape, size, stride = POOLS[pool]
    x = normal(rng, *shape, dtype=np.float32)
    y, argmax = s1_loops.maxpool_forward(x, size, stride)
    dy = normal(rng, *y.shape, dtype=np.float32)
    expected = s1_loops.maxpool_backward(dy.astype(np.float64), argmax, x.shape, size, stride)
    what = f"max-pool dx, x {x.shape}, {size}×{size} s={stride}"
    yield Case(what, {"args": [dy, argmax.astype(np.int32), np.zeros(shape, np.float32)]}, [close("dx", expected, 1e-6, what)])


def conv_cases(rng, config, memory, family):
    for N, C, H, W, F, K, stride, pad in SHAPES[family]:
        x, w = normal(rng, N, C, H, W, dtype=np.float32), normal(rng, F, C, K, K, dtype=np.float32)
        dy = normal(rng, N, F, out_size(H, K, stride, pad), out_size(W, K, stride, pad), dtype=np.float32)
        expected = s1_loops.conv_backward(dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64), stride, pad)
        label = f"x {x.shape}, w {w.shape}, s={stride} p={pad}"
        zeros = [np.zeros(shape, np.float32) for shape in (x.shape, w.shape, (F,))]
        yield Case(label, {"args": [dy, x, w, *zeros, stride, pad]},
                   [close(name, value, 1e-5, f"{name}, {label}") for name, value in zip(("dx", "dw", "db"), expected)])


def atomic_writes(outputs: tuple):
    """Kernel side: every write into ``outputs`` that the kernel's source makes, and whether it is atomic."""
    def run(inputs, kernel, *others):
        return {"kernel": python_function(kernel).__name__,
                "writes": [[line, code, atomic] for line, code, _, atomic in writes_into(kernel, outputs)]}
    return run


def atomics_cases(rng, config, memory, outputs: tuple):
    def judge(reported):
        name, writes = reported.get("kernel", "your kernel"), reported.get("writes") or []
        plain = [f"line {line}: `{code}`" for line, code, atomic in writes if not atomic]
        if plain:
            return Verdict(False, message=f"{name} writes into {'/'.join(outputs)} without an atomic, so threads that "
                                          f"collide lose additions — use cuda.atomic.add(array, index, value): "
                                          + "; ".join(plain))
        if not writes:
            return Verdict(False, message=f"{name}: the additions that collide must use cuda.atomic.add")
        return Verdict(True, f"{name}: all {len(writes)} writes into {', '.join(outputs)} are cuda.atomic.add")
    yield Case("atomics", {}, [judge])


MAXPOOL, CONV = launch_1d(0, dx=2), launch_1d(0, dx=3, dw=4, db=5)
FAMILIES = {
    **{f"test_maxpool_{pool}": Family(partial(maxpool_cases, pool=pool), MAXPOOL) for pool in POOLS},
    "test_conv_stride1": Family(partial(conv_cases, family="stride 1"), CONV),
    "test_conv_stride2": Family(partial(conv_cases, family="stride 2"), CONV),
    "test_conv_padding": Family(partial(conv_cases, family="padding"), CONV),
    "test_atomics_maxpool": Family(partial(atomics_cases, outputs=("dx",)), atomic_writes(("dx",)), own_work=None),
    "test_atomics_conv": Family(partial(atomics_cases, outputs=("dx", "dw", "db")), atomic_writes(("dx", "dw", "db")),
                                own_work=None),
}
