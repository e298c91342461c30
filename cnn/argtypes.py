"""The numbers every command line and every checkpoint's configuration take: a bad value is one line naming it.

A ``Number`` is a kind (int or float) and an interval. Called on a command-line string it is an
argparse ``type`` (a bad value: ``argparse.ArgumentTypeError``, which argparse turns into one line
and exit 2); ``rule.check(value, name)`` checks a value from anywhere else — a configuration read
from a checkpoint, a ``TrainConfig`` built in a notebook — and raises ValueError naming ``name``.
A float is always finite: ``float("nan")``, ``float("inf")`` and ``1e999`` parse, and none of them
is a learning rate. An int is never a bool, and stays below ``INT_LIMIT`` (no epoch count, batch size
or step number of this course comes near it, and numpy's fixed-width integers hold it).

==========================  =====================  =============================================
rule                        interval               used by
==========================  =====================  =============================================
``positive_int``            1 … INT_LIMIT          --epochs, --batch-size, --steps, ...
``count``                   0 … INT_LIMIT          --eval-every, --checkpoint-every, a rank
``positive_float``          (0, ∞)                 --lr, --lr-scale, --budget, --peer-timeout
``non_negative_float``      [0, ∞)                 --weight-decay, --warmup-epochs
``momentum``                [0, 1)                 --momentum: 1 would never forget a gradient
``decay_factor``            (0, 1]                 --gamma: the rate is multiplied by it
``seed``                    0 … 2³² − 1            --seed: what every numpy generator accepts
==========================  =====================  =============================================

Shared by ``python -m cnn`` (``cnn/cli.py``), its ``bench`` command (``cnn/bench/command.py``),
``python -m cnn.parallel`` and ``cnn.config.TrainConfig.check``.
"""

from __future__ import annotations

import argparse
import math
import numbers

#: The largest integer any integer setting may take (2³¹ − 1)
INT_LIMIT = 2**31 - 1


class Number:
    """A kind of number and the interval it must lie in (``low_open``/``high_open``: end excluded)."""

    def __init__(self, kind: type, low=None, high=None, *, low_open: bool = False, high_open: bool = False):
        self.kind, self.low, self.high = kind, low, high
        self.low_open, self.high_open = low_open, high_open
        self.__name__ = kind.__name__        # argparse names the type in some messages

    def __call__(self, text: str):
        """argparse's ``type``: the value of ``text``, or ArgumentTypeError (one line)."""
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {self.kind.__name__}: it must be "
                                             f"{self.describe()}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{text} {problem}")
        return value

    def check(self, value, name: str):
        """``value`` if it is right for this rule, else ValueError "NAME must be ..., got VALUE"."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real if self.kind is float else numbers.Integral):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r} ({type(value).__name__})")
        problem = self.problem(value)
        if problem:
            raise ValueError(f"{name} {problem}, got {value!r}" if self.kind is int or math.isfinite(value)
                             else f"{name} is {value!r}, not finite: it must be {self.describe()}")
        return self.kind(value)

    def problem(self, value) -> str | None:
        """Why ``value`` (already of the right kind) is out of range ("must be > 0", ...), or None."""
        if self.kind is float and not math.isfinite(value):
            return f"is not finite: it must be {self.describe()}"
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return f"must be {self.describe(noun=False)}"
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return f"must be {self.describe(noun=False)}" if self.high != INT_LIMIT else f"must be at most {INT_LIMIT}"
        return None

    def describe(self, noun: bool = True) -> str:
        """"an integer > 0", "a number in [0, 1)" ... (``INT_LIMIT`` goes unsaid: it is a technical cap)."""
        kind = ("an integer " if self.kind is int else "a number ") if noun else ""
        show = str if self.kind is int else "{:g}".format
        if self.high is None or self.high == INT_LIMIT:
            return f"{kind}{'>' if self.low_open else '>='} {show(self.low)}"
        return (f"{kind}in {'(' if self.low_open else '['}{show(self.low)}, {show(self.high)}"
                f"{')' if self.high_open else ']'}")


positive_int = Number(int, 0, INT_LIMIT, low_open=True)
count = Number(int, 0, INT_LIMIT)
positive_float = Number(float, 0.0, low_open=True)
non_negative_float = Number(float, 0.0)
momentum = Number(float, 0.0, 1.0, high_open=True)
decay_factor = Number(float, 0.0, 1.0, low_open=True)
seed = Number(int, 0, 2**32 - 1)
