"""The pictures of the course: speedups, time breakdowns, transfers, and a network learning.

Every function draws on a fresh ``matplotlib.figure.Figure`` (no pyplot state, PNGs rendered by
the Agg backend), saves it as a PNG to ``save_to`` (``results/NAME.png`` by default; ``None``
saves nothing) and returns the Figure, so a notebook can show it as it is.

Benchmark plots take the results dict of ``cnn.bench`` (or the path of its JSON file):

- ``headline_plot``   the course in one picture: every stage's step time on every machine, PyTorch beside
- ``speedup_plot``    speedup of every stage over the first one, log scale, annotated with the factor
- ``breakdown_plot``  where a training step's time goes (host→device, forward, backward, update,
                      device→host) and the step time itself
- ``compare_plot``    images/s of every stage on several machines side by side
- ``transfer_plot``   copy latency and bandwidth against size
- ``ablation_plot``   stage 7's fixes one at a time and added up (``--ablation`` results)

Learning pictures take the history dicts of ``cnn.train.train`` (or their JSON files):

- ``learning_curves``            loss and accuracy against steps and against seconds, one line per run
- ``digit_grid``                 test digits with the predicted label and confidence at several moments
- ``filters_and_feature_maps``   the first convolution's filters and what they make of one digit
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cnn.formatting import PHASE_LABELS, PHASES, compare_label, fmt_factor, fmt_ms
from cnn.machine import busy_note

PICTURES_DIR = Path("results")
PHASE_COLORS = {"load_batch": "#8c8c8c", "forward": "#4c72b0", "backward": "#dd8452",
                "update": "#55a868", "fetch_loss": "#c44e52"}
DEVICE_COLORS = {"cpu": "#4c72b0", "cuda": "#55a868"}
REFERENCE_COLOR = "#b0b0b0"
WRONG = "#d62728"
LINESTYLES = ("-", "--", ":", "-.")
_DEFAULT = object()


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(figure, save_to, default_name: str):
    """Save as PNG (Agg) unless ``save_to`` is None; return the figure."""
    path = PICTURES_DIR / default_name if save_to is _DEFAULT else save_to
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=120)
    return figure


def load(source) -> dict:
    """A dict as it is, or the JSON file it names."""
    if isinstance(source, dict):
        return source
    try:
        return json.loads(Path(source).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{source}: cannot read it as JSON ({err})") from None


def _rows(result: dict) -> list[dict]:
    return result["stages"] + result["references"]


def _row_label(row: dict) -> str:
    return f"{row['number']}. {row['name']}" if row.get("number") else f"{row['name']}\n(reference)"


def _subtitle(result: dict) -> str:
    machine, config = result["machine"], result["config"]
    gpu = machine.get("gpu")
    busy = busy_note(machine)
    return (f"{config['model']}, batch {config['batch_size']}, {config['dtype']}, {result['created'][:10]}\n"
            f"{machine['cpu']} ({machine['cores']} cores){', ' + gpu['name'] if gpu else ', no GPU'}"
            + (f"\n{busy.upper()}" if busy else ""))


# == benchmark =================================================================================

def _step_times(result: dict) -> tuple[str, dict]:
    """("back to back" or "phase by phase", {row name: ms}): back to back when every row was timed so,
    else phase by phase — one kind for every bar, never the two mixed."""
    rows = _rows(result)
    if all(row.get("back_to_back_ms") for row in rows):
        return "back to back", {row["name"]: row["back_to_back_ms"]["median"] for row in rows}
    return "phase by phase", {row["name"]: row["step_ms"]["median"] for row in rows}


def speedup_plot(result, save_to=_DEFAULT):
    """Bars of t(first stage) / t(stage) on a log scale, each annotated with its factor (and vs the previous).

    All bars are of one kind of time (``_step_times``): steps back to back when every row has that, else
    phase by phase, said on the axis. Where a stage and the one before it were also timed back to back,
    the bar says that factor too, labelled: a stage built to run steps back to back (cuda-tuned's CUDA
    graph) is slower phase by phase than the stage before it and faster back to back.
    """
    result = load(result)
    rows = _rows(result)
    how, times = _step_times(result)
    first = result["stages"][0]["name"]
    factors = [times[first] / times[row["name"]] for row in rows]
    figure = _figure(max(6.0, 1.3 * len(rows) + 2), 4.8)
    axes = figure.add_subplot()
    colors = [DEVICE_COLORS.get(row["device"], "#4c72b0") if row["kind"] == "stage" else REFERENCE_COLOR
              for row in rows]
    bars = axes.bar(range(len(rows)), factors, color=colors, edgecolor="black", linewidth=0.6)
    previous = {row["name"]: before for before, row in zip(result["stages"], result["stages"][1:])}
    for bar, row, factor in zip(bars, rows, factors):
        if row["kind"] == "reference":
            bar.set_hatch("//")
        note = fmt_factor(factor, times_first=True)
        before = previous.get(row["name"]) if row["kind"] == "stage" else None
        if before is not None:
            note += f"\n({fmt_factor(times[before['name']] / times[row['name']], times_first=True)} vs previous)"
            if how == "phase by phase" and before.get("back_to_back_ms") and row.get("back_to_back_ms"):
                factor_b2b = before["back_to_back_ms"]["median"] / row["back_to_back_ms"]["median"]
                note += f"\nback to back: {fmt_factor(factor_b2b, times_first=True)}"
        if row.get("limited_by_budget"):
            note += f"\n{row['timed_steps']} steps timed"
        axes.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 3),
                      textcoords="offset points", ha="center", va="bottom", fontsize=8.5)
    axes.set_yscale("log")
    axes.set_ylim(min(min(factors) / 2, 0.5), max(factors) * 12)
    axes.axhline(1.0, color="black", linewidth=0.6)
    axes.set_xticks(range(len(rows)), [_row_label(row) for row in rows], fontsize=9)
    axes.set_ylabel(f"training-step speedup over stage {first}\n(log; steps timed {how})")
    axes.set_title(f"How much faster each stage trains than stage {first} (steps timed {how})\n{_subtitle(result)}",
                   fontsize=10)
    axes.grid(axis="y", which="major", alpha=0.3)
    return _save(figure, save_to, "speedup.png")


def breakdown_plot(result, save_to=_DEFAULT):
    """Left: each phase's share of a training step. Right: the step time (median, bar = interquartile range)."""
    result = load(result)
    rows = _rows(result)[::-1]                       # first stage at the top
    figure = _figure(11, 1.7 + 0.55 * len(rows))
    share_axes, time_axes = figure.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    positions = np.arange(len(rows))
    left = np.zeros(len(rows))
    for phase in PHASES:
        shares = np.array([row["phases_ms"][phase]["median"] / sum(row["phases_ms"][p]["median"] for p in PHASES)
                           for row in rows])
        share_axes.barh(positions, 100 * shares, left=left, color=PHASE_COLORS[phase], label=PHASE_LABELS[phase])
        left += 100 * shares
    share_axes.set_xlim(0, 100)
    share_axes.set_xlabel("share of the training step (%)")
    share_axes.set_yticks(positions, [_row_label(row).replace("\n", " ") for row in rows])
    share_axes.legend(ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, frameon=False)
    medians = np.array([row["step_ms"]["median"] for row in rows])
    spread = np.array([[r["step_ms"]["median"] - r["step_ms"]["q1"], r["step_ms"]["q3"] - r["step_ms"]["median"]]
                       for r in rows]).T
    time_axes.barh(positions, medians, xerr=spread, color=[REFERENCE_COLOR if r["kind"] == "reference" else
                                                          DEVICE_COLORS.get(r["device"], "#4c72b0") for r in rows])
    for position, median, row in zip(positions, medians, rows):
        time_axes.annotate(f"{fmt_ms(median)} ms", (row["step_ms"]["q3"], position), xytext=(5, 0),
                           textcoords="offset points", va="center", fontsize=8.5)
    lowest, marked_any = medians.min(), False
    for key, marker, label in (("back_to_back_ms", "D", "back to back (one wait at the end)"),
                               ("graph_ms", "^", "as one CUDA graph")):
        marked = [(position, row[key]["median"]) for position, row in zip(positions, rows) if row.get(key)]
        if marked:
            time_axes.scatter([ms for _, ms in marked], [position for position, _ in marked], marker=marker,
                              color="black", s=22, zorder=3, label=label)
            lowest, marked_any = min(lowest, *(ms for _, ms in marked)), True
    if marked_any:
        time_axes.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, frameon=False)
    time_axes.set_xscale("log")
    time_axes.set_xlim(lowest / 2, medians.max() * 12)
    time_axes.set_xlabel("ms per training step (log; bars: phase by phase)")
    figure.suptitle(f"Where a training step's time goes\n{_subtitle(result)}", fontsize=10)
    return _save(figure, save_to, "breakdown.png")


