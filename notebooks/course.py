"""What every tutorial notebook does before it teaches: the fast switch, the CUDA simulator, showing code.

- ``fast_mode()``: True when ``CNN_FAST=1`` — tiny shapes, few steps, no full training (what CI runs,
  and what to use on a slow laptop). A notebook's parameter cell may also set ``FAST`` by hand.
- ``use_simulator_without_gpu()``: switch Numba's CUDA simulator on when this machine has no NVIDIA
  GPU. Numba reads ``NUMBA_ENABLE_CUDASIM`` once, when it is first imported, so this must run
  before anything imports numba (the first code cell of a CUDA notebook).
- ``show(function, ...)``: the library's own source of a function or class, syntax-highlighted —
  the notebooks never carry a copy of the code they explain.
- ``median_ms(call)``: how long ``call()`` takes, the median of a few runs (``cnn.bench``'s clock);
  ``load_note()``: the line printed under a timing that says how busy the machine was.
- ``recorded_results()`` / ``recorded_parallel()``: the benchmark and MPI-run results kept in
  ``benchmarks/results/`` (what GPU machines and cluster runs measured, for machines that cannot).
- ``show_recorded_bench``, ``show_findings``, ``show_ablations``, ``show_kernel_profiles``, ``probe``,
  ``recorded_copies``: what a real GPU measured, read from the committed files (``cnn.bench.recorded``)
  and shown with the device, date and file they come from — so a laptop shows what an H100 did.
- ``draw_*``: the diagrams of the notebooks (pictures only; no library logic lives here).
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import numpy as np

from cnn.grading.bytecode import python_function   # the Python function behind a Numba dispatcher
from cnn.machine import SIMULATOR_VARIABLE, nvidia_gpu_present, use_cuda_simulator_unless_gpu
REPOSITORY = Path(__file__).resolve().parent.parent
BENCH_RESULTS = REPOSITORY / "benchmarks" / "results"
PARALLEL_RESULTS = BENCH_RESULTS / "parallel"


def _show_figures_inline() -> None:
    """In a notebook, display the matplotlib Figures that ``cnn.plots`` returns as pictures."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "kernel"):
        shell.run_line_magic("matplotlib", "inline")


_show_figures_inline()


def fast_mode() -> bool:
    """True when the environment asks for a fast run: CNN_FAST set to anything but '' or '0'."""
    return os.environ.get("CNN_FAST", "0") not in ("", "0")


def simulator_requested() -> bool:
    return os.environ.get(SIMULATOR_VARIABLE, "0") not in ("", "0")


def use_simulator_without_gpu() -> bool:
    """Turn the CUDA simulator on when there is no GPU (a value already set is kept); True when it is on."""
    if SIMULATOR_VARIABLE not in os.environ and not nvidia_gpu_present() and "numba" in sys.modules:
        raise RuntimeError("numba was imported before the simulator switch; restart the kernel and run "
                           "this cell first")
    if use_cuda_simulator_unless_gpu():
        print("No GPU in use: CUDA kernels run in Numba's simulator (NUMBA_ENABLE_CUDASIM=1), one Python thread "
              "per CUDA thread,\nso the CUDA cells below use tiny shapes and report no timings.")
    else:
        print("CUDA kernels run on the GPU.")
    return simulator_requested()


def show(*objects) -> None:
    """Display the source of library functions, kernels or classes, as they are in the files."""
    from IPython.display import Markdown, display

    for obj in map(python_function, objects):
        where = Path(inspect.getsourcefile(obj)).resolve()
        try:
            where = where.relative_to(REPOSITORY)
        except ValueError:
            pass
        display(Markdown(f"`{where}` — `{obj.__qualname__}`\n```python\n{inspect.getsource(obj).rstrip()}\n```"))


def recorded_results(on_gpu: bool | None = None) -> list[dict]:
    """The benchmark results docs/benchmarks.md shows (``python -m cnn bench`` writes them): per machine and
    workload the newest run, and older runs that timed stages no newer one did, less any measured on a
    busy machine (``cnn.bench.readme.published_results``).

    ``on_gpu``: True keeps results measured with a GPU, False those without, None all of them.
    """
    from cnn.bench.readme import published_results
    from cnn.bench.results import load_results

    results = [load_results(path) for path in published_results(BENCH_RESULTS)]
    return [result for result in results if on_gpu is None or bool(result["machine"].get("gpu")) == on_gpu]


# == what a real GPU measured (the committed files) ==============================================

