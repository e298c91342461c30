"""``python -m cnn bench --op OP``: one operation, every stage's version of it, checked then timed.

The llm.c ``dev/cuda`` pattern: the arguments are fresh random arrays at the shapes of the
network's busiest layer of that kind; every stage's ``ops`` function is run on copies of them and
compared with stage ``loops`` (max |got − expected| / max |expected| ≤ ``OP_TOLERANCE``; integer
outputs exactly); only when all agree are they timed. Also counts each stage's kernel launches per
training step, which is what fusion removes.

Writes ``op-OP-MACHINE-DEVICE-DATE.json``: the header of ``cnn.bench.results`` with
``"kind": "op"``, then "op", "inputs", "launches_per_step": {stage: n}, "rows": [{"name", "device",
"time_ms": stats, "calls_per_sample", "speedup_vs_reference", "kernel_ms" (GPU only)}].
"""

from __future__ import annotations

import argparse

import numpy as np

from cnn.bench.measure import clock_for, repetitions, summarize
from cnn.bench.profiling import KernelTimer
from cnn.bench.results import gpu_info, results_header, write_results
from cnn.bench.step_timing import launches_per_step, selected_stages
from cnn.bench.workload import benchmark_batches, course_hyperparameters
from cnn.formatting import fmt_factor, fmt_ms, spread

OPS = ("conv-forward", "conv-backward", "relu-forward", "relu-backward",
       "maxpool-forward", "maxpool-backward", "dense-forward", "dense-backward")
OP_OUTPUT_NAMES = {"conv-forward": ("y",), "conv-backward": ("dx", "dW", "db"), "relu-forward": ("y",),
                   "relu-backward": ("dx",), "maxpool-forward": ("y", "argmax"), "maxpool-backward": ("dx",),
                   "dense-forward": ("y",), "dense-backward": ("dx", "dW", "db")}
#: max |got − expected| / max |expected| allowed when an op is checked against stage loops
OP_TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


class OpCandidate:
    """One stage's version of the operations: its Ops, and how to wait for (and time) its work."""

    def __init__(self, name: str, ops, device: str = "cpu", synchronize=lambda: None, stage=None):
        self.name, self.ops, self.device, self.synchronize, self.stage = name, ops, device, synchronize, stage


def op_candidates(names: list[str], net, dtype, progress=print) -> list[OpCandidate]:
    """Stages among ``names`` that can run here and expose ``ops``; the others are said to be skipped."""
    from cnn.stages import StageUnavailable, get_stage

    candidates = []
    for name in names:
        try:
            stage_class = get_stage(name)
        except StageUnavailable as err:
            progress(f"  {name:<12} skipped: {str(err).split(';')[0]}")
            continue
        ops = getattr(stage_class, "ops", None)
        if ops is None:
            progress(f"  {name:<12} skipped: the stage has no per-operation functions (no `ops`)")
            continue
        if np.dtype(dtype) not in [np.dtype(d) for d in stage_class.dtypes]:
            progress(f"  {name:<12} skipped: it does not support {np.dtype(dtype).name}")
            continue
        stage = stage_class(net, dtype)
        candidates.append(OpCandidate(name, ops, stage_class.device, stage.synchronize, stage))
    return candidates


def launches_of(candidates: list[OpCandidate], batches, seed: int = 0) -> dict:
    """{stage: kernel launches per training step}; a CUDA stage runs one step first to count them."""
    counts = {}
    for candidate in candidates:
        if candidate.device == "cuda" and candidate.stage is not None:
            candidate.stage.init("he", seed).train_step(*batches[0], *course_hyperparameters())
        counts[candidate.name] = launches_per_step(candidate.stage) if candidate.stage is not None else None
    return counts


def _op_layer(net, op: str):
    """The layer an op is benchmarked on: the one of its kind doing the most work; with its input shape."""
    from cnn.model import Conv, Dense, MaxPool, ReLU

    kind = {"conv": Conv, "relu": ReLU, "maxpool": MaxPool, "dense": Dense}[op.split("-")[0]]
    shapes = net.activation_shapes()
    found = [(index, layer) for index, layer in enumerate(net.layers) if isinstance(layer, kind)]
    if not found:
        raise ValueError(f"--op {op}: network {net.name!r} has no {kind.__name__} layer")

    def work(item):
        index, layer = item
        return int(np.prod(shapes[index])) * max(1, sum(int(np.prod(s)) for s in layer.param_shapes().values()))
    index, layer = max(found, key=work)
    return layer, shapes[index], shapes[index + 1]


