"""``python -m cnn bench --update-docs``: the measured tables of docs/benchmarks.md, docs/profiling.md and
of the stage docstrings, regenerated from the committed results files (those measured on a quiet
machine: ``cnn.bench.recorded.not_quiet``; the files left out are listed on docs/benchmarks.md and printed).

Every generated block sits between two marker lines, ``<!-- generated:NAME start -->`` and
``<!-- generated:NAME end -->`` (inside a module docstring as well), and is rewritten whole; the
text around it is written by hand and quotes no measured figure. ``BLOCKS`` lists them: which
file, which block, and the function that renders it from ``out_dir`` (``benchmarks/results``).
``stale_blocks()`` says which blocks differ from what the files give (the test suite checks that
none does, README's blocks included).
"""

from __future__ import annotations

from pathlib import Path

from cnn.bench import recorded
from cnn.bench.findings import LENET, ALEXNET, NETWORK_NAMES, findings
from cnn.bench.nsight import kernel_summary, share_words
from cnn.bench.readme import plots_of, published_results, relative_link, replace_between_markers, tables_body
from cnn.bench.results import RESULTS_DIR, load_results, run_tag
from cnn.bench.tables import ablation_table, back_to_back_table, kernel_table, markdown
from cnn.formatting import fmt_ms

BENCHMARKS = Path("docs/benchmarks.md")
PROFILING = Path("docs/profiling.md")
STAGE5 = Path("cnn/stages/s5_cuda_fused.py")
COMMAND = "python -m cnn bench --update-docs"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- generated:{name} start -->", f"<!-- generated:{name} end -->"


def label(model: str, batch: int) -> str:
    return f"{NETWORK_NAMES.get(model, model)} b{batch}"


def session(path, created: str = "") -> str:
    """How a doc names a results file's run: 'commit f5350bb' when its name carries the commit, else its
    creation time, else 'the later run of that day' (of one day's files, the tagged ones are older)."""
    tag = run_tag(path)
    if tag:
        return f"commit {tag}"
    return created.replace("T", " ")[:16] if created else "the later run of that day"


def profile_session(profile: dict, profiles: list[dict]) -> str:
    """``session`` for a Nsight Compute profile: said only where the same device profiled the same stage and
    network twice that day (a tagged run and a later one); '' otherwise."""
    twins = [other for other in profiles if all(other[key] == profile[key]
                                                for key in ("stage", "model", "batch", "device", "date"))]
    return session(profile["path"]) if len(twins) > 1 else ""


# == docs/benchmarks.md =========================================================================

def bench_tables_block(out_dir, page: Path) -> str:
    """Every published bench run: per machine and workload its table and plots (``cnn.bench.readme``)."""
    results = [(path, load_results(path)) for path in published_results(out_dir)]
    return tables_body(results, page, draw_missing=False) if results else "No quiet bench results yet."


def skipped_block(out_dir, page: Path) -> str:
    """The results files these pages do not quote, and why (``cnn.bench.recorded.publication``)."""
    skipped = recorded.publication(out_dir)[1]
    if not skipped:
        return "Every results file was measured on a quiet machine: none is left out."
    return "\n".join(f"- [`{path.name}`]({relative_link(path, page)}): {reason}" for path, reason in skipped)


# == docs/profiling.md ==========================================================================

def findings_block(out_dir, page: Path) -> str:
    return "\n\n".join(findings(out_dir, link=lambda path: f"[`{Path(path).name}`]({relative_link(path, page)})"))


def kernels_block(out_dir, page: Path) -> str:
    """Every Nsight Compute profile: the per-kernel table of one training step, and its summary line."""
    parts, profiles = [], recorded.ncu_profiles(out_dir)
    for profile in profiles:
        summary = kernel_summary(profile["path"])
        run = profile_session(profile, profiles)
        parts += [f"**{profile['stage']}, {label(profile['model'], profile['batch'])}** — "
                  f"{profile['device']}, {profile['date']}{', ' + run if run else ''} "
                  f"([`{profile['path'].name}`]({relative_link(profile['path'], page)}); {summary['steps']} "
                  f"step{'s' if summary['steps'] > 1 else ''} profiled, per step below): "
                  f"{fmt_ms(summary['total_us'] / 1e3)} ms of kernel time, {share_words(summary['shares'])}.",
                  "", kernel_table(summary), ""]
    return "\n".join(parts).strip() or "No Nsight Compute profile in the results files yet."