def _link(path) -> str:
    """A Markdown link to a results file, from this folder (GitHub shows the notebook from here)."""
    relative = Path(os.path.relpath(Path(path).resolve(), Path(__file__).resolve().parent)).as_posix()
    return f"[`{Path(path).name}`]({relative})"


def _source(path, result) -> str:
    from cnn.bench.recorded import when

    return f"{when(path, result)} — {_link(path)}"


def show_recorded_bench(model: str = "lenet5", batch: int = 64, stages=(), plots_shown=("speedup", "breakdown"),
                        needs: dict | None = None) -> None:
    """The newest GPU benchmark of ``model`` at ``batch`` that timed every stage in ``stages`` (or has the
    row keys in ``needs``): its table, named by device, date and file, and its plots."""
    from IPython.display import Markdown, display
    from cnn import plots
    from cnn.bench.recorded import bench_with
    from cnn.bench.tables import markdown_table

    found = bench_with(model, batch, needs or {name: [] for name in stages}, BENCH_RESULTS)
    if found is None:
        print(f"no GPU benchmark of {model} at batch {batch} with {', '.join(stages or needs)} in "
              f"benchmarks/results yet: run `python -m cnn bench` on a machine with a GPU")
        return
    path, result = found
    display(Markdown(f"**Measured on a real GPU:** {_source(path, result)}\n\n{markdown_table(result)}"))
    drawers = {"speedup": plots.speedup_plot, "breakdown": plots.breakdown_plot}
    for kind in plots_shown:
        display(drawers[kind](result, save_to=None))


def show_findings(*names: str) -> None:
    """The paragraphs of ``cnn.bench.findings`` (all, or those named: "first_port", "launch_bound", "graph",
    "alexnet", "training", "fused_net"), every figure read from the committed files, with links to them."""
    from IPython.display import Markdown, display
    from cnn.bench import findings

    chosen = [getattr(findings, f"finding_{name}") for name in names] if names else findings.FINDINGS
    paragraphs = [text for text in (finding(BENCH_RESULTS, _link) for finding in chosen) if text]
    display(Markdown("\n\n".join(paragraphs) if paragraphs else "No GPU measurements in benchmarks/results yet."))


def show_ablations() -> None:
    """Stage 7's newest complete ablation of each network (every fix), then those of only some fixes timed since
    (``--fixes``): the table and the picture, named by device, date and file."""
    from IPython.display import Markdown, display
    from cnn import plots
    from cnn.bench.recorded import ablations
    from cnn.bench.tables import ablation_table

    runs = {}
    for path, result in ablations(BENCH_RESULTS):                             # files come oldest first
        runs.setdefault((result["model"], result["batch_size"]), []).append((path, result))
    if not runs:
        print("no ablation recorded yet: run `python -m cnn bench --ablation` on a GPU")
    for (model, batch), found in sorted(runs.items(), key=lambda item: item[0][0] != "lenet5"):
        most_rows = max(len(result["rows"]) for _, result in found)
        complete = max(index for index, (_, result) in enumerate(found) if len(result["rows"]) == most_rows)
        for path, result in found[complete:]:
            display(Markdown(f"**{model}, batch {batch}** — {_source(path, result)}\n\n"
                             + ablation_table([(f"{model} b{batch}", result)])))
            display(plots.ablation_plot(result, save_to=None))


def show_kernel_profiles(model: str | None = None, stage: str | None = None) -> None:
    """Every Nsight Compute profile recorded (of ``model`` and ``stage`` only, if given): its per-kernel table."""
    from IPython.display import Markdown, display
    from cnn.bench.nsight import kernel_summary, share_words
    from cnn.bench.recorded import ncu_profiles
    from cnn.bench.tables import kernel_table

    profiles = [p for p in ncu_profiles(BENCH_RESULTS) if model in (None, p["model"]) and stage in (None, p["stage"])]
    if not profiles:
        print("no Nsight Compute profile recorded yet: benchmarks/gpu_session.sh ncu, on a GPU")
    for profile in profiles:
        summary = kernel_summary(profile["path"])
        display(Markdown(f"**{profile['stage']}, {profile['model']} b{profile['batch']}** — {profile['device']}, "
                         f"{profile['date']}{', commit ' + profile['tag'] if profile['tag'] else ''} — "
                         f"{_link(profile['path'])}: {summary['total_us'] / 1e3:.3g} ms of kernel time a step: "
                         f"{share_words(summary['shares'])}\n\n{kernel_table(summary)}"))


