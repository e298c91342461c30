"""Runs already written, side by side: machines (``--compare A.json B.json``) and learning curves (``--curves``).

``--compare`` prints images/s of every stage on every machine and draws the same as bars;
``--curves`` draws the loss and accuracy of several training histories (``python -m cnn train``
writes them) in one picture, each labelled by its stage.
"""

from __future__ import annotations

from pathlib import Path

from cnn.bench.results import load_results, results_stem
from cnn.bench.tables import compare_table


def cmd_compare(args) -> int:
    """images/s of every stage on every machine: a Markdown table, and a picture unless --no-plots."""
    from cnn import plots as pictures

    results = [load_results(path) for path in args.compare]
    stages = [r for r in results if r["kind"] == "stages"]
    if len(stages) != len(results):
        raise ValueError("--compare takes stage benchmark files (bench-*.json), not memory or other results")
    print(compare_table(results))
    if args.plots:
        labels = "_vs_".join(results_stem("", r["machine"], r["created"]).strip("-") for r in results)
        path = Path(args.out) / f"compare-{labels}.png"[:200]
        pictures.compare_plot(results, save_to=path)
        print(f"plot: {path}")
    return 0


def cmd_curves(args) -> int:
    """Learning curves of the given training histories, labelled by their stage, in one picture."""
    from cnn import plots as pictures

    histories = {}
    for path in args.curves:
        history = pictures.load(path)
        if "steps" not in history:
            raise ValueError(f"{path}: not a training history (no \"steps\"); python -m cnn train writes them")
        label = history.get("config", {}).get("stage") or Path(path).stem
        histories[label if label not in histories else f"{label} ({Path(path).stem})"] = history
    path = Path(args.pictures_dir) / "learning-curves.png"
    pictures.learning_curves(histories, save_to=path)
    print(f"plot: {path}")
    return 0