def op_inputs(op: str, net, batch: int, dtype, reference_ops, seed: int = 0) -> tuple[tuple, str]:
    """Fresh random arguments for ``op`` at the shapes of the network's busiest layer of that kind.

    Inputs that come from another op (the ReLU output, the pooling argmax) are made by the reference.
    """
    rng = np.random.default_rng(seed)
    layer, in_shape, out_shape = _op_layer(net, op)

    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)
    x, dy = normal(batch, *in_shape), normal(batch, *out_shape)
    if op.startswith("conv"):
        fan_in = layer.in_channels * layer.kernel ** 2
        W = normal(layer.out_channels, layer.in_channels, layer.kernel, layer.kernel) * dtype.type(np.sqrt(2 / fan_in))
        args = ((x, W, normal(layer.out_channels), layer.stride, layer.pad) if op == "conv-forward"
                else (dy, x, W, layer.stride, layer.pad))
        described = f"x {x.shape}, W {W.shape}, stride {layer.stride}, pad {layer.pad}"
    elif op.startswith("dense"):
        W = normal(layer.out_features, layer.in_features) * dtype.type(np.sqrt(2 / layer.in_features))
        args = (x, W, normal(layer.out_features)) if op == "dense-forward" else (dy, x, W)
        described = f"x {x.shape}, W {W.shape}"
    elif op.startswith("relu"):
        args = (x,) if op == "relu-forward" else (dy, reference_ops.relu_forward(x))
        described = f"x {x.shape}"
    else:
        size, stride = layer.size, layer.stride
        if op == "maxpool-forward":
            args = (x, size, stride)
        else:
            args = (dy, reference_ops.maxpool_forward(x, size, stride)[1], x.shape, size, stride)
        described = f"x {x.shape}, window {size}, stride {stride}"
    return args, f"{described}, {dtype.name}"


def _to_host(value):
    return value.copy_to_host() if hasattr(value, "copy_to_host") else np.asarray(value)


