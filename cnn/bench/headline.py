"""``python -m cnn bench --headline``: the course in one picture and one table — every stage's training
step on every machine measured, beside PyTorch, read from the committed results files.

For one workload (LeNet-5, batch 64, unless told otherwise) and each machine that measured it (the
quiet bench files of ``cnn.bench.recorded``), a row's time is taken from the newest file that timed
it **back to back** — N steps one after the other and one wait at the end, as training runs them —
else from the newest that timed it **phase by phase** (a wait after every phase: it shows where the
time goes, and it takes from a stage built to run steps back to back, such as cuda-tuned's one CUDA
graph a step, what it gained). Every time carries which of the two it is, its machine, its date and
its file.

A ratio (× the previous stage, × PyTorch) compares like with like: two rows of ONE file, back to
back where both have it, else phase by phase, and says which; none when no file has both rows.

PREDICTED times (``recorded.predictions``: the H100 step of each stage whose code as it is now no GPU
has run, from ``benchmarks/results/predict-h100-sm90.json``) are drawn hatched and labelled so, with the
commit they predict; they sit beside a measurement, never in its place.
"""

from __future__ import annotations

from pathlib import Path

from cnn.bench import recorded
from cnn.bench.results import RESULTS_DIR
from cnn.formatting import fmt_factor, fmt_ms

HEADLINE_PICTURE = Path("docs/images/headline.png")
BACK_TO_BACK, PHASE_BY_PHASE, GRAPH, PREDICTED = "back to back", "phase by phase", "as one CUDA graph", "PREDICTED"
#: which PyTorch row a stage on each device is compared with
PYTORCH_OF_DEVICE = {"cpu": "torch-cpu", "cuda": "torch-cuda"}
PYTORCH_LABELS = {"torch-cpu": "PyTorch (CPU)", "torch-cuda": "PyTorch eager (GPU)"}
NETWORK_NAMES = {"lenet5": "LeNet-5", "alexnet-small": "AlexNet-small"}


def gpu_short_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100': the words after the vendor's, up to the first with a digit."""
    words = [word for word in name.split() if word not in ("NVIDIA", "GeForce", "Tesla")]
    short = []
    for word in words:
        short.append(word)
        if any(character.isdigit() for character in word):
            break
    return " ".join(short) or name


def machine_label(result: dict) -> str:
    """How the picture and the table name a results file's machine: '2-core CPU', 'H100 machine'."""
    machine = result["machine"]
    gpu = machine.get("gpu")
    return f"{gpu_short_name(gpu['name'])} machine" if gpu else f"{machine['cores']}-core CPU"


def where(result: dict, row: dict) -> str:
    """Where one row ran: the GPU itself, or a CPU (the GPU machine's host CPU named as such)."""
    machine = result["machine"]
    gpu = machine.get("gpu")
    if not gpu:
        return f"{machine['cores']}-core CPU"
    short = gpu_short_name(gpu["name"])
    return short if row["device"] == "cuda" else f"{short} machine's {machine['cores']}-core CPU"


def machines(model: str = "lenet5", batch: int = 64, out_dir=RESULTS_DIR) -> dict[str, list[tuple[Path, dict]]]:
    """{machine label: its quiet bench files of this workload, oldest first}, machines without a GPU first."""
    found: dict[str, list] = {}
    for path, result in recorded.quiet_bench_results(out_dir):
        if (result["config"]["model"], result["config"]["batch_size"]) == (model, batch):
            found.setdefault(machine_label(result), []).append((path, result))
    return dict(sorted(found.items(), key=lambda item: bool(item[1][0][1]["machine"].get("gpu"))))


def timings(row: dict) -> dict[str, float]:
    """{how: ms} of one row: back to back, phase by phase, and as one CUDA graph where measured."""
    found = {PHASE_BY_PHASE: row["step_ms"]["median"]}
    for key, how in (("back_to_back_ms", BACK_TO_BACK), ("graph_ms", GRAPH)):
        if row.get(key):
            found[how] = row[key]["median"]
    return found