def compare_plot(results, save_to=_DEFAULT):
    """images/s of every stage (rows) on every machine (one bar colour per results file), log scale."""
    results = [load(result) for result in results]
    names = []
    for result in results:
        names += [row["name"] for row in _rows(result) if row["name"] not in names]
    figure = _figure(9, 1.2 + 0.45 * len(names) * len(results))
    axes = figure.add_subplot()
    height = 0.8 / len(results)
    colors = ("#4c72b0", "#55a868", "#dd8452", "#8172b2", "#c44e52", "#937860")
    for index, result in enumerate(results):
        by_name = {row["name"]: row["images_per_s"] for row in _rows(result)}
        positions = [n + index * height for n, name in enumerate(names) if name in by_name]
        values = [by_name[name] for name in names if name in by_name]
        bars = axes.barh(positions, values, height=height, color=colors[index % len(colors)],
                         label=compare_label(result))
        axes.bar_label(bars, [f"{v:,.0f}" if v >= 10 else f"{v:.2f}" for v in values], padding=3, fontsize=8)
    axes.set_yticks([n + 0.4 - height / 2 for n in range(len(names))], names)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlim(right=axes.get_xlim()[1] * 3)
    axes.set_xlabel("training images per second (log; steps timed phase by phase)")
    axes.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=min(2, len(results)), frameon=False)
    model = results[0]["config"]
    figure.suptitle(f"The stages on {len(results)} machines: {model['model']}, batch {model['batch_size']}",
                    fontsize=10)
    return _save(figure, save_to, "compare.png")


