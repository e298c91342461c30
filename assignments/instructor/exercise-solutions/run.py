"""Run the worked solutions of the tutorial notebooks' exercises, printing each answer and its evidence.

    python assignments/instructor/exercise-solutions/run.py            # all fourteen notebooks
    python assignments/instructor/exercise-solutions/run.py 01 06      # notebooks 01 and 06 only
    CNN_FAST=1 python assignments/instructor/exercise-solutions/run.py # tiny shapes, seconds each (what CI runs)

Instructors only: these are the answers; do not hand this folder to students (README.md).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import fast_mode, use_simulator_without_gpu  # noqa: E402

use_simulator_without_gpu()          # before anything imports numba: the CUDA solutions need it


def solution_modules(numbers=()) -> list[str]:
    """Module names ``nbNN_*`` of the solutions, in notebook order (only the given NN when some are)."""
    names = sorted(path.stem for path in HERE.glob("nb[0-9][0-9]_*.py"))
    return [name for name in names if not numbers or name[2:4] in numbers]


def exercises(module) -> list:
    """The module's ``exercise_1``, ``exercise_2``, … functions, in order."""
    found = [(name, value) for name, value in vars(module).items() if name.startswith("exercise_") and callable(value)]
    return [value for _, value in sorted(found, key=lambda item: int(item[0].split("_")[1]))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="two-digit notebook numbers (default: all)")
    args = parser.parse_args(argv)
    for name in solution_modules(args.notebooks):
        module = importlib.import_module(name)
        print(f"\n{'=' * 100}\n{module.__doc__.strip()}")
        for exercise in exercises(module):
            print(f"\n--- {exercise.__name__}\n{inspect.getdoc(exercise)}\n")
            exercise(fast_mode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