def probe(name: str) -> float:
    """One figure of the probes file (small programs run on the GPU machine; the file says how)."""
    from cnn.bench.recorded import probe as recorded_probe

    return recorded_probe(name, BENCH_RESULTS)


def show_probes(*names: str) -> None:
    """The probes file's figures (all, or those named): value, unit, what was measured, and how."""
    from IPython.display import Markdown, display
    from cnn.bench.recorded import probes
    from cnn.bench.tables import markdown

    found = probes(BENCH_RESULTS)
    if found is None:
        print("no probes file in benchmarks/results")
        return
    path, content = found
    rows = [[f"{figure['value']:g} {figure['unit']}", figure["what"], figure["how"]]
            for name, figure in content["figures"].items() if not names or name in names]
    display(Markdown(f"**{content['device']}, {content['created']}, commit {content['commit']}** — {_link(path)}"
                     f"\n\n" + markdown(["value", "what", "how it was measured"], rows)))


def recorded_copies() -> tuple[Path, dict] | None:
    """(path, result) of the newest host↔device copy measurement made on a GPU, or None."""
    from cnn.bench.recorded import memory_result

    return memory_result(BENCH_RESULTS)


def recorded_parallel(*strategies) -> list[dict]:
    """Run summaries of ``python -m cnn.parallel`` kept in benchmarks/results/parallel (all, or these strategies)."""
    from cnn.parallel.report import load

    summaries = load(sorted(PARALLEL_RESULTS.glob("*.json"))) if PARALLEL_RESULTS.is_dir() else []
    summaries = [summary for summary in summaries if "strategy" in summary]      # not the timelines
    return [summary for summary in summaries if not strategies or summary["strategy"] in strategies]


def median_ms(call, repeats: int = 5, synchronize=lambda: None) -> float:
    """Median milliseconds of ``call()`` over ``repeats`` runs after one untimed warm-up run."""
    from cnn.bench.measure import HostClock, summarize

    clock = HostClock(synchronize)
    call()
    return summarize([clock.time(call) for _ in range(repeats)])["median"]


def load_note() -> str:
    """One line to print under a timing: the machine's 1-minute load average against its cores, and, when
    other work kept it busy (``cnn.machine.busy_note``), that the times above are inflated."""
    from cnn.machine import busy_note

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if load is None:
        return "(the machine's load is unknown here: times taken while other work runs are inflated)"
    busy = busy_note({"load_average": [load], "cores": cores})
    return (f"(timed at a 1-minute load average of {load:.1f} on {cores} cores: "
            + ("the machine was busy with other work, so these times are inflated)" if busy else "a quiet machine)"))


def random_array(rng, *shape, dtype=np.float64) -> np.ndarray:
    """Standard-normal numbers of the given shape: continuous, so max-pool windows have no ties."""
    return rng.standard_normal(shape).astype(dtype)


# == diagrams ====================================================================================

def _figure(width, height):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _grid(axes, rows, cols, values=None, colors=None, origin=(0, 0), fontsize=8):
    """Draw a rows × cols grid of unit squares at ``origin`` (x, y of the top-left corner)."""
    from matplotlib.patches import Rectangle

    x0, y0 = origin
    for r in range(rows):
        for c in range(cols):
            color = "white" if colors is None else colors[r][c]
            axes.add_patch(Rectangle((x0 + c, y0 - r - 1), 1, 1, facecolor=color, edgecolor="black", linewidth=0.6))
            if values is not None:
                axes.text(x0 + c + 0.5, y0 - r - 0.5, values[r][c], ha="center", va="center", fontsize=fontsize)


