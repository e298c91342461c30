"""The pictures: each function writes a non-empty PNG and returns its Figure, and what it draws is right
(speedup factors — never a phase-by-phase time against a back-to-back one —, the red frames of wrong
predictions, feature maps equal to stage loops' convolution, a busy machine said on the plot).
~6 s on 2 cores.
"""

import json

import numpy as np
import pytest

from cnn import plots
from cnn.bench import PHASES
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU, init_params
from cnn.stages import get_stage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, f"{path} is not a non-empty PNG"


def fake_row(name, number, median, kind="stage", first=1000.0, previous=None):
    stats = {"median": median, "q1": 0.9 * median, "q3": 1.1 * median, "min": 0.8 * median, "max": 1.2 * median, "n": 5}
    shares = dict(zip(PHASES, (0.05, 0.3, 0.5, 0.1, 0.05)))
    return {"name": name, "number": number, "kind": kind, "device": "cpu", "step_ms": stats,
            "phases_ms": {phase: {**stats, "median": share * median} for phase, share in shares.items()},
            "images_per_s": 64e3 / median, "speedup_vs_first": first / median,
            "speedup_vs_previous": previous / median if previous else None,
            "limited_by_budget": number == 1, "timed_steps": 3 if number == 1 else 20}


def fake_result(created="2025-01-01T10:00:00", gpu=None):
    return {"created": created, "kind": "stages",
            "machine": {"cpu": "Test CPU", "cores": 2, "gpu": gpu, "packages": {}},
            "config": {"model": "lenet5", "batch_size": 64, "dtype": "float32"},
            "stages": [fake_row("loops", 1, 1000.0), fake_row("numpy", 2, 10.0, previous=1000.0),
                       fake_row("numba-cpu", 3, 4.0, previous=10.0)],
            "references": [fake_row("torch-cpu", None, 5.0, kind="reference")]}


def texts(figure):
    return [text.get_text() for axes in figure.axes for text in axes.texts]


def test_speedup_plot_annotates_each_factor(tmp_path):
    figure = plots.speedup_plot(fake_result(), save_to=tmp_path / "speedup.png")
    assert_png(tmp_path / "speedup.png")
    notes = texts(figure)
    assert any(note.startswith("×100\n(×100 vs previous)") for note in notes)
    assert any(note.startswith("×250\n(×2.50 vs previous)") for note in notes)
    assert figure.axes[0].get_yscale() == "log"


def with_back_to_back(row, ms):
    row["back_to_back_ms"] = {"median": ms}
    return row


def test_speedup_plot_compares_back_to_back_times_when_every_row_has_them():
    """A stage built for back-to-back steps (a CUDA graph) is slow phase by phase: 9.44 ms against 2.95,
    but 1.01 against 3.16 back to back. Every row has both: the bars are back to back, and say so."""
    result = fake_result()
    result["stages"] = [with_back_to_back(fake_row("cuda-ring", 6, 2.95), 3.16),
                        with_back_to_back(fake_row("cuda-tuned", 7, 9.44, previous=2.95), 1.01)]
    result["references"] = [with_back_to_back(fake_row("torch-cuda", None, 2.69, kind="reference"), 2.38)]
    figure = plots.speedup_plot(result, save_to=None)
    assert any(note.startswith("×3.13\n(×3.13 vs previous)") for note in texts(figure))
    assert not any("0.31" in note for note in texts(figure))
    assert "back to back" in figure.axes[0].get_ylabel() and "back to back" in figure.axes[0].get_title()


def test_speedup_plot_of_mixed_rows_is_phase_by_phase_and_says_the_back_to_back_factor_apart():
    result = fake_result()
    result["stages"][1] = with_back_to_back(result["stages"][1], 8.0)
    result["stages"][2] = with_back_to_back(result["stages"][2], 2.0)       # loops has no back-to-back time
    figure = plots.speedup_plot(result, save_to=None)
    assert any(note.startswith("×250\n(×2.50 vs previous)\nback to back: ×4.00") for note in texts(figure))
    assert "phase by phase" in figure.axes[0].get_ylabel()


def test_a_busy_machine_is_said_on_the_plot():
    result = fake_result()
    result["machine"]["load_average"] = [23.0, 20.0, 18.0]
    assert "BUSY: 1-MINUTE LOAD 23.0 ON 2 CORES, TIMES INFLATED" in plots.speedup_plot(result, save_to=None).axes[0].get_title()
    result["machine"]["load_average"] = [0.4, 0.5, 0.5]
    assert "BUSY" not in plots.speedup_plot(result, save_to=None).axes[0].get_title()


def test_headline_plot_labels_every_bar_with_machine_date_and_how(tmp_path):
    cells = {"2-core CPU": {"ms": 6.0, "how": "phase by phase", "where": "2-core CPU", "date": "2026-01-01"},
             "H100 machine": {"ms": 1.0, "how": "back to back", "where": "H100", "date": "2026-01-02"}}
    data = {"model": "lenet5", "batch": 64, "machines": list(cells),
            "rows": [{"name": "numba-cpu", "label": "3. numba-cpu", "kind": "stage", "cells": dict(cells)}]}
    figure = plots.headline_plot(data, save_to=tmp_path / "headline.png")
    assert_png(tmp_path / "headline.png")
    assert set(texts(figure)) == {"6.00 ms  2-core CPU, 2026-01-01, phase by phase",
                                  "1.00 ms  H100, 2026-01-02, back to back"}
    assert figure.axes[0].get_xscale() == "log"


