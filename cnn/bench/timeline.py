"""``python -m cnn bench --timeline``: how much of stage 6's gradient copies hides under compute (GPU only).

Stage 6 (``cuda-ring``) copies each step's gradient slot to pinned host memory on a second
stream while the compute stream goes on. ``ring_timeline`` records CUDA events on the compute
stream around every step, and the ring records its own around every copy; a copy's
``overlap_ms`` is the part of it that ran while a step was computing — copy time that cost the
training nothing.

Writes ``benchmarks/results/ring-timeline-MACHINE-GPU-DATE.json``: the bench header
(``"kind": "ring-timeline"``), ``config``, and per step ``compute_ms``, ``copy_ms``, ``overlap_ms``
with their totals. In Numba's simulator streams run one after another and events carry no
time, so it refuses to run there.
"""

from __future__ import annotations

import argparse

from cnn.bench.results import results_header, write_results
from cnn.bench.workload import benchmark_batches, course_hyperparameters
from cnn.model import get_network
from cnn.stages import get_stage
from cnn.stages.s6_cuda_ring import CudaRingStage
from kernels.device import simulated
from kernels.streams import new_event


def overlap_ms(interval, others) -> float:
    """Milliseconds of ``interval`` = (start, end) covered by the (disjoint) ``others``."""
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others)


def ring_timeline(stage: CudaRingStage, batches, hyper, steps: int = 20, warmup: int = 3) -> dict:
    """Per step: when the compute stream ran it and when the copy stream copied its gradient (ms from the start).

    Timing events on the compute stream around each step, and the ring's own around each copy
    (make the stage with ``timing=True``). A copy's ``overlap_ms`` is the part of it that ran while
    the compute stream was busy with a step: copy time that cost the training nothing.
    """
    if simulated():
        raise RuntimeError("ring_timeline: the CUDA simulator runs streams one after another and its events "
                           "carry no time, so there is no overlap to measure; run on a GPU")
    if not stage.ring.timing:
        raise ValueError("ring_timeline: make the stage with timing=True, so that the ring times its copies")
    for step in range(warmup):
        stage.train_step(*batches[step % len(batches)], *hyper)
    stage.synchronize()
    stage.ring.copy_log.clear()
    origin = new_event(timing=True)
    origin.record(stage.stream)
    marks = []
    for step in range(steps):
        start, end = new_event(timing=True), new_event(timing=True)
        start.record(stage.stream)
        stage.train_step(*batches[step % len(batches)], *hyper)
        end.record(stage.stream)
        marks.append((start, end))
    stage.synchronize()
    compute = [(origin.elapsed_time(start), origin.elapsed_time(end)) for start, end in marks]
    rows = []
    for (step, copy_start, copy_end), interval in zip(stage.ring.copy_log, compute):
        copy = (origin.elapsed_time(copy_start), origin.elapsed_time(copy_end))
        rows.append({"step": step, "compute_ms": list(interval), "copy_ms": list(copy),
                     "overlap_ms": overlap_ms(copy, compute)})
    copy_total = sum(row["copy_ms"][1] - row["copy_ms"][0] for row in rows)
    hidden = sum(row["overlap_ms"] for row in rows)
    return {"steps": rows, "copy_ms_total": copy_total, "overlap_ms_total": hidden,
            "overlap_fraction": hidden / copy_total if copy_total > 0 else None}


def cmd_timeline(args) -> int:
    """``--timeline --model M --batch-size B --slots K --steps N``: random float32 batches, seed 0."""
    get_stage("cuda-ring")                     # StageUnavailable: one line, why and what to try
    net = get_network(args.model)
    data = argparse.Namespace(batch_size=args.batch_size, dtype="float32", data="random", seed=0, model=args.model)
    batches, _ = benchmark_batches(net, data)
    stage = CudaRingStage(net, slots=args.slots, timing=True).init("he", 0)
    timeline = ring_timeline(stage, batches, course_hyperparameters(), args.steps)
    config = {"timeline": True, "model": args.model, "batch_size": args.batch_size, "slots": args.slots,
              "steps": args.steps, "out": args.out}
    path = write_results(args.out, "ring-timeline", {**results_header("ring-timeline"), "config": config, **timeline})
    print(f"gradient copies: {timeline['copy_ms_total']:.3f} ms over {args.steps} steps, "
          f"{timeline['overlap_ms_total']:.3f} ms of it under compute ({timeline['overlap_fraction'] or 0:.0%}); "
          f"results: {path}")
    return 0
