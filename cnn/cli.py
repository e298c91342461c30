"""Command line: ``cnn train | evaluate | data | stages | bench`` (``python -m cnn ...`` is the same).

Every mistake a user can make — a bad flag, an impossible shape, a missing or corrupt data file, a
CUDA stage on a machine without a GPU — ends in one line on stderr and a non-zero exit code
(2 for bad input, 1 for a run that failed), never in a traceback.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from cnn.argtypes import count, decay_factor, momentum, non_negative_float, positive_float, positive_int, seed
from cnn.interrupt import politely
from cnn.model import INIT_SCHEMES, NETWORKS
from cnn.train import SCHEDULES, TrainConfig

EXIT_BAD_INPUT, EXIT_FAILED = 2, 1


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is a single line (no usage dump) and exits with 2."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def program_name() -> str:
    """How help and errors name the command: ``cnn`` when run as the console script, else ``python -m cnn``."""
    return "cnn" if Path(sys.argv[0]).name == "cnn" else "python -m cnn"


def _stage_choices():
    from cnn.stages import stage_names
    return stage_names()


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The training flags, shared by ``train`` and by ``python -m cnn.parallel``."""
    defaults = TrainConfig()
    add = parser.add_argument
    add("--model", choices=list(NETWORKS), default=defaults.model)
    add("--stage", choices=_stage_choices(), default=defaults.stage)
    add("--epochs", type=positive_int, default=defaults.epochs)
    add("--batch-size", type=positive_int, default=defaults.batch_size)
    add("--lr", type=positive_float, default=defaults.lr, help="learning rate η")
    add("--momentum", type=momentum, default=defaults.momentum)
    add("--weight-decay", type=non_negative_float, default=defaults.weight_decay, help="L2 strength λ")
    add("--schedule", choices=SCHEDULES, default=defaults.schedule)
    add("--step-epochs", type=positive_int, default=defaults.step_epochs)
    add("--gamma", type=decay_factor, default=defaults.gamma)
    add("--lr-scale", type=positive_float, default=defaults.lr_scale, help="warmup: target = lr-scale · lr")
    add("--warmup-epochs", type=non_negative_float, default=defaults.warmup_epochs)
    add("--init", choices=INIT_SCHEMES, default=defaults.init)
    add("--seed", type=seed, default=defaults.seed)
    add("--dtype", choices=("float32", "float64"), default=defaults.dtype)
    add("--data-dir", default=None, help="directory holding the dataset files")
    add("--limit-train", type=positive_int, default=None, help="train on the first N images only")
    add("--limit-test", type=positive_int, default=None, help="evaluate on the first N test images only")
    add("--eval-every", type=count, default=defaults.eval_every, help="evaluate every N steps too")
    add("--eval-subset", type=positive_int, default=defaults.eval_subset)
    add("--checkpoint", default=None, help="checkpoint file (.npz), written atomically")
    add("--checkpoint-every", type=count, default=defaults.checkpoint_every)
    add("--resume", action="store_true", help="continue from --checkpoint if it exists")
    add("--no-progress", dest="progress", action="store_false")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {field.name for field in fields(TrainConfig)}
    return TrainConfig(**{key: value for key, value in vars(args).items() if key in names}).check()


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=program_name(), description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    train = commands.add_parser("train", help="train a network with one stage")
    add_training_arguments(train)
    train.add_argument("--out", default=None, help="history JSON (default results/train-MODEL-STAGE.json)")

    evaluate = commands.add_parser("evaluate", help="test accuracy of a checkpoint")
    evaluate.add_argument("--checkpoint", required=True)
    evaluate.add_argument("--stage", choices=_stage_choices(), default=None, help="default: the one it was trained with")
    evaluate.add_argument("--data-dir", default=None)

    data = commands.add_parser("data", help="where MNIST is and whether its checksums hold")
    data.add_argument("--data-dir", default=None)
    data.add_argument("--download", action="store_true", help="fetch MNIST if it is not found")

    commands.add_parser("stages", help="list the stages and whether each can run here")

    from cnn.bench.command import add_arguments
    add_arguments(commands.add_parser("bench", help="time every stage, write results and plots"))
    return parser


