"""What the committed GPU measurements say, in sentences whose every figure is read from a file.

Each ``finding_*`` returns one Markdown paragraph (or None when the files it needs are not there):
the claim in bold, then the figures and the file each comes from. The wording follows the numbers
(``faster``/``slower`` is decided by them), so a re-measurement that turns a result around turns
the sentence around too. README (``--update-readme``) and docs/profiling.md (``--update-docs``)
print the same paragraphs; ``link(path)`` makes a results path into a link from the page that shows it.
"""

from __future__ import annotations

from pathlib import Path

from cnn.bench import recorded
from cnn.bench.nsight import kernel_summary
from cnn.bench.results import RESULTS_DIR, slug
from cnn.formatting import fmt_factor, fmt_ms

NETWORK_NAMES = {"lenet5": "LeNet-5", "alexnet-small": "AlexNet-small"}
LENET, ALEXNET = ("lenet5", 64), ("alexnet-small", 128)


def plain_link(path) -> str:
    return f"[`{Path(path).name}`]({Path(path).as_posix()})"


def ratio(slow: float, fast: float) -> str:
    """'3.0×' (how many times ``fast`` is faster than ``slow``)."""
    return fmt_factor(slow / fast)


def faster_or_slower(time: float, other: float) -> str:
    return "faster than" if time < other else "slower than"


def b2b(result: dict, name: str) -> float:
    return recorded.row(result, name)["back_to_back_ms"]["median"]


def step(result: dict, name: str) -> float:
    return recorded.row(result, name)["step_ms"]["median"]


def finding_first_port(out_dir=RESULTS_DIR, link=plain_link) -> str | None:
    """Stage 4 against the compiled CPU stage on the GPU machine's host, both networks."""
    lenet = recorded.bench_with(*LENET, {"cuda": [], "numba-cpu": []}, out_dir)
    alex = recorded.bench_with(*ALEXNET, {"cuda": [], "numba-cpu": []}, out_dir)
    if lenet is None:
        return None
    path, result = lenet
    gpu, cpu = step(result, "cuda"), step(result, "numba-cpu")
    cores = result["machine"]["cores"]
    text = (f"**The first CUDA port is {faster_or_slower(gpu, cpu)} the compiled CPU stage on LeNet-5.** Stage 4 "
            f"`cuda` took {fmt_ms(gpu)} ms a training step (batch 64, phase by phase) on the "
            f"{result['machine']['gpu']['name']}, stage 3 `numba-cpu` {fmt_ms(cpu)} ms on the same machine's "
            f"{cores} CPU cores; the GPU step is {recorded.row(result, 'cuda')['launches_per_step']} kernel "
            f"launches ({link(path)}).")
    if alex:
        path, result = alex
        gpu, cpu = step(result, "cuda"), step(result, "numba-cpu")
        text += (f" On AlexNet-small (batch 128), with more arithmetic a launch, it is "
                 f"{ratio(max(gpu, cpu), min(gpu, cpu))} {faster_or_slower(gpu, cpu)} `numba-cpu` "
                 f"({fmt_ms(gpu)} against {fmt_ms(cpu)} ms, {link(path)}).")
    return text


def finding_launch_bound(out_dir=RESULTS_DIR, link=plain_link) -> str | None:
    """PyTorch eager against PyTorch as one graph, and our stage 6, on LeNet-5; the launch cost probes."""
    found = recorded.bench_with(*LENET, {"torch-cuda": ["back_to_back_ms", "graph_ms"],
                                         "cuda-ring": ["back_to_back_ms"]}, out_dir)
    if found is None:
        return None
    path, result = found
    eager, graph = b2b(result, "torch-cuda"), recorded.row(result, "torch-cuda")["graph_ms"]["median"]
    ring = recorded.row(result, "cuda-ring")
    text = (f"**On LeNet-5, PyTorch eager and our stages are launch-bound.** Steps back to back (one wait at the "
            f"end, as training runs them): PyTorch eager took {fmt_ms(eager)} ms a step, the same step captured "
            f"as one CUDA graph {fmt_ms(graph)} ms — {ratio(eager, graph)} less for the same kernels, so most of "
            f"the eager step is the host launching them. Stage 6 `cuda-ring` took {fmt_ms(b2b(result, 'cuda-ring'))} "
            f"ms with {ring['launches_per_step']} launches a step ({link(path)})")
    found = recorded.probes(out_dir)
    if found:
        one, eight = (found[1]["figures"][name]["value"] for name in ("launch_1_array_us", "launch_8_arrays_us"))
        launches = ring["launches_per_step"]
        text += (f"; one numba-cuda launch costs {one:g} µs of host time with one array argument and {eight:g} µs "
                 f"with eight ({link(found[0])}), so its {launches} launches alone take "
                 f"{fmt_ms(launches * one / 1e3)}–{fmt_ms(launches * eight / 1e3)} ms of the host's time a step")
    return text + "."


