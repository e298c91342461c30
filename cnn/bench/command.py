"""The command line of ``python -m cnn bench``: its flags, checked, and which module runs each mode.

The census, the ablation and the timeline drive the CUDA stages 6 and 7, whose modules import
Numba's CUDA target: they are imported only when their mode is asked for.
"""

from __future__ import annotations

import argparse

from cnn.argtypes import count, positive_float, positive_int, seed
from cnn.bench.compare import cmd_compare, cmd_curves
from cnn.bench.demo import cmd_demo
from cnn.bench.measure import SIMULATOR_REFUSAL, simulator_on
from cnn.bench.ops import OPS, cmd_op
from cnn.bench.profiling import cmd_profile
from cnn.bench.readme import cmd_update_readme
from cnn.bench.results import RESULTS_DIR, USER_RESULTS_DIR
from cnn.bench.step_timing import cmd_stages, selected_stages
from cnn.bench.transfers import cmd_memory
from cnn.flag_aliases import add_deprecated_alias

#: the census without a GPU: the simulator counts what a GPU would run (a minute or two on the narrow copies)
CENSUS_IN_THE_SIMULATOR = "NUMBA_ENABLE_CUDASIM=1 python -m cnn bench --census --reduced"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``python -m cnn bench``."""
    from cnn.model import NETWORKS

    add = parser.add_argument
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--op", choices=OPS, help="check and time every stage's version of one operation")
    mode.add_argument("--memory", action="store_true", help="host↔device copy latency and bandwidth")
    mode.add_argument("--profile", metavar="STAGE", help="host profile and per-kernel device times of one stage")
    mode.add_argument("--compare", nargs="+", metavar="JSON", help="plot several results files side by side")
    mode.add_argument("--update-readme", nargs="*", metavar="JSON", default=None,
                      help="rewrite README's bench table (from these results files; default: the newest run of "
                           "each machine and workload, and older runs that timed stages the newer did not) and "
                           "its GPU findings")
    mode.add_argument("--headline", action="store_true",
                      help="draw docs/images/headline.png: every stage's step time on every machine, PyTorch beside "
                           "(from the quiet results files)")
    mode.add_argument("--update-docs", action="store_true",
                      help="rewrite the measured tables of docs/profiling.md and the stage docstrings from the "
                           "results files")
    mode.add_argument("--curves", nargs="+", metavar="JSON",
                      help="learning curves from histories written by python -m cnn train")
    mode.add_argument("--demo", action="store_true",
                      help="benchmark, train the fastest stage one epoch, draw every picture (make demo)")
    mode.add_argument("--census", action="store_true",
                      help="launches, copies, allocations per step of cuda-ring and cuda-tuned: counts, exact on a "
                           f"GPU or in Numba's simulator (without a GPU: {CENSUS_IN_THE_SIMULATOR})")
    mode.add_argument("--ablation", action="store_true",
                      help="time cuda-ring and each fix of cuda-tuned on its own (GPU only)")
    mode.add_argument("--timeline", action="store_true",
                      help="how much of cuda-ring's gradient copies hides under compute (GPU only)")
    mode.add_argument("--predict", action="store_true",
                      help="PREDICTED H100 step of every CUDA stage from the static report, and its error on every "
                           "committed H100 measurement (no GPU needed)")
    mode.add_argument("--static", metavar="STAGE",
                      help="every kernel of STAGE's step compiled for sm_90 without a GPU: registers, spills, "
                           "occupancy, hot-loop instruction mix, predicted H100 time (STAGE 'all': stages 4-8)")
    add("--stage", dest="stages", default=None, metavar="STAGE[,STAGE...]",
        help="the stage to time, or several, comma-separated: numpy,numba-cpu (default: every registered stage)")
    add_deprecated_alias(parser, "--stages", "--stage", dest="stages")
    add("--model", choices=list(NETWORKS), default="lenet5")
    add("--batch-size", type=positive_int, default=64)
    add("--dtype", choices=("float32", "float64"), default="float32")
    add("--data", choices=("real", "random"), default="real",
        help="real: the model's dataset (MNIST for lenet5); random: Gaussian images, random labels")
    add("--data-dir", default=None, help="directory holding the dataset (default $CNN_DATA_DIR, data/)")
    add("--steps", type=positive_int, default=20, help="timed steps per stage (fewer if --budget runs out)")
    add("--warmup", type=positive_int, default=3, help="untimed steps first (JIT compilation, caches)")
    add("--min-steps", type=positive_int, default=3, help="timed steps even when a stage exceeds --budget")
    add("--budget", type=positive_float, default=30.0, help="seconds per stage before steps are cut")
    add("--seed", type=seed, default=0)
    add("--reference", choices=("auto", "none"), default="auto",
        help="auto: PyTorch rows when torch is importable (pip install -e '.[bench]')")
    add("--out-dir", dest="out", default=None, metavar="DIR",
        help=f"the folder results files and plots go to (default {USER_RESULTS_DIR}/, git-ignored; "
             f"--out-dir {RESULTS_DIR} to commit them); --update-readme, --update-docs and --headline read "
             f"the results files from it (default {RESULTS_DIR}/, the committed ones)")
    add_deprecated_alias(parser, "--out", "--out-dir", dest="out")
    add("--pictures-dir", default=None, help="--demo: where the learning pictures go (default: --out-dir)")
    add("--no-progress", dest="progress", action="store_false", help="--demo: no progress bar while training")
    add("--readme", default="README.md", help="--update-readme: the file holding the markers")
    add("--no-plots", dest="plots", action="store_false")
    add("--demo-curve-steps", type=count, default=200, help="--demo: steps of each stage's learning curve")
    add("--reduced", action="store_true",
        help="--census: on the networks' narrow copies (same counts, smaller bytes; fast in the simulator)")
    add("--ablation-steps", type=positive_int, default=50, help="--ablation: training steps per timed call")
    add("--slots", type=positive_int, default=2, help="--timeline: gradient slots in cuda-ring's ring")
    add("--fixes", default=None, help="--static cuda-tuned: only these fixes (comma-separated; 'none' for none)")
    add("--at", default=None, metavar="COMMIT", help="--static: the kernels of an older commit (git archive)")
    add("--calibrate", action="store_true", help="--predict: fit the model's constants to the H100 files first")
    add("--vs-measured", action="store_true",
        help="--predict: the committed prediction beside the GPU measurements made since (on the GPU machine)")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m cnn bench``; returns the exit status."""
    publishes = args.update_readme is not None or args.update_docs or getattr(args, "headline", False)
    if args.out is None and not publishes:     # a run never writes into the committed results unless told to
        args.out = str(USER_RESULTS_DIR)
    if args.pictures_dir is None:
        args.pictures_dir = args.out if args.demo else str(USER_RESULTS_DIR)
    if args.update_readme is not None:
        return cmd_update_readme(args)
    if args.headline:
        from cnn.bench.headline import cmd_headline
        return cmd_headline(args)
    if args.update_docs:
        from cnn.bench.docs import cmd_update_docs
        return cmd_update_docs(args)
    if args.compare:
        return cmd_compare(args)
    if args.curves:
        return cmd_curves(args)
    if args.census:
        return census(args)
    if args.static:
        from cnn.bench.static_report import cmd_static
        return cmd_static(args)
    if args.predict:
        from cnn.bench.predict_report import cmd_predict
        return cmd_predict(args)
    check_arguments(args)
    if simulator_on():
        raise ValueError(SIMULATOR_REFUSAL)
    if args.op:
        return cmd_op(args)
    if args.memory:
        return cmd_memory(args)
    if args.profile:
        return cmd_profile(args)
    if args.demo:
        return cmd_demo(args)
    if args.ablation:
        from cnn.bench.ablation import cmd_ablation
        return cmd_ablation(args)
    if args.timeline:
        from cnn.bench.timeline import cmd_timeline
        return cmd_timeline(args)
    return cmd_stages(args)


def census(args) -> int:
    """``--census``: on a GPU, or in the simulator; without either, one line saying how to run it in the simulator."""
    from cnn.stages import cuda_unavailable_reason

    if not simulator_on() and cuda_unavailable_reason() is not None:
        raise ValueError(f"--census needs a CUDA GPU or Numba's simulator, and this machine has no GPU; the counts are "
                         f"exact in the simulator: {CENSUS_IN_THE_SIMULATOR}")
    from cnn.bench.census import cmd_census
    return cmd_census(args)


def check_arguments(args) -> None:
    """Raise ValueError (one line) for flag values argparse cannot check alone."""
    from cnn.stages import stage_names

    selected_stages(args.stages)
    if args.profile is not None and args.profile not in stage_names():
        raise ValueError(f"--profile: unknown stage {args.profile!r}; choose from {', '.join(stage_names())}")
    if args.min_steps > args.steps:
        raise ValueError(f"--min-steps {args.min_steps} is more than --steps {args.steps}")
