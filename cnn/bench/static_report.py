"""``python -m cnn bench --static STAGE``: every kernel of a stage's training step, compiled for the H100
(sm_90) on a machine with no GPU, and what its machine code says it will cost.

Per kernel: registers a thread, spills, local-memory stack, shared memory a block (static +
dynamic), the blocks an SM holds and the occupancy that gives (``static_h100``), launches a step,
and the mix of its hot loop (``static_sass``): FFMAs against all instructions, shared and global
loads per FFMA, integer divisions. Four steps, none needing a GPU:

1. record (``static_record.py``, a process with the simulator on): the launches of one training
   step at the network's real size — kernel, argument types, grid, block — without running them;
2. compile (``static_compile.py``, a process with the simulator off): each distinct kernel and
   argument types to PTX for sm_90 (numba-cuda + libNVVM);
3. assemble: ``ptxas -arch=sm_90 -v`` → cubin and its resources; ``nvdisasm`` → SASS;
4. read: occupancy from the resources and the block size; the instruction mix from the SASS.

Steps 2-4 are cached per kernel in ``results/static-sm90/`` (git-ignored), keyed by the kernel,
its argument types and a digest of the ``kernels/`` sources: a first full report compiles for a
few minutes, later ones take seconds. ``--static STAGE`` writes
``benchmarks/results/static-sm90-STAGE-MODEL-bBATCH.json`` (``--out``), from which docs/profiling.md's
tables are generated (``python -m cnn bench --update-docs``); ``--static all`` does every CUDA
stage on both networks. A new stage needs no change here: its kernels are found by recording.

The report can be made for an older commit (``tree_at``: ``git archive`` of ``cnn/`` and
``kernels/`` into the cache): the H100 measurements that ``cnn/bench/predict_step.py`` is
calibrated against were made with kernels that have changed since.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cnn.bench import static_h100, static_sass

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / "results" / "static-sm90"
HERE = Path(__file__).resolve().parent
NETWORK_BATCHES = (("lenet5", 64), ("alexnet-small", 128))


# -- steps 1 and 2: the two helper processes ---------------------------------------------------------
def run_script(script: str, arguments, tree: Path, simulator: bool) -> None:
    """Run ``cnn/bench/SCRIPT`` (of this checkout) against the source ``tree``; one ValueError line on failure."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1" if simulator else "0", "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(HERE / script), *map(str, arguments)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no message)"]
        raise ValueError(f"static report: {script} failed: {lines[-1]}")


def record_step(stage: str, model: str, batch: int, fixes: str | None = None, tree: Path = ROOT) -> dict:
    """The launches of one training step of ``stage`` (``static_record.py``), phase by phase and back to back."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "launches.json"
        run_script("static_record.py", [stage, model, batch, fixes or "all", out], tree, simulator=True)
        return json.loads(out.read_text())


def type_key(description):
    """A kernel argument's type, without its shape or value: what a compiled kernel depends on."""
    if "array" in description:
        return ["array", description["array"], description["ndim"], description["layout"]]
    for key in ("bool", "int", "float"):
        if key in description:
            return key
    if "scalar" in description:
        return ["scalar", description["scalar"]]
    if "tuple" in description:
        return ["tuple", [type_key(item) for item in description["tuple"]]]
    if "namedtuple" in description:
        return [description["namedtuple"], [type_key(item) for item in description["fields"]]]
    return description


def tree_digest(tree: Path, modules=None) -> str:
    """A digest of the tree's kernel sources (``modules``: the files a recorded step imported; default every
    file of ``kernels/``) and the compiler versions: a cached kernel is valid while it holds."""
    from importlib.metadata import version

    digest = hashlib.sha256(f"{version('numba-cuda')} {version('numba')}".encode())
    paths = [tree / module for module in modules] if modules else sorted((tree / "kernels").rglob("*.py"))
    for path in sorted(paths):
        digest.update(path.relative_to(tree).as_posix().encode() + (path.read_bytes() if path.exists() else b""))
    return digest.hexdigest()[:16]


def job_key(launch: dict) -> str:
    return json.dumps([launch["kernel"], [type_key(arg) for arg in launch["args"]]], sort_keys=True)


# -- steps 2 to 4, cached ---------------------------------------------------------------------------
def analyse(jobs: list[dict], tree: Path = ROOT, progress=None, modules=None) -> list[dict]:
    """{"resources", "mix" (static_sass.loop_mix), "error"} of each job ({"kernel", "args"}), cached under the
    digest of ``modules`` (the kernel sources the step imported)."""
    digest = tree_digest(tree, modules)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    paths = [CACHE_DIR / f"{hashlib.sha256((digest + job_key(job)).encode()).hexdigest()[:24]}.json" for job in jobs]
    missing = [number for number, path in enumerate(paths) if not path.exists()]
    if missing:
        found = static_sass.tools()
        if progress:
            progress(f"compiling {len(missing)} kernel(s) for sm_90 (numba-cuda + libNVVM, ptxas, nvdisasm)…")
        with tempfile.TemporaryDirectory() as scratch:
            scratch = Path(scratch)
            (scratch / "jobs.json").write_text(json.dumps([{"kernel": jobs[n]["kernel"], "args": jobs[n]["args"]}
                                                           for n in missing]))
            run_script("static_compile.py", [scratch / "jobs.json", scratch], tree, simulator=False)
            for index, number in enumerate(missing):
                paths[number].write_text(json.dumps(assembled(scratch, index, found)))
    return [json.loads(path.read_text()) for path in paths]


