"""README, docs/benchmarks.md, docs/profiling.md and the stage docstrings quote the committed
measurements only through generated blocks: those blocks must equal what the generators make from
benchmarks/results/ now, and the headline picture that leads README must exist.

Also: the selection of the runs README shows, the run tags in file names, the Nsight Compute reader,
findings whose wording follows the numbers (a re-measured result that turns around turns the
sentence around), the headline's like-for-like ratios, PREDICTED times kept apart from measured
ones, and files measured on a busy machine left out and named. ~3 s.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from cnn import cli, plots
from cnn.bench import docs, findings, headline, nsight, predict_report, readme, recorded, results, tables

REPOSITORY = Path(__file__).resolve().parent.parent
RESULTS = REPOSITORY / "benchmarks" / "results"
H100 = "intel-xeon-processor-nvidia-h100-80gb-hbm3-2026-11-23"


@pytest.fixture
def at_repository(monkeypatch):
    monkeypatch.chdir(REPOSITORY)


def test_readme_blocks_equal_what_the_results_files_give(at_repository):
    page = Path("README.md")
    expected = readme.regenerated_readme(page, readme.published_results(results.RESULTS_DIR), results.RESULTS_DIR,
                                         draw_missing=False)
    assert expected == page.read_text(), "README is stale: run python -m cnn bench --update-readme"


def test_docs_and_docstring_blocks_equal_what_the_results_files_give(at_repository):
    assert docs.stale_blocks() == [], "run python -m cnn bench --update-docs"


def test_readme_shows_both_gpu_runs_and_every_plot_exists(at_repository):
    shown = [path.name for path in results.shown_results(results.RESULTS_DIR)]
    for network in ("lenet5-b64", "alexnet-small-b128"):
        assert f"bench-{network}-{H100}-f5350bb.json" in shown and f"bench-{network}-{H100}.json" in shown
    for path in results.shown_results(results.RESULTS_DIR):
        assert set(readme.plots_of(path, draw_missing=False)) == {"speedup", "breakdown"}, path


def fake_bench(created: str, rows: list[str], gpu=True, model="lenet5", batch=64) -> dict:
    machine = {"cpu": "Some CPU", "cores": 4, "gpu": {"name": "Some GPU"} if gpu else None}
    return {"schema": results.SCHEMA, "kind": "stages", "created": created, "machine": machine,
            "config": {"model": model, "batch_size": batch},
            "stages": [{"name": name} for name in rows], "references": []}


def test_shown_results_keeps_an_older_run_only_for_what_no_newer_run_measured(tmp_path):
    files = {"old-all.json": fake_bench("2026-01-01T00:00", ["numpy", "cuda", "cuda-tuned"]),
             "mid-subset.json": fake_bench("2026-01-02T00:00", ["cuda"]),
             "new-some.json": fake_bench("2026-01-03T00:00", ["cuda", "cuda-tuned"]),
             "cpu.json": fake_bench("2026-01-01T00:00", ["numpy"], gpu=False),
             "alex.json": fake_bench("2025-01-01T00:00", ["cuda"], model="alexnet-small", batch=128)}
    for name, content in files.items():
        (tmp_path / f"bench-{name}").write_text(json.dumps(content))
    shown = [path.name for path in results.shown_results(tmp_path)]
    assert shown == ["bench-cpu.json", "bench-old-all.json", "bench-new-some.json", "bench-alex.json"]


@pytest.mark.parametrize("name,tag", [(f"bench-lenet5-b64-{H100}-f5350bb.json", "f5350bb"),
                                      (f"bench-lenet5-b64-{H100}.json", ""),
                                      (f"bench-lenet5-b64-{H100}-f5350bb-speedup.png", ""),
                                      ("ncu-cuda-tuned-lenet5-b64-nvidia-h100-2026-11-23-f5350bb.csv", "f5350bb")])
def test_run_tag_is_the_commit_after_the_date(name, tag):
    assert results.run_tag(name) == tag


NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_line(launch, kernel, metric, value):
    return (f'"{launch}","1","python","h","mod::{kernel}[v1,abc](Array<float, 1, C>)","1","13","(32, 1, 1)",'
            f'"(4, 1, 1)","0","9.0","Command line profiler metrics","{metric}","","{value}"')


def test_nsight_csv_is_summed_per_training_step(tmp_path):
    launches = [("conv_relu_pool_backward_smem_kernel", "3,000"), ("tiled_epilogue_kernel", "500"),
                ("sgd_momentum_kernel", "500")] * 2           # two steps
    lines = ["==PROF== Connected to process 1", NCU_HEADER]
    for launch, (kernel, ns) in enumerate(launches):
        lines += [ncu_line(launch, kernel, "gpu__time_duration.sum", ns),
                  ncu_line(launch, kernel, "sm__throughput.avg.pct_of_peak_sustained_elapsed", 10 + launch)]
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(lines) + "\n")
    summary = nsight.kernel_summary(path)
    assert summary["steps"] == 2 and summary["total_us"] == pytest.approx(4.0)
    conv = summary["kernels"][0]
    assert conv["launches"] == 1 and conv["us"] == pytest.approx(3.0) and conv["sm_percent"] == (10, 13)
    assert summary["shares"]["conv backward"] == pytest.approx(0.75)
    assert summary["shares"]["dense"] == pytest.approx(0.125)
    path.write_text("==PROF== nothing profiled\n")
    with pytest.raises(ValueError, match="not an Nsight Compute CSV"):
        nsight.kernel_summary(path)


def test_a_fused_step_is_one_share_and_stage_7s_block_keeps_to_stage_7(tmp_path):
    """Stage 8's profile is not split by layer: its summary names the fused kernels' share, and stage 7's docstring
    block lists only cuda-tuned's profiles."""
    lines = [NCU_HEADER]
    for launch, (kernel, ns) in enumerate([("fused_net_step_kernel", "900"), ("sum_sgd_kernel", "60"),
                                           ("sgd_momentum_kernel", "40")]):
        lines.append(ncu_line(launch, kernel, "gpu__time_duration.sum", ns))
    fused = tmp_path / "ncu-cuda-fused-net-lenet5-b64-nvidia-h200-2026-11-28.csv"
    fused.write_text("\n".join(lines) + "\n")
    summary = nsight.kernel_summary(fused)
    assert summary["shares"]["fused step"] == pytest.approx(0.96)
    assert nsight.share_words(summary["shares"]) == "the fused kernels 96 %"
    assert "cuda-fused-net" not in docs.stage7_block(tmp_path, tmp_path)
    shutil.copy(RESULTS / f"ncu-cuda-tuned-lenet5-b64-{H100.split('processor-')[1]}.csv", tmp_path)
    block = docs.stage7_block(tmp_path, tmp_path)
    assert "ncu-cuda-tuned-lenet5" in block and "ncu-cuda-fused-net" not in block and "conv backward" in block


