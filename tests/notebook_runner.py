"""Grade many notebooks fast, the way nbgrader does, without starting a Jupyter kernel for each.

nbgrader's autograder starts a kernel per submission, and a kernel that imports numba and the CUDA
simulator takes seconds before it runs a cell. The tests grade a hundred submissions — wrong answers,
each part alone, cheats — so ``NotebookRunner`` does it this way instead:

- one *pool* process (this file, ``--pool``) imports numpy, numba, the CUDA simulator, IPython and the
  course once; for each notebook it **forks** a child, which runs the notebook's code cells one by one
  in an IPython shell (``InteractiveShell.run_cell``: input transformers, custom exception handlers and
  all — what a cheat would use in a kernel) and records each cell's outputs as nbgrader would see them:
  stdout and stderr streams, the value of a last expression, and an error when the cell raised;
- the child grades against one referee (``cnn.grading.referee``) that this process started and whose
  key it holds, as nbgrader's ``StartReferee`` does;
- back here, ``CheckSeals``'s own check (``cnn.grading.nbgrader_plugin.check_seals``) and nbgrader's
  ``determine_grade`` score the cells — the same two steps as ``nbgrader autograde``.

Children run two at a time (the machine has two cores). Each child is a fresh copy of the pool, so a
submission that rewrites the library or IPython affects nothing after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import nbformat

HERE = Path(__file__).resolve().parent
PARALLEL = 2
TIMEOUT_S = 600          # a notebook still running after this is killed (a cheat that hangs)


class Grade(NamedTuple):
    score: float
    max_score: float
    error: str          # "ename: evalue" of each of the cell's errors, joined by " | "; "" when it ran through


def error_text(cell) -> str:
    """Every error of an executed cell, "ename: evalue", joined by " | " ("" when it ran through)."""
    return " | ".join(f"{output.ename}: {output.evalue}" for output in cell.get("outputs", [])
                      if output.output_type == "error")


class NotebookRunner:
    """A referee and a warm pool; ``grade(notebook, assignment)`` → {test cell id: Grade}."""

    def __init__(self, assignments=()):
        from cnn.grading.referee import RefereeProcess

        self.referee = RefereeProcess(preload=assignments)
        self._pool = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--pool"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def execute(self, notebooks: list) -> list:
        """Run every notebook's code cells, two at a time; return copies holding the outputs."""
        jobs = [[cell.source for cell in notebook.cells if cell.cell_type == "code"] for notebook in notebooks]
        self._pool.stdin.write(json.dumps({"jobs": jobs, "referee": self.referee.address}) + "\n")
        self._pool.stdin.flush()
        reply = self._pool.stdout.readline()
        if not reply:
            raise RuntimeError("the notebook pool died")
        executed, results = [], json.loads(reply)
        self.seconds = [(result["cpu_s"], result["wall_s"]) for result in results]   # per notebook: CPU, wall
        for notebook, outputs in zip(notebooks, (result["outputs"] for result in results)):
            copy = nbformat.from_dict(json.loads(json.dumps(notebook)))
            for cell, cell_outputs in zip((cell for cell in copy.cells if cell.cell_type == "code"), outputs):
                cell.outputs = [nbformat.from_dict(output) for output in cell_outputs]
            executed.append(copy)
        return executed

    def grade(self, submissions: list, assignment_of) -> list[dict]:
        """Grade each notebook as nbgrader's autograder would: {grade_id: Grade} of its autograded cells."""
        from nbgrader.utils import determine_grade

        from cnn.grading.nbgrader_plugin import autograded_cells, check_seals

        results = []
        for notebook, assignment in zip(self.execute(submissions), assignment_of):
            check_seals(notebook, self.referee.key, assignment)
            grades = {}
            for cell in autograded_cells(notebook):
                score, max_score = determine_grade(cell)
                grades[cell.metadata.nbgrader["grade_id"]] = Grade(score, max_score, error_text(cell))
            results.append(grades)
        return results

    def close(self) -> None:
        self._pool.stdin.close()
        self._pool.wait(30)
        self.referee.stop()


