"""``python -m cnn bench --predict``: the PREDICTED H100 step of every CUDA stage, and its error on every measurement.

Writes ``benchmarks/results/predict-h100-sm90.json`` (``--out``):

    constants      ``predict_step.CALIBRATED`` and the measured figures the model uses as they are
    calibration    every committed H100 measurement of a stage 4-7 step (``predict_calibrate.step_points``)
                   and of a kernel (Nsight Compute), with the prediction for the kernels that were
                   measured (the static report of that commit) and predicted / measured
    predicted      for this checkout: each CUDA stage (every fix for cuda-tuned) on both networks, phase
                   by phase, back to back and — for the stages that replay a step as one CUDA graph
                   (``GRAPHED``) — as one CUDA graph; and the rows of stage
                   7's ablation that tiled-conv changes, with what the fix buys: "+ tiled-conv alone"
                   against cuda-ring, and tiled-conv on top of the fixes before it

docs/profiling.md's ``prediction`` block is rendered from that file (``docs_block``), so the figures
there are the file's; every predicted figure is called PREDICTED where it is shown, and none
replaces a measurement. ``--predict --calibrate`` fits the constants again first and prints them
(they are then copied into ``CALIBRATED`` by hand, with the loss they reached: a change of the model
is a change of the code).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from cnn.bench import predict_calibrate, predict_step
from cnn.bench.recorded import PREDICTED_DEVICE, PREDICTION_FILE
from cnn.bench.static_report import NETWORK_BATCHES, cuda_stages

RESULTS_NAME = PREDICTION_FILE             # and the GPU every figure of it is predicted for, PREDICTED_DEVICE
#: the stages whose step is one CUDA graph replay: cuda-tuned (its cuda-graph fix) and cuda-fused-net
GRAPHED = ("cuda-tuned", "cuda-fused-net")
TILED_ROWS = (("+ tiled-conv alone", "none", "tiled-conv"),
              ("…, launch-config, tiled-conv", "resident-data,pinned-buffers,overlap-copies,fused-loss,fewer-launches,"
               "smem-weights,launch-config", "resident-data,pinned-buffers,overlap-copies,fused-loss,fewer-launches,"
               "smem-weights,launch-config,tiled-conv"))


def stage_prediction(report: dict, constants: dict, copies: dict, graph: bool) -> dict:
    """One stage's PREDICTED step; "own_models": the kernels timed by a model of their own, with its range."""
    phases = predict_step.phase_by_phase_ms(report, constants, copies)
    launches = [op for op in report["back_to_back"] or report["phase_by_phase"] if "copy" not in op]
    predicted = [(report["kernels"][op["kernel"]]["function"],
                  predict_step.kernel_us(report["kernels"][op["kernel"]], op, constants, report["model"]))
                 for op in launches]
    return {"phase_by_phase_ms": sum(phases.values()), "phases_ms": phases,
            "unmodelled": sorted({name for name, kernel in predicted if not kernel["modelled"]}),
            "own_models": [{"kernel": name, "low_us": kernel["low_us"], "high_us": kernel["us"]}
                           for name, kernel in predicted if "low_us" in kernel],
            "back_to_back_ms": predict_step.back_to_back_ms(report, constants, copies),
            "graph_ms": predict_step.back_to_back_ms(report, constants, copies, graph=True) if graph else None,
            "kernels_us": [round(kernel["us"], 2) for _, kernel in predicted]}