def test_stage_8_against_pytorch_follows_the_numbers(tmp_path):
    """Slow stage 8 down in a copy of the H200 run below PyTorch's graph: it is no longer called the fastest, and
    the row says slower."""
    name = "bench-lenet5-b64-intel-xeon-processor-nvidia-h200-2026-11-28-fused-net.json"
    assert "is the fastest way to train both networks" in findings.finding_fused_net(RESULTS)
    copied = json.loads((RESULTS / name).read_text())
    recorded.row(copied, "cuda-fused-net")["back_to_back_ms"].update(median=0.5, min=0.5, max=0.5)
    (tmp_path / name).write_text(json.dumps(copied))
    turned = findings.finding_fused_net(tmp_path)
    assert "is not the fastest way to train LeNet-5" in turned
    assert "2.00× slower than PyTorch as one CUDA graph (0.250 ms)" in turned
    assert "0.500 ms a step" in turned and "above" in docs.stage8_block(tmp_path, tmp_path)


def test_findings_follow_the_numbers(tmp_path):
    """Make stage 4 faster than stage 3 in a copy of the first H100 run: the sentence turns around."""
    name = f"bench-lenet5-b64-{H100}-f5350bb.json"
    original = findings.finding_first_port(RESULTS)
    assert "slower than the compiled CPU stage" in original
    copied = json.loads((RESULTS / name).read_text())
    recorded.row(copied, "cuda")["step_ms"]["median"] = 1.5
    (tmp_path / name).write_text(json.dumps(copied))
    turned = findings.finding_first_port(tmp_path)
    assert "faster than the compiled CPU stage" in turned and "took 1.50 ms" in turned