def _as_outputs(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def compare_outputs(op: str, got, expected, dtype) -> str | None:
    """None when ``got`` matches ``expected``, else one line saying where and by how much it does not.

    Float outputs: max |got − expected| / max |expected| ≤ OP_TOLERANCE[dtype] (float32 sums in another
    order differ in the last bits, float64 ones far less); integer outputs (argmax) must be equal.
    """
    got, expected = _as_outputs(got), _as_outputs(expected)
    names = OP_OUTPUT_NAMES[op]
    if len(got) != len(expected):
        return f"returned {len(got)} outputs, the reference {len(expected)} ({', '.join(names)})"
    tolerance = OP_TOLERANCE[np.dtype(dtype).name]
    for name, value, ref in zip(names, got, expected):
        value, ref = _to_host(value), np.asarray(ref)
        if value.shape != ref.shape:
            return f"output {name}: shape {value.shape}, expected {ref.shape}"
        if ref.dtype.kind in "iu":
            wrong = np.argwhere(value != ref)
            if wrong.size:
                where = tuple(int(i) for i in wrong[0])
                return (f"output {name}: {len(wrong)} of {ref.size} entries differ, first at {where}: "
                        f"got {value[where]}, expected {ref[where]}")
            continue
        error = np.abs(value.astype(np.float64) - ref)
        scale = max(float(np.abs(ref).max()), np.finfo(np.float64).tiny)
        if not np.all(np.isfinite(value)) or error.max() / scale > tolerance:
            where = tuple(int(i) for i in np.unravel_index(np.nanargmax(np.where(np.isfinite(error), error, np.inf)),
                                                           error.shape))
            return (f"output {name}: max relative error {np.nanmax(error) / scale:.2e} > tolerance {tolerance:g}, "
                    f"worst at {where}: got {value[where]:.6g}, expected {ref[where]:.6g}")
    return None


def check_op(op: str, candidates: list[OpCandidate], reference: OpCandidate, args: tuple, dtype) -> dict:
    """Run every candidate once on copies of ``args``; {name: None or the mismatch line}."""
    function = op.replace("-", "_")
    expected = getattr(reference.ops, function)(*_copies(args))
    verdicts = {}
    for candidate in candidates:
        implementation = getattr(candidate.ops, function, None)
        if implementation is None:
            verdicts[candidate.name] = "the stage does not provide this op"
            continue
        try:
            got = implementation(*_copies(args))
            candidate.synchronize()
        except Exception as err:
            verdicts[candidate.name] = f"raised {type(err).__name__}: {err}"
            continue
        verdicts[candidate.name] = compare_outputs(op, got, expected, dtype)
    return verdicts


def _copies(args: tuple) -> tuple:
    """Fresh copies of the array arguments, so an op that writes into its inputs cannot spoil the next one."""
    return tuple(arg.copy() if isinstance(arg, np.ndarray) else arg for arg in args)


def time_op(op: str, candidate: OpCandidate, args: tuple, settings) -> dict:
    """Milliseconds per call of one stage's op, budget-limited like the stages.

    A sample times enough back-to-back calls to last about a millisecond (a clock read costs about
    as much as a 5 µs op), divided by their number. On a GPU, ``kernel_ms`` adds the device time of
    the kernels alone, without the copies a host wrapper makes (CUDA events around each launch).
    """
    function = getattr(candidate.ops, op.replace("-", "_"))
    clock = clock_for(candidate.device, candidate.synchronize)
    inputs = _copies(args)

    def calls(count):
        return lambda: [function(*inputs) for _ in range(count)]
    first = clock.time(calls(1)) / 1e3       # warm-up (compiles if it must)
    second = clock.time(calls(1)) / 1e3
    per_sample = int(min(1000, max(1, 1e-3 / max(second, 1e-9))))
    samples = repetitions(max(second * per_sample, 1e-7), settings.budget - first - second, settings.steps * 2,
                          min(settings.min_steps, settings.steps))
    row = {"time_ms": summarize([clock.time(calls(per_sample)) / per_sample for _ in range(samples)]),
           "calls_per_sample": per_sample}
    if candidate.device == "cuda" and gpu_info() is not None:
        with KernelTimer() as timer:
            calls(per_sample)()
        row["kernel_ms"] = sum(ms for _, _, ms in timer.summary()) / per_sample
    return row


def op_benchmark(op: str, candidates: list[OpCandidate], reference: OpCandidate, args: tuple, dtype,
                 settings, progress=print) -> tuple[bool, list[dict]]:
    """Validate every candidate against the reference, then (only if all pass) time them; (ok, rows)."""
    verdicts = check_op(op, candidates, reference, args, dtype)
    failures = {name: why for name, why in verdicts.items() if why is not None}
    for name, why in failures.items():
        progress(f"  {name:<12} MISMATCH: {why}")
    if failures:
        progress(f"{op}: {len(failures)} stage(s) disagree with stage {reference.name}; no timings reported")
        return False, []
    progress(f"  all {len(candidates)} stage(s) match stage {reference.name}; timing ...")
    rows = [{"name": c.name, "device": c.device, **time_op(op, c, args, settings)} for c in candidates]
    reference_ms = next((r["time_ms"]["median"] for r in rows if r["name"] == reference.name), None)
    for row in rows:
        median = row["time_ms"]["median"]
        row["speedup_vs_reference"] = reference_ms / median if reference_ms and median else None
        clock = "cuda-events" if row["device"] == "cuda" else "perf_counter"
        kernels = f"; kernels alone {fmt_ms(row['kernel_ms'])} ms" if "kernel_ms" in row else ""
        copies = " (host wrapper: includes its copies)" if row["device"] == "cuda" else ""
        progress(f"  {row['name']:<12} ok  {fmt_ms(median):>9} ms {spread(row['time_ms']):>5}  "
                 f"{fmt_factor(row['speedup_vs_reference']):>8} vs {reference.name}  "
                 f"({row['time_ms']['n']} samples of {row['calls_per_sample']} calls, {clock}){copies}{kernels}")
    return True, rows


def cmd_op(args) -> int:
    from cnn.model import get_network
    from cnn.stages import get_stage

    net, dtype = get_network(args.model), np.dtype(args.dtype)
    reference = OpCandidate("loops", get_stage("loops").ops)
    op_args, described = op_inputs(args.op, net, args.batch_size, dtype, reference.ops, args.seed)
    print(f"{args.op} on {described} (the busiest such layer of {net.name}); reference: stage loops")
    candidates = op_candidates(selected_stages(args.stages), net, dtype)
    ok, rows = op_benchmark(args.op, candidates, reference, op_args, dtype, args)
    if not ok:
        return 1
    random_args = argparse.Namespace(**{**vars(args), "data": "random"})
    launches = launches_of(candidates, benchmark_batches(net, random_args)[0], args.seed)
    print(f"kernel launches per training step of {net.name} (what fusion removes): "
          + ", ".join(f"{name} {'—' if count is None else count}" for name, count in launches.items()))
    result = {**results_header("op"), "op": args.op, "inputs": described, "launches_per_step": launches,
              "rows": rows}
    path = write_results(args.out, f"op-{args.op}", result)
    print(f"results: {path}")
    return 0
