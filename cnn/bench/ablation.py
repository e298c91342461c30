"""``python -m cnn bench --ablation``: stage 7's fixes timed one at a time against stage 6 (GPU only).

Rows (``ablation_variants``): ``cuda-ring`` (no fix); each fix alone, on top of the fixes it
needs, against a baseline of just those; then the fixes added one by one in course order, each
against the row before. A row's ``speedup_vs_baseline`` is therefore what that one fix bought —
against a baseline that differs from row to row, which each row records (``baseline_fixes``).
``--fixes FIX`` times only the two rows that add FIX (``benchmarks/gpu_session.sh predict``: tiled-conv).
Every variant trains on the same random dataset through the epoch API the trainer uses
(``load_dataset`` / ``begin_epoch`` / ``run_steps``), so resident data, overlapped copies, the
loop on the device and the CUDA graphs count too.

Writes ``benchmarks/results/ablation-MODEL-bBATCH-MACHINE-GPU-DATE.json``: the bench header
(``"kind": "ablation"``) with ``model``, ``batch_size`` and ``rows``; refuses in Numba's simulator,
whose kernel times mean nothing.
"""

from __future__ import annotations

import numpy as np

from cnn.bench.back_to_back import EpochLoop, timed_runs
from cnn.bench.results import results_header, workload, write_results
from cnn.model import get_network
from cnn.stages import get_stage
from cnn.stages.s7_cuda_tuned import FIXES, CudaTunedStage, check_fixes, with_requirements
from kernels.device import simulated


def ablation_variants(only: str | None = None) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(label, baseline fixes, fixes) rows: cuda-ring; each fix alone (on top of what it needs); cumulative.
    With ``only``: just the two rows that add that fix (alone, and on top of the fixes before it)."""
    if only is not None:
        return [row for row in ablation_variants() if row[2] and row[2] != row[1]
                and set(row[2]) - set(row[1]) == {only}]
    rows = [("cuda-ring", (), ())]
    for fix in FIXES:
        needs = tuple(f for f in with_requirements(fix) if f != fix)
        rows.append((f"+ {fix} alone", needs, with_requirements(fix)))
    for count in range(1, len(FIXES) + 1):
        baseline = with_requirements(*FIXES[:count - 1]) if count > 1 else ()
        rows.append((f"cumulative: {' + '.join(FIXES[:count])}", baseline, with_requirements(*FIXES[:count])))
    return rows


def time_variant(net, fixes, images, labels, batch_size, hyper, steps: int, repeats: int = 7) -> dict:
    """Milliseconds a step, ``steps`` steps run as the trainer runs them (``cnn.bench.back_to_back``).

    One call of the epoch loop runs ``steps`` steps in requests of the stage's ``steps_per_sync``
    (1 without device-epoch: the loss fetched every step; the pipelined copies of overlap-copies
    live inside a request), ending in one synchronisation; median and quartiles over ``repeats``
    calls, after a warm-up call (compilation, buffers, and the CUDA graphs of cuda-graph).
    """
    stage = CudaTunedStage(net, fixes=fixes).init("he", 0)
    batches = [(images[start:start + batch_size], labels[start:start + batch_size])
               for start in range(0, len(images) - batch_size + 1, batch_size)]
    timed = timed_runs(EpochLoop(stage, batches, hyper, steps_per_epoch=len(batches)), stage.synchronize,
                        steps, repeats)
    return {"median_ms": timed["median"], "q1_ms": timed["q1"], "q3_ms": timed["q3"], "steps": steps,
            "repeats": repeats, "launches_per_step": stage.launches_per_step()}


def ablation(model: str, batch_size: int, steps: int = 50, samples: int = 8192, progress=print,
             only: str | None = None) -> dict:
    """Every variant of ``ablation_variants(only)`` timed on the same random dataset (refuses in the simulator)."""
    if simulated():
        raise RuntimeError("ablation: the CUDA simulator is on — simulated kernels are Python threads and their "
                           "timings mean nothing; run on a GPU with NUMBA_ENABLE_CUDASIM unset")
    net, hyper = get_network(model), (0.01, 0.9, 5e-4)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((samples, *net.input_shape)).astype(np.float32)
    labels = rng.integers(0, net.num_classes, samples)
    timed, rows = {}, []
    if only is not None:
        check_fixes(only)                      # one line for an unknown fix
    for label, baseline, fixes in ablation_variants(only):
        for variant in (baseline, fixes):
            if variant not in timed:
                timed[variant] = time_variant(net, variant, images, labels, batch_size, hyper, steps)
        row = {"variant": label, "fixes": list(fixes), "baseline_fixes": list(baseline), **timed[fixes],
               "speedup_vs_baseline": timed[baseline]["median_ms"] / timed[fixes]["median_ms"]}
        rows.append(row)
        progress(f"{label:<60} {row['median_ms']:8.3f} ms  ×{row['speedup_vs_baseline']:.2f} vs its baseline")
    return {"model": model, "batch_size": batch_size, "rows": rows}


def cmd_ablation(args) -> int:
    """``--ablation --model M --batch-size B [--ablation-steps N] [--fixes FIX]``: time the variants (with
    ``--fixes``: only the two rows that add that one fix), write the results file."""
    get_stage("cuda-tuned")                    # StageUnavailable: one line, why and what to try
    result = ablation(args.model, args.batch_size, args.ablation_steps, only=args.fixes)
    path = write_results(args.out, f"ablation-{workload(args.model, args.batch_size)}",
                         {**results_header("ablation"), **result})
    print(f"results: {path}")
    return 0