def assembled(scratch: Path, index: int, found: dict) -> dict:
    """ptxas and nvdisasm on job ``index``'s PTX; or the compile error, one line."""
    error = scratch / f"{index}.error"
    if error.exists():
        return {"error": error.read_text().strip()}
    try:
        cubin, resources = static_sass.assemble(scratch / f"{index}.ptx", found)
        return {"resources": resources, "mix": static_sass.loop_mix(static_sass.disassemble(cubin, found))}
    except ValueError as err:
        return {"error": str(err)}


def tree_at(commit: str) -> Path:
    """The ``cnn/`` and ``kernels/`` of ``commit``, extracted once into the cache (to report on what was measured)."""
    tree = CACHE_DIR / "trees" / commit
    if not (tree / "kernels").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "cnn", "kernels"], capture_output=True)
        if archive.returncode != 0:
            raise ValueError(f"static report: no commit {commit!r} in this clone ({archive.stderr.decode().strip()})")
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


# -- the report -------------------------------------------------------------------------------------
def static_report(stage: str, model: str, batch: int, fixes: str | None = None, tree: Path = ROOT,
                  progress=None) -> dict:
    """Everything the report says about one stage's step: {"stage", "model", "batch_size", "fixes",
    "kernels": [one entry a distinct compiled kernel], "phase_by_phase" / "back_to_back": [launch…]};
    each launch has "kernel" (its index in "kernels"), "grid", "block", "shared_dynamic", "args", "phase";
    the copies between them are {"copy": "to_device" | "to_host", "bytes", "phase"}."""
    recorded = record_step(stage, model, batch, fixes, tree)
    launches = [launch for launch in recorded["back_to_back"] or recorded["phase_by_phase"] if "copy" not in launch]
    every = [launch for launch in recorded["phase_by_phase"] + (recorded["back_to_back"] or []) if "copy" not in launch]
    keys = list(dict.fromkeys(job_key(launch) for launch in every))
    first = {job_key(launch): launch for launch in reversed(every)}
    analyses = analyse([first[key] for key in keys], tree, progress, recorded.get("kernel_modules"))
    kernels = []
    phased = [launch for launch in recorded["phase_by_phase"] if "copy" not in launch]
    for key, analysis in zip(keys, analyses):
        mine = [launch for launch in launches if job_key(launch) == key]
        kernels.append({"function": first[key]["function"], "ref": first[key]["kernel"],
                        "launches_per_step": len(mine),
                        "launches_phase_by_phase": sum(job_key(launch) == key for launch in phased), **analysis,
                        "occupancy": occupancies(analysis, mine or [first[key]])})
    for launch in every:
        launch["kernel"] = keys.index(job_key(launch))
    return {"stage": stage, "model": model, "batch_size": batch, "fixes": recorded["fixes"], "kernels": kernels,
            "phase_by_phase": recorded["phase_by_phase"], "back_to_back": recorded["back_to_back"],
            "steps_per_sync": recorded["steps_per_sync"], "kernel_modules": recorded.get("kernel_modules")}


def occupancies(analysis: dict, launches: list[dict]) -> list[dict]:
    """Occupancy of each distinct (block size, dynamic shared memory) the kernel is launched with."""
    if "resources" not in analysis:
        return []
    shapes = dict.fromkeys((block_threads(launch), launch.get("shared_dynamic", 0)) for launch in launches)
    resources = analysis["resources"]
    return [{"threads": threads, "shared": resources["shared_static"] + shared,
             **static_h100.occupancy(resources["registers"], threads,
                                     resources["shared_static"] + shared)._asdict()} for threads, shared in shapes]


def block_threads(launch: dict) -> int:
    x, y, z = launch["block"]
    return x * y * z


def grid_blocks(launch: dict) -> int:
    x, y, z = launch["grid"]
    return x * y * z


# -- what a reader sees --------------------------------------------------------------------------------
COLUMNS = ["kernel", "launches a step", "registers", "spills (B)", "local stack (B)", "shared a block (B)",
           "blocks/SM", "occupancy", "hot loop: FFMA / all", "LDS per FFMA", "LDG per FFMA", "div/rem in loops"]


