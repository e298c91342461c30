"""argparse types for the numbers every command line takes: a bad value is one line naming it.

``positive_int`` (> 0), ``positive_float`` (> 0), ``count`` (an int >= 0), ``non_negative_float``
(>= 0). Shared by ``python -m cnn`` (``cnn/cli.py``), its ``bench`` command (``cnn/bench/command.py``)
and ``python -m cnn.parallel``.
"""

from __future__ import annotations

import argparse


def _number(kind, minimum, strict):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {minimum}")
        return value
    return parse


positive_int, positive_float = _number(int, 0, True), _number(float, 0.0, True)
count, non_negative_float = _number(int, 0, False), _number(float, 0.0, False)
