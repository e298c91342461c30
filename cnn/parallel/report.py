"""Markdown tables from run summaries.

    python -m cnn.parallel.report FILE.json [...]                  # print the strategy table
    python -m cnn.parallel.report FILE.json --into docs/distributed.md
    python -m cnn.parallel.report --cost-model benchmarks/results/parallel_cost_model.json --into docs/distributed.md
    python -m cnn.parallel.report --algorithms benchmarks/results/parallel_algorithms.json --into docs/distributed.md

A FILE holds one summary (what ``--summary`` writes) or a list of them (what
``benchmarks/parallel_strategies.py`` collects). The table's columns are seed 000's phases, in
milliseconds per step of the rank shown (rank 0 where it computes, else the mean of the workers).
``--into`` replaces the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in a
Markdown file (NAME = parallel-strategies, parallel-cost-model, or parallel-SECTION for each section
of ``benchmarks/parallel_algorithms.py``'s results), so the numbers are regenerated from the JSON,
never typed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cnn.parallel.timing import AVERAGE, COMPUTE, DISTRIBUTE, FETCH, SEED_PHASES, UPDATE

COLUMNS = [("compute", COMPUTE), ("grad fetch", FETCH), ("grad avg", AVERAGE), ("update", UPDATE),
           ("distribute", DISTRIBUTE)]


COLUMN_NOTE = ("Columns: ms per step of the rank named in *notes*; " + ", ".join(SEED_PHASES) +
               " are seed 000's phases; *other* is the rest of the step (waiting for a turn or for the "
               "other half of the network, summing portions, bookkeeping).")


def label(summary: dict) -> str:
    """The strategy and the options that tell its variants apart (runs recorded before an option
    existed ran what is now its other value: SGD, the round-robin EASGD, the cut after Flatten)."""
    options, name = summary["options"], summary["strategy"]
    if name == "allreduce":
        return f"allreduce ({options['allreduce']}{', overlapped' if options.get('overlap') else ''})"
    if name == "easgd":
        mode = options["easgd_mode"]
        if mode == "async" and "steps_when_first_worker_finished" not in summary:
            mode = "round-robin"          # recorded when "async" named the round-robin
        return f"easgd ({mode}, τ={options['tau']})"
    if name == "downpour":
        return f"downpour ({options.get('server_rule') or 'sgd'}, push {options['n_push']}, fetch {options['n_fetch']})"
    if name == "sandblaster":
        return f"sandblaster ({options.get('optimizer', 'sgd').replace('lbfgs', 'L-BFGS')})"
    if name == "model-parallel":
        cut = summary.get("split") or "7, after Flatten"
        return f"model-parallel (cut {cut}, {options['micro_batches']} micro-batches)"
    return name


def machine_key(summary: dict) -> tuple:
    machine = summary.get("machine", {})
    return machine.get("host"), machine.get("cpu"), machine.get("cores")


def machine_line(summaries: list[dict]) -> str:
    """Where the runs were measured: the CPU, its cores, the ranks, and how busy the machine was."""
    machine = summaries[0].get("machine", {})
    cores, ranks = machine.get("cores"), sorted({summary["ranks"] for summary in summaries})
    most = max(ranks)
    layout = ("one rank per core" if cores and most <= cores
              else f"oversubscribed: up to {most} ranks on {cores} cores" if cores else "cores unknown")
    loads = [summary["load_average"][0] for summary in summaries if summary.get("load_average")]
    load = f"; 1-minute load average {min(loads):.1f}–{max(loads):.1f} at the end of the runs" if loads else ""
    return (f"Measured on {machine.get('cpu', 'an unknown CPU')} with {cores} cores, "
            f"{' or '.join(map(str, ranks))} ranks per run ({layout}){load}.")


def machines(summaries: list[dict]) -> list[tuple]:
    """The machines the summaries were measured on, in order of first appearance."""
    return list(dict.fromkeys(machine_key(summary) for summary in summaries))


def machine_lines(summaries: list[dict]) -> str:
    """One ``machine_line`` per machine; with more than one, each starts with the mark its rows carry."""
    keys = machines(summaries)
    if len(keys) == 1:
        return machine_line(summaries)
    return "\n\n".join(f"[{chr(65 + i)}] " + machine_line([s for s in summaries if machine_key(s) == key])
                       for i, key in enumerate(keys))


def strategy_table(summaries: list[dict]) -> str:
    """One row per run: layout, ms per step and its breakdown, throughput, accuracy, staleness (and,
    when the runs come from several machines, the mark of the machine each row was measured on)."""
    header = ["strategy", "ranks", "global batch", "peak lr", "epochs", "ms/step"] + \
             [name for name, _ in COLUMNS] + ["other", "img/s", "test acc.", "notes"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = machines(summaries)
    for summary in summaries:
        breakdown = summary["breakdown_s"]
        step = breakdown.get("step", 0.0)
        phases = [breakdown.get(phase, 0.0) for _, phase in COLUMNS]
        other = step - sum(phases)
        accuracy = summary["final_test_accuracy"]
        config = summary["config"]
        lbfgs = summary["options"].get("optimizer") == "lbfgs" and summary["strategy"] == "sandblaster"
        peak_lr = config["lr"] * (config["lr_scale"] if config["schedule"] == "warmup" else 1)
        mark = f" [{chr(65 + keys.index(machine_key(summary)))}]" if len(keys) > 1 else ""
        cells = [label(summary) + mark, str(summary["ranks"]), str(summary["global_batch"]),
                 "line search" if lbfgs else f"{peak_lr:g}", str(config["epochs"]), f"{step * 1e3:.1f}"]
        cells += [f"{seconds * 1e3:.1f}" if seconds else "–" for seconds in phases]
        cells += [f"{other * 1e3:.1f}", f"{summary['images_per_second']:.0f}",
                  f"{accuracy:.2%}" if accuracy is not None else "–", notes(summary)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def notes(summary: dict) -> str:
    from cnn.train import TrainConfig

    parts = [f"view: {summary['breakdown_view']}"]
    rule = {"downpour": summary["options"].get("server_rule"), "sandblaster": summary["options"].get("optimizer")}
    momentum_unused = rule.get(summary["strategy"]) in ("adagrad", "lbfgs")
    if summary["config"]["momentum"] != TrainConfig.momentum and not momentum_unused:
        parts.append(f"momentum {summary['config']['momentum']:g}")
    if summary.get("staleness", {}).get("count"):
        stale = summary["staleness"]
        parts.append(f"staleness mean {stale['mean']:.2f}, max {stale['max']}")
    if "duplicates" in summary:
        parts.append(f"{summary['duplicates']} duplicate portions")
    if summary.get("lbfgs"):
        parts.append(f"{summary['lbfgs']['evaluations_per_iteration']:.1f} evaluations an iteration")
    if summary.get("steps_when_first_worker_finished"):
        parts.append("steps when the first worker finished: " + ", ".join(
            f"rank {rank} {steps}" for rank, steps in sorted(summary["steps_when_first_worker_finished"].items())))
    if summary.get("gpu_path"):
        parts.append(summary["gpu_path"])
    if summary.get("lost_ranks"):
        parts.append(f"lost rank(s) {summary['lost_ranks']}")
    if summary["status"] != "completed":
        parts.append(summary["status"])
    return "; ".join(parts)


def cost_table(result: dict) -> str:
    """The α-β model against the measured communication per step (LeNet-5's gradient), with the ratio."""
    fit = result["alpha_beta"]
    ranks = [row["ranks"] for row in result["comparison"] if row["source"] == "isolated exchange"]
    cores = result.get("cores")
    lines = [f"Ping-pong between two ranks, waited on as the strategies wait: α = {fit['alpha'] * 1e6:.1f} µs, "
             f"1/β = {1 / fit['beta'] / 1e9:.2f} GB/s" + (f"; {cores} cores, {', '.join(map(str, ranks))} ranks "
             f"({'one rank per core' if max(ranks) <= cores else 'oversubscribed above ' + str(cores)})"
             if cores and ranks else "") + ". Ratio = measured / model.", "",
             "| ranks | measured in | server: model | server: measured | ratio | ring: model | ring: measured | ratio "
             "| MPI allreduce: measured |",
             "|---|---|---|---|---|---|---|---|---|"]
    runs = result.get("comparison_runs") or [result["comparison"]]
    if len(runs) > 1:
        lines[0] = lines[0].replace(". Ratio = measured / model.", f"; {len(runs)} runs, the rank counts taking "
                                    f"turns. Ratio = measured / model, min–median–max over the runs (α from "
                                    f"{spread([a * 1e6 for a in result['alpha_beta']['alphas']], '{:.1f}')} µs).")
    for index, row in enumerate(result["comparison"]):
        same = [run[index] for run in runs if index < len(run)]
        lines.append(f"| {row['ranks']} | {row['source']} | {milliseconds(row['ps_model'])} | "
                     f"{milliseconds(row['ps_measured'])} | {ratio_spread(same, 'ps')} | "
                     f"{milliseconds(row['ring_model'])} | {milliseconds(row['ring_measured'])} | "
                     f"{ratio_spread(same, 'ring')} | "
                     f"{milliseconds(row['mpi_allreduce_measured'])} |")
    return "\n".join(lines)


def ratio_spread(rows: list[dict], name: str) -> str:
    """measured / model of ``name`` ("ps" or "ring") in each run's row: one ratio, or min–median–max."""
    values = [row[f"{name}_measured"] / row[f"{name}_model"] for row in rows
              if row.get(f"{name}_measured") and row.get(f"{name}_model")]
    if len(values) <= 1:
        return f"{values[0]:.1f}× (1 run)" if values else "–"
    return spread(values, "{:.1f}", "×")


def wait_table(result: dict) -> str:
    """MPI's allreduce back to back, per way of waiting, for each model and rank count."""
    lines = ["MPI's allreduce of a gradient, back to back as in training, per way of waiting for it:", "",
             "| model | ranks | World.wait | MPI_Wait | blocking Allreduce | sleeps (first version) "
             "| sleeps ÷ World.wait |", "|---|---|---|---|---|---|---|"]
    for ranks, waits in sorted(result.get("waits", {}).items(), key=lambda item: int(item[0])):
        for model, way in waits.items():
            lines.append(f"| {model} | {ranks} | {milliseconds(way['World.wait'])} | {milliseconds(way['MPI_Wait'])} | "
                         f"{milliseconds(way['blocking'])} | {milliseconds(way['sleeps'])} | "
                         f"{ratio(way['sleeps'], way['World.wait'])} |")
    return "\n".join(lines)


def measured_on(section: dict) -> str:
    """"Measured on CPU with N cores, R runs at load L–L'" for one section of parallel_algorithms.json."""
    machine = section.get("machine", {})
    cores = machine.get("usable_cores") or machine.get("cores")
    loads = [load for run in section.get("runs", []) for load in run.get("load_average", [])] or \
        [(machine.get("load_average") or [None])[0]]
    loads = [load for load in loads if load is not None]
    runs = len(section_runs(section))
    return (f"Measured on {machine.get('cpu', 'an unknown CPU')} with {cores} cores, "
            f"{runs} run{'s' if runs > 1 else ''}"
            + (f" at a 1-minute load average of {min(loads):.1f}–{max(loads):.1f}" if loads else "")
            + (f", {section['limit_train']} training images" if section.get("limit_train") else "")
            + f" ({section.get('seconds', 0) / 60:.0f} min)")


def section_runs(section: dict) -> list:
    """The results of each run of a section (a file from before repeats holds one, as "results")."""
    return [run["results"] for run in section["runs"]] if "runs" in section else [section["results"]]


def spread(values, fmt: str = "{:.2f}", unit: str = "") -> str:
    """min–median–max of ``values`` (one value: itself, marked as a single run)."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return fmt.format(values[0]) + unit + " (1 run)"
    low, mid, high = min(values), float(np.median(values)), max(values)
    return f"{fmt.format(low)}–{fmt.format(mid)}–{fmt.format(high)}{unit}"


SPREAD_NOTE = "Each cell: min–median–max over the runs."


def staleness_table(section: dict) -> str:
    """Downpour's final accuracy and loss per server rule and fetch interval, over the runs."""
    runs = section_runs(section)
    lines = [measured_on(section) + "; 4 ranks (3 replicas, oversubscribed where the cores are fewer). "
             + SPREAD_NOTE, "",
             "| server rule | lr | --n-fetch | test accuracy, % | test loss | staleness mean |",
             "|---|---|---|---|---|---|"]
    for index, row in enumerate(runs[0]):
        same = [run[index] for run in runs]
        rule = "SGD, momentum " + f"{row['momentum']:g}" if row["rule"] == "sgd" else "Adagrad"
        lines.append(f"| {rule} | {row['lr']:g} | {row['n_fetch']} | "
                     f"{spread([100 * r['accuracy'] for r in same], '{:.1f}')} | {spread([r['loss'] for r in same], '{:.3f}')} | "
                     f"{spread([r['staleness']['mean'] for r in same], '{:.1f}')} |")
    return "\n".join(lines)


def straggler_table(section: dict) -> str:
    """EASGD's workers' ms a step, and how far the slow one had got when the first finished, per mode."""
    runs = section_runs(section)
    workers = sorted(runs[0][0]["step_ms"], key=int)
    lines = [measured_on(section) + "; 4 ranks (a master, 3 workers); worker rank 1 computes 3× slower; the "
             "two modes take turns in each run. " + SPREAD_NOTE, "",
             "| mode | " + " | ".join(f"rank {w}: ms a step" for w in workers) +
             " | rank 1's steps when the first worker finished | wall time, s | against round-robin | test accuracy, % |",
             "|---|" + "---|" * len(workers) + "---|---|---|---|"]
    for index, row in enumerate(runs[0]):
        same = [run[index] for run in runs]
        baseline = [run[0]["train_seconds"] for run in runs]
        progress = [r["steps_when_first_worker_finished"] for r in same]
        done = (spread([p["1"] for p in progress], "{:.0f}") + f" of {row['steps']}" if all(progress)
                else "all together (lock-step)")
        lines.append(f"| {row['mode']} | " + " | ".join(spread([r["step_ms"][w] for r in same], "{:.0f}")
                                                       for w in workers) +
                     f" | {done} | {spread([r['train_seconds'] for r in same], '{:.1f}')} | "
                     f"{spread([r['train_seconds'] / b for r, b in zip(same, baseline)], '{:.2f}', '×')} | "
                     f"{spread([100 * r['accuracy'] for r in same], '{:.1f}')} |")
    return "\n".join(lines)


def overlap_table(section: dict) -> str:
    """Step and wait-after-backward, plain against overlapped, per rank count, over the runs."""
    runs = section_runs(section)
    lines = [measured_on(section) + "; the two kinds of step alternate inside one MPI job per rank count and run "
             "(medians of its steps). " + SPREAD_NOTE, "",
             "| ranks | plain: ms a step | overlapped: ms a step | overlapped ÷ plain | wait after the backward: "
             "plain, ms | overlapped, ms | oversubscribed |", "|---|---|---|---|---|---|---|"]
    for index, row in enumerate(runs[0]):
        same = [run[index] for run in runs]
        lines.append(f"| {row['ranks']} | {spread([r['step_s']['plain'] * 1e3 for r in same], '{:.1f}')} | "
                     f"{spread([r['step_s']['overlapped'] * 1e3 for r in same], '{:.1f}')} | "
                     f"{spread([r['step_ratio'] for r in same], '{:.2f}')} | "
                     f"{spread([r['wait_s']['plain'] * 1e3 for r in same], '{:.1f}')} | "
                     f"{spread([r['wait_s']['overlapped'] * 1e3 for r in same], '{:.1f}')} | "
                     f"{'yes' if row['oversubscribed'] else 'no'} |")
    return "\n".join(lines)


def model_split_table(section: dict) -> str:
    """The per-layer cost probe (the last run's), then each cut's compute per rank and step time at 1, 4,
    8 micro-batches, over the runs."""
    runs = section_runs(section)
    result = runs[-1]
    costs = result["costs_s"]
    batches = sorted(costs, key=int, reverse=True)
    lines = [measured_on(section) + "; 2 ranks. The probe (last run): ms of forward + backward of each layer "
             "alone, and of each convolution block split into its fixed part + a part per filter.", "",
             "| layer | " + " | ".join(f"ms at batch {b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    for index, name in enumerate(result["layers"]):
        cells = [f"{costs[b]['layers'][index] * 1e3:.3f}" for b in batches]
        lines.append(f"| {index} {name} | " + " | ".join(cells) + " |")
    for block in costs[batches[0]]["blocks"]:
        cells = [f"{costs[b]['blocks'][block][0] * 1e3:.3f} + {costs[b]['blocks'][block][1] * 1e3:.3f}/filter"
                 for b in batches]
        lines.append(f"| block {block}: fixed + per filter | " + " | ".join(cells) + " |")
    lines.append("| balanced cut | " + " | ".join(result["balanced"][b] for b in batches) + " |")
    cuts = sorted({r["balanced"]["8"] for r in runs})
    lines += ["", f"The six configurations alternate step by step inside one 2-rank MPI job, "
              f"{result.get('repeats', '?')} steps each (medians), once per run (balanced cut: "
              f"{', '.join(cuts)}). " + SPREAD_NOTE, "",
              "| cut | micro-batches | rank 0 compute, ms | rank 1 compute, ms | ms a step | against 1 micro-batch |",
              "|---|---|---|---|---|---|"]
    for index, run in enumerate(result["runs"]):
        same = [r["runs"][index] for r in runs]
        singles = [{x["split"]: x["step_ms"] for x in r["runs"] if x["micro_batches"] == 1} for r in runs]
        lines.append(f"| {run['split']} ({run['asked']}) | {run['micro_batches']} | "
                     f"{spread([x['compute_ms']['0'] for x in same], '{:.1f}')} | "
                     f"{spread([x['compute_ms']['1'] for x in same], '{:.1f}')} | "
                     f"{spread([x['step_ms'] for x in same], '{:.1f}')} | "
                     f"{spread([x['step_ms'] / single[x['split']] for x, single in zip(same, singles)], '{:.2f}', '×')} |")
    return "\n".join(lines)


ALGORITHM_TABLES = {"staleness": staleness_table, "straggler": straggler_table, "overlap": overlap_table,
                    "model-split": model_split_table}


def algorithm_tables(results: dict) -> str:
    """Every section of benchmarks/results/parallel_algorithms.json as a Markdown table."""
    return "\n\n".join(f"{name}:\n\n{ALGORITHM_TABLES[name](section)}" for name, section in results.items()
                       if name in ALGORITHM_TABLES)


def ratio(measured: float | None, model: float | None) -> str:
    return f"{measured / model:.1f}×" if measured and model else "–"


def milliseconds(seconds: float | None) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds else "–"


def replace_between_markers(path: str | Path, name: str, text: str) -> None:
    """Put ``text`` between ``<!-- name:start -->`` and ``<!-- name:end -->`` in the file."""
    path = Path(path)
    content = path.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in content or end not in content:
        raise SystemExit(f"{path}: no {start} … {end} markers")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def load(paths) -> list[dict]:
    summaries = []
    for path in paths:
        value = json.loads(Path(path).read_text())
        summaries.extend(value if isinstance(value, list) else [value])
    return summaries


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cnn.parallel.report", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="summary JSON files")
    parser.add_argument("--cost-model", default=None, help="benchmarks/results/parallel_cost_model.json")
    parser.add_argument("--algorithms", default=None, help="benchmarks/results/parallel_algorithms.json")
    parser.add_argument("--into", default=None, help="Markdown file whose marked section is replaced")
    args = parser.parse_args(argv)
    if args.algorithms:
        results = json.loads(Path(args.algorithms).read_text())
        for name, section in results.items():
            text = ALGORITHM_TABLES[name](section)
            if args.into:
                replace_between_markers(args.into, f"parallel-{name}", text)
            else:
                print(f"{name}:\n\n{text}\n")
        return 0
    if args.cost_model:
        result = json.loads(Path(args.cost_model).read_text())
        name, text = "parallel-cost-model", cost_table(result) + "\n\n" + wait_table(result)
    else:
        summaries = load(args.files)
        name, text = "parallel-strategies", (machine_lines(summaries) + "\n\n" + strategy_table(summaries)
                                             + "\n\n" + COLUMN_NOTE)
    if args.into:
        replace_between_markers(args.into, name, text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
