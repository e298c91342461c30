"""Markdown tables from run summaries.

    python -m cnn.parallel.report FILE.json [...]                  # print the strategy table
    python -m cnn.parallel.report FILE.json --into docs/distributed.md
    python -m cnn.parallel.report --cost-model benchmarks/results/parallel_cost_model.json --into docs/distributed.md

A FILE holds one summary (what ``--summary`` writes) or a list of them (what
``benchmarks/parallel_strategies.py`` collects). The table's columns are seed 000's phases, in
milliseconds per step of the rank shown (rank 0 where it computes, else the mean of the workers).
``--into`` replaces the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in a
Markdown file (NAME = parallel-strategies or parallel-cost-model), so the README's numbers are
regenerated from the JSON, never typed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cnn.parallel.timing import AVERAGE, COMPUTE, DISTRIBUTE, FETCH, SEED_PHASES, UPDATE

COLUMNS = [("compute", COMPUTE), ("grad fetch", FETCH), ("grad avg", AVERAGE), ("update", UPDATE),
           ("distribute", DISTRIBUTE)]


COLUMN_NOTE = ("Columns: ms per step of the rank named in *notes*; " + ", ".join(SEED_PHASES) +
               " are seed 000's phases; *other* is the rest of the step (waiting for a turn or for the "
               "other half of the network, summing portions, bookkeeping).")


def label(summary: dict) -> str:
    """The strategy and the option that tells its variants apart."""
    options, name = summary["options"], summary["strategy"]
    if name == "allreduce":
        return f"allreduce ({options['allreduce']})"
    if name == "easgd":
        return f"easgd ({options['easgd_mode']}, τ={options['tau']})"
    if name == "downpour":
        return f"downpour (push {options['n_push']}, fetch {options['n_fetch']})"
    if name == "model-parallel":
        return f"model-parallel ({options['micro_batches']} micro-batches)"
    return name


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


def strategy_table(summaries: list[dict]) -> str:
    """One row per run: layout, ms per step and its breakdown, throughput, accuracy, staleness."""
    header = ["strategy", "ranks", "global batch", "peak lr", "epochs", "ms/step"] + \
             [name for name, _ in COLUMNS] + ["other", "img/s", "test acc.", "notes"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for summary in summaries:
        breakdown = summary["breakdown_s"]
        step = breakdown.get("step", 0.0)
        phases = [breakdown.get(phase, 0.0) for _, phase in COLUMNS]
        other = step - sum(phases)
        accuracy = summary["final_test_accuracy"]
        config = summary["config"]
        peak_lr = config["lr"] * (config["lr_scale"] if config["schedule"] == "warmup" else 1)
        cells = [label(summary), str(summary["ranks"]), str(summary["global_batch"]), f"{peak_lr:g}",
                 str(config["epochs"]), f"{step * 1e3:.1f}"]
        cells += [f"{seconds * 1e3:.1f}" if seconds else "–" for seconds in phases]
        cells += [f"{other * 1e3:.1f}", f"{summary['images_per_second']:.0f}",
                  f"{accuracy:.2%}" if accuracy is not None else "–", notes(summary)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def notes(summary: dict) -> str:
    from cnn.train import TrainConfig

    parts = [f"view: {summary['breakdown_view']}"]
    if summary["config"]["momentum"] != TrainConfig.momentum:
        parts.append(f"momentum {summary['config']['momentum']:g}")
    if summary.get("staleness", {}).get("count"):
        stale = summary["staleness"]
        parts.append(f"staleness mean {stale['mean']:.2f}, max {stale['max']}")
    if "duplicates" in summary:
        parts.append(f"{summary['duplicates']} duplicate portions")
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
    for row in result["comparison"]:
        lines.append(f"| {row['ranks']} | {row['source']} | {milliseconds(row['ps_model'])} | "
                     f"{milliseconds(row['ps_measured'])} | {ratio(row['ps_measured'], row['ps_model'])} | "
                     f"{milliseconds(row['ring_model'])} | {milliseconds(row['ring_measured'])} | "
                     f"{ratio(row['ring_measured'], row['ring_model'])} | "
                     f"{milliseconds(row['mpi_allreduce_measured'])} |")
    return "\n".join(lines)


def wait_table(result: dict) -> str:
    """MPI's allreduce back to back, per way of waiting, for each model and rank count."""
    lines = ["MPI's allreduce of a gradient, back to back as in training, per way of waiting for it:", "",
             "| model | ranks | World.wait (spinning) | MPI_Wait | blocking Allreduce | sleeps (first version) "
             "| sleeps ÷ World.wait |", "|---|---|---|---|---|---|---|"]
    for ranks, waits in sorted(result.get("waits", {}).items(), key=lambda item: int(item[0])):
        for model, way in waits.items():
            lines.append(f"| {model} | {ranks} | {milliseconds(way['World.wait'])} | {milliseconds(way['MPI_Wait'])} | "
                         f"{milliseconds(way['blocking'])} | {milliseconds(way['sleeps'])} | "
                         f"{ratio(way['sleeps'], way['World.wait'])} |")
    return "\n".join(lines)


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
    parser.add_argument("--into", default=None, help="Markdown file whose marked section is replaced")
    args = parser.parse_args(argv)
    if args.cost_model:
        result = json.loads(Path(args.cost_model).read_text())
        name, text = "parallel-cost-model", cost_table(result) + "\n\n" + wait_table(result)
    else:
        summaries = load(args.files)
        name, text = "parallel-strategies", (machine_line(summaries) + "\n\n" + strategy_table(summaries)
                                             + "\n\n" + COLUMN_NOTE)
    if args.into:
        replace_between_markers(args.into, name, text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
