"""The benchmark harness on tiny runs: results structure, speedup arithmetic, README markers, the
simulator refusal, and --op validation catching wrong operations. No assertion is about a time.

A tiny network (one 3×3 convolution, pooling, one dense layer) on random 8×8 images keeps
stage loops fast; the whole file takes ~10–15 s on 2 cores.
"""

import json
import sys
import time

import numpy as np
import pytest

from cnn import cli
from cnn.bench import demo, measure, ops, profiling, results, step_timing, tables, transfers
from cnn.bench.readme import README_END, README_START, update_readme
from cnn.formatting import PHASES
from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU
from cnn.stages import get_stage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_net():
    return Network("tiny", (1, 8, 8), (Conv(1, 2, 3), ReLU(), MaxPool(2, 2), Flatten(), Dense(18, 4)))


def bench_args(tmp_path, *flags):
    defaults = ["--stage", "loops,numpy", "--data", "random", "--steps", "3", "--warmup", "1",
                "--min-steps", "2", "--budget", "5", "--reference", "none", "--out-dir", str(tmp_path)]
    return cli.build_parser().parse_args(["bench", *defaults, *flags])


def random_batches(net, batch=4, count=3, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, *net.input_shape)).astype(np.float32),
             rng.integers(0, net.num_classes, batch)) for _ in range(count)]


def assert_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, f"{path} is not a non-empty PNG"


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = bench_args(out)
    with pytest.MonkeyPatch.context() as patch:
        short_back_to_back(patch)
        result = step_timing.benchmark(args, net=tiny_net(), batches=random_batches(tiny_net()),
                                       progress=lambda line: None)
    return result, step_timing.save_benchmark(result, out)


def short_back_to_back(monkeypatch) -> None:
    """Back-to-back runs of 20 steps, however slow the loaded machine makes a step (the real rule would skip them
    when 120 steps do not fit the budget): the same code as a second's worth of steps, ~10x less time."""
    monkeypatch.setattr(step_timing, "back_to_back_steps", lambda row, args: 20)


@pytest.mark.parametrize("median_ms, limited, steps", [(1.0, False, 500), (30.0, False, 33), (45.0, False, None),
                                                      (1.0, True, None)])
def test_back_to_back_runs_about_a_second_of_steps_when_the_budget_allows(tmp_path, median_ms, limited, steps):
    row = {"step_ms": {"median": median_ms}, "limited_by_budget": limited}
    assert step_timing.back_to_back_steps(row, bench_args(tmp_path)) == steps     # budget 5 s: 6 runs of >= 20 steps


# -- the results file ------------------------------------------------------------------------------

def test_results_file_structure_and_plots(tiny_result):
    result, path = tiny_result
    loaded = results.load_results(path)
    assert loaded == json.loads(json.dumps(result))
    assert path.name.startswith("bench-") and path.name.endswith(f"-cpu-{result['created'][:10]}.json")
    assert {"schema", "kind", "created", "command", "machine", "config", "stages", "references", "skipped",
            "failed", "plots"} <= set(loaded)
    assert {"cpu", "cores", "packages", "gpu"} <= set(loaded["machine"])
    assert [row["name"] for row in loaded["stages"]] == ["loops", "numpy"]
    assert [row["number"] for row in loaded["stages"]] == [1, 2]
    for row in loaded["stages"]:
        assert set(row["phases_ms"]) == set(PHASES)
        assert row["step_ms"]["n"] == row["timed_steps"] >= 2
        assert row["step_ms"]["min"] <= row["step_ms"]["median"] <= row["step_ms"]["max"]
        assert row["images_per_s"] == pytest.approx(4 / (row["step_ms"]["median"] / 1e3))
        assert row["launches_per_step"] == 0 and row["clock"] == "perf_counter"
        assert row["peak_host_rss_bytes"] > 0
        assert row["back_to_back_steps"] == 20 and row["back_to_back_ms"]["n"] == 5 and row["back_to_back_ms"]["min"] > 0
    for plot in loaded["plots"].values():
        assert_png(plot)


