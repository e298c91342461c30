"""notebooks/navigation.py: the links cell and the set-up cell of every tutorial notebook, written by one tool.

On copies of the course's notebooks: the tool writes both cells where they are missing, links the
previous and the next notebook and the modules the code cells import, changes nothing when run again,
and follows a notebook that starts importing another module. The set-up cell it writes makes a notebook
run from a working directory anywhere inside the clone. Where a committed notebook already carries the
two cells, they are what the tool writes now (no drift). ~5 s; ~20 s at a load of 8 on 2 cores.
"""

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "notebooks"))
import navigation  # noqa: E402


@pytest.fixture
def course_copy(tmp_path, monkeypatch):
    """Three notebooks, copies of the course's first ones, in a folder the tool treats as notebooks/."""
    for path in sorted((ROOT / "notebooks").glob("0[0-2]_*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        notebook.cells = [cell for cell in notebook.cells if cell.metadata.get("course") not in ("links", "setup")]
        nbformat.write(notebook, tmp_path / path.name)
    monkeypatch.setattr(navigation, "FOLDER", tmp_path)
    return sorted(tmp_path.glob("*.ipynb"))


def test_writes_both_cells_then_changes_nothing(course_copy):
    first, second, third = course_copy
    assert navigation.apply(course_copy) == course_copy
    notebook = nbformat.read(second, as_version=4)
    links, setup = notebook.cells[1], next(cell for cell in notebook.cells if cell.cell_type == "code")
    assert links.metadata["course"] == "links" and setup.metadata["course"] == "setup"
    assert f"]({first.name})" in links.source and f"]({third.name}) →" in links.source
    assert "[`cnn/stages/s1_loops.py`](../cnn/stages/s1_loops.py)" in links.source
    assert setup.source == navigation.SETUP and 'pip install -e ".[dev]"' in setup.source.splitlines()[0]
    assert "← previous" not in nbformat.read(first, as_version=4).cells[1].source
    texts = [path.read_text() for path in course_copy]
    assert navigation.apply(course_copy) == []
    assert [path.read_text() for path in course_copy] == texts


def test_links_follow_what_the_code_imports(course_copy):
    navigation.apply(course_copy)
    notebook = nbformat.read(course_copy[0], as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell("from kernels import sgd\nimport cnn.plots"))
    nbformat.write(notebook, course_copy[0])
    assert navigation.main(["--check", "00"]) == 1
    navigation.apply(course_copy)
    links = nbformat.read(course_copy[0], as_version=4).cells[1].source
    assert "[`kernels/sgd.py`](../kernels/sgd.py)" in links and "[`cnn/plots.py`]" in links


def test_the_set_up_cell_runs_from_anywhere_inside_the_clone(tmp_path):
    script = navigation.SETUP + "\nimport course\nprint(Path.cwd(), course.REPOSITORY)"
    for where in (ROOT / "cnn" / "stages", ROOT / "notebooks"):
        run = subprocess.run([sys.executable, "-c", script], cwd=where, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": ""})
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [str(ROOT / "notebooks"), str(ROOT)]
    outside = subprocess.run([sys.executable, "-c", navigation.SETUP], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60)
    assert "is not inside a clone of the course" in outside.stderr.strip().splitlines()[-1]


def test_committed_notebooks_that_carry_the_cells_are_up_to_date():
    carrying = [path for path in navigation.tutorial_notebooks()
                if any(cell.metadata.get("course") == "links" for cell in nbformat.read(path, as_version=4).cells)]
    assert carrying, "no notebook carries the navigation cells: python notebooks/navigation.py"
    stale = [path.name for path in carrying if path in navigation.apply(carrying, check=True)]
    assert not stale, f"python notebooks/navigation.py {' '.join(name[:2] for name in stale)}"
