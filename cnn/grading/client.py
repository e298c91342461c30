"""The kernel's side of grading: ``grade(family, *answers)``, the one call every test cell makes.

A notebook's set-up cell makes ``grade = Grader("a1_naive_conv")``; a test cell is then one line,
``grade("test_forward_stride1", conv_forward_naive)``. For that family of cases the grader

1. refuses at once an answer that uses the course library (``cnn.grading.authorship``: followed
   through globals, closures and helpers), and a library whose functions the notebook replaced;
2. asks the referee (``cnn.grading.referee``, another process) for the family's cases: fresh inputs,
   whose expected results never leave the referee;
3. runs the student's code on each case (the family's ``run``: a call, a kernel launch, ranks in
   threads, a counted run) — recording any call into the library while it runs — and sends back what
   came out; the referee judges it and answers with the lines to print, or the failure;
4. reports the calls recorded to the referee, which, if everything passed, seals the verdict: the
   cell prints the seal, and nbgrader's ``CheckSeals`` gives the cell its points only if it is there.

Under nbgrader's autograder the referee is started outside the kernel and its address is in
``$CNN_REFEREE``; a student running the notebook gets a referee of their own, started at the first test.
"""

from __future__ import annotations

import importlib
import inspect
import os
from contextlib import nullcontext

from cnn.grading.authorship import Calls, library_calls, own_work_problems, replacement_refusal
from cnn.grading.bytecode import python_function
from cnn.grading.protocol import decode, encode

ADDRESS_VARIABLE = "CNN_REFEREE"

_connection = None
_local_referee = None
_current_calls = None


def _connect(assignment: str = ""):
    """The connection to the referee: the autograder's, else one started for this kernel."""
    global _connection, _local_referee
    if _connection is None:
        from multiprocessing.connection import Client

        address = os.environ.get(ADDRESS_VARIABLE)
        if not address:
            from cnn.grading.referee import RefereeProcess

            _local_referee = RefereeProcess(preload=[assignment] if assignment else [])
            address = _local_referee.address
        _connection = Client(address, family="AF_UNIX")
    return _connection


def request(message: dict) -> dict:
    """Send one message to the referee and return its reply; a refusal raises with the referee's reason."""
    connection = _connect(message.get("assignment", ""))
    connection.send_bytes(encode(message))
    reply = decode(connection.recv_bytes())
    if "error" in reply:
        raise RuntimeError(f"the grader's referee could not do this: {reply['error']}")
    return reply


def lend(obj):
    """Mark ``obj`` — a library function the grader itself hands to the student's code — as not the
    student's own use of the library (see ``cnn.grading.authorship``). Returns ``obj``."""
    if _current_calls is not None:
        _current_calls.exempt(obj)
    return obj


def _traceable(answer) -> bool:
    """Plain Python (a function or a class) runs its calls through Python, where they can be recorded;
    a compiled kernel or an ``@njit`` function does not."""
    return inspect.isfunction(answer) or inspect.isclass(answer)


def _other_parts(family, checked) -> list:
    """The notebook's functions that are other parts' answers, as the checked answers' globals hold them."""
    names = family.own_work.other_parts if family.own_work else ()
    return [python_function(answer).__globals__[name] for answer in checked for name in names
            if name in getattr(python_function(answer), "__globals__", {})]


class Grader:
    """``grade(family, *answers)`` for one assignment's test families."""

    def __init__(self, assignment: str):
        self.assignment = assignment
        self.families = importlib.import_module(f"cnn.grading.assignments.{assignment}").FAMILIES

    def __call__(self, name: str, *answers) -> None:
        family = self.families[name]
        refusal = replacement_refusal()
        if refusal:
            raise AssertionError(refusal)
        rules = family.own_work.rules if family.own_work else ()
        checked = [answers[index] for index in (family.own_work.answers if family.own_work else ())
                   if index < len(answers)]
        other_parts = _other_parts(family, checked)
        problems = own_work_problems(checked, rules, {}, other_parts)
        if problems:
            raise AssertionError(problems[0])
        config = family.config(*answers) if family.config else {}
        opened = request({"op": "open", "assignment": self.assignment, "family": name, "config": config})
        attempt = opened["attempt"]
        traced = bool(checked) and all(_traceable(python_function(answer)) for answer in checked)
        with library_calls() if traced else nullcontext(Calls()) as calls:
            for other in other_parts:
                calls.exempt(other)
            self._run_cases(family, attempt, opened["cases"], answers, calls)
        if family.own_work:
            problems = own_work_problems([], rules, calls)
            request({"op": "own_work", "attempt": attempt, "problems": problems})
        verdict = request({"op": "close", "attempt": attempt})
        if not verdict["passed"]:
            raise AssertionError(verdict["message"])
        if verdict["seal"]:
            print(verdict["seal"])

    @staticmethod
    def _run_cases(family, attempt: str, cases: list, answers, calls) -> None:
        """Run the student's code on every case and have the referee judge it; stop at the first failure."""
        global _current_calls
        _current_calls = calls
        try:
            for index, case in enumerate(cases):
                outputs = family.run(case["inputs"], *answers)
                reply = request({"op": "answer", "attempt": attempt, "case": index, "outputs": outputs})
                for line in reply["lines"]:
                    print(line)
                if not reply["ok"]:
                    raise AssertionError(reply["message"])
        finally:
            _current_calls = None