def test_speedups_in_results_are_ratios_of_median_steps(tiny_result):
    loops, numpy_row = tiny_result[0]["stages"]
    ratio = loops["step_ms"]["median"] / numpy_row["step_ms"]["median"]
    assert numpy_row["speedup_vs_first"] == pytest.approx(ratio)
    assert numpy_row["speedup_vs_previous"] == pytest.approx(ratio)
    assert loops["speedup_vs_first"] == pytest.approx(1.0) and loops["speedup_vs_previous"] is None


def _row(name, median, kind="stage"):
    stats = {"median": median, "q1": median, "q3": median, "min": median, "max": median, "n": 3}
    return {"name": name, "kind": kind, "step_ms": stats}


def test_speedup_arithmetic():
    rows = [_row("a", 1000.0), _row("b", 100.0), _row("c", 25.0)]
    references = [_row("torch-cpu", 50.0, "reference")]
    step_timing.add_speedups(rows, references)
    assert [r["speedup_vs_previous"] for r in rows] == [None, pytest.approx(10.0), pytest.approx(4.0)]
    assert [r["speedup_vs_first"] for r in rows] == [pytest.approx(1.0), pytest.approx(10.0), pytest.approx(40.0)]
    assert [r["ratio_to_reference"]["torch-cpu"] for r in rows] == [pytest.approx(0.05), pytest.approx(0.5),
                                                                     pytest.approx(2.0)]
    assert references[0]["speedup_vs_first"] == pytest.approx(20.0)


def test_markdown_tables_pad_each_column_to_its_widest_cell():
    from cnn.formatting import markdown

    assert markdown(["stage", "ms"], [["numpy", "28.9 ±3%"], ["numba-cpu", "6.07"]]).splitlines() == [
        "| stage     | ms       |",
        "|-----------|----------|",
        "| numpy     | 28.9 ±3% |",
        "| numba-cpu | 6.07     |"]


def test_markdown_table_lists_every_row_and_skips(tiny_result):
    result = json.loads(json.dumps(tiny_result[0]))
    result["skipped"].append({"name": "cuda", "reason": "needs a CUDA GPU"})
    table = tables.markdown_table(result)
    header, separator, *body = table.splitlines()
    assert "loops" in body[0] and "numpy" in body[1]
    assert header.count("|") == separator.count("|") == body[0].count("|")
    assert "Skipped cuda: needs a CUDA GPU" in table and result["machine"]["cpu"] in table


class SlowRunner:
    """A stand-in stage whose every phase takes at least 10 ms."""

    device = "cpu"

    def __getattr__(self, phase):
        return lambda *args: time.sleep(0.01)

    def train_step(self, *args):
        time.sleep(0.04)


def test_slow_stage_is_timed_only_as_budget_allows(tmp_path):
    args = bench_args(tmp_path, "--steps", "20", "--min-steps", "2", "--warmup", "3", "--budget", "0.1")
    row = step_timing.time_steps(SlowRunner(), measure.HostClock(), random_batches(tiny_net()), args, (0.1, 0.9, 0.0))
    assert row["timed_steps"] == 2 and row["limited_by_budget"] and row["warmup_steps"] == 2
    assert measure.repetitions(9.0, 30, 20, 3) == 3
    assert measure.repetitions(0.03, 30, 20, 3) == 20
    assert measure.repetitions(1.0, 5.5, 20, 3) == 5


# -- README ------------------------------------------------------------------------------------------

def test_readme_table_replaced_between_markers(tiny_result, tmp_path):
    _, path = tiny_result
    readme = tmp_path / "README.md"
    markers = f"{README_START}\nstale table\n{README_END}"
    readme.write_text(f"# Title\n\nprose before\n\n{markers}\n\nprose after\n")
    update_readme(readme, [path])
    text = readme.read_text()
    assert text.startswith("# Title\n\nprose before\n\n") and text.endswith("\n\nprose after\n")
    assert "stale table" not in text and "| 1 " in text and "numpy" in text
    assert text.count(README_START) == text.count(README_END) == 1
    update_readme(readme, [path])
    assert readme.read_text() == text        # regenerating is idempotent


