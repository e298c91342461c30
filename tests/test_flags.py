"""Every numeric flag is checked before anything runs (issue 26): nan, inf, -inf and a value out of its
range are each refused in one line naming the flag, exit 2 — for ``cnn train``, ``evaluate``, ``bench``
and ``cnn.parallel`` alike. The flags are found by walking the parsers, so a flag added later is
tested too (and one given a plain ``int`` or ``float`` type fails the test). Under a second."""

import argparse
import contextlib
import io
from dataclasses import fields

import pytest

from cnn import argtypes
from cnn.cli import build_parser
from cnn.config import NUMBER_RULES, TrainConfig
from cnn.parallel.cli import build_parser as build_parallel_parser

from test_reliability import assert_one_line, run_main

REQUIRED = {"train": [], "evaluate": ["--checkpoint", "ck.npz"], "bench": [], "cnn.parallel": ["--strategy", "allreduce"]}


def commands() -> dict[str, argparse.ArgumentParser]:
    """{command: its parser}: the subcommands of ``python -m cnn`` that take flags, and ``cnn.parallel``."""
    subparsers = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return {**{name: subparsers.choices[name] for name in ("train", "evaluate", "bench")},
            "cnn.parallel": build_parallel_parser()}


def numeric_flags():
    """(command, flag, rule) for every flag whose type is a number."""
    for command, parser in commands().items():
        for action in parser._actions:
            if action.option_strings and action.type is not None and action.type is not str:
                yield command, action.option_strings[-1], action.type


def out_of_range(rule: argtypes.Number) -> list[str]:
    """Values just outside the rule's interval, as the user would type them."""
    step = 1 if rule.kind is int else 0.5
    values = [str(rule.low if rule.low_open else rule.low - step)]
    if rule.high is not None:
        values.append(str(rule.high if rule.high_open else rule.high + step))
    return values


def refusal(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    return exit_.value.code, err.getvalue()


def test_every_numeric_flag_has_a_checked_type():
    flags = list(numeric_flags())
    plain = [(command, flag) for command, flag, rule in flags if not isinstance(rule, argtypes.Number)]
    assert plain == [], f"numeric flags without a range: {plain}"
    assert {command for command, _, _ in flags} >= {"train", "bench", "cnn.parallel"}
    assert len(flags) >= 40


@pytest.mark.parametrize("command, flag, rule", [pytest.param(*case, id=f"{case[0]} {case[1]}")
                                                 for case in numeric_flags()])
def test_non_finite_and_out_of_range_values_are_refused_in_one_line(command, flag, rule):
    parser = commands()[command]
    for value in ["nan", "inf", "-inf", "1e999", *out_of_range(rule)]:
        code, err = refusal(parser, REQUIRED[command] + [f"{flag}={value}"])
        assert code == 2, f"{command} {flag}={value} was accepted"
        assert_one_line(err, f"argument {flag}")


def test_in_range_values_are_kept():
    parser = commands()["train"]
    args = parser.parse_args(["--momentum", "0", "--gamma", "1", "--seed", str(2**32 - 1), "--warmup-epochs", "0",
                              "--lr", "1e-8"])
    assert (args.momentum, args.gamma, args.seed, args.warmup_epochs, args.lr) == (0.0, 1.0, 2**32 - 1, 0.0, 1e-8)


@pytest.mark.parametrize("name", sorted(NUMBER_RULES))
def test_a_configuration_from_elsewhere_obeys_the_same_rules(name):
    """A TrainConfig built in a notebook or read from a checkpoint: non-finite or mistyped is refused."""
    rule = NUMBER_RULES[name]
    for value in [float("nan"), float("inf"), "1", True, *[rule.kind(v) for v in out_of_range(rule)]]:
        with pytest.raises(ValueError) as err:
            TrainConfig(**{name: value}).check()
        assert_one_line(str(err.value), name.replace("_", "-"))


def test_every_setting_is_checked():
    """Each field of TrainConfig is a number with a rule, a choice, a switch or an optional path."""
    from cnn.config import OPTIONAL, SWITCHES, choices

    checked = set(NUMBER_RULES) | set(choices()) | set(SWITCHES) | set(OPTIONAL)
    assert {field.name for field in fields(TrainConfig)} <= checked


@pytest.mark.parametrize("argv", [["train", "--gamma", "nan"], ["train", "--warmup-epochs", "inf"],
                                  ["train", "--seed", "99999999999999999999999"], ["train", "--lr-scale", "nan"],
                                  ["train", "--weight-decay", "inf"], ["bench", "--budget", "nan"]])
def test_the_issues_examples_end_before_anything_runs(argv):
    code, out, err = run_main(*argv)
    assert code == 2 and out == ""
    assert_one_line(err, f"argument {argv[1]}")