def test_breakdown_plot_shares_add_up_to_the_whole_step(tmp_path):
    figure = plots.breakdown_plot(fake_result(), save_to=tmp_path / "breakdown.png")
    assert_png(tmp_path / "breakdown.png")
    share_axes = figure.axes[0]
    widths = np.array([patch.get_width() for patch in share_axes.patches]).reshape(len(PHASES), -1)
    assert np.allclose(widths.sum(axis=0), 100.0)
    assert "4.00 ms" in texts(figure) and "1,000 ms" in texts(figure)


def test_compare_and_transfer_plots(tmp_path):
    other = fake_result("2025-02-02T10:00:00", gpu={"name": "Test GPU"})
    plots.compare_plot([fake_result(), other], save_to=tmp_path / "compare.png")
    assert_png(tmp_path / "compare.png")
    curve = [{"bytes": 2 ** k, "latency_ms": {"median": 1e-3 * 2 ** (k - 10)}, "gb_per_s": 1.0 + k}
             for k in (10, 14, 18)]
    plots.transfer_plot({"machine": fake_result()["machine"], "curves": {"host memcpy": curve}},
                        save_to=tmp_path / "transfers.png")
    assert_png(tmp_path / "transfers.png")


def fake_history(seed, steps=60, eval_every=10):
    rng = np.random.default_rng(seed)
    losses = 2.3 * np.exp(-np.arange(steps) / 20) + 0.05 * rng.random(steps)
    return {"steps": [[s + 1, float(losses[s]), 0.05, 0.03 * (s + 1)] for s in range(steps)],
            "evals": [[s, 0.5 + s / 200, 0.5, 0.03 * s] for s in range(eval_every, steps + 1, eval_every)],
            "epochs": [{"epoch": 1, "test_accuracy": 0.8, "test_loss": 0.6, "train_seconds": 1.8, "step": steps}]}


def test_learning_curves_from_dicts_and_json_files(tmp_path):
    path = tmp_path / "history.json"
    path.write_text(json.dumps(fake_history(1)))
    figure = plots.learning_curves({"numpy": fake_history(0), "numba-cpu": str(path)},
                                   save_to=tmp_path / "curves.png")
    assert_png(tmp_path / "curves.png")
    assert len(figure.axes) == 4
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert labels == ["numpy", "numba-cpu"]


def test_moving_average_matches_a_direct_mean():
    values = np.random.default_rng(2).standard_normal(30)
    expected = [values[max(0, i - 4):i + 1].mean() for i in range(30)]
    assert np.allclose(plots.moving_average(values, 5), expected)


def test_digit_grid_frames_wrong_predictions_in_red(tmp_path):
    rng = np.random.default_rng(5)
    images, labels = rng.standard_normal((4, 1, 28, 28)), np.array([3, 1, 4, 1])
    probabilities = np.full((4, 10), 0.02)
    probabilities[[0, 1, 2, 3], [3, 1, 7, 1]] = 0.82           # image 2 is predicted 7, but is a 4
    figure = plots.digit_grid(images, labels, [("before", np.full((4, 10), 0.1)), ("after", probabilities)],
                              save_to=tmp_path / "digits.png")
    assert_png(tmp_path / "digits.png")
    after = figure.axes[4:]
    assert after[2].get_title() == "7 (82%)\nis 4" and after[0].get_title() == "3 (82%)"
    red = plots.WRONG
    assert after[2].spines["top"].get_edgecolor() == pytest.approx(plots_color(red))
    assert after[0].spines["top"].get_edgecolor() != pytest.approx(plots_color(red))
    assert "3/4 right" in after[0].get_ylabel() and "0/4 right" in figure.axes[0].get_ylabel()


def plots_color(name):
    from matplotlib.colors import to_rgba
    return to_rgba(name)


def test_feature_maps_are_the_reference_convolution(tmp_path):
    net = Network("small", (1, 10, 10), (Conv(1, 3, 3), ReLU(), MaxPool(2, 2), Flatten(), Dense(48, 10)))
    params = init_params(net, "he", seed=7)
    image = np.random.default_rng(8).standard_normal((1, 10, 10)).astype(np.float32)
    figure = plots.filters_and_feature_maps(net, params, image, save_to=tmp_path / "filters.png")
    assert_png(tmp_path / "filters.png")
    loops = get_stage("loops").ops
    weights, bias = params[:27].reshape(3, 1, 3, 3), params[27:30]
    expected = loops.relu_forward(loops.conv_forward(image[None], weights, bias, 1, 0))[0]
    maps = [axes.images[0].get_array() for axes in figure.axes if axes.get_title().startswith("map")]
    filters = [axes.images[0].get_array() for axes in figure.axes if axes.get_title().startswith("filter")]
    assert np.allclose(np.array(maps), expected, rtol=1e-5, atol=1e-6)
    assert np.allclose(np.array(filters), weights[:, 0])


def test_nothing_is_written_without_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    figure = plots.speedup_plot(fake_result(), save_to=None)
    assert figure.axes and list(tmp_path.iterdir()) == []
    plots.speedup_plot(fake_result())
    assert_png(tmp_path / "results" / "speedup.png")


def test_curves_command_labels_histories_by_stage(tmp_path, capsys):
    from cnn import cli

    paths = []
    for seed, stage in enumerate(("numpy", "numba-cpu")):
        history = {**fake_history(seed), "config": {"stage": stage}}
        paths.append(tmp_path / f"train-{stage}.json")
        paths[-1].write_text(json.dumps(history))
    assert cli.main(["bench", "--curves", *map(str, paths), "--pictures-dir", str(tmp_path)]) == 0
    assert_png(tmp_path / "learning-curves.png")
    (tmp_path / "bad.json").write_text('{"epochs": []}')
    assert cli.main(["bench", "--curves", str(tmp_path / "bad.json")]) == 2
    assert "not a training history" in capsys.readouterr().err
