"""Assignment 9's tests: stage 3's compiled convolution plane and fused conv + bias + ReLU + max-pool layer.

Values are compared with stage 1 (``cnn.stages.s1_loops``, not stage 3, whose internals the course may
rewrite) in float64; a switch is right wherever it points at a maximum of its window. Speed is graded by
counts, never a clock (``cnn.grading.traffic``): a ``prange`` loop Numba compiled as parallel, the
largest temporary, the writes and reads of the outputs, the reads of x. A counted run must also compute
the right values and read every pixel of x at least once — a layer that behaves differently when counted,
or hides its reads, earns nothing. The layer runs with the student's ``conv_plane``, or, when part 1 was
left blank, with ``reference_conv_plane`` below in its place, so that each part is graded alone.
"""

from functools import partial
from types import FunctionType

import numpy as np
from numba import njit

from cnn.grading.bytecode import is_blank, python_function
from cnn.grading.checks import parallel_loops
from cnn.grading.client import lend
from cnn.grading.family import Case, Family, OwnWork, Verdict, close, normal, switches
from cnn.grading.runners import library_for_blanks, once_per_answer
from cnn.grading.traffic import compiled_code_problems, count_python
from cnn.stages import s1_loops


@njit
def reference_conv_plane(x, W, b, n, f, plane):
    """plane[i, j] = b[f] + Σ_c,p,q W[f, c, p, q]·x[n, c, i + p, j + q]: what replaces a blank part 1."""
    C, K = x.shape[1], W.shape[2]
    Hc, Wc = plane.shape
    plane[:, :] = b[f]
    for c in range(C):
        for p in range(K):
            for q in range(K):
                weight = W[f, c, p, q]
                for i in range(Hc):
                    for j in range(Wc):
                        plane[i, j] += weight * x[n, c, i + p, j + q]


def conv_size(x, W):
    """(Hc, Wc): the size of a stride-1, unpadded convolution's output plane."""
    return x.shape[2] - W.shape[2] + 1, x.shape[3] - W.shape[3] + 1


def pooled_shape(x, W, size, stride):
    Hc, Wc = conv_size(x, W)
    return x.shape[0], W.shape[0], (Hc - size) // stride + 1, (Wc - size) // stride + 1


# -- the referee's side --------------------------------------------------------------------------------------

def reference(x, W, b, size, stride):
    """Stage 1, one layer at a time: (the conv + bias + ReLU planes, the pooled output)."""
    planes = s1_loops.relu_forward(s1_loops.conv_forward(x, W, b, 1, 0))
    return planes, s1_loops.maxpool_forward(planes, size, stride)[0]


def plane_cases(rng, config, memory):
    for N, C, H, Wd, F, K in [(2, 1, 6, 6, 2, 3), (1, 3, 7, 5, 2, 3), (2, 2, 9, 9, 3, 5), (1, 2, 4, 4, 2, 1)]:
        x, W, b = normal(rng, N, C, H, Wd), normal(rng, F, C, K, K), normal(rng, F)
        what = f"conv planes, x {x.shape}, W {W.shape}"
        yield Case(what, {"args": [x, W, b]}, [close("planes", s1_loops.conv_forward(x, W, b, 1, 0), 1e-12, what)])


def layer_case(rng, N, C, H, Wd, F, K, size, stride, counted=(), memory=None):
    """A case of the fused layer: the inputs, and the judges of its pooled output and switches. A ``counted``
    run (its judges given) is first checked for honesty — nothing refused, every pixel of x read — and its
    inputs are the session's one counted case (in ``memory``), which every counted family judges."""
    key = ("counted", N, C, H, Wd, F, K, size, stride)
    if counted and key in memory:
        x, W, b = memory[key]
    else:
        x, W, b = normal(rng, N, C, H, Wd), normal(rng, F, C, K, K), normal(rng, F)
        if counted:
            memory[key] = x, W, b
    planes, pooled = reference(x, W, b, size, stride)
    what = f"{'counted run, ' if counted else ''}x {x.shape}, W {W.shape}, pool {size}×{size} s={stride}"
    judges = [close("out", pooled, 1e-12, f"pooled, {what}"),
              switches("switch", planes, pooled, size, stride, 1e-12, f"switches, {what}")]
    if counted:
        judges = [refused] + judges + [read_every_pixel(x.size)] + list(counted)
    return Case(what, {"args": [x, W, b, size, stride]}, judges)