def ablation_plot(result, save_to=_DEFAULT):
    """Stage 7's ablation (``python -m cnn bench --ablation``): ms a step of every variant, each fix alone
    (against the fixes it needs) and the fixes added one by one, annotated with what the fix bought."""
    result = load(result)
    rows = result["rows"][::-1]                      # cuda-ring at the top
    figure = _figure(10, 1.4 + 0.32 * len(rows))
    axes = figure.add_subplot()
    positions = np.arange(len(rows))
    colors = ["#8c8c8c" if row["variant"] == "cuda-ring" else "#4c72b0" if "alone" in row["variant"]
              else "#55a868" for row in rows]
    bars = axes.barh(positions, [row["median_ms"] for row in rows], color=colors)
    axes.bar_label(bars, [f"{fmt_ms(row['median_ms'])} ms  {fmt_factor(row['speedup_vs_baseline'], True)}"
                          for row in rows], padding=3, fontsize=8)
    labels = [row["variant"] if not row["variant"].startswith("cumulative") else
              "all up to " + row["fixes"][-1] if row["fixes"] else row["variant"] for row in rows]
    axes.set_yticks(positions, labels, fontsize=8)
    axes.set_xlim(0, max(row["median_ms"] for row in rows) * 1.35)
    axes.set_xlabel("ms per training step, steps back to back as the trainer runs them "
                    "(×: against the same stage without that fix)")
    gpu = (result.get("machine") or {}).get("gpu") or {}
    axes.set_title(f"Stage 7's fixes, one at a time (blue) and added up (green): {result['model']}, batch "
                   f"{result['batch_size']}\n{gpu.get('name', 'no GPU')}, {result.get('created', '')[:10]}",
                   fontsize=10)
    return _save(figure, save_to, "ablation.png")


HEADLINE_COLORS = {"cpu machine": "#4c72b0", "gpu": "#55a868", "gpu host": "#a3c9a8"}


def _headline_color(cell: dict) -> str:
    where = cell["where"]
    if "machine's" in where:
        return HEADLINE_COLORS["gpu host"]
    return HEADLINE_COLORS["cpu machine"] if where.endswith("CPU") else HEADLINE_COLORS["gpu"]