def measured(files, name: str, how_wanted=(BACK_TO_BACK, PHASE_BY_PHASE)) -> dict | None:
    """The time shown for row ``name`` on one machine: the newest file with it in the first of
    ``how_wanted`` that any file has. {"name", "ms", "how", "where", "date", "path", "row"} or None."""
    for how in how_wanted:
        for path, result in reversed(files):
            row = recorded.row(result, name)
            if row is not None and how in timings(row):
                return {"name": name, "ms": timings(row)[how], "how": how, "where": where(result, row),
                        "date": result["created"][:10], "path": path, "row": row}
    return None


def like_for_like(files, slow: str, fast: str) -> tuple[float, str] | None:
    """(how many times faster ``fast`` is than ``slow``, how both were timed) from the newest file holding
    both rows, back to back where both have it there, else phase by phase; None when no file has both."""
    for path, result in reversed(files):
        rows = recorded.row(result, slow), recorded.row(result, fast)
        if None in rows:
            continue
        times = [timings(row) for row in rows]
        how = BACK_TO_BACK if all(BACK_TO_BACK in t for t in times) else PHASE_BY_PHASE
        return times[0][how] / times[1][how], how
    return None


def stage_order(files_by_machine) -> list[str]:
    """The stages measured on any machine, in course order (the registry's, then by stage number)."""
    from cnn.stages import stage_names

    numbers = {}
    for files in files_by_machine.values():
        for _, result in files:
            for row in result["stages"]:
                numbers[row["name"]] = row.get("number") or 99
    registry = stage_names()
    return sorted(numbers, key=lambda name: (registry.index(name) if name in registry else numbers[name], name))


def course_number(name: str) -> int | None:
    """A stage's number in the course (the registry's order, as the bench numbers its rows), None for others."""
    from cnn.stages import stage_names

    return stage_names().index(name) + 1 if name in stage_names() else None


def headline(model: str = "lenet5", batch: int = 64, out_dir=RESULTS_DIR) -> dict:
    """Everything the picture and the table show: {"model", "batch", "machines": [labels], "rows": [...]}.

    Each row: {"name", "label", "kind": "stage" | "reference", "cells": {machine: cell}} where a cell is
    ``measured``'s dict plus "vs_previous" and "vs_pytorch" (each (factor, how) or None), or a PREDICTED
    cell {"ms", "how": PREDICTED, "timing", "where", "date", "commit", "path"}.
    """
    files_by_machine = machines(model, batch, out_dir)
    stages = stage_order(files_by_machine)
    predicted = recorded.predictions(model, batch, out_dir)
    for entry in predicted:
        if entry["stage"] not in stages:
            stages.append(entry["stage"])
    rows = []
    for name in stages:
        cells = {}
        for label, files in files_by_machine.items():
            cell = measured(files, name)
            if cell is None:
                continue
            before = [other for other in stages[:stages.index(name)] if measured(files, other)]
            cell["vs_previous"] = like_for_like(files, before[-1], name) if before else None
            cell["previous"] = before[-1] if before else None
            cell["pytorch"] = PYTORCH_OF_DEVICE.get(cell["row"]["device"])
            cell["vs_pytorch"] = like_for_like(files, cell["pytorch"], name) if cell["pytorch"] else None
            cells[label] = cell
        for entry in predicted:
            if entry["stage"] == name:
                short = gpu_short_name(entry["device"])
                cells[f"{short} {PREDICTED}"] = {**entry, "how": PREDICTED, "where": short}
        number = next((cell["row"]["number"] for cell in cells.values() if cell.get("row")), None) or course_number(name)
        rows.append({"name": name, "number": number, "label": f"{number}. {name}" if number else name,
                     "kind": "stage", "cells": cells})
    for name in ("torch-cpu", "torch-cuda"):
        for how, label in ((BACK_TO_BACK, PYTORCH_LABELS[name]), (GRAPH, "PyTorch as one CUDA graph")):
            if how == GRAPH and name != "torch-cuda":
                continue
            wanted = (GRAPH,) if how == GRAPH else (BACK_TO_BACK, PHASE_BY_PHASE)
            cells = {machine: cell for machine, files in files_by_machine.items()
                     if (cell := measured(files, name, wanted))}
            if cells:
                rows.append({"name": name, "number": None, "label": label, "kind": "reference", "cells": cells})
    machine_labels = list(files_by_machine)
    machine_labels += [label for row in rows for label in row["cells"] if label not in machine_labels]
    return {"model": model, "batch": batch, "machines": list(dict.fromkeys(machine_labels)), "rows": rows}