def finding_graph(out_dir=RESULTS_DIR, link=plain_link) -> str | None:
    """What stage 7's cuda-graph fix bought, and where cuda-tuned stands against PyTorch."""
    lenet = recorded.ablation_with(*LENET, "+ cuda-graph alone", out_dir)
    if lenet is None:
        return None
    bench = recorded.bench_with(*LENET, {"cuda-tuned": ["back_to_back_ms"],
                                         "torch-cuda": ["back_to_back_ms", "graph_ms"]}, out_dir,
                                device=recorded.gpu_name(lenet[1]))       # the ablation's GPU, not another's
    if bench is None:
        return None
    path, result = lenet
    alone = recorded.ablation_row(result, "+ cuda-graph alone")
    base = recorded.ablation_row(result, "+ device-epoch alone")["median_ms"]
    tuned, (bench_path, bench_result) = result["rows"][-1], bench
    ours, eager = b2b(bench_result, "cuda-tuned"), b2b(bench_result, "torch-cuda")
    graph = recorded.row(bench_result, "torch-cuda")["graph_ms"]["median"]
    text = (f"**A CUDA graph changes that.** In stage 7's ablation the fix `cuda-graph` alone made the LeNet-5 "
            f"step {fmt_factor(alone['speedup_vs_baseline'])} faster ({fmt_ms(base)} → {fmt_ms(alone['median_ms'])} "
            f"ms, {alone['launches_per_step']} launch a step; {link(path)}). With every fix, `cuda-tuned` takes "
            f"{fmt_ms(tuned['median_ms'])} ms in the ablation and {fmt_ms(ours)} ms back to back in the benchmark: "
            f"{ratio(max(ours, eager), min(ours, eager))} {faster_or_slower(ours, eager)} PyTorch eager "
            f"({fmt_ms(eager)} ms), and {ratio(max(ours, graph), min(ours, graph))} "
            f"{faster_or_slower(ours, graph)} PyTorch as one graph ({fmt_ms(graph)} ms; {link(bench_path)}).")
    alex = recorded.ablation_with(*ALEXNET, "+ cuda-graph alone", out_dir)
    if alex:
        row = recorded.ablation_row(alex[1], "+ cuda-graph alone")
        text += (f" On AlexNet-small the graph alone changes the step by {fmt_factor(row['speedup_vs_baseline'])} "
                 f"({link(alex[0])}): its time is in the kernels, not in launching them.")
    return text


def verdict(factors) -> str:
    """What a fix did, from what it bought in each measurement (× above 1: faster)."""
    if all(factor < 1 for factor in factors):
        return "made the step slower, not faster"
    if all(factor > 1 for factor in factors):
        return "made the step faster"
    return "changed the step"


def conv_backward_share(profile: dict) -> str:
    return f"{100 * profile['shares']['conv backward']:.0f} %"


def finding_alexnet(out_dir=RESULTS_DIR, link=plain_link) -> str | None:
    """AlexNet-small: cuda-tuned against PyTorch; what tiled-conv did; where Nsight Compute puts the time."""
    bench = recorded.bench_with(*ALEXNET, {"cuda-tuned": ["back_to_back_ms"],
                                           "torch-cuda": ["back_to_back_ms", "graph_ms"]}, out_dir)
    if bench is None:
        return None
    path, result = bench
    ours, eager = b2b(result, "cuda-tuned"), b2b(result, "torch-cuda")
    graph = recorded.row(result, "torch-cuda")["graph_ms"]["median"]
    text = (f"**On AlexNet-small, stage 7's kernels are {faster_or_slower(ours, graph).split()[0]} than PyTorch's in "
            f"device time.** On the {recorded.gpu_name(result)}, `cuda-tuned` takes {fmt_ms(ours)} ms "
            f"a step back to back — one graph launch a step, so this is the GPU's own time — against PyTorch's "
            f"{fmt_ms(eager)} ms eager and {fmt_ms(graph)} ms as one graph ({ratio(ours, graph)} the time of PyTorch's graph; "
            f"{link(path)}).")
    tiled = {model: recorded.ablation_with(model, batch, "+ tiled-conv alone", out_dir) for model, batch in (ALEXNET, LENET)}
    if all(tiled.values()):
        parts, factors = [], []
        for model, (ablation_path, ablation) in tiled.items():
            alone = recorded.ablation_row(ablation, "+ tiled-conv alone")
            added = next(r for r in ablation["rows"] if r["variant"].startswith("cumulative") and
                         r["fixes"] and r["fixes"][-1] == "tiled-conv")
            factors += [alone["speedup_vs_baseline"], added["speedup_vs_baseline"]]
            parts.append(f"{NETWORK_NAMES[model]} {fmt_factor(alone['speedup_vs_baseline'])} alone and "
                         f"{fmt_factor(added['speedup_vs_baseline'])} on top of the fixes before it "
                         f"({link(ablation_path)})")
        text += (f" The fix `tiled-conv`, which replaced the direct convolution kernels by tiled implicit matrix "
                 f"products, {verdict(factors)}: {'; '.join(parts)} "
                 f"(below 1×: slower).")
    device = slug(recorded.gpu_name(result))            # as the profiles' file names spell it
    profiles = [p for p in recorded.ncu_profiles(out_dir)
                if (p["stage"], p["model"], p["batch"], p["device"]) == ("cuda-tuned", *ALEXNET, device)]
    if profiles:
        profile = kernel_summary(profiles[-1]["path"])
        top = max(profile["kernels"], key=lambda k: k["share"])
        text += (f" Nsight Compute puts {conv_backward_share(profile)} of the kernel time of a `cuda-tuned` "
                 f"AlexNet-small step ({fmt_ms(profile['total_us'] / 1e3)} ms) in the convolutions' backward "
                 f"pass; the largest kernel, `{top['kernel']}` — {top['role']} — takes {100 * top['share']:.0f} % "
                 f"at {top['sm_percent'][0]:.0f}–{top['sm_percent'][1]:.0f} % of the SMs' peak throughput "
                 f"({link(profiles[-1]['path'])}).")
    return text