def refused(outputs):
    """The counted run was refused (``cnn.grading.traffic.compiled_code_problems``)."""
    problems = outputs.get("refused") or []
    return Verdict(not problems, message=problems[0] if problems else "")


def read_every_pixel(x_size: int):
    def judge(outputs):
        reads = int(outputs.get("loads_x", 0))
        return Verdict(reads >= x_size, message=f"the counter saw {reads} reads of x, whose {x_size} pixels a fused "
                                                f"layer must each read at least once: the layer read x around the "
                                                f"counter — refused")
    return judge


def fused_cases(rng, config, memory, shapes):
    for shape in shapes:
        yield layer_case(rng, *shape)


def parallel_cases(rng, config, memory):
    def judge(outputs):
        parallel = outputs.get("parallel") or []
        return Verdict(bool(parallel), "Numba runs these loops in parallel:\n  " + "\n  ".join(parallel),
                       "conv_relu_pool has no loop that Numba runs in parallel: decorate it with @njit(parallel=True) "
                       "and write the loop over the (sample, filter) items with prange")
    case = layer_case(rng, 2, 2, 8, 8, 3, 3, 2, 2)
    case.judges.append(judge)
    yield case


#: the one counted run the speed families judge: 3 × 3 windows every pixel, so that each convolution output
#: lies in up to 9 windows; 4 samples, so that the whole convolution output is 4 times one sample's planes
COUNTED = dict(N=4, C=2, H=10, Wd=10, F=3, K=3, size=3, stride=1)
HC = COUNTED["H"] - COUNTED["K"] + 1


def counted_case(rng, memory, judge):
    return layer_case(rng, **COUNTED, counted=[judge], memory=memory)


def temporary_cases(rng, config, memory):
    N, F = COUNTED["N"], COUNTED["F"]
    allowed = F * HC * HC

    def judge(outputs):
        largest, shape = int(outputs.get("largest", 0)), outputs.get("largest_shape")
        line = (f"largest temporary: {largest} numbers {tuple(shape) if shape else ''}; a fused layer needs at most one "
                f"sample's planes, F·Hc·Wc = {allowed}; the unfused layer's convolution output has N·F·Hc·Wc = "
                f"{N * F * HC * HC}")
        return Verdict(largest <= allowed, line, f"conv_relu_pool allocated an array of shape {tuple(shape or ())} "
                                                 f"({largest} numbers): the whole convolution output goes through memory."
                                                 f" Fuse: compute one Hc × Wc plane per (sample, filter) item and pool it at once")
    yield counted_case(rng, memory, judge)


def written_once_cases(rng, config, memory):
    Ho = (HC - COUNTED["size"]) // COUNTED["stride"] + 1
    outputs_count = COUNTED["N"] * COUNTED["F"] * Ho * Ho

    def judge(outputs):
        for name in ("out", "switch"):
            stores, loads = int(outputs.get(f"stores_{name}", -1)), int(outputs.get(f"loads_{name}", -1))
            if stores != outputs_count or loads != 0:
                return Verdict(False, message=f"{name} was written {stores / outputs_count:g} times per element and read "
                                              f"{loads / outputs_count:g} times: keep the running maximum and its position "
                                              f"in local variables and write each output once")
        return Verdict(True, f"out and switch: each element written once, never read ({outputs_count} elements)")
    yield counted_case(rng, memory, judge)


def computed_once_cases(rng, config, memory):
    multiply_adds = COUNTED["N"] * COUNTED["F"] * HC * HC * COUNTED["C"] * COUNTED["K"] ** 2

    def judge(outputs):
        reads = int(outputs.get("loads_x", 0))
        return Verdict(reads <= multiply_adds, f"reads of x: {reads}; the convolution's multiply-adds: {multiply_adds}",
                       f"conv_relu_pool read x {reads / multiply_adds:.1f} times per multiply-add of the convolution: "
                       f"overlapping windows recompute the outputs they share. Compute the plane once, then pool it")
    yield counted_case(rng, memory, judge)


# -- the kernel's side -----------------------------------------------------------------------------------------