def predictions(constants: dict, copies: dict, progress=None) -> dict:
    """PREDICTED figures for this checkout (module docstring)."""
    stages, tiled = [], []
    for model, batch in NETWORK_BATCHES:
        for stage in cuda_stages():
            if progress:
                progress(f"predicting {stage}, {model} b{batch}…")
            report = predict_calibrate.report_for(stage, model, batch, None, None)
            graph = stage in GRAPHED
            stages.append({"stage": stage, "model": model, "batch_size": batch,
                           **stage_prediction(report, constants, copies, graph)})
        for label, baseline, fixes in TILED_ROWS:
            times = [predict_step.back_to_back_ms(predict_calibrate.report_for("cuda-tuned", model, batch, variant, None),
                                                  constants, copies) for variant in (baseline, fixes)]
            tiled.append({"variant": label, "model": model, "batch_size": batch, "baseline_ms": times[0],
                          "ms": times[1], "speedup_vs_baseline": times[0] / times[1]})
    return {"stages": stages, "tiled_conv": tiled}


def calibration(constants: dict, copies: dict) -> dict:
    steps = []
    for point in predict_calibrate.step_points():
        predicted = predict_calibrate.predict_point(point, constants, copies)
        steps.append({**point, "predicted_ms": predicted, "ratio": predicted / point["measured_ms"]})
    kernels = []
    for point in predict_calibrate.kernel_points():
        predicted = predict_step.kernel_us(point["report"]["kernels"][point["op"]["kernel"]], point["op"], constants)
        kernels.append({key: point[key] for key in ("model", "batch", "commit", "file", "kernel", "measured_us")}
                       | {"grid": point["op"]["grid"], "block": point["op"]["block"], "predicted_us": predicted["us"],
                          "bound": predicted["bound"], "ratio": predicted["us"] / point["measured_us"]})
    return {"steps": steps, "kernels": kernels}


def versus_measured(out_dir) -> dict:
    """The committed predictions beside the newest GPU measurements made after them (``--predict --vs-measured``,
    on the GPU machine right after ``benchmarks/gpu_session.sh predict`` measured): no compiling, no git."""
    from cnn.bench import recorded
    from cnn.bench.results import bench_results

    predicted = json.loads((Path(out_dir) / RESULTS_NAME).read_text())
    since = predicted["created"]
    rows, device = [], None
    for row in predicted["predicted"]["stages"]:
        found = [(path, result) for path, result in bench_results(out_dir) if result["machine"].get("gpu")
                 and result["created"] >= since and (result["config"]["model"], result["config"]["batch_size"])
                 == (row["model"], row["batch_size"]) and recorded.row(result, row["stage"])]
        if not found:
            continue
        path, result = found[-1]
        device = result["machine"]["gpu"]["name"]
        measured = recorded.row(result, row["stage"])
        for mode, key in (("phase by phase", "step_ms"), ("back to back", "back_to_back_ms")):
            if measured.get(key):
                guess = row["back_to_back_ms"] if key == "back_to_back_ms" and not row["graph_ms"] else \
                    row["graph_ms"] if key == "back_to_back_ms" else row["phase_by_phase_ms"]
                rows.append({"stage": row["stage"], "model": row["model"], "timing": mode, "file": path.name,
                             "predicted_ms": guess, "measured_ms": measured[key]["median"],
                             "ratio": guess / measured[key]["median"]})
    for row in predicted["predicted"]["tiled_conv"]:
        found = [(path, result) for path, result in recorded.ablations(out_dir) if result["created"] >= since
                 and (result["model"], result["batch_size"]) == (row["model"], row["batch_size"])]
        for path, result in found[-1:]:
            label = "+ tiled-conv alone" if "alone" in row["variant"] else None
            match = [r for r in result["rows"] if (r["variant"] == label) if label] or \
                    [r for r in result["rows"] if r["variant"].startswith("cumulative") and r["fixes"][-1] == "tiled-conv"]
            for measured in match[:1]:
                rows.append({"stage": f"ablation {row['variant']}", "model": row["model"], "timing": "× tiled-conv buys",
                             "file": path.name, "predicted_ms": row["speedup_vs_baseline"],
                             "measured_ms": measured["speedup_vs_baseline"],
                             "ratio": row["speedup_vs_baseline"] / measured["speedup_vs_baseline"]})
    return {"device": device, "prediction": RESULTS_NAME, "prediction_commit": predicted.get("commit"), "rows": rows}