@pytest.mark.parametrize("body", ["no markers at all\n", f"{README_END}\n{README_START}\n",
                                  f"{README_START}\n{README_START}\n{README_END}\n"])
def test_readme_without_one_pair_of_markers_is_refused(tiny_result, tmp_path, body):
    readme = tmp_path / "README.md"
    readme.write_text(body)
    with pytest.raises(ValueError, match="README.md"):
        update_readme(readme, [tiny_result[1]])
    assert readme.read_text() == body


def test_update_readme_command_uses_newest_results(tiny_result, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"{README_START}\n{README_END}\n")
    out = tiny_result[1].parent
    assert cli.main(["bench", "--update-readme", "--out-dir", str(out), "--readme", str(readme)]) == 0
    assert tiny_result[1].name in readme.read_text()


def test_compare_writes_side_by_side_plot(tiny_result, tmp_path, capsys):
    _, path = tiny_result
    assert cli.main(["bench", "--compare", str(path), str(path), "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| loops " in printed and "| numpy " in printed
    assert_png(next(tmp_path.glob("compare-*.png")))


# -- refusals and bad flags ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [[], ["--op", "relu-forward"], ["--memory"], ["--profile", "numpy"], ["--demo"]])
def test_refuses_to_time_under_the_simulator(monkeypatch, tmp_path, capsys, mode):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    status = cli.main(["bench", "--stage", "numpy", "--data", "random", "--out-dir", str(tmp_path), *mode])
    error = capsys.readouterr().err
    assert status != 0 and "simulator" in error and error.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, message", [(["--stage", "numpy,warp-drive"], "warp-drive"),
                                            (["--profile", "warp-drive"], "warp-drive"),
                                            (["--steps", "2", "--min-steps", "5"], "--min-steps")])