def run_planes(inputs, conv_plane, *others):
    x, W, b = inputs["args"]
    Hc, Wc = conv_size(x, W)
    planes = np.full((x.shape[0], W.shape[0], Hc, Wc), np.nan)
    for n in range(x.shape[0]):
        for f in range(W.shape[0]):
            conv_plane(x, W, b, n, f, planes[n, f])
    return {"planes": planes}


_COMPILED: dict = {}           # (the layer, the reference plane) -> the layer compiled with the reference plane
NUMBA_OPTIONS = ("parallel", "fastmath", "boundscheck", "error_model", "nogil")


def layer_with_library_plane(layer):
    """``layer`` itself, or — when the notebook's ``conv_plane`` is blank — a copy of it compiled with the same
    options and ``reference_conv_plane`` in place of ``conv_plane``."""

    function = python_function(layer)
    if not is_blank(function.__globals__.get("conv_plane")):
        return layer
    key = (function.__code__, id(layer))
    if key not in _COMPILED:
        namespace = {**function.__globals__, "conv_plane": lend(reference_conv_plane)}
        copy = FunctionType(function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__)
        options = {name: value for name, value in getattr(layer, "targetoptions", {}).items() if name in NUMBA_OPTIONS}
        _COMPILED[key] = njit(**options)(copy)
    return _COMPILED[key]


def outputs_for(x, W, size, stride):
    """out (NaN) and switch (−1) arrays of the right shape for a fused layer."""
    shape = pooled_shape(x, W, size, stride)
    return np.full(shape, np.nan), np.full(shape, -1, dtype=np.int64)


def run_layer(inputs, layer, *others):
    x, W, b, size, stride = inputs["args"]
    out, switch = outputs_for(x, W, size, stride)
    layer_with_library_plane(layer)(x, W, b, size, stride, out, switch)
    return {"out": out, "switch": switch}


def run_parallel(inputs, layer, *others):
    compiled = layer_with_library_plane(layer)
    x, W, b, size, stride = inputs["args"]
    out, switch = outputs_for(x, W, size, stride)
    compiled(x, W, b, size, stride, out, switch)           # compiles it for float64 arrays
    return {"out": out, "switch": switch, "parallel": parallel_loops(compiled)}


@once_per_answer
def run_counted(inputs, layer, *others):
    """The layer run once more as Python on counted arrays: its outputs, its counts, and any refusal."""
    refused = compiled_code_problems(layer)
    x, W, b, size, stride = inputs["args"]
    out, switch = outputs_for(x, W, size, stride)
    if refused:
        return {"refused": refused, "out": out, "switch": switch}
    with library_for_blanks(layer, conv_plane=reference_conv_plane):
        _, traffic = count_python(layer, x, W, b, size, stride, out, switch)
    largest, shape = traffic.largest_allocation()
    return {"out": out, "switch": switch, "largest": largest, "largest_shape": shape, "loads_x": traffic.loads("x"),
            **{f"{kind}_{name}": getattr(traffic, kind)(name) for kind in ("loads", "stores") for name in ("out", "switch")}}


BUILT_ON_PART_1 = OwnWork(other_parts=("conv_plane",))
FAMILIES = {
    "test_conv_plane": Family(plane_cases, run_planes),
    "test_fused_2x2": Family(partial(fused_cases, shapes=[(2, 3, 10, 10, 4, 3, 2, 2), (1, 1, 12, 8, 2, 5, 2, 2),
                                                          (3, 2, 6, 6, 2, 1, 2, 2)]), run_layer, BUILT_ON_PART_1),
    "test_fused_overlapping": Family(partial(fused_cases, shapes=[(2, 2, 9, 9, 3, 3, 3, 2), (1, 3, 8, 7, 2, 3, 3, 1),
                                                                  (2, 1, 9, 8, 2, 2, 2, 2)]), run_layer, BUILT_ON_PART_1),
    "test_parallel_loop": Family(parallel_cases, run_parallel, BUILT_ON_PART_1),
    "test_no_full_size_temporary": Family(temporary_cases, run_counted, BUILT_ON_PART_1),
    "test_outputs_written_once": Family(written_once_cases, run_counted, BUILT_ON_PART_1),
    "test_convolution_computed_once": Family(computed_once_cases, run_counted, BUILT_ON_PART_1),
}