def cmd_predict(args) -> int:
    from cnn.bench.results import results_header, slug, write_json

    if args.vs_measured:
        compared = versus_measured(args.out)
        if not compared["rows"]:
            raise ValueError("--predict --vs-measured: no GPU measurement newer than the prediction in "
                             f"{args.out} (benchmarks/gpu_session.sh predict makes them)")
        result = {**results_header("predict-vs-measured"), **compared}
        path = write_json(Path(args.out) / f"predict-vs-measured-{slug(compared['device'])}-{result['created'][:10]}.json",
                          result)
        for row in compared["rows"]:
            print(f"{row['stage']:<40} {row['model']:<14} {row['timing']:<18} PREDICTED {row['predicted_ms']:8.3g}  "
                  f"measured {row['measured_ms']:8.3g}  ×{row['ratio']:.2f}")
        print(f"results: {path} (device: {compared['device']})")
        return 0

    copies = predict_step.measured_copies()
    constants = dict(predict_step.CALIBRATED)
    if args.calibrate:
        constants = predict_calibrate.calibrate()
        print("fitted:", json.dumps(constants))
    result = {**results_header("predict-h100"), "device": PREDICTED_DEVICE, "constants": constants,
              "measured_constants": {"launch_1_array_us": predict_step.LAUNCH_1_ARRAY_US,
                                     "launch_8_arrays_us": predict_step.LAUNCH_8_ARRAYS_US,
                                     "graph_replay_us": predict_step.GRAPH_REPLAY_US},
              "calibration": calibration(constants, copies), "predicted": predictions(constants, copies, print)}
    path = write_json(Path(args.out) / RESULTS_NAME, result)
    print(docs_block(Path(args.out), Path("docs/profiling.md")))
    print(f"results: {path}")
    return 0


# -- docs/profiling.md ---------------------------------------------------------------------------
def times(ratio: float) -> str:
    return f"{ratio:.2f}×"