@politely    # SIGINT/SIGTERM stop training politely, and one after training waits for the history to be saved
def cmd_train(args) -> int:
    """Train; the history goes to --out, checked writable before training. A run that stops early
    (divergence, a checkpoint that cannot be written, SIGINT/SIGTERM) still saves its history and says where."""
    from cnn.bench.results import load_average
    from cnn.checkpoint import check_writable, save_history
    from cnn.machine import machine_info
    from cnn.train import CheckpointWriteFailed, TrainingDiverged, TrainingStopped, pace_line, train

    config = config_from_args(args)
    out = Path(args.out or f"results/train-{config.model}-{config.stage}.json")
    check_writable(out, "--out")
    load = load_average()       # as the run begins: how much other work shares the cores (the history says it)
    try:
        history = train(config)
    except (TrainingDiverged, CheckpointWriteFailed, TrainingStopped) as err:
        _, where = save_history(err.history, out)
        print(f"{program_name()} train: {err}; {where}", file=sys.stderr)
        return getattr(err, "exit_code", EXIT_FAILED)      # a polite stop: 130 (SIGINT) or 143 (SIGTERM)
    history["machine"] = {**machine_info(), "load_average": load}
    history["command"] = "python -m cnn " + " ".join(sys.argv[1:])
    saved_to, where = save_history(history, out)
    epochs = len(history["epochs"])
    print(f"final test accuracy {history['final_test_accuracy']:.2%} after {epochs} epoch{'s' if epochs != 1 else ''}, "
          f"{pace_line(history)}" + (f"; {where}" if saved_to == out else ""))
    if saved_to != out:
        print(f"{program_name()} train: {where}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_evaluate(args) -> int:
    import numpy as np
    from cnn.model import get_network
    from cnn.stages import get_stage
    from cnn.train import config_from_checkpoint, evaluate, load_checkpoint, load_dataset

    saved = load_checkpoint(args.checkpoint)
    overrides = {"data_dir": args.data_dir, "limit_train": 1, "limit_test": None, "progress": True}
    if args.stage:
        overrides["stage"] = args.stage
    config = config_from_checkpoint(saved, **overrides)
    stage = get_stage(config.stage)(get_network(config.model), np.dtype(config.dtype))
    stage.set_params(saved["params"])
    _, _, test_x, test_y = load_dataset(config)         # says where the data came from, in one line
    with np.errstate(all="ignore"):                     # a diverged checkpoint's loss is shown as nan
        accuracy, loss = evaluate(stage, test_x, test_y)
    print(f"{args.checkpoint}: {config.model}, stage {config.stage}, epoch {saved['epoch']}: "
          f"test accuracy {accuracy:.2%} ({len(test_y)} images), test loss {loss:.4f}")
    return 0


def cmd_data(args) -> int:
    from cnn import data

    if args.download:
        data.find_mnist(args.data_dir, download=True)
    for line in data.describe_mnist(args.data_dir):
        print(line)
    return 0


def cmd_stages(args) -> int:
    """One line a stage: ok and what it is, or n/a, why, and that stage's own hint; then, in one line,
    whether the installed numba-cuda can compile kernels with the installed numpy (when it cannot)."""
    from cnn.stages import available_stages, get_stage, numba_cuda_problem
    from cnn.bench.measure import simulator_on

    problem = None if simulator_on() else numba_cuda_problem()
    stages = available_stages()
    width = max(len(name) for name, _ in stages)          # the names' column as wide as the longest
    for number, (name, reason) in enumerate(stages, start=1):
        if reason is None:
            summary = get_stage(name).summary
        elif problem and problem in reason:
            summary = "numba-cuda cannot compile kernels with the installed numpy (the last line says why)"
        else:
            summary = reason.split(": ", 1)[1]
        print(f"{number}. {name:<{width}}  {'ok ' if reason is None else 'n/a'}  {summary}")
    if problem:
        print(f"numba-cuda and numpy: {problem}")
    return 0


def cmd_bench(args) -> int:
    from cnn.bench.command import run
    return run(args)


COMMANDS = {"train": cmd_train, "evaluate": cmd_evaluate, "data": cmd_data,
            "stages": cmd_stages, "bench": cmd_bench}


def main(argv=None) -> int:
    from cnn.data import DataError
    from cnn.stages import StageUnavailable
    from cnn.train import TrainingDiverged

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, DataError, StageUnavailable) as err:
        print(f"{program_name()} {args.command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingDiverged as err:
        print(f"{program_name()} {args.command}: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{program_name()} {args.command}: interrupted", file=sys.stderr)
        return 130
