"""Old flag names that keep working after a rename: one line on stderr says the new name, the run goes on.

One flag name has one meaning in every command of the course: ``--stage`` picks the stage(s) (``train``,
``evaluate``, ``bench``, ``python -m cnn.parallel``), ``--out FILE`` is the JSON record of one run
(``train``), ``--out-dir DIR`` the folder a command writes its results files and plots into (``bench``).
The names they replaced (``bench --stages``, ``bench --out``) are registered here as hidden aliases::

    add_deprecated_alias(parser, "--stages", "--stage", dest="stages")

``bench --stages numpy`` then sets ``args.stages`` exactly as ``--stage numpy`` does, after printing
``python -m cnn bench: --stages is deprecated, use --stage (same meaning)``. (Python 3.13's argparse
has ``deprecated=True``, but for a flag's own name only, and the course runs on 3.11.)
"""

from __future__ import annotations

import argparse
import sys


class _DeprecatedAlias(argparse.Action):
    """Store the value like the new flag does, after one line on stderr naming the new flag."""

    def __init__(self, option_strings, dest, new_name: str, **kwargs):
        self.new_name = new_name
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is deprecated, use {self.new_name} (same meaning)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, dest: str) -> None:
    """Accept ``old`` as a hidden alias of the flag ``new`` (whose value goes to ``dest``)."""
    parser.add_argument(old, dest=dest, action=_DeprecatedAlias, new_name=new, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