def docs_block(out_dir, page: Path) -> str:
    """The ``prediction`` block of docs/profiling.md, from ``predict-h100-sm90.json``."""
    from cnn.bench.findings import NETWORK_NAMES
    from cnn.bench.readme import relative_link
    from cnn.bench.tables import markdown

    path = Path(out_dir) / RESULTS_NAME
    if not path.exists():
        return "No prediction yet: `python -m cnn bench --predict`."
    result = json.loads(path.read_text())
    link = f"[`{path.name}`]({relative_link(path, page)})"
    names = lambda model, batch: f"{NETWORK_NAMES.get(model, model)} b{batch}"  # noqa: E731
    constants = ", ".join(f"{name} = {value:.3g}" for name, value in result["constants"].items())
    steps = [s for s in result["calibration"]["steps"] if s["kind"] == "bench"]
    ablation = [s for s in result["calibration"]["steps"] if s["kind"] == "ablation"]
    kernels = result["calibration"]["kernels"]
    worst = max(max(s["ratio"], 1 / s["ratio"]) for s in steps)
    parts = [f"Calibrated constants ({link}, commit {result.get('commit')}): {constants}. "
             f"Used as measured: numba-cuda's launch {result['measured_constants']['launch_1_array_us']} µs with one "
             f"array argument and {result['measured_constants']['launch_8_arrays_us']} µs with eight, "
             f"{result['measured_constants']['graph_replay_us']} µs of graph replay a kernel, the copies' latency "
             f"(`--memory`).", "",
             f"**The committed H100 steps of stages 4-7, each PREDICTED from the kernels that were measured** "
             f"(the static report of that commit): the largest error is {worst:.2f}× "
             f"(predicted / measured; 1.5× is the target).", "",
             markdown(["network", "stage, timing", "measured (H100 session)", "kernels predicted from", "measured ms",
                       "PREDICTED ms", "predicted / measured"],
                      [[names(s["model"], s["batch"]), s["label"], session_of(s["file"]), kernels_of(s),
                        f"{s['measured_ms']:.3g}", f"{s['predicted_ms']:.3g}", times(s["ratio"])] for s in steps]), ""]
    if ablation:
        ratios = [s["ratio"] for s in ablation]
        far = [s for s in ablation if max(s["ratio"], 1 / s["ratio"]) > 1.5]
        parts += [f"Stage 7's ablation rows ({len(ablation)}, both sessions, back to back): predicted / measured "
                  f"{min(ratios):.2f}–{statistics.median(ratios):.2f}–{max(ratios):.2f}× (min–median–max); "
                  f"{len(far)} outside 1.5×" + (": " + "; ".join(f"{names(s['model'], s['batch'])} {s['label'][10:]} "
                                                                 f"({session_of(s['file'])}) {times(s['ratio'])}"
                                                                 for s in far[:6])
                                                + ("…" if len(far) > 6 else "") if far else "") + ".", ""]
    if kernels:
        ratios = [k["ratio"] for k in kernels]
        within = sum(1 for r in ratios if 0.5 <= r <= 2)
        parts += [f"Nsight Compute's {len(kernels)} kernel launches: predicted / measured {min(ratios):.2f}–"
                  f"{statistics.median(ratios):.2f}–{max(ratios):.2f}× (min–median–max), {within} within 2×. "
                  f"A kernel is harder to predict than a step, whose errors partly cancel.", ""]
    predicted, compared = result["predicted"], measured_since(out_dir, page)
    parts += ["**PREDICTED for this checkout** (" + ("measured since on a GPU: the table after these" if compared else
              "not measured: `sh benchmarks/gpu_session.sh predict` measures every figure below on a GPU and writes "
              "them beside these") + "):", "",
              markdown(["stage", "network", "PREDICTED phase by phase, ms", "PREDICTED back to back, ms",
                        "PREDICTED as one CUDA graph, ms"],
                       [[f"`{s['stage']}`" + (" ¹" if s.get("unmodelled") else "") + (" ²" if s.get("own_models") else ""),
                         names(s["model"], s["batch_size"]),
                         f"{s['phase_by_phase_ms']:.3g}", f"{s['back_to_back_ms']:.3g}",
                         f"{s['graph_ms']:.3g}" if s["graph_ms"] else "—"] for s in predicted["stages"]]), "",
              *([f"¹ A lower bound: no work model (`cnn/bench/predict_work.py`'s `WORK`) for "
                 f"{', '.join(sorted({f'`{k}`' for s in predicted['stages'] for k in s.get('unmodelled', [])}))}, "
                 f"whose arithmetic loops are then counted as run once a thread.", ""]
                if any(s.get("unmodelled") for s in predicted["stages"]) else []),
              *([own_models_note(predicted["stages"], names), ""] if any(s.get("own_models") for s in predicted["stages"])
                else []),
              "Stage 7's ablation, the rows tiled-conv changes (PREDICTED, back to back; × what the fix buys: the "
              "row's time against the same variant without tiled-conv — cuda-ring for the first row, the fixes "
              "before it for the second):", "",
              markdown(["variant", "network", "PREDICTED ms without tiled-conv", "PREDICTED ms with it",
                        "× what tiled-conv buys (PREDICTED)"],
                       [[t["variant"], names(t["model"], t["batch_size"]), f"{t['baseline_ms']:.3g}", f"{t['ms']:.3g}",
                         times(t["speedup_vs_baseline"])] for t in predicted["tiled_conv"]])]
    return "\n".join(parts + ([""] + compared if compared else []))