def test_no_gpu_files_no_findings(tmp_path):
    shutil.copy(RESULTS / "bench-lenet5-b64-intel-xeon-processor-cpu-2026-11-22.json", tmp_path)
    assert findings.findings(tmp_path) == []


# -- the headline: one picture, one table, like compared with like -----------------------------------

def test_the_headline_picture_leads_readme(at_repository):
    text = Path("README.md").read_text()
    picture = headline.HEADLINE_PICTURE
    assert picture.exists() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "run python -m cnn bench --headline"
    assert f"]({picture.as_posix()})" in text
    assert text.index(picture.as_posix()) < text.index("## The stages") < text.index("## The course map")
    assert 100 <= len(text.splitlines()) <= 200, "README is a front page: about 150 lines"


def cell(data, stage, machine="H100 machine"):
    return next(row for row in data["rows"] if row["name"] == stage and row["kind"] == "stage")["cells"][machine]


def test_the_headline_compares_like_with_like():
    """Stage 7 against stage 6 on the H100: back to back in the run that timed both so (×3.1), never its
    phase-by-phase time against stage 6's back-to-back one (×0.31, what notebook 10 once showed)."""
    data = headline.headline(out_dir=RESULTS)
    tuned = cell(data, "cuda-tuned")
    newest = json.loads((RESULTS / f"bench-lenet5-b64-{H100}.json").read_text())
    ring_b2b, tuned_b2b = (recorded.row(newest, name)["back_to_back_ms"]["median"] for name in ("cuda-ring", "cuda-tuned"))
    assert tuned["how"] == headline.BACK_TO_BACK and tuned["ms"] == pytest.approx(tuned_b2b)
    assert tuned["vs_previous"] == (pytest.approx(ring_b2b / tuned_b2b), headline.BACK_TO_BACK)
    fused = cell(data, "cuda-fused")            # timed phase by phase only: compared so, and marked
    assert fused["how"] == headline.PHASE_BY_PHASE and fused["vs_previous"][1] == headline.PHASE_BY_PHASE
    table = headline.front_table(data)                # tabulate pads cells: a cell is its text then spaces
    assert re.search(r"\| 1\.01 +\|", table) and "9.44" not in table
    assert cell(data, "loops", "2-core CPU")["how"] == headline.PHASE_BY_PHASE


def busy_copy(tmp_path, load: float, created: str, name: str) -> Path:
    content = json.loads((RESULTS / "bench-lenet5-b64-intel-xeon-processor-cpu-2026-11-22.json").read_text())
    content["machine"]["load_average"] = [load, load, load]
    content["created"] = created
    recorded.row(content, "numpy")["step_ms"]["median"] = 100.0 + load      # which file the figure came from
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return path


def test_files_measured_on_a_busy_machine_are_left_out_and_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(recorded, "PUBLISHED_DIR", tmp_path)
    quiet = busy_copy(tmp_path, 0.3, "2026-01-01T10:00:00", "bench-lenet5-b64-quiet-cpu-2026-01-01.json")
    busy = busy_copy(tmp_path, 23.0, "2026-01-02T10:00:00", "bench-lenet5-b64-busy-cpu-2026-01-02.json")
    published, skipped = recorded.publication(tmp_path)
    assert published == [quiet] and skipped == [(busy, "the machine was busy: 1-minute load 23.0 on 2 cores, "
                                                       "times inflated")]
    assert readme.published_results(tmp_path) == [quiet]      # the newer busy run of the same rows hides nothing
    assert "The machine was busy: 1-minute load 23.0 on 2 cores, times inflated" in \
        " ".join(tables.table_notes(json.loads(busy.read_text())))             # the table says so by the same rule
    assert cell(headline.headline(out_dir=tmp_path), "numpy", "2-core CPU")["ms"] == 100.3
    page = tmp_path / "README.md"
    page.write_text(f"{readme.HEADLINE_START}\n{readme.HEADLINE_END}\n")
    assert cli.main(["bench", "--update-readme", "--out", str(tmp_path), "--readme", str(page)]) == 0
    assert f"skipped {busy.name}: the machine was busy" in capsys.readouterr().out
    assert quiet.name in page.read_text() and busy.name not in page.read_text()
    monkeypatch.setattr(recorded, "PUBLISHED_DIR", tmp_path / "elsewhere")     # one's own results: all read
    assert cell(headline.headline(out_dir=tmp_path), "numpy", "2-core CPU")["ms"] == 123.0