def draw_convolution(size=6, kernel=3, stride=1, out=(1, 2)):
    """One output of a convolution and the window of input pixels it sums over: y[i, j] = Σ W[p, q]·x[i·s + p, j·s + q]."""
    i, j = out
    outputs = (size - kernel) // stride + 1
    figure = _figure(9, 3.6)
    axes = figure.add_subplot()
    colors = [["#fbe3c8" if i * stride <= r < i * stride + kernel and j * stride <= c < j * stride + kernel
               else "white" for c in range(size)] for r in range(size)]
    _grid(axes, size, size, [[f"x{r}{c}" for c in range(size)] for r in range(size)], colors, origin=(0, 0))
    _grid(axes, kernel, kernel, [[f"W{p}{q}" for q in range(kernel)] for p in range(kernel)],
          [["#f4b183"] * kernel for _ in range(kernel)], origin=(size + 1.5, -(size - kernel) / 2))
    out_colors = [["#c55a11" if (r, c) == (i, j) else "white" for c in range(outputs)] for r in range(outputs)]
    _grid(axes, outputs, outputs, [[f"y{r}{c}" for c in range(outputs)] for r in range(outputs)], out_colors,
          origin=(size + kernel + 3, -(size - outputs) / 2))
    axes.text(size / 2, 0.4, f"input x ({size}×{size})", ha="center")
    axes.text(size + 1.5 + kernel / 2, 0.4 - (size - kernel) / 2, f"filter W ({kernel}×{kernel})", ha="center")
    axes.text(size + kernel + 3 + outputs / 2, 0.4 - (size - outputs) / 2, f"output y ({outputs}×{outputs})",
              ha="center")
    axes.set_title(f"y[{i},{j}] = b + Σ_p Σ_q W[p,q] · x[{i}·{stride}+p, {j}·{stride}+q]   (the shaded window)",
                   fontsize=10)
    axes.set_xlim(-0.5, size + kernel + outputs + 3.5)
    axes.set_ylim(-size - 0.5, 1)
    axes.set_aspect("equal")
    axes.axis("off")
    return figure


def draw_im2col(size=4, kernel=3):
    """A 1-channel size×size input, and the matrix whose rows are its kernel×kernel windows (stride 1)."""
    from matplotlib import colormaps

    outputs = size - kernel + 1
    palette = colormaps["tab10"]
    figure = _figure(10, 3.8)
    axes = figure.add_subplot()
    _grid(axes, size, size, [[str(r * size + c) for c in range(size)] for r in range(size)], origin=(0, 0),
          fontsize=9)
    rows = []
    for i in range(outputs):
        for j in range(outputs):
            rows.append([str((i + p) * size + j + q) for p in range(kernel) for q in range(kernel)])
    colors = [[palette(k % 10)[:3] + (0.35,)] * (kernel * kernel) for k in range(len(rows))]
    _grid(axes, len(rows), kernel * kernel, rows, colors, origin=(size + 2, 0), fontsize=9)
    for k in range(len(rows)):
        axes.text(size + 1.6, -k - 0.5, f"window ({k // outputs},{k % outputs})", ha="right", va="center",
                  fontsize=8, color=palette(k % 10))
    axes.text(size / 2, 0.4, "input pixels, numbered", ha="center")
    axes.text(size + 2 + kernel * kernel / 2, 0.4, f"cols: one row per window, {kernel}·{kernel} columns",
              ha="center")
    axes.set_title(f"im2col: a {kernel}×{kernel} convolution of a {size}×{size} image is cols ({len(rows)}×"
                   f"{kernel * kernel}) times the filter as a column — pixels in several windows are copied",
                   fontsize=10)
    axes.set_xlim(-0.5, size + 2 + kernel * kernel + 0.5)
    axes.set_ylim(-max(size, len(rows)) - 0.5, 1)
    axes.set_aspect("equal")
    axes.axis("off")
    return figure