def test_bad_flags_are_one_line_errors(capsys, flags, message):
    assert cli.main(["bench", *flags]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_results_file_that_is_not_one_is_named(tmp_path):
    wrong = tmp_path / "other.json"
    wrong.write_text('{"steps": []}')
    with pytest.raises(ValueError, match="other.json"):
        results.load_results(wrong)


# -- --op: every stage's version of one operation against stage loops --------------------------------

def _candidates(*names):
    return [ops.OpCandidate(name, get_stage(name).ops) for name in names]


@pytest.mark.parametrize("op", ops.OPS)
def test_numpy_ops_match_the_reference(op):
    reference = ops.OpCandidate("loops", get_stage("loops").ops)
    args, _ = ops.op_inputs(op, tiny_net(), 3, np.dtype(np.float32), reference.ops, seed=ops.OPS.index(op))
    assert all(np.abs(a).sum() > 0 for a in args if isinstance(a, np.ndarray) and a.dtype.kind == "f")
    assert ops.check_op(op, _candidates("numpy"), reference, args, np.float32) == {"numpy": None}


def flipped_conv_forward(x, W, b, stride, pad):
    """A classic mistake: true convolution (kernel flipped) instead of cross-correlation."""
    return get_stage("numpy").ops.conv_forward(x, np.ascontiguousarray(W[:, :, ::-1, ::-1]), b, stride, pad)


def shifted_maxpool_forward(x, size, stride):
    """Right maxima, argmax off by one: only the integer output is wrong."""
    y, argmax = get_stage("numpy").ops.maxpool_forward(x, size, stride)
    return y, argmax + 1


@pytest.mark.parametrize("op, wrong", [("conv-forward", {"conv_forward": flipped_conv_forward}),
                                       ("maxpool-forward", {"maxpool_forward": shifted_maxpool_forward}),
                                       ("dense-backward", {"dense_backward": lambda dy, x, W: (dy @ W, x.T @ dy,
                                                                                               dy.sum(0))})])
def test_op_validation_catches_a_wrong_op(op, wrong, tmp_path):
    reference = ops.OpCandidate("loops", get_stage("loops").ops)
    broken = ops.OpCandidate("broken", get_stage("numpy").ops._replace(**wrong))
    args, _ = ops.op_inputs(op, tiny_net(), 3, np.dtype(np.float32), reference.ops)
    lines = []
    ok, rows = ops.op_benchmark(op, _candidates("numpy") + [broken], reference, args, np.float32,
                                  bench_args(tmp_path), progress=lines.append)
    assert not ok and rows == []
    assert any(line.strip().startswith("broken") and "MISMATCH" in line for line in lines)
    assert not any(line.strip().startswith("numpy") and "MISMATCH" in line for line in lines)


def test_op_benchmark_times_matching_stages(tmp_path):
    reference = ops.OpCandidate("loops", get_stage("loops").ops)
    args, _ = ops.op_inputs("conv-backward", tiny_net(), 3, np.dtype(np.float32), reference.ops)
    ok, rows = ops.op_benchmark("conv-backward", _candidates("loops", "numpy"), reference, args, np.float32,
                                  bench_args(tmp_path, "--budget", "0.2"), progress=lambda line: None)
    assert ok and [row["name"] for row in rows] == ["loops", "numpy"]
    assert rows[0]["speedup_vs_reference"] == pytest.approx(1.0) and rows[1]["time_ms"]["n"] >= 2


@pytest.mark.parametrize("dtype, factor, passes", [(np.float32, 1 + 1e-6, True), (np.float32, 1 + 1e-3, False),
                                                   (np.float64, 1 + 1e-6, False), (np.float64, 1 + 1e-13, True)])
def test_tolerance_knows_the_precision(dtype, factor, passes):
    expected = np.random.default_rng(3).standard_normal((4, 5)).astype(dtype)
    verdict = ops.compare_outputs("relu-forward", expected * dtype(factor), expected, dtype)
    assert (verdict is None) == passes


def test_nan_and_wrong_shape_are_mismatches():
    expected = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    with_nan = expected.copy()
    with_nan[1, 2] = np.nan
    assert "(1, 2)" in ops.compare_outputs("relu-forward", with_nan, expected, np.float32)
    assert "shape" in ops.compare_outputs("relu-forward", expected.T, expected, np.float32)


# -- the other modes, CPU side ------------------------------------------------------------------------

def test_memory_without_gpu_times_host_copies_labelled_as_such(tmp_path):
    from cnn import plots

    curves = transfers.host_copy_curves(sizes=(1024, 65536), budget_s=0.05, steps=3)
    (name, curve), = curves.items()
    assert "CPU analogue" in name and [point["bytes"] for point in curve] == [1024, 65536]
    assert all(point["gb_per_s"] > 0 and point["latency_ms"]["n"] >= 3 for point in curve)
    result = {"machine": results.machine_record(), "curves": curves}
    plots.transfer_plot(result, save_to=tmp_path / "transfers.png")
    assert_png(tmp_path / "transfers.png")


def test_profile_of_a_cpu_stage(tmp_path):
    report = profiling.profile_stage("numpy", tiny_net(), random_batches(tiny_net()), bench_args(tmp_path))
    assert "host profile" in report and "train_step" in report and "runs on the CPU" in report


def test_snapshot_stage_records_predictions_and_passes_everything_else():
    net, batches = tiny_net(), random_batches(tiny_net())
    stage = get_stage("numpy")(net).init("he", 0)
    watched = demo.SnapshotStage(stage, batches[0][0], at_steps=[2])
    watched.snapshot(0)
    for images, labels in batches:
        watched.train_step(images, labels, 0.1, 0.9, 0.0)
    assert sorted(watched.snapshots, key=str) == [0, 2] and watched.steps_done == 3
    assert np.allclose(watched.snapshots[2].sum(axis=1), 1.0)
    assert not np.allclose(watched.snapshots[0], watched.snapshots[2])
    assert np.array_equal(watched.get_params(), stage.get_params())


def test_demo_on_random_mnist_shaped_data(tmp_path, monkeypatch):
    """The whole demo pipeline on 160 random 'digits': every picture written, an accuracy returned."""
    short_back_to_back(monkeypatch)
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((160, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 160),
            rng.standard_normal((100, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 100))
    args = bench_args(tmp_path, "--stage", "numpy", "--steps", "2", "--batch-size", "16", "--demo-curve-steps", "4",
                      "--pictures-dir", str(tmp_path / "pictures"))
    report = demo.demo(args, data=data, progress=lambda line: None)
    assert report["stage"] == "numpy" and 0.0 <= report["final_test_accuracy"] <= 1.0
    for key in ("speedup", "breakdown", "digits", "filters", "epoch_curve", "curves"):
        assert_png(report["paths"][key])
    history = json.loads((tmp_path / "pictures" / "demo-history-numpy.json").read_text())
    assert len(history["steps"]) == 10 and history["evals"]


# -- on a real GPU only (skipped elsewhere by tests/conftest.py) ------------------------------------

@pytest.mark.gpu
def test_gpu_stage_rows_are_timed_by_cuda_events(tmp_path):
    args = bench_args(tmp_path, "--stage", "numpy,cuda", "--reference", "auto")
    result = step_timing.benchmark(args, net=tiny_net(), batches=random_batches(tiny_net()), progress=lambda line: None)
    row = next(row for row in result["stages"] if row["name"] == "cuda")
    assert row["clock"] == "cuda-events" and set(row["host_phases_ms"]) == set(PHASES)
    assert row["launches_per_step"] > 0 and row["device_bytes"] is not None
    assert result["machine"]["gpu"]["name"]
    assert [ref["name"] for ref in result["references"]] == ["torch-cpu", "torch-cuda"]


@pytest.mark.gpu
def test_gpu_transfer_curves_and_kernel_profile(tmp_path):
    curves = transfers.device_copy_curves(sizes=(4096, 1 << 20), budget_s=0.05, steps=3)
    assert set(curves) == {"H→D pageable", "H→D pinned", "D→H pageable", "D→H pinned"}
    assert all(point["gb_per_s"] > 0 for curve in curves.values() for point in curve)
    report = profiling.profile_stage("cuda", tiny_net(), random_batches(tiny_net()), bench_args(tmp_path))
    assert "per-kernel device times (CUDA events" in report


def test_snapshots_are_taken_when_the_trainer_runs_steps_in_requests():
    """cnn.train asks a stage for run_steps(first, count); the wrapper still stops at every snapshot step."""
    from cnn.train import TrainConfig, train

    net, rng = tiny_net(), np.random.default_rng(0)
    data = (rng.standard_normal((48, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 48),
            rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 8))
    stage = get_stage("numpy")(net).init("he", 0)
    watched = demo.SnapshotStage(stage, data[2], at_steps=[3])
    watched.steps_per_sync = 5                  # requests of 5 steps: 0-4 must be cut at 3
    config = TrainConfig(model="lenet5", stage="numpy", epochs=1, batch_size=4, progress=False, eval_every=0)
    history = train(config, data, stage=watched)
    assert 3 in watched.snapshots and watched.steps_done == 12 and len(history["steps"]) == 12


@pytest.mark.parametrize("mode, command", [([], "cmd_stages"), (["--op", "relu-forward"], "cmd_op"),
                                           (["--memory"], "cmd_memory"), (["--demo"], "cmd_demo"),
                                           (["--compare", "a.json"], "cmd_compare")])
def test_results_go_to_the_git_ignored_folder_unless_told(monkeypatch, mode, command):
    """Plain bench, --op, --memory, --demo, --compare: results/ (git-ignored), benchmarks/results only when told."""
    from cnn.bench import command as bench_command

    seen = {}
    monkeypatch.setattr(bench_command, "simulator_on", lambda: False)
    monkeypatch.setattr(bench_command, command, lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["bench", *mode]) == 0
    assert seen["out"] == "results" and seen["pictures_dir"] == "results"
    assert cli.main(["bench", *mode, "--out-dir", "benchmarks/results"]) == 0
    assert seen["out"] == "benchmarks/results"
    assert seen["pictures_dir"] == ("benchmarks/results" if mode == ["--demo"] else "results")


@pytest.mark.parametrize("mode, command", [(["--update-readme"], "cmd_update_readme"),
                                           (["--update-docs"], "cmd_update_docs")])
def test_the_publishing_modes_read_the_committed_results_unless_told(monkeypatch, mode, command):
    from cnn.bench import command as bench_command, docs

    seen = {}
    monkeypatch.setattr(bench_command if command == "cmd_update_readme" else docs, command,
                        lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["bench", *mode]) == 0
    assert seen["out"] is None                 # each reads results.RESULTS_DIR, benchmarks/results, by default
    assert cli.main(["bench", *mode, "--out-dir", "elsewhere"]) == 0 and seen["out"] == "elsewhere"


def bench_help(capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    return capsys.readouterr().out


def test_the_old_flag_names_still_work_and_say_the_new_ones(capsys):
    old = cli.build_parser().parse_args(["bench", "--stages", "numpy", "--out", "x"])
    new = cli.build_parser().parse_args(["bench", "--stage", "numpy", "--out-dir", "x"])
    assert vars(old) == vars(new) and (new.stages, new.out) == ("numpy", "x")
    assert capsys.readouterr().err.splitlines() == [
        "python -m cnn bench: --stages is deprecated, use --stage (same meaning)",
        "python -m cnn bench: --out is deprecated, use --out-dir (same meaning)"]
    help_text = bench_help(capsys)
    assert "--stages" not in help_text and "--out " not in help_text and "--out-dir DIR" in help_text


def test_census_without_gpu_or_simulator_says_how_to_run_it_in_the_simulator(monkeypatch, capsys):
    from cnn import stages
    from cnn.bench import command as bench_command

    monkeypatch.setattr(bench_command, "simulator_on", lambda: False)
    monkeypatch.setattr(stages, "cuda_unavailable_reason", lambda stage=None: "no CUDA GPU found")
    assert cli.main(["bench", "--census"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and bench_command.CENSUS_IN_THE_SIMULATOR in error
    help_text = bench_help(capsys)
    assert "simulator too" not in help_text and "NUMBA_ENABLE_CUDASIM=1" in " ".join(help_text.split())


def test_a_results_file_written_from_a_notebook_names_it(monkeypatch):
    """A kernel's own command line (ipykernel_launcher -f kernel.json) says nothing: the notebook's name where
    Jupyter gives it (JPY_SESSION_NAME), else that it came from a notebook."""
    from cnn.bench.results import command_line

    monkeypatch.setattr(sys, "argv", ["/venv/lib/python3.11/site-packages/ipykernel_launcher.py", "-f", "/k.json"])
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert command_line() == "from a notebook"
    monkeypatch.setenv("JPY_SESSION_NAME", "/work/main/notebooks/00_quick_start.ipynb")
    assert command_line() == "from the notebook 00_quick_start.ipynb"
    monkeypatch.setattr(sys, "argv", ["/venv/lib/python3.11/site-packages/cnn/__main__.py", "bench", "--stage", "numpy"])
    assert command_line() == "python -m cnn bench --stage numpy"


def test_pytorch_reference_is_timed_in_a_process_of_its_own(tmp_path):
    """The torch-cpu row comes from a child Python that imported PyTorch first (its own OpenMP and defaults),
    with the same phases as in this process."""
    pytest.importorskip("torch")
    args = bench_args(tmp_path, "--reference", "auto")
    result = {"references": [], "skipped": [], "failed": []}
    step_timing._measure_references(result, args, tiny_net(), random_batches(tiny_net()), (0.01, 0.9, 0.0),
                                    progress=lambda line: None)
    assert not result["failed"], result["failed"]
    row = next(row for row in result["references"] if row["name"] == "torch-cpu")
    assert row["process"].startswith("its own") and set(row["phases_ms"]) == set(PHASES)
