"""Command line of ``mpiexec -n P python -m mpi4py -m cnn.parallel --strategy NAME [options]``.

The training flags are those of ``python -m cnn train`` (``cnn.cli.add_training_arguments``). Some
defaults differ:

- following Horovod, the strategies whose global batch grows with the workers (``ps-sync``,
  ``allreduce``, ``sandblaster``) use ``--schedule warmup`` with ``--lr-scale`` = the number of
  workers (the linear scaling rule with a per-batch warmup over one epoch, or a quarter of the run
  if that is shorter: a one-epoch run would otherwise never reach the scaled rate); the others keep
  the rate constant;
- the lock-free and stale-gradient strategies (``downpour``, ``hogwild``) take ``--momentum 0.5
  --lr 0.05``: asynchrony already acts as momentum (Mitliagkas et al. 2016), and with the usual 0.9
  a 4-rank Downpour run on MNIST ended at chance accuracy;
- ``downpour``'s server runs Adagrad (``--server-rule adagrad``) with ``--lr 0.01``: Adagrad's
  first step moves every weight by the rate, whatever the size of its gradient;
- ``sandblaster`` runs L-BFGS (``--optimizer lbfgs``): ``--lr`` is only its first trial step.

Give the flag to choose yourself. The arguments are parsed before MPI starts, so a bad flag costs
nothing; only rank 0 prints the one-line error (the rank comes from the launcher's environment).
A run that loses a peer, diverges or ends at chance accuracy exits with 1 (the last with a
warning, never "completed"); bad input exits with 2 on every rank. The synchronous strategies
(``ps-sync``, ``allreduce`` on host stages) stop politely on SIGINT or SIGTERM to any rank: the
ranks agree on the step, rank 0 writes a checkpoint of exactly that point and says how to resume,
and the run exits with 130 or 143.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import fields

from cnn.cli import EXIT_BAD_INPUT, EXIT_FAILED, OneLineParser, add_training_arguments, config_from_args, count
from cnn.cli import non_negative_float, positive_float, positive_int
from cnn.parallel import STRATEGIES
from cnn.parallel.common import ParallelOptions
from cnn.parallel.optimizers import SERVER_RULES

GROWING_BATCH = ("ps-sync", "allreduce", "sandblaster")
STALE_DEFAULTS = {"downpour": {"momentum": 0.5, "lr": 0.05}, "hogwild": {"momentum": 0.5, "lr": 0.05}}
ADAGRAD_LR = 0.01                 # downpour with its default server rule: Adagrad's base rate
WARMUP_SHARE = 0.25               # the default warmup: one epoch, but at most this share of the run
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


def launcher_rank() -> int:
    """This process's rank as the launcher's environment gives it (before MPI is initialised)."""
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class RankZeroParser(OneLineParser):
    """One-line errors, printed by rank 0 only (every rank parses the same arguments)."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n" if launcher_rank() == 0 else None)


def build_parser() -> RankZeroParser:
    parser = RankZeroParser(prog="python -m cnn.parallel",
                            description="Distributed training over MPI; launch with "
                                        "mpiexec -n P python -m mpi4py -m cnn.parallel --strategy NAME")
    parser.add_argument("--strategy", required=True, choices=list(STRATEGIES))
    add_training_arguments(parser)
    parser.set_defaults(schedule=None, lr_scale=None, momentum=None, lr=None,   # strategy-dependent: settings_from_args
                        warmup_epochs=None)
    run = parser.add_argument_group("run")
    run.add_argument("--summary", default=None, help="JSON summary (default results/parallel-STRATEGY[-overlap]-RANKS.json)")
    run.add_argument("--timeline", default=None, help="Chrome-trace JSON of every rank's phases")
    run.add_argument("--log-every", type=count, default=0, help="a log line every N steps (0: about ten)")
    run.add_argument("--peer-timeout", type=positive_float, default=60.0,
                     help="seconds of silence after which a peer counts as lost")
    strategy = parser.add_argument_group("strategies")
    strategy.add_argument("--allreduce", choices=("mpi", "ring"), default="mpi", help="allreduce: algorithm")
    strategy.add_argument("--overlap", action="store_true",
                          help="allreduce: allreduce each layer's gradient as soon as its backward is done, "
                               "while the layers below still compute (as PyTorch DDP and Horovod do)")
    strategy.add_argument("--n-push", type=positive_int, default=1, help="downpour: push every N steps")
    strategy.add_argument("--n-fetch", type=positive_int, default=1, help="downpour: fetch every N steps")
    strategy.add_argument("--server-rule", choices=tuple(SERVER_RULES), default=None,
                          help="downpour: the server's update rule (default adagrad; sgd: with momentum)")
    strategy.add_argument("--easgd-mode", choices=("sync", "round-robin", "async"), default="sync",
                          help="easgd: all workers every τ steps, one at a time in turn, or whoever arrives")
    strategy.add_argument("--rho", type=positive_float, default=None,
                          help="easgd: elastic strength ρ (default: η·ρ = 0.9 / workers)")
    strategy.add_argument("--tau", type=positive_int, default=1, help="easgd: steps between elastic exchanges")
    strategy.add_argument("--portions", type=positive_int, default=None,
                          help="sandblaster: portions per batch (default 2 × workers)")
    strategy.add_argument("--max-copies", type=positive_int, default=2,
                          help="sandblaster: copies of one portion in flight at most")
    strategy.add_argument("--backup-after", type=non_negative_float, default=0.0,
                          help="sandblaster: duplicate a portion only once it has been out this many "
                               "times the median portion time (0: as soon as a worker is idle)")
    strategy.add_argument("--optimizer", choices=("lbfgs", "sgd"), default="lbfgs",
                          help="sandblaster: L-BFGS with a line search (default) or SGD with momentum")
    strategy.add_argument("--history", type=positive_int, default=10,
                          help="sandblaster: L-BFGS's memory, the curvature pairs kept")
    strategy.add_argument("--split", default=None,
                          help="model-parallel: K (layers [0, K) on rank 0) or K:C (also output channels [0, C) "
                               "of convolution K); default: the cut that balances the measured per-layer cost")
    strategy.add_argument("--micro-batches", type=positive_int, default=1, help="model-parallel: pipelining")
    strategy.add_argument("--reduced", action="store_true",
                          help="the network's narrow copy on the images' centre (GPU ranks in the CUDA simulator)")
    hooks = parser.add_argument_group("fault injection (tests)")
    hooks.add_argument("--kill-rank", type=count, default=None, help="this rank exits abruptly ...")
    hooks.add_argument("--kill-at-step", type=count, default=None, help="... at this step")
    hooks.add_argument("--slow-rank", type=count, default=None, help="this rank computes --slow-down times slower")
    hooks.add_argument("--slow-down", type=positive_float, default=3.0)
    hooks.add_argument("--interrupt-rank", type=count, default=None, help="this rank sends itself a signal ...")
    hooks.add_argument("--interrupt-at-step", type=count, default=None, help="... at this step ...")
    hooks.add_argument("--interrupt-signal", choices=("INT", "TERM"), default="TERM", help="... this one")
    return parser