def finding_fused_net(out_dir=RESULTS_DIR, link=plain_link) -> str | None:
    """Stage 8 against stage 7 and PyTorch (eager and as one CUDA graph), both networks; its 10 epochs of MNIST."""
    needs = {"cuda-fused-net": ["back_to_back_ms"], "cuda-tuned": ["back_to_back_ms"],
             "torch-cuda": ["back_to_back_ms", "graph_ms"]}
    found = [(model, batch, bench) for model, batch in (LENET, ALEXNET)
             if (bench := recorded.bench_with(model, batch, needs, out_dir))]
    if not found:
        return None
    parts, fastest = [], True
    for model, batch, (path, result) in found:
        fused = b2b(result, "cuda-fused-net")
        others = {"PyTorch as one CUDA graph": recorded.row(result, "torch-cuda")["graph_ms"]["median"],
                  "PyTorch eager": b2b(result, "torch-cuda"), "stage 7": b2b(result, "cuda-tuned")}
        fastest = fastest and all(fused < other for other in others.values())
        against = ", ".join(f"{ratio(max(fused, other), min(fused, other))} {faster_or_slower(fused, other)} "
                            f"{name} ({fmt_ms(other)} ms)" for name, other in others.items())
        spread = recorded.row(result, "cuda-fused-net")["back_to_back_ms"]
        parts.append(f"{NETWORK_NAMES[model]} b{batch} on the {recorded.gpu_name(result)}: {fmt_ms(fused)} ms a step "
                     f"({fmt_ms(spread['min'])}–{fmt_ms(spread['max'])} over {spread['n']} runs), {against} "
                     f"({link(path)})")
    networks = "both networks" if len(found) == 2 else NETWORK_NAMES[found[0][0]]
    claim = (f"the fastest way to train {networks}" if fastest else
             f"not the fastest way to train {networks} in every row below")
    text = (f"**Stage 8 `cuda-fused-net`, the whole step in three kernels, is {claim}.** Steps back to back, as "
            f"training runs them: {'; '.join(parts)}.")
    training = recorded.training_run("cuda-fused-net", out_dir)
    if training:
        path, history = training
        epochs = history["epochs"]
        first, later = recorded.epoch_seconds(history)
        text += (f" {len(epochs)} epochs of MNIST reached {history['final_test_accuracy']:.2%} test accuracy at "
                 f"{later:.3g} s of training an epoch after the first ({first:.1f} s, which compiles every kernel; "
                 f"{link(path)}).")
    return text


def finding_training(out_dir=RESULTS_DIR, link=plain_link) -> str | None:
    """10 epochs of MNIST with cuda-tuned: accuracy, the first epoch (compilation) and the others."""
    found = recorded.training_run("cuda-tuned", out_dir)
    if found is None:
        return None
    path, history = found
    epochs = history["epochs"]
    first, later = recorded.epoch_seconds(history)
    return (f"**Training.** {len(epochs)} epochs of MNIST with `cuda-tuned` (LeNet-5, batch "
            f"{history['config']['batch_size']}) reached {history['final_test_accuracy']:.2%} test accuracy; "
            f"the first epoch took {first:.1f} s of training (it compiles every kernel), each later one "
            f"{later:.2f} s ({link(path)}).")


FINDINGS = (finding_first_port, finding_launch_bound, finding_graph, finding_alexnet, finding_training,
            finding_fused_net)


def findings(out_dir=RESULTS_DIR, link=plain_link) -> list[str]:
    """Every finding the committed files support, in the order the course tells them."""
    return [text for text in (finding(out_dir, link) for finding in FINDINGS) if text]