# == the table =====================================================================================

MARKS = {BACK_TO_BACK: "", PHASE_BY_PHASE: " †", GRAPH: " ‡", PREDICTED: " PREDICTED"}


def time_cell(cell: dict | None) -> str:
    if cell is None:
        return "—"
    prefix = "~" if cell["how"] == PREDICTED else ""
    return f"{prefix}{fmt_ms(cell['ms'])}{MARKS[cell['how']]}"


def factor_cell(found) -> str:
    if not found:
        return "—"
    factor, how = found
    return f"{fmt_factor(factor) if factor >= 0.01 else f'{factor:.2g}×'}{MARKS[how]}"


def predicted_only(data: dict, label: str) -> bool:
    return all(row["cells"][label]["how"] == PREDICTED for row in data["rows"] if label in row["cells"])


def front_table(data: dict) -> str:
    """The Markdown table of ``headline``: a row per stage and PyTorch row, per machine the time of a step,
    × the previous stage and × PyTorch."""
    from cnn.bench.tables import markdown

    header = ["stage"]
    for label in data["machines"]:
        header += [f"{label}: ms a step"] + ([] if predicted_only(data, label) else ["× previous", "× PyTorch"])
    body = []
    for row in data["rows"]:
        line = [(f"{row['number'] or ''} `{row['name']}`".strip() if row["kind"] == "stage" else row["label"])]
        for label in data["machines"]:
            cell = row["cells"].get(label)
            line.append(time_cell(cell))
            if not predicted_only(data, label):
                line += [factor_cell(cell and cell.get("vs_previous")),
                         factor_cell(cell and row["kind"] == "stage" and cell.get("vs_pytorch"))]
        body.append(line)
    return markdown(header, body)


def table_notes(data: dict, link) -> list[str]:
    """What the marks mean, and every file the table reads (``link(path)`` makes a Markdown link)."""
    files = sorted({cell["path"] for row in data["rows"] for cell in row["cells"].values()}, key=str)
    notes = [f"Milliseconds a training step of {NETWORK_NAMES.get(data['model'], data['model'])} at batch "
             f"{data['batch']}, median. Unmarked: steps back to back, as training runs them (one wait at the end); "
             f"† phase by phase (a wait after every phase, which a stage made to run steps back to back pays for); "
             f"‡ PyTorch's step captured as one CUDA graph. × columns: how many times faster than the stage before it "
             f"on that machine and than PyTorch on the same device, two rows of one run compared like with like "
             f"(† when phase by phase). On the GPU machine the CPU stages ran on its host CPU."]
    if any(cell["how"] == PREDICTED for row in data["rows"] for cell in row["cells"].values()):
        commits = sorted({str(cell.get("commit")) for row in data["rows"] for cell in row["cells"].values()
                          if cell["how"] == PREDICTED})
        notes.append(f"PREDICTED: a step time computed from the kernels' machine code without running them on that "
                     f"GPU (`python -m cnn bench --predict`, commit {', '.join(commits)}; as one CUDA graph where the "
                     f"stage replays one), for the stages whose code as it is now that GPU has not run (another GPU may "
                     f"have: its column says); never a measurement.")
    notes.append("From " + ", ".join(link(path) for path in files) + ".")
    return notes


# == the command ===================================================================================

def draw(out_dir=RESULTS_DIR, save_to=HEADLINE_PICTURE, model: str = "lenet5", batch: int = 64):
    """The headline picture of ``headline(...)`` (``cnn.plots.headline_plot``), saved to ``save_to``."""
    from cnn import plots

    data = headline(model, batch, out_dir)
    if not data["rows"]:
        raise ValueError(f"no quiet bench results of {model} at batch {batch} in {out_dir}: nothing to draw")
    return plots.headline_plot(data, save_to=save_to)


def cmd_headline(args) -> int:
    out = Path(args.out or RESULTS_DIR)
    draw(out, HEADLINE_PICTURE, args.model, args.batch_size)
    print(f"{HEADLINE_PICTURE}: drawn from the quiet results files in {out}")
    for line in recorded.publication_lines(out):
        print(line)
    return 0