# -- the pool --------------------------------------------------------------------------------------------

def _warm_up() -> None:
    """Import what the notebooks import, once, before any fork."""
    import numba  # noqa: F401
    import numpy  # noqa: F401
    from IPython.core.interactiveshell import InteractiveShell  # noqa: F401

    import cnn.grading.client  # noqa: F401
    import cnn.grading.runners  # noqa: F401
    import cnn.stages.s1_loops  # noqa: F401
    import cnn.stages.s2_numpy  # noqa: F401
    import kernels.device  # noqa: F401
    import kernels.launch  # noqa: F401


def _run_cells(cells: list[str], referee: str, result_file: str) -> None:
    """In a forked child: run the cells in a fresh IPython shell, write their outputs as JSON, exit."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output
    from traitlets.config import Config

    os.environ["CNN_REFEREE"] = referee
    os.chdir(tempfile.mkdtemp(prefix="notebook-"))
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    values = []
    shell.displayhook.write_output_prompt = lambda: None
    shell.displayhook.write_format_data = lambda data, metadata=None: values.append(data)
    outputs = []
    for source in cells:
        values.clear()
        with capture_output(display=False) as captured:
            result = shell.run_cell(source, store_history=True)
        cell_outputs = [{"output_type": "stream", "name": name, "text": text}
                        for name, text in (("stdout", captured.stdout), ("stderr", captured.stderr)) if text]
        cell_outputs += [{"output_type": "execute_result", "data": data, "metadata": {}, "execution_count": None}
                         for data in values]
        error = result.error_before_exec or result.error_in_exec
        if error is not None:                     # what the kernel's error reply makes nbgrader record
            cell_outputs.append({"output_type": "error", "ename": type(error).__name__, "evalue": str(error),
                                 "traceback": []})
        outputs.append(cell_outputs)
    Path(result_file).write_text(json.dumps(outputs))


def _start(cells: list[str], referee: str, result_file: str) -> int:
    """Fork a child that runs ``cells``; its own stdout and stderr go to a file, not to the pool's pipe."""
    pid = os.fork()
    if pid == 0:
        try:
            log = os.open(result_file + ".log", os.O_WRONLY | os.O_CREAT)
            os.dup2(log, 1)
            os.dup2(log, 2)
            _run_cells(cells, referee, result_file)
        finally:
            os._exit(0)
    return pid


def _died(cells: list[str], why: str) -> list:
    return [[{"output_type": "error", "ename": "NotebookDied", "evalue": why, "traceback": []}] for _ in cells]


def _pool() -> None:
    _warm_up()
    for line in sys.stdin:
        request = json.loads(line)
        pending, results, running = list(enumerate(request["jobs"])), {}, {}
        folder = tempfile.mkdtemp(prefix="notebook-pool-")
        while pending or running:
            while pending and len(running) < PARALLEL:
                index, cells = pending.pop(0)
                result_file = os.path.join(folder, f"{index}.json")
                running[_start(cells, request["referee"], result_file)] = (index, result_file, time.monotonic())
            pid, _, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                for child, (index, _, started) in list(running.items()):
                    if time.monotonic() - started > TIMEOUT_S:
                        os.kill(child, signal.SIGKILL)
                time.sleep(0.01)
                continue
            index, result_file, started = running.pop(pid)
            path = Path(result_file)
            outputs = (json.loads(path.read_text()) if path.exists() else
                       _died(request["jobs"][index], f"the notebook's process died after {time.monotonic() - started:.0f} s"))
            results[index] = {"outputs": outputs, "cpu_s": usage.ru_utime + usage.ru_stime,
                              "wall_s": time.monotonic() - started}
        print(json.dumps([results[index] for index in range(len(request["jobs"]))]), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--pool"]:
    sys.path.insert(0, str(HERE))
    _pool()