def headline_plot(data: dict, save_to=_DEFAULT):
    """The course in one picture: ms a training step of every stage on every machine, PyTorch beside them.

    ``data`` is ``cnn.bench.headline.headline()``: rows (stages in course order, then PyTorch), each with a
    cell per machine {"ms", "how", "where", "date"}. One horizontal bar per cell, log scale, each labelled
    with its time, where it ran, its date and how it was timed (back to back, phase by phase, as one CUDA
    graph) — so a phase-by-phase bar is never read as a back-to-back one. PREDICTED cells are hatched,
    unfilled and labelled PREDICTED.
    """
    from matplotlib.patches import Patch

    bars = [(row, label, cell) for row in data["rows"] for label, cell in row["cells"].items()]
    figure = _figure(12, 1.6 + 0.34 * len(bars) + 0.12 * len(data["rows"]))
    axes = figure.add_subplot()
    position, positions, ticks = 0.0, [], []
    for index, row in enumerate(data["rows"]):
        count = len(row["cells"])
        ticks.append((position + (count - 1) / 2, row["label"] if row["kind"] == "stage" else row["label"]))
        positions += [position + k for k in range(count)]
        position += count + 0.7
    for y, (row, label, cell) in zip(positions, bars):
        predicted = cell["how"] == "PREDICTED"
        color = _headline_color(cell)
        axes.barh(y, cell["ms"], height=0.8, color="white" if predicted else color,
                  edgecolor=color if predicted else "black", hatch="///" if predicted else None,
                  linewidth=1.2 if predicted else 0.5)
        text = (f"~{fmt_ms(cell['ms'])} ms  PREDICTED for the {cell['where']} at commit {cell.get('commit')} "
                f"({cell['date']}), {cell.get('timing', 'back to back')}" if predicted else
                f"{fmt_ms(cell['ms'])} ms  {cell['where']}, {cell['date']}, {cell['how']}")
        axes.annotate(text, (cell["ms"], y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8,
                      fontweight="bold" if predicted else None)
    times = [cell["ms"] for _, _, cell in bars]
    axes.set_xscale("log")
    axes.set_xlim(min(times) / 2, max(times) * 400)
    axes.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=9)
    axes.set_ylim(position - 0.5, -0.7)
    axes.set_xlabel("ms per training step (log scale; shorter is faster)")
    axes.grid(axis="x", which="major", alpha=0.3)
    legend = [Patch(facecolor=HEADLINE_COLORS["cpu machine"], edgecolor="black", label="a CPU without a GPU"),
              Patch(facecolor=HEADLINE_COLORS["gpu"], edgecolor="black", label="on the GPU"),
              Patch(facecolor=HEADLINE_COLORS["gpu host"], edgecolor="black", label="the GPU machine's host CPU")]
    if any(cell["how"] == "PREDICTED" for _, _, cell in bars):
        legend.append(Patch(facecolor="white", edgecolor=HEADLINE_COLORS["gpu"], hatch="///",
                            label="PREDICTED, not measured"))
    axes.legend(handles=legend, fontsize=8, loc="lower right")
    network = {"lenet5": "LeNet-5", "alexnet-small": "AlexNet-small"}.get(data["model"], data["model"])
    axes.set_title(f"One training step of {network} (batch {data['batch']}), stage by stage, on each machine\n"
                   f"back to back = steps run as training runs them (one wait at the end); phase by phase = a wait "
                   f"after every phase", fontsize=10)
    return _save(figure, save_to, "headline.png")


