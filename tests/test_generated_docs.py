"""README, docs/profiling.md and the stage-5 docstring quote the committed measurements only through
generated blocks: those blocks must equal what the generators make from benchmarks/results/ now.

Also: the selection of the runs README shows, the run tags in file names, the Nsight Compute reader,
and findings whose wording follows the numbers (a re-measured result that turns around turns the
sentence around).
"""

import json
import shutil
from pathlib import Path

import pytest

from cnn.bench import docs, findings, nsight, readme, recorded, results

REPOSITORY = Path(__file__).resolve().parent.parent
RESULTS = REPOSITORY / "benchmarks" / "results"
H100 = "intel-xeon-processor-nvidia-h100-80gb-hbm3-2026-11-23"


@pytest.fixture
def at_repository(monkeypatch):
    monkeypatch.chdir(REPOSITORY)


def test_readme_blocks_equal_what_the_results_files_give(at_repository):
    page = Path("README.md")
    expected = readme.regenerated_readme(page, results.shown_results(results.RESULTS_DIR), results.RESULTS_DIR,
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