def prediction_file(folder: Path, rows: list[dict], calibration: list[dict]) -> None:
    """A ``python -m cnn bench --predict`` file: PREDICTED stages, and the measurements it was checked against."""
    (folder / predict_report.RESULTS_NAME).write_text(json.dumps(
        {"kind": "predict-h100", "created": "2026-12-01T10:00:00", "commit": "abc1234",
         "calibration": {"steps": calibration}, "predicted": {"stages": rows, "tiled_conv": []}}))


def test_predicted_times_stand_beside_the_measured_ones_and_say_so(tmp_path):
    """The headline reads the one prediction file: a PREDICTED bar for each stage whose code as it is now was never
    measured (stage 8; stage 7, measured only with older kernels), as one CUDA graph where the stage replays one —
    and none for a stage measured as it is (stage 6)."""
    for path in RESULTS.glob(f"bench-lenet5-b64-{H100}*.json"):
        shutil.copy(path, tmp_path)
    lenet = {"model": "lenet5", "batch_size": 64}
    rows = [{"stage": "cuda-ring", **lenet, "back_to_back_ms": 3.0, "graph_ms": None},
            {"stage": "cuda-tuned", **lenet, "back_to_back_ms": 2.7, "graph_ms": 0.9},
            {"stage": "cuda-fused-net", **lenet, "back_to_back_ms": 0.5, "graph_ms": 0.4},
            {"stage": "cuda-fused-net", "model": "alexnet-small", "batch_size": 128, "back_to_back_ms": 9, "graph_ms": 8}]
    measured = [{"kind": "bench", "stage": "cuda-ring", "model": "lenet5", "batch": 64, "fixes": None, "commit": None},
                {"kind": "bench", "stage": "cuda-tuned", "model": "lenet5", "batch": 64, "fixes": None, "commit": "ecf7081"}]
    prediction_file(tmp_path, rows, measured)
    data = headline.headline(out_dir=tmp_path)
    assert cell(data, "cuda-tuned")["how"] == headline.BACK_TO_BACK                 # the measurement stays
    predicted = cell(data, "cuda-tuned", "H100 PREDICTED")
    assert predicted["ms"] == 0.9 and predicted["timing"] == headline.GRAPH and predicted["commit"] == "abc1234"
    rows = {row["name"]: row for row in data["rows"] if row["kind"] == "stage"}
    assert "H100 PREDICTED" not in rows["cuda-ring"]["cells"]                        # measured as it is
    fused = rows["cuda-fused-net"]
    assert fused["cells"].keys() == {"H100 PREDICTED"} and fused["label"] == "8. cuda-fused-net"
    table = headline.front_table(data)
    assert re.search(r"\| ~0\.400 PREDICTED +\|", table) and re.search(r"\| H100 PREDICTED: ms a step +\|", table)
    assert "commit abc1234" in " ".join(headline.table_notes(data, str))
    figure = plots.headline_plot(data, save_to=None)
    labels = [text.get_text() for text in figure.axes[0].texts]
    assert "~0.400 ms  PREDICTED for the H100 at commit abc1234 (2026-12-01), as one CUDA graph" in labels
    hatched = [patch for patch in figure.axes[0].patches if patch.get_hatch()]
    assert len(hatched) == 2
    measured = [label for label in labels if "PREDICTED" not in label]
    assert measured and all(label.endswith(("back to back", "phase by phase", "as one CUDA graph")) for label in measured)


def test_the_committed_headline_predicts_stages_7_and_8_on_the_h100_and_measures_the_rest():
    data = headline.headline(out_dir=RESULTS)
    predicted = [row["name"] for row in data["rows"] if "H100 PREDICTED" in row["cells"]]
    assert predicted == ["cuda-tuned", "cuda-fused-net"]
    assert cell(data, "cuda-tuned")["how"] == headline.BACK_TO_BACK