def ablation_block(out_dir, page: Path) -> str:
    """The ablations, newest session first, both networks side by side."""
    by_day: dict[tuple, list] = {}
    for path, result in recorded.ablations(out_dir):
        key = (str(result.get("created", ""))[:10], run_tag(path))
        by_day.setdefault(key, []).append((path, result))
    parts = []
    for (day, tag), found in sorted(by_day.items(), key=lambda item: (item[0][0], item[0][1] == ""), reverse=True):
        found.sort(key=lambda item: item[1]["model"] != "lenet5")
        links = ", ".join(f"[`{path.name}`]({relative_link(path, page)})" for path, _ in found)
        fixes = max(len(result["rows"]) for _, result in found)
        parts += [f"**{recorded.when(*found[0]).split(',')[0]}, {day}, {session(found[0][0], found[0][1]['created'])}** "
                  f"({fixes} rows; {links}):", "",
                  ablation_table([(label(r['model'], r['batch_size']), r) for _, r in found]), ""]
    return "\n".join(parts).strip() or "No ablation in the results files yet."


def pytorch_block(out_dir, page: Path) -> str:
    """The newest benchmarks with PyTorch as one CUDA graph, both networks; and the probes of PyTorch."""
    columns, links = [], []
    for model, batch in (LENET, ALEXNET):
        found = recorded.bench_with(model, batch, {"torch-cuda": ["graph_ms"]}, out_dir)
        if found:
            columns.append((label(model, batch), found[1]))
            links.append(f"[`{found[0].name}`]({relative_link(found[0], page)})")
    parts = []
    if columns:
        parts += [f"ms a training step, median ({', '.join(links)}):", "", back_to_back_table(columns)]
    found = recorded.probes(out_dir)
    if found:
        path, content = found
        rows = [[f"`{name}`", f"{figure['value']:g} {figure['unit']}", figure["what"]]
                for name, figure in content["figures"].items()]
        parts += ["", f"Probes — small programs outside the repository, {content['device']}, {content['created']}, "
                      f"commit {content['commit']} ([`{path.name}`]({relative_link(path, page)}), which says how "
                      f"each was measured):", "", markdown(["figure", "value", "what"], rows)]
    return "\n".join(parts).strip() or "No GPU benchmark with PyTorch in the results files yet."


def training_block(out_dir, page: Path) -> str:
    rows = []
    for stage in ("cuda-fused", "cuda-tuned", "cuda-fused-net"):
        for path, history in recorded.training_runs(stage, out_dir):
            epochs = history["epochs"]
            first, later = recorded.epoch_seconds(history)
            rows.append([f"`{stage}`", recorded.run_in_name(path), str(len(epochs)), f"{history['final_test_accuracy']:.2%}",
                         f"{first:.1f}", f"{later:.3g}", f"[`{path.name}`]({relative_link(path, page)})"])
    return markdown(["stage", "run", "epochs", "test accuracy", "first epoch, s (compiles)", "later epochs, s each",
                     "file"], rows) if rows else "No GPU training run in the results files yet."


def copies_block(out_dir, page: Path) -> str:
    found = recorded.memory_result(out_dir)
    if found is None:
        return "No GPU copy measurement in the results files yet (`python -m cnn bench --memory` on a GPU)."
    path, result = found
    small, large = 1024, max(point["bytes"] for point in next(iter(result["curves"].values())))
    rows = []
    for curve in result["curves"]:
        first, last = recorded.copy_point(result, curve, small), recorded.copy_point(result, curve, large)
        rows.append([curve, f"{first['latency_ms']['median'] * 1e3:.0f}", f"{last['gb_per_s']:.1f}"])
    return (f"{recorded.when(path, result)} ([`{path.name}`]({relative_link(path, page)})):\n\n" +
            markdown(["copy through numba-cuda", f"µs for {small // 1024} KiB (median)",
                      f"GB/s at {large // 2**20} MiB"], rows))


# == stage docstrings =============================================================================

