"""Two nbgrader preprocessors that keep the verdicts outside the student's reach.

``assignments/nbgrader_config.py`` puts them around nbgrader's ``Execute`` in ``autograde``:

- ``StartReferee`` (before): starts the referee (``cnn.grading.referee``) in a process of its own and
  puts its address in ``$CNN_REFEREE``, which the kernel inherits. The key that seals the referee's
  verdicts stays in this process and the referee's.
- ``CheckSeals`` (after): every autograded test cell must show the referee's seal for its own
  ``grade_id`` (``cnn.grading.seal``). A cell without it — whatever else it printed, "10/10"
  included — gets an error output saying so, and so no points: its checks did not run as written
  (the function it calls redefined, its code rewritten by an input transformer, an error hidden).
  Manually graded cells (the written answers) are left to the grader. Then it stops the referee.

``check_seals`` is the check itself, for a notebook's executed cells and a key; the test suite applies
it to notebooks it runs without nbgrader.
"""

from __future__ import annotations

import os

from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import NbGraderPreprocessor

from cnn.grading.client import ADDRESS_VARIABLE
from cnn.grading.referee import RefereeProcess
from cnn.grading.seal import is_sealed


def autograded_cells(notebook) -> list:
    """The code cells nbgrader scores by running them: grade cells that are not solution cells."""
    return [cell for cell in notebook.cells if cell.cell_type == "code"
            and cell.metadata.get("nbgrader", {}).get("grade") and not cell.metadata["nbgrader"].get("solution")]


def unsealed_error(grade_id: str) -> NotebookNode:
    text = (f"no sealed verdict from the grader for {grade_id}: this cell's checks did not run as written (the "
            f"function it calls was redefined, its code rewritten before it ran, or an error hidden) — refused")
    return NotebookNode(output_type="error", ename="UnsealedResult", evalue=text, traceback=[f"UnsealedResult: {text}"])


def check_seals(notebook, key: bytes, assignment: str) -> list[str]:
    """Append an error output to every autograded cell of ``notebook`` without its valid seal; return their ids."""
    refused = []
    for cell in autograded_cells(notebook):
        grade_id = cell.metadata["nbgrader"]["grade_id"]
        printed = "".join(output.get("text", "") for output in cell.get("outputs", [])
                          if output.get("output_type") == "stream" and output.get("name") == "stdout")
        if not is_sealed(printed, key, assignment, grade_id):
            cell.outputs.append(unsealed_error(grade_id))
            refused.append(grade_id)
    return refused


class StartReferee(NbGraderPreprocessor):
    """Start the referee before the kernel, outside it."""

    def preprocess(self, nb, resources):
        referee = RefereeProcess(preload=[resources["nbgrader"]["notebook"]])
        resources["cnn_referee"] = referee
        os.environ[ADDRESS_VARIABLE] = referee.address
        return nb, resources


class CheckSeals(NbGraderPreprocessor):
    """After the kernel has run: no seal, no points. Stops the referee."""

    def preprocess(self, nb, resources):
        referee = resources.pop("cnn_referee", None)
        os.environ.pop(ADDRESS_VARIABLE, None)
        if referee is None:
            raise RuntimeError("CheckSeals needs StartReferee before nbgrader's Execute (assignments/nbgrader_config.py)")
        try:
            assignment = resources["nbgrader"]["notebook"]
            for grade_id in check_seals(nb, referee.key, assignment):
                self.log.warning("%s: %s has no sealed verdict; it scores 0", assignment, grade_id)
        finally:
            referee.stop()
        return nb, resources
