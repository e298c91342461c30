"""Strip the outputs of the assignment notebooks before they are committed, or check that they are stripped.

    python notebooks/strip_outputs.py            # strip every notebook in assignments/source/
    python notebooks/strip_outputs.py --check    # exit 1, naming them, if any code cell has outputs

Assignment notebooks are nbgrader's source: students get them blank. The tutorial notebooks of this
folder are the opposite — committed with the outputs of a full run (``python notebooks/execute.py``).

As a git pre-commit hook (``.git/hooks/pre-commit``)::

    #!/bin/sh
    exec python notebooks/strip_outputs.py --check

The test suite runs the same check (tests/test_notebooks.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

REPOSITORY = Path(__file__).resolve().parent.parent
FOLDERS = (REPOSITORY / "assignments" / "source",)


def course_notebooks() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in folder.rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in path.parts)


def has_outputs(notebook) -> bool:
    """True when a code cell holds outputs or an execution count."""
    return any(cell.get("outputs") or cell.get("execution_count") is not None
               for cell in notebook.cells if cell.cell_type == "code")


def strip(notebook) -> None:
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report notebooks that have outputs")
    args = parser.parse_args(argv)
    dirty = []
    for path in course_notebooks():
        notebook = nbformat.read(path, as_version=4)
        if has_outputs(notebook):
            dirty.append(path.relative_to(REPOSITORY))
            if not args.check:
                strip(notebook)
                nbformat.write(notebook, path)
    if args.check and dirty:
        print(f"notebooks with outputs (run python notebooks/strip_outputs.py): {', '.join(map(str, dirty))}",
              file=sys.stderr)
        return 1
    for path in dirty:
        print(f"stripped {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