def _bytes_label(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def transfer_plot(result, save_to=_DEFAULT):
    """Latency and bandwidth of one copy against its size, one line per kind of copy."""
    result = load(result)
    figure = _figure(11, 4.2)
    latency_axes, bandwidth_axes = figure.subplots(1, 2)
    for index, (name, curve) in enumerate(result["curves"].items()):
        sizes = [point["bytes"] for point in curve]
        style = dict(marker="o", markersize=3, linestyle=LINESTYLES[index % len(LINESTYLES)], label=name)
        latency_axes.plot(sizes, [point["latency_ms"]["median"] * 1e3 for point in curve], **style)
        bandwidth_axes.plot(sizes, [point["gb_per_s"] for point in curve], **style)
    from matplotlib.ticker import FuncFormatter

    for axes in (latency_axes, bandwidth_axes):
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_formatter(FuncFormatter(lambda size, _: _bytes_label(size)))
        axes.set_xlabel("bytes per copy")
        axes.grid(alpha=0.3, which="both")
    latency_axes.set_yscale("log")
    latency_axes.set_ylabel("time per copy (µs, log)")
    bandwidth_axes.set_ylabel("bandwidth (GB/s)")
    bandwidth_axes.legend(fontsize=8)
    machine = result["machine"]
    where = machine["gpu"]["name"] if machine.get("gpu") else f"{machine['cpu']}, no GPU: host memcpy as the analogue"
    figure.suptitle(f"Copy latency and bandwidth against size — {where}", fontsize=10)
    return _save(figure, save_to, "transfers.png")


# == a network learning ========================================================================

def moving_average(values, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each point (fewer at the start)."""
    values = np.asarray(values, dtype=np.float64)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


def learning_curves(histories: dict, save_to=_DEFAULT, title: str | None = None):
    """Training loss and test accuracy against steps and against training seconds, one line style per run.

    ``histories`` maps a label (the stage) to a history dict from ``cnn.train.train`` or its JSON file.
    The loss is drawn raw (faint) and as a moving average; accuracy comes from "evals" (a test subset
    every eval_every steps) and "epochs" (the whole test set, large dots).
    """
    histories = {label: load(history) for label, history in histories.items()}
    figure = _figure(11, 7.5)
    (loss_steps, loss_seconds), (acc_steps, acc_seconds) = figure.subplots(2, 2)
    for index, (label, history) in enumerate(histories.items()):
        color, style = f"C{index}", LINESTYLES[index % len(LINESTYLES)]
        steps = np.array(history["steps"], dtype=np.float64).reshape(-1, 4)
        smooth = moving_average(steps[:, 1], max(1, len(steps) // 25))
        for axes, x in ((loss_steps, steps[:, 0]), (loss_seconds, steps[:, 3])):
            axes.plot(x, steps[:, 1], color=color, alpha=0.2, linewidth=0.6)
            axes.plot(x, smooth, color=color, linestyle=style, linewidth=1.6, label=label)
        evals = np.array(history.get("evals", []), dtype=np.float64).reshape(-1, 4)
        epochs = history.get("epochs", [])
        for axes, column, key in ((acc_steps, 0, "step"), (acc_seconds, 3, "train_seconds")):
            axes.plot(evals[:, column], 100 * evals[:, 1], color=color, linestyle=style, marker=".", label=label)
            axes.plot([e[key] for e in epochs], [100 * e["test_accuracy"] for e in epochs], "o", color=color,
                      markersize=7, markeredgecolor="black")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    some = FuncFormatter(lambda value, _: f"{value:g}" if f"{value:e}"[0] in "25" else "")
    for axes in (loss_steps, loss_seconds):
        axes.set_yscale("log")
        axes.yaxis.set_major_formatter(plain)
        axes.yaxis.set_minor_formatter(some)
        axes.set_ylabel("training loss (log; line = moving average)")
    for axes in (acc_steps, acc_seconds):
        axes.set_ylabel("test accuracy (%)  (dots: whole test set)")
    for axes in (loss_steps, acc_steps):
        axes.set_xlabel("training step")
    for axes in (loss_seconds, acc_seconds):
        axes.set_xlabel("seconds of training")
    for axes in (loss_steps, loss_seconds, acc_steps, acc_seconds):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title or "Learning curves", fontsize=11)
    return _save(figure, save_to, "learning-curves.png")


def _displayable(image: np.ndarray) -> tuple[np.ndarray, str | None]:
    """(H, W) for one channel (a grey colormap), (H, W, 3) scaled to [0, 1] for three."""
    image = np.asarray(image, dtype=np.float64)
    if image.ndim == 3 and image.shape[0] == 1:
        return image[0], "gray"
    if image.ndim == 3 and image.shape[0] == 3:
        rgb = image.transpose(1, 2, 0)
        return (rgb - rgb.min()) / max(np.ptp(rgb), 1e-12), None
    return image, "gray"


def digit_grid(images, labels, snapshots, save_to=_DEFAULT, class_names=None, title: str | None = None):
    """One row per moment of training, one column per test image: the predicted class and its probability.

    ``snapshots`` = [(row title, probabilities (N, classes)), ...]. A wrong prediction gets a red frame
    and a red title that also names the true class.
    """
    labels = np.asarray(labels)
    names = class_names or [str(k) for k in range(max(10, int(labels.max()) + 1))]
    figure = _figure(1.05 * len(images) + 1.6, 1.45 * len(snapshots) + 0.7)
    grid = figure.subplots(len(snapshots), len(images), squeeze=False)
    for row, (row_title, probabilities) in zip(grid, snapshots):
        predicted = np.argmax(probabilities, axis=1)
        right = int((predicted == labels).sum())
        for column, (axes, image) in enumerate(zip(row, images)):
            picture, cmap = _displayable(image)
            axes.imshow(picture, cmap=cmap)
            axes.set_xticks([])
            axes.set_yticks([])
            guess, truth = predicted[column], labels[column]
            confidence = probabilities[column, guess]
            wrong = guess != truth
            text = f"{names[guess]} ({confidence:.0%})" + (f"\nis {names[truth]}" if wrong else "")
            axes.set_title(text, fontsize=9, color=WRONG if wrong else "black", fontweight="bold" if wrong else None)
            for spine in axes.spines.values():
                spine.set_edgecolor(WRONG if wrong else "#999999")
                spine.set_linewidth(3 if wrong else 0.5)
        row[0].set_ylabel(f"{row_title}\n{right}/{len(images)} right", fontsize=9, rotation=0, ha="right", va="center")
    figure.suptitle(title or "Predictions as the network learns (red: wrong)", fontsize=11)
    return _save(figure, save_to, "digits-learning.png")


def first_conv_layer(net):
    """(index, layer) of the network's first convolution."""
    from cnn.model import Conv

    for index, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            return index, layer
    raise ValueError(f"network {net.name!r} has no convolution to draw")


def filters_and_feature_maps(net, params, image, save_to=_DEFAULT, per_row: int = 8):
    """The first convolution's filters (top rows) and the maps they make of ``image`` after ReLU (bottom rows).

    map_f = max(0, b_f + Σ_c W_f,c ⋆ image_c)  — computed with stage numpy's ``conv_forward``.
    Filters share one diverging colour scale (red +, blue −), maps one sequential scale.
    """
    from cnn.model import param_views
    from cnn.stages.s2_numpy import conv_forward, relu_forward

    index, layer = first_conv_layer(net)
    weights, bias = (param_views(net, np.asarray(params))[index][key] for key in ("W", "b"))
    image = np.asarray(image, dtype=weights.dtype)
    maps = relu_forward(conv_forward(image[None], weights, bias, layer.stride, layer.pad))[0]
    count = weights.shape[0]
    columns, rows_each = min(count, per_row), -(-count // per_row)
    figure = _figure(1.3 * columns + 2.4, 2.6 * rows_each + 0.8)
    grid = figure.add_gridspec(2 * rows_each, columns + 1)
    digit_axes = figure.add_subplot(grid[:, 0])
    picture, cmap = _displayable(image)
    digit_axes.imshow(picture, cmap=cmap)
    digit_axes.set_title("input", fontsize=9)
    digit_axes.axis("off")
    limit = float(np.abs(weights).max())
    shown = weights.mean(axis=1) if weights.shape[1] != 3 else weights
    for f in range(count):
        row, column = divmod(f, per_row)
        top = figure.add_subplot(grid[row, column + 1])
        if shown.ndim == 4:     # RGB filters: each scaled to [0, 1]
            top.imshow(_displayable(shown[f])[0])
        else:
            top.imshow(shown[f], cmap="RdBu_r", vmin=-limit, vmax=limit)
        top.set_title(f"filter {f + 1}", fontsize=8)
        top.axis("off")
        bottom = figure.add_subplot(grid[rows_each + row, column + 1])
        bottom.imshow(maps[f], cmap="magma", vmin=0, vmax=max(float(maps.max()), 1e-12))
        bottom.set_title(f"map {f + 1}", fontsize=8)
        bottom.axis("off")
    figure.suptitle(f"{net.name}: the {count} filters of the first convolution ({layer.kernel}×{layer.kernel}; "
                    f"red positive, blue negative weights)\nand the feature maps they make of one digit (after ReLU; "
                    f"bright = strong response)", fontsize=10)
    return _save(figure, save_to, "filters.png")
