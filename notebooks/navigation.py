"""Write (or bring up to date) the two cells every tutorial notebook starts with, so that they never drift:

- the **links cell** (Markdown, right after the title): the previous and the next notebook of the course,
  the list of all notebooks, and the library's modules the notebook imports — found by reading its code
  cells' import statements, so a notebook that starts showing another module links to it too;
- the **set-up cell** (the first code cell): finds the clone the notebook sits in from the kernel's
  working directory (anywhere inside the clone), puts the repository and ``notebooks/`` on the import
  path and works from ``notebooks/``; its first line says what to install.

    python notebooks/navigation.py              # every tutorial notebook (make notebooks runs it)
    python notebooks/navigation.py 00 10        # only the notebooks whose names start so
    python notebooks/navigation.py --check      # list the notebooks whose two cells are not what this writes

Running it twice changes nothing. The cells are found by ``metadata["course"]`` ("links", "setup"), so
their text can change here and every notebook follows. A notebook given a new set-up cell must be run
again (``python notebooks/execute.py NN``, which applies this first); a links cell is Markdown, and
updating it needs no run.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import nbformat

FOLDER = Path(__file__).resolve().parent
ROOT = FOLDER.parent
PACKAGES = ("cnn", "kernels")

SETUP = '''\
# Set-up (notebooks/navigation.py writes this cell): needs the course installed, pip install -e ".[dev]" in the clone.
# Works from anywhere inside the clone: finds it from the working directory, then runs from notebooks/.
import os
import sys
from pathlib import Path

CLONE = next((folder for folder in (Path.cwd(), *Path.cwd().parents) if (folder / "notebooks" / "course.py").is_file()),
             None)
if CLONE is None:
    raise RuntimeError(f"{Path.cwd()} is not inside a clone of the course: start Jupyter inside the clone")
os.chdir(CLONE / "notebooks")
sys.path[:0] = [str(CLONE / "notebooks"), str(CLONE)]'''


def tutorial_notebooks(prefixes=()) -> list[Path]:
    paths = sorted(FOLDER.glob("[0-9][0-9]_*.ipynb"))
    return [path for path in paths if not prefixes or path.name.startswith(tuple(prefixes))]


def title(path: Path) -> str:
    """'Stage 1 `loops`' — the notebook's first heading, up to its colon."""
    notebook = nbformat.read(path, as_version=4)
    heading = next((line for cell in notebook.cells if cell.cell_type == "markdown"
                    for line in cell.source.splitlines() if line.startswith("# ")), f"# {path.stem}")
    return heading[2:].split(":")[0].strip()


def module_file(dotted: str) -> Path | None:
    """The source file of module ``dotted`` in this repository (a package: its __init__.py), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def shown_modules(notebook) -> list[Path]:
    """The library's modules a notebook's code cells import (``cnn.*``, ``kernels.*``), in order of first use."""
    found: list[Path] = []
    for cell in notebook.cells:
        if cell.cell_type != "code" or cell.metadata.get("course") == "setup":
            continue
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [f"{node.module}.{alias.name}" for alias in node.names
                           if module_file(f"{node.module}.{alias.name}")]
                names = modules or [node.module]
            for name in names:
                path = module_file(name)
                if name.split(".")[0] in PACKAGES and name not in PACKAGES and path and path not in found:
                    found.append(path)
    return found


def links_text(path: Path, order: list[Path], notebook) -> str:
    """The links cell of ``path``: previous, all notebooks, next; the modules it shows."""
    index = order.index(path)
    neighbours = []
    if index > 0:
        neighbours.append(f"← previous: [{order[index - 1].name[:2]} {title(order[index - 1])}]({order[index - 1].name})")
    neighbours.append("[all notebooks](README.md)")
    if index + 1 < len(order):
        neighbours.append(f"next: [{order[index + 1].name[:2]} {title(order[index + 1])}]({order[index + 1].name}) →")
    modules = [f"[`{module.relative_to(ROOT).as_posix()}`](../{module.relative_to(ROOT).as_posix()})"
               for module in shown_modules(notebook)]
    lines = [" · ".join(neighbours)]
    if modules:
        lines += ["", "The code this notebook shows: " + ", ".join(modules) + "."]
    return "\n".join(lines)


def course_cell(notebook, role: str):
    return next((cell for cell in notebook.cells if cell.metadata.get("course") == role), None)


def with_navigation(path: Path, order: list[Path]):
    """The notebook at ``path`` with its links cell (after the title) and set-up cell (the first code cell)
    written or updated; (notebook, whether anything changed)."""
    notebook = nbformat.read(path, as_version=4)
    before = nbformat.writes(notebook)
    links = course_cell(notebook, "links")
    if links is None:
        links = nbformat.v4.new_markdown_cell(metadata={"course": "links"})
        notebook.cells.insert(1, links)
    links.source = links_text(path, order, notebook)
    setup = course_cell(notebook, "setup")
    if setup is None:
        setup = nbformat.v4.new_code_cell(metadata={"course": "setup"})
        first_code = next(index for index, cell in enumerate(notebook.cells) if cell.cell_type == "code")
        notebook.cells.insert(first_code, setup)
    if setup.source != SETUP:
        setup.source, setup.outputs, setup.execution_count = SETUP, [], None
    return notebook, nbformat.writes(notebook) != before


def apply(paths, check: bool = False) -> list[Path]:
    """Bring the two cells of each notebook up to date (``check``: only say which are not); the changed ones."""
    order = tutorial_notebooks()
    changed = []
    for path in paths:
        notebook, differs = with_navigation(path, order)
        if differs:
            changed.append(path)
            if not check:
                nbformat.write(notebook, path)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="only the notebooks whose names start with these (00, 10_)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a notebook is not up to date")
    args = parser.parse_args(argv)
    paths = tutorial_notebooks(args.prefixes)
    if not paths:
        print(f"navigation.py: no tutorial notebook starts with {' or '.join(args.prefixes)}", file=sys.stderr)
        return 2
    changed = apply(paths, check=args.check)
    for path in changed:
        print(f"{path.name}: {'not up to date' if args.check else 'links and set-up cells written'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