def measured_since(out_dir, page: Path) -> list[str]:
    """The newest ``predict-vs-measured-*.json`` (``recorded.predict_vs_measured``) as lines of Markdown: each
    PREDICTED figure beside what a GPU measured; [] when none exists."""
    from cnn.bench import recorded
    from cnn.bench.readme import relative_link
    from cnn.bench.tables import markdown

    found = recorded.predict_vs_measured(out_dir)
    if found is None:
        return []
    path, result = found
    ratios = [row["ratio"] for row in result["rows"]]
    within = sum(1 for ratio in ratios if 1 / 1.5 <= ratio <= 1.5)
    return [f"**The PREDICTED figures above, measured** on the {result['device']}, {result['created'][:10]} "
            f"([`{path.name}`]({relative_link(path, page)}); predicted for the H100 at commit "
            f"{result['prediction_commit']}, measured at commit {result['commit']}): predicted / measured "
            f"{min(ratios):.2f}–{statistics.median(ratios):.2f}–{max(ratios):.2f}× (min–median–max), {within} of "
            f"{len(ratios)} within 1.5×." + (" The H200 has the H100's 132 SMs at the same clock, with more and "
                                             "faster memory." if "H200" in result["device"] else ""), "",
            markdown(["stage", "network", "timing", "PREDICTED", "measured", "predicted / measured", "file"],
                     [[row["stage"], row["model"], row["timing"], f"{row['predicted_ms']:.3g}",
                       f"{row['measured_ms']:.3g}", times(row["ratio"]), f"`{row['file']}`"] for row in result["rows"]])]


def own_models_note(stages: list[dict], names) -> str:
    """The footnote of the kernels a model of their own predicts (``predict_work.OWN_MODELS``), with its range."""
    kernels = sorted({k["kernel"] for s in stages for k in s.get("own_models", [])})
    spans = "; ".join(f"{names(s['model'], s['batch_size'])} {k['high_us']:.3g} µs (low end {k['low_us']:.3g})"
                      for s in stages for k in s.get("own_models", []))
    return (f"² {', '.join(f'`{k}`' for k in kernels)} timed by its stage's own model (`kernels/fused_net_cost.py`, "
            f"phase by phase from the layer table), at its high end, the one with issue 22's calibrated constants: "
            f"{spans}.")


def stage7_block(out_dir, page: Path) -> str:
    """Stage 7's docstring: its PREDICTED step and what tiled-conv is PREDICTED to buy (predict-h100-sm90.json)."""
    path = Path(out_dir) / RESULTS_NAME
    if not path.exists():
        return "No prediction yet: python -m cnn bench --predict."
    result = json.loads(path.read_text())
    lines = [f"    PREDICTED, not measured ({path.as_posix()}, commit {result.get('commit')}; the model's error on every",
             f"    committed H100 step of stages 4-7 is at most {worst_bench_ratio(out_dir):.2f}x):"]
    for row in result["predicted"]["stages"]:
        if row["stage"] == "cuda-tuned":
            lines.append(f"        {row['model']} b{row['batch_size']}: {row['graph_ms']:.3g} ms a step as one CUDA graph, "
                         f"{row['back_to_back_ms']:.3g} ms launched kernel by kernel")
    for row in result["predicted"]["tiled_conv"]:
        lines.append(f"        {row['model']} b{row['batch_size']}, ablation '{row['variant']}': tiled-conv buys "
                     f"x{row['speedup_vs_baseline']:.2f} ({row['baseline_ms']:.3g} -> {row['ms']:.3g} ms)")
    return "\n".join(lines)


def session_of(name: str) -> str:
    from cnn.bench.results import run_tag

    tag = run_tag(name)
    return f"commit {tag}" if tag else "the later run of that day"


def kernels_of(point: dict) -> str:
    return f"commit {point['commit']}" if point["commit"] else "this checkout's (unchanged since)"


def worst_bench_ratio(out_dir) -> float:
    """max(predicted / measured, measured / predicted) over the committed bench steps (the 1.5× target)."""
    result = json.loads((Path(out_dir) / RESULTS_NAME).read_text())
    return max(max(s["ratio"], 1 / s["ratio"]) for s in result["calibration"]["steps"] if s["kind"] == "bench")


def finite(value) -> bool:
    return value is not None and math.isfinite(value) and value > 0