def kernel_row(kernel: dict) -> list[str]:
    """One line of the report's table (``COLUMNS``)."""
    if "error" in kernel:
        return [f"`{kernel['function']}`", str(kernel["launches_per_step"]), f"not compiled: {kernel['error']}"] + \
               [""] * (len(COLUMNS) - 3)
    resources, mix = kernel["resources"], kernel["mix"]
    hot = mix["hot"]
    occupancy = kernel["occupancy"]
    blocks = sorted({o["blocks_per_sm"] for o in occupancy})
    percents = sorted({round(100 * o["occupancy"]) for o in occupancy})
    loops_div = mix["in_loops"]["divisions_32"] + mix["in_loops"]["divisions_64"]

    def per_ffma(count):
        return f"{count / hot['ffma']:.2f}" if hot and hot["ffma"] else "—"

    launches = str(kernel["launches_per_step"]) or "0"
    if not kernel["launches_per_step"]:
        launches = f"0 ({kernel.get('launches_phase_by_phase', 0)} phase by phase)"
    return [f"`{kernel['function']}`", launches, str(resources["registers"]),
            f"{resources['spill_stores']}/{resources['spill_loads']}", str(resources["stack"]),
            " / ".join(str(o["shared"]) for o in occupancy[:1]) + ("…" if len(occupancy) > 1 else ""),
            span(blocks), span(percents, "%") + f" ({occupancy[0]['limited_by']})" if occupancy else "",
            f"{hot['ffma']} / {hot['instructions']} ({100 * hot['ffma'] / hot['instructions']:.0f} %)" if hot else
            "no loop", per_ffma(hot["lds"]) if hot else "—", per_ffma(hot["ldg"]) if hot else "—", str(loops_div)]


def span(values, unit: str = "") -> str:
    return f"{values[0]}{unit}" if len(values) == 1 else f"{values[0]}–{values[-1]}{unit}"


def report_table(report: dict) -> str:
    from cnn.bench.tables import markdown

    return markdown(COLUMNS, [kernel_row(kernel) for kernel in report["kernels"]])


def results_path(out_dir, stage: str, model: str, batch: int, fixes: str | None = None, at: str | None = None) -> Path:
    variant = "" if fixes in (None, "all") else "-" + (fixes.replace(",", "+") or "none")
    commit = f"-at-{at}" if at else ""
    return Path(out_dir) / f"static-sm90-{stage}{variant}-{model}-b{batch}{commit}.json"


def cuda_stages() -> list[str]:
    """Every registered stage that runs CUDA kernels (4 and later: a new stage is picked up by itself)."""
    import importlib

    from cnn.stages import REGISTRY

    found = []
    for name, target in REGISTRY.items():
        module, cls = target.split(":")
        if getattr(getattr(importlib.import_module(module), cls), "device", "cpu") == "cuda":
            found.append(name)
    return found


def cmd_static(args) -> int:
    """``--static STAGE|all [--model M --batch-size B] [--fixes F,G] [--at COMMIT]``: print the table, write
    the results file (``--at``: the kernels of an older commit, e.g. those a measurement was made with)."""
    from cnn.bench.results import results_header, write_json

    stages = cuda_stages() if args.static == "all" else [args.static]
    unknown = [stage for stage in stages if stage not in cuda_stages()]
    if unknown:
        raise ValueError(f"--static: {unknown[0]!r} is not a CUDA stage; choose from {', '.join(cuda_stages())} or all")
    workloads = NETWORK_BATCHES if args.static == "all" else ((args.model, args.batch_size),)
    tree = tree_at(args.at) if args.at else ROOT
    for stage in stages:
        for model, batch in workloads:
            report = static_report(stage, model, batch, args.fixes, tree, progress=print)
            header = {**results_header("static-sm90"), **({"commit": args.at} if args.at else {})}
            path = write_json(results_path(args.out, stage, model, batch, args.fixes, args.at), {**header, **report})
            print(f"\n{stage}, {model} b{batch} — sm_90, compiled without a GPU ({path}):\n")
            print(report_table(report))
    return 0


# -- docs/profiling.md ---------------------------------------------------------------------------
def docs_block(out_dir, page: Path) -> str:
    """Every ``static-sm90-*.json`` of ``out_dir``: a table a stage and network, stages in course order,
    an older commit's report right after today's of the same stage."""
    from cnn.bench.findings import NETWORK_NAMES
    from cnn.bench.readme import relative_link
    from cnn.stages import REGISTRY

    found = []
    for path in Path(out_dir).glob("static-sm90-*.json"):
        report = json.loads(path.read_text())
        order = list(REGISTRY).index(report["stage"]) if report["stage"] in REGISTRY else len(REGISTRY)
        older = "-at-" in path.name
        found.append(((order, [m for m, _ in NETWORK_BATCHES].index(report["model"])
                       if report["model"] in dict(NETWORK_BATCHES) else 9, older, path.name), path, report))
    parts = []
    for _, path, report in sorted(found, key=lambda item: item[0]):
        name = f"{NETWORK_NAMES.get(report['model'], report['model'])} b{report['batch_size']}"
        fixes = "" if report.get("fixes") in (None, "all") else f" with fixes {report['fixes']}"
        when = f"the kernels of commit {report['commit']}" if "-at-" in path.name else f"commit {report.get('commit')}"
        total = sum(kernel["launches_per_step"] for kernel in report["kernels"])
        parts += [f"**`{report['stage']}`{fixes}, {name}** — {when}, {total} launches a step "
                  f"([`{path.name}`]({relative_link(path, page)})):", "", report_table(report), ""]
    return "\n".join(parts).strip() or "No static report yet: `python -m cnn bench --static all`."