def draw_grid_of_blocks(count=20, threads_per_block=8):
    """A 1-D launch: blocks of threads laid over an array; thread k = blockIdx.x · blockDim.x + threadIdx.x."""
    from matplotlib.patches import Rectangle

    blocks = -(-count // threads_per_block)
    figure = _figure(11, 2.8)
    axes = figure.add_subplot()
    for b in range(blocks):
        axes.add_patch(Rectangle((b * threads_per_block - 0.1, -0.15), threads_per_block, 1.9,
                                 facecolor=f"C{b}", alpha=0.15, edgecolor=f"C{b}"))
        axes.text(b * threads_per_block + threads_per_block / 2 - 0.5, 1.95, f"block {b}", ha="center",
                  color=f"C{b}")
        for t in range(threads_per_block):
            k = b * threads_per_block + t
            idle = k >= count
            axes.text(k + 0.4, 1.25, f"t{t}", ha="center", fontsize=8, color="grey" if idle else "black")
            axes.add_patch(Rectangle((k, 0), 0.8, 0.8, facecolor="white" if idle else "#dbe9f6",
                                     edgecolor="grey" if idle else "black", linestyle=":" if idle else "-"))
            axes.text(k + 0.4, 0.4, "—" if idle else str(k), ha="center", va="center", fontsize=8)
    axes.text(-0.5, 0.4, "a[k]", ha="right", va="center")
    axes.set_title(f"grid = {blocks} blocks × {threads_per_block} threads for {count} elements: thread t of block b "
                   f"handles k = b·{threads_per_block} + t;  the last {blocks * threads_per_block - count} threads "
                   "fail `if k < a.size` and do nothing", fontsize=10)
    axes.set_xlim(-2, blocks * threads_per_block)
    axes.set_ylim(-0.5, 2.4)
    axes.axis("off")
    return figure


def draw_pull_push(size=6, kernel=3):
    """Backward of a 1-D convolution both ways: pull (each dx gathers) and push (each dy scatters).

    Push: arrows meeting at one dx are threads writing the same address at once — an atomic add.
    """
    outputs = size - kernel + 1
    shift = (size - outputs) / 2
    figure = _figure(11, 3.4)
    pull, push = figure.subplots(1, 2)
    for axes in (pull, push):
        for j in range(outputs):
            _box(axes, j + shift, 1.6, f"dy{j}", "#f4b183")
        for h in range(size):
            writers = sum(1 for j in range(outputs) if j <= h < j + kernel)
            _box(axes, h, 0, f"dx{h}", "#f8cbad" if axes is push and writers > 1 else "#dbe9f6")
        for j in range(outputs):
            for h in range(j, j + kernel):
                # from what a thread reads (dy) to what it writes (dx), in the colour of the thread doing it
                color = f"C{j}" if axes is push else f"C{h}"
                axes.annotate("", xy=(h + 0.4, 0.8), xytext=(j + shift + 0.4, 1.6),
                              arrowprops=dict(arrowstyle="->", color=color, alpha=0.75))
        axes.set_xlim(-0.5, size + 0.5)
        axes.set_ylim(-0.4, 2.7)
        axes.axis("off")
    pull.set_title("pull (gather): one thread per dx, it reads every dy whose window covers it\n"
                   "(arrows coloured by the thread that follows them) — each dx written once, no races",
                   fontsize=9)
    push.set_title("push (scatter): one thread per dy, it adds into every dx under its window\n"
                   "(arrows coloured by thread) — red dx get adds from several threads: atomics", fontsize=9)
    return figure


def _box(axes, x, y, text, color):
    from matplotlib.patches import Rectangle

    axes.add_patch(Rectangle((x, y), 0.8, 0.8, facecolor=color, edgecolor="black", linewidth=0.6))
    axes.text(x + 0.4, y + 0.4, text, ha="center", va="center", fontsize=8)


def draw_server_and_ring(workers=4):
    """Where a step's gradients travel: to and from one parameter server, or around a ring."""
    import math

    figure = _figure(10, 4.4)
    server, ring = figure.subplots(1, 2)
    angles = [math.pi / 2 + 2 * math.pi * k / workers for k in range(workers)]
    spots = [(math.cos(a), math.sin(a)) for a in angles]
    for axes in (server, ring):
        axes.set_xlim(-1.6, 1.6)
        axes.set_ylim(-1.5, 1.5)
        axes.set_aspect("equal")
        axes.axis("off")
    for k, (x, y) in enumerate(spots):
        server.annotate("", xy=(0.15 * x, 0.15 * y), xytext=(0.8 * x, 0.8 * y),
                        arrowprops=dict(arrowstyle="->", color="C1", lw=1.5))
        server.annotate("", xy=(0.8 * x + 0.08 * y, 0.8 * y - 0.08 * x), xytext=(0.15 * x + 0.08 * y, 0.15 * y - 0.08 * x),
                        arrowprops=dict(arrowstyle="->", color="C2", lw=1.5))
        server.text(x, y, f"worker {k + 1}", ha="center", va="center", bbox=dict(boxstyle="round", fc="#dbe9f6"))
        nx, ny = spots[(k + 1) % workers]
        ring.annotate("", xy=(0.75 * nx + 0.25 * x, 0.75 * ny + 0.25 * y), xytext=(0.75 * x + 0.25 * nx, 0.75 * y + 0.25 * ny),
                      arrowprops=dict(arrowstyle="->", color="C1", lw=1.5))
        ring.text(x, y, f"rank {k}", ha="center", va="center", bbox=dict(boxstyle="round", fc="#dbe9f6"))
    server.text(0, 0, "server", ha="center", va="center", bbox=dict(boxstyle="round", fc="#f4b183"))
    server.set_title(f"parameter server: {workers} gradients in (orange),\n{workers} weight vectors out (green),\n"
                     "all through the server's one link", fontsize=9)
    ring.set_title("ring allreduce: each rank sends 2·(P−1) chunks\nof N/P numbers to its neighbour;\n"
                   "every link carries about 2N, whatever P", fontsize=9)
    return figure
