"""The results of a stage benchmark as Markdown: the table, the notes a reader needs under it, machines side by side.

Every table is laid out by ``cnn.formatting.markdown`` (tabulate); this module decides what goes in the cells.
"""

from __future__ import annotations

from cnn.formatting import PHASE_LABELS, PHASES, compare_label, fmt_factor, fmt_mib, fmt_ms, markdown, spread
from cnn.machine import busy_note


def table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the results table (stages, then references)."""
    rows, refs = result["stages"], result["references"]
    first = rows[0]["name"] if rows else "first"
    device_memory = any(row.get("device_bytes") is not None for row in rows + refs)
    graphs = any(row.get("graph_ms") for row in refs)
    header = ["#", "stage", "step ms (median, IQR/2)", *(PHASE_LABELS[p] for p in PHASES), "back to back ms",
              *(["as one CUDA graph ms"] if graphs else []), "images/s",
              "× previous", f"× {first}", *(f"× {ref['name']}" for ref in refs), "launches/step",
              "peak RSS MiB", *(["device MiB"] if device_memory else []), "timed steps"]
    cells = []
    for row in rows + refs:
        cells.append([
            str(row["number"]) if row.get("number") else "ref",
            row["name"] if row["kind"] == "stage" else f"{row['name']} (reference)",
            f"{fmt_ms(row['step_ms']['median'])} {spread(row['step_ms'])}",
            *(fmt_ms(row["phases_ms"][phase]["median"]) for phase in PHASES),
            fmt_ms(row["back_to_back_ms"]["median"]) if row.get("back_to_back_ms") else "—",
            *([fmt_ms(row["graph_ms"]["median"]) if row.get("graph_ms") else "—"] if graphs else []),
            f"{row['images_per_s']:,.0f}" if row["images_per_s"] >= 10 else f"{row['images_per_s']:.2f}",
            fmt_factor(row.get("speedup_vs_previous")), fmt_factor(row.get("speedup_vs_first")),
            *(fmt_factor(row["ratio_to_reference"].get(ref["name"])) for ref in refs),
            "—" if row.get("launches_per_step") is None else str(row["launches_per_step"]),
            fmt_mib(row.get("peak_host_rss_bytes")),
            *([fmt_mib(row.get("device_bytes"))] if device_memory else []),
            f"{row['timed_steps']}" + ("*" if row["limited_by_budget"] else "")])
    return header, cells


def machine_line(result: dict) -> str:
    machine, config = result["machine"], result["config"]
    gpu = machine.get("gpu")
    packages = ", ".join(f"{name} {version}" for name, version in machine.get("packages", {}).items())
    return (f"{machine['cpu']} ({machine['cores']} cores), GPU: {gpu['name'] if gpu else 'none'}; "
            f"{config['model']}, batch {config['batch_size']}, {config['dtype']}, "
            f"data: {config['data'].split(' (')[0]}; "
            f"{result['created'][:10]}; {packages}")


def markdown_table(result: dict) -> str:
    """The results table in Markdown, with the notes a reader needs under it."""
    return "\n".join([markdown(*table_rows(result)), ""] + [f"- {note}" for note in table_notes(result)])


def table_notes(result: dict) -> list[str]:
    config = result["config"]
    notes = [f"Measured on {machine_line(result)}.",
             f"Times per training step in ms (median of the timed steps; CUDA stages by CUDA events, CPU stages "
             f"by perf_counter, with synchronize() around every phase). Back to back: ms a step of N steps run as "
             f"training runs them (the stage's run_steps; PyTorch without .item()), one synchronize() at the end. "
             f"× columns: how many times faster than "
             f"that row (above 1 = faster). Peak RSS: the process's resident-memory high-water mark while the "
             f"stage ran (interpreter, libraries and data included). Command: `{result['command']}`."]
    busy = busy_note(result["machine"])
    if busy:
        notes.append(f"The machine was {busy} (other work shared its cores as the measurement began).")
    for row in result["stages"] + result["references"]:
        if row["limited_by_budget"]:
            notes.append(f"\\* {row['name']}: only {row['timed_steps']} of {row['requested_steps']} steps timed "
                         f"({row['warmup_steps']} warm-up): a step takes {fmt_ms(row['step_ms']['median'])} ms, "
                         f"and the budget is {config['budget_s']:g} s per stage.")
        if row["first_step_ms"] > 10 * row["step_ms"]["median"] + 100:
            notes.append(f"{row['name']}: the first (untimed) step took {row['first_step_ms'] / 1e3:,.1f} s "
                         f"(JIT compilation, allocations).")
    for entry in result["skipped"]:
        notes.append(f"Skipped {entry['name']}: {entry['reason']}")
    for entry in result["failed"]:
        notes.append(f"FAILED {entry['name']}: {entry['reason']}")
    return notes


def compare_table(results: list[dict]) -> str:
    """images/s of every stage (rows) on every machine (columns)."""
    names = []
    for result in results:
        for row in result["stages"] + result["references"]:
            if row["name"] not in names:
                names.append(row["name"])
    header = ["stage", *(f"images/s, {compare_label(r)}" for r in results)]
    cells = []
    for name in names:
        line = [name]
        for result in results:
            row = next((r for r in result["stages"] + result["references"] if r["name"] == name), None)
            line.append("—" if row is None else f"{row['images_per_s']:,.1f}")
        cells.append(line)
    return markdown(header, cells)


def ablation_table(columns: list[tuple[str, dict]]) -> str:
    """Stage 7's ablation, one column per (label, ablation result): ms a step, × against the same stage
    without that fix, launches a step; rows in the order of the result with the most variants."""
    variants = max((result["rows"] for _, result in columns), key=len)
    header = ["variant", *(f"{label}: ms a step (× what the fix bought), launches" for label, _ in columns)]
    cells = []
    for variant in (row["variant"] for row in variants):
        line = [variant.replace("cumulative: ", "all of: ") if len(variant) < 60 else
                "all of: …, " + ", ".join(variant.split(" + ")[-2:])]
        for _, result in columns:
            row = next((r for r in result["rows"] if r["variant"] == variant), None)
            line.append("—" if row is None else f"{fmt_ms(row['median_ms'])} ({fmt_factor(row['speedup_vs_baseline'])}), "
                                                f"{row.get('launches_per_step', '—')}")
        cells.append(line)
    return markdown(header, cells)


def kernel_table(profile: dict) -> str:
    """A ``cnn.bench.nsight.kernel_summary`` as Markdown: a row a kernel, the most expensive first."""
    header = ["kernel", "what it computes", "launches a step", "µs a step", "share", "SM throughput, % of peak",
              "grid × block"]
    cells = []
    for row in sorted(profile["kernels"], key=lambda kernel: -kernel["us"]):
        low, high = row["sm_percent"] or (None, None)
        sm = "—" if low is None else (f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}–{high:.0f}")
        cells.append([f"`{row['kernel']}`", row["role"], f"{row['launches']:g}", f"{row['us']:,.1f}",
                      f"{100 * row['share']:.1f} %", sm, f"{row['grid']} × {row['block']}"])
    cells.append(["**all**", "", f"{sum(row['launches'] for row in profile['kernels']):g}",
                  f"**{profile['total_us']:,.1f}**", "100 %", "", ""])
    return markdown(header, cells)


def back_to_back_table(columns: list[tuple[str, dict]]) -> str:
    """Per (label, bench result): every row's step phase by phase, back to back, and as one CUDA graph (ms)."""
    names = []
    for _, result in columns:
        names += [row["name"] for row in result["stages"] + result["references"] if row["name"] not in names]
    header = ["stage", *(f"{label}: {kind}" for label, _ in columns
                         for kind in ("phase by phase", "back to back", "as one CUDA graph"))]
    cells = []
    for name in names:
        line = [name]
        for _, result in columns:
            row = next((r for r in result["stages"] + result["references"] if r["name"] == name), None)
            for key in ("step_ms", "back_to_back_ms", "graph_ms"):
                line.append(fmt_ms(row[key]["median"]) if row and row.get(key) else "—")
        cells.append(line)
    return markdown(header, cells)