def settings_from_args(args: argparse.Namespace):
    """(TrainConfig, ParallelOptions, FaultHooks) from the parsed flags, the strategy's defaults filled in."""
    from cnn.parallel.world import FaultHooks
    from cnn.train import TrainConfig

    if args.schedule is None:
        args.schedule = "warmup" if args.strategy in GROWING_BATCH else "constant"
    if args.warmup_epochs is None:          # a warmup longer than the run would never reach the scaled rate
        args.warmup_epochs = min(TrainConfig.warmup_epochs, WARMUP_SHARE * args.epochs)
    if args.server_rule is None:
        args.server_rule = "adagrad" if args.strategy == "downpour" else "sgd"
    if args.strategy == "downpour" and args.server_rule == "adagrad" and args.lr is None:
        args.lr = ADAGRAD_LR
    for name in ("momentum", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, STALE_DEFAULTS.get(args.strategy, {}).get(name, getattr(TrainConfig, name)))
    if (args.kill_rank is None) != (args.kill_at_step is None):
        raise ValueError("--kill-rank and --kill-at-step go together")
    if args.overlap and args.allreduce != "mpi":
        raise ValueError("--overlap needs --allreduce mpi: the hand-written ring waits on every chunk")
    options = ParallelOptions(**{f.name: getattr(args, f.name) for f in fields(ParallelOptions)})
    if (args.interrupt_rank is None) != (args.interrupt_at_step is None):
        raise ValueError("--interrupt-rank and --interrupt-at-step go together")
    hooks = FaultHooks(args.kill_rank, args.kill_at_step, args.slow_rank, args.slow_down, args.interrupt_rank,
                       args.interrupt_at_step, args.interrupt_signal)
    return args, options, hooks


def run_strategy(args, options, hooks) -> int:
    """Start MPI, check the layout, train with the strategy, report; returns the exit code."""
    from mpi4py import MPI

    from cnn.parallel.common import Interrupted, Run
    from cnn.parallel.world import PeerLost, World
    from cnn.train import TrainingDiverged

    world = World(MPI.COMM_WORLD, options.peer_timeout, hooks, quiet=not args.progress)
    module = importlib.import_module(STRATEGIES[options.strategy])
    workers, roles = module.layout(world.size, options)
    if args.lr_scale is None:
        args.lr_scale = float(workers) if args.schedule == "warmup" else 1.0
    config = config_from_args(args)
    command = "mpiexec -n {} python -m mpi4py -m cnn.parallel {}".format(world.size, " ".join(sys.argv[1:]))
    run = Run(config, options, world, workers, roles, command)
    world.listen_for_roll_calls()
    try:
        extra = module.train(run)
    except PeerLost as lost:
        return world.leave(run.stop_after_loss(lost))
    except Interrupted as stop:
        return world.leave(run.stop_on_signal(stop))
    except TrainingDiverged as err:
        if world.rank == 0:
            world.warn(f"python -m cnn.parallel: {err}")
        run.training_done()
        run.report(status="diverged", message=str(err))
        return world.leave(EXIT_FAILED)
    status = "completed" if not world.lost else "completed without rank(s) " + ", ".join(map(str, sorted(world.lost)))
    summary = run.report(status=status, **extra)
    learned = summary is None or summary["status"].startswith("completed")
    return world.leave(0 if learned and not world.lost else EXIT_FAILED)


def main(argv=None) -> int:
    from cnn.data import DataError
    from cnn.stages import StageUnavailable

    speaks = launcher_rank() == 0
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:          # --help, or a bad flag already reported by rank 0
        return exit.code
    try:
        args, options, hooks = settings_from_args(args)
        return run_strategy(args, options, hooks)
    except (ValueError, DataError, StageUnavailable) as err:
        if speaks:                       # one line per problem (a host check may find several)
            for line in str(err).splitlines():
                print(f"python -m cnn.parallel: error: {line}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