def stage5_block(out_dir, page: Path) -> str:
    """Stage 4 (pull) against stage 5 (push) in the newest GPU benchmark that timed both, both networks."""
    lines = []
    for model, batch in (LENET, ALEXNET):
        found = recorded.bench_with(model, batch, {"cuda": [], "cuda-fused": []}, out_dir)
        if found is None:
            continue
        path, result = found
        pull, push = recorded.row(result, "cuda"), recorded.row(result, "cuda-fused")
        if not lines:
            lines += [f"Measured on {result['machine']['gpu']['name']}, {result['created'][:10]} (python -m cnn bench; ms a training step, "
                      f"median, phase by phase):", "",
                      f"    {'':<20}{'cuda (pull)':>12}{'cuda-fused (push)':>19}{'launches a step':>18}"]
        lines.append(f"    {label(model, batch):<20}{fmt_ms(pull['step_ms']['median']):>12}"
                     f"{fmt_ms(push['step_ms']['median']):>19}"
                     f"{str(pull['launches_per_step']) + ' -> ' + str(push['launches_per_step']):>18}")
        lines.append(f"        ({session(path)}: {path.as_posix()})")
    if not lines:
        return "No GPU benchmark of stages cuda and cuda-fused in the results files yet."
    return "\n".join(lines + ["", "The single operations (conv_backward, maxpool_backward, pull against push) have not "
                                  "been timed on a GPU yet:",
                              "    python -m cnn bench --op conv-backward --stage cuda,cuda-fused",
                              "    python -m cnn bench --op maxpool-backward --stage cuda,cuda-fused"])


def stage7_block(out_dir, page: Path) -> str:
    """The launch-cost probes and, per Nsight Compute profile, the kernel time of a step and its shares."""
    lines = []
    found = recorded.probes(out_dir)
    if found:
        path, content = found
        figures = content["figures"]
        lines += [f"    numba-cuda launch, host time: {figures['launch_1_array_us']['value']:g} µs with one array "
                  f"argument, {figures['launch_8_arrays_us']['value']:g} µs with eight; a CUDA graph replays",
                  f"    {figures['graph_replay_us_per_kernel']['value']:g} µs a kernel ({content['device']}, "
                  f"{content['created']}: {path.as_posix()})", ""]
    profiles = recorded.ncu_profiles(out_dir)
    for profile in (profile for profile in profiles if profile["stage"] == "cuda-tuned"):
        summary, run = kernel_summary(profile["path"]), profile_session(profile, profiles)
        lines += [f"    {label(profile['model'], profile['batch'])}, {profile['device']}, {profile['date']}"
                  f"{', ' + run if run else ''}: "
                  f"{fmt_ms(summary['total_us'] / 1e3)} ms of kernel time a step; "
                  f"{share_words(summary['shares'], short=True)}", f"        ({profile['path'].as_posix()})"]
    return "\n".join(lines).rstrip() or "No GPU measurement in the results files yet."


STAGE7 = Path("cnn/stages/s7_cuda_tuned.py")
STAGE8 = Path("cnn/stages/s8_cuda_fused_net.py")


def against_range(measured: float, low: float, high: float) -> str:
    return "below" if measured < low else "above" if measured > high else "within"


def stage8_block(out_dir, page: Path) -> str:
    """Stage 8 measured beside its PREDICTED figures: the step back to back against stage 7 and PyTorch as one
    CUDA graph (the newest GPU benchmark timing all three), kernel 1 under Nsight Compute, 10 epochs of MNIST."""
    from cnn.model import get_network
    from cnn.stages.s8_cuda_fused_net import predicted_step

    needs = {"cuda-fused-net": ["back_to_back_ms"], "cuda-tuned": ["back_to_back_ms"], "torch-cuda": ["graph_ms"]}
    lines = []
    for model, batch in (LENET, ALEXNET):
        found = recorded.bench_with(model, batch, needs, out_dir)
        if found is None:
            continue
        path, result = found
        fused = recorded.row(result, "cuda-fused-net")["back_to_back_ms"]
        tuned = recorded.row(result, "cuda-tuned")["back_to_back_ms"]["median"]
        graph = recorded.row(result, "torch-cuda")["graph_ms"]["median"]
        low, high = predicted_step(get_network(model), batch).step_ms
        if not lines:
            lines += [f"Measured on {recorded.gpu_name(result)}, {result['created'][:10]} (python -m cnn bench; ms a "
                      f"training step, steps back to back, median of {fused['n']} runs and their range):", "",
                      f"    {'':<20}{'stage 7':>8}{'PyTorch graph':>15}   {'cuda-fused-net':<22}PREDICTED (H100)"]
        measured = f"{fmt_ms(fused['median'])} ({fmt_ms(fused['min'])}–{fmt_ms(fused['max'])})"
        lines += [f"    {label(model, batch):<20}{fmt_ms(tuned):>8}{fmt_ms(graph):>15}   {measured:<22}"
                  f"{low:.2f} – {high:.2f}: {against_range(fused['median'], low, high)}",
                  f"        ({path.as_posix()})"]
    if not lines:
        return "No GPU benchmark of stage 8 beside stage 7 and PyTorch in the results files yet."
    kernels = []
    for profile in recorded.ncu_profiles(out_dir):
        if profile["stage"] == "cuda-fused-net":
            kernel_1 = next(row for row in kernel_summary(profile["path"])["kernels"]
                            if row["kernel"] == "fused_net_step_kernel")
            low, high = predicted_step(get_network(profile["model"]), profile["batch"]).kernel_1_us
            kernels += [f"    {label(profile['model'], profile['batch']):<20}{kernel_1['us']:>6.0f} µs   PREDICTED "
                        f"{low:.0f} – {high:.0f} µs: {against_range(kernel_1['us'], low, high)}  "
                        f"({profile['device']}, {profile['date']})", f"        ({profile['path'].as_posix()})"]
    if kernels:
        lines += ["", "Kernel 1 alone, Nsight Compute (its default replay flushes the caches before the kernel):", "",
                  *kernels]
    training = recorded.training_run("cuda-fused-net", out_dir)
    if training:
        path, history = training
        epochs = history["epochs"]
        first, later = recorded.epoch_seconds(history)
        lines += ["", f"Training, {len(epochs)} epochs of MNIST (LeNet-5, batch {history['config']['batch_size']}): "
                      f"{history['final_test_accuracy']:.2%} test accuracy,", f"    {later:.3g} s of training an epoch "
                      f"after the first ({first:.1f} s: it compiles every kernel)", f"        ({path.as_posix()})"]
    return "\n".join(lines)


def static_block(out_dir, page: Path) -> str:
    from cnn.bench.static_report import docs_block
    return docs_block(out_dir, page)


def prediction_block(out_dir, page: Path) -> str:
    from cnn.bench.predict_report import docs_block
    return docs_block(out_dir, page)


def stage7_prediction_block(out_dir, page: Path) -> str:
    from cnn.bench.predict_report import stage7_block
    return stage7_block(out_dir, page)


#: (file, block name, renderer): every block ``--update-docs`` writes
BLOCKS = ((BENCHMARKS, "bench-tables", bench_tables_block), (BENCHMARKS, "gpu-findings", findings_block),
          (BENCHMARKS, "skipped", skipped_block),
          (PROFILING, "gpu-findings", findings_block), (PROFILING, "ncu-kernels", kernels_block),
          (PROFILING, "ablation", ablation_block), (PROFILING, "pytorch", pytorch_block),
          (PROFILING, "training", training_block), (PROFILING, "copies", copies_block),
          (STAGE5, "gpu-table", stage5_block), (STAGE7, "gpu-profile", stage7_block),
          (STAGE8, "gpu-measured", stage8_block),
          (PROFILING, "static-sm90", static_block), (PROFILING, "prediction", prediction_block),
          (STAGE7, "prediction", stage7_prediction_block))


def render(text: str, source: str, name: str, body: str) -> str:
    start, end = markers(name)
    block = f"{start}\n{body}\n{end}"
    return replace_between_markers(text, block, source, start, end)


def regenerated(path: Path, out_dir=RESULTS_DIR) -> str:
    """The text of ``path`` with every block of ``BLOCKS`` in it rendered anew (paths relative to the
    repository root, the working directory)."""
    text = path.read_text()
    for target, name, renderer in BLOCKS:
        if target == path:
            text = render(text, str(path), name, renderer(Path(out_dir), path))
    return text


def stale_blocks(out_dir=RESULTS_DIR) -> list[str]:
    """The files whose generated blocks differ from what ``out_dir``'s files give."""
    return [str(path) for path in dict.fromkeys(target for target, _, _ in BLOCKS)
            if regenerated(path, out_dir) != path.read_text()]


def cmd_update_docs(args) -> int:
    out = Path(args.out or RESULTS_DIR)
    for results_file in published_results(out):          # a run's two plots, drawn anew from the file
        plots_of(results_file, redraw=True)
    for path in dict.fromkeys(target for target, _, _ in BLOCKS):
        text = regenerated(path, out)
        if text != path.read_text():
            path.write_text(text)
            print(f"{path}: generated blocks rewritten from {out}")
        else:
            print(f"{path}: up to date")
    for line in recorded.publication_lines(out):
        print(line)
    return 0
