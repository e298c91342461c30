"""The referee: the process that makes the inputs, computes what the answers must be, and judges them.

A student's code runs in the notebook's kernel, and anything in that process it can change: it can
replace the library's reference (``s1_loops.conv_forward = my_conv``), redefine the function a test
calls, or edit the numbers a limit is computed from. So the tests' other half runs here, in a
separate process started before — or apart from — the student's code:

- for each family of cases (one test cell), it draws fresh random inputs and computes the expected
  results with the course library's reference, as imported by this process (``cnn.grading.family``);
- it sends the kernel only the inputs; the kernel runs the student's code and sends back what came
  out; the referee compares, with its own numbers and its own limits, and answers with the lines to
  print and, at the first failure, the message;
- when every case of a family has passed (and the kernel has reported the student's own work), it
  seals the verdict (``cnn.grading.seal``) with a key that never leaves this process and its parent.

Run as ``python -I -m cnn.grading.referee [assignment …]``: it imports those assignments' tests, prints
one JSON line ``{"address": …, "key": …}`` to its parent and serves kernels on that Unix socket until its standard input closes (its parent —
nbgrader's autograder, a test, or a notebook kernel running locally — went away). Messages are
``cnn.grading.protocol`` frames, never pickle. ``RefereeProcess`` starts one and stops it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field

import numpy as np

from cnn.grading.protocol import decode, encode
from cnn.grading.seal import seal_line

_ASSIGNMENT = re.compile(r"a\d+_[a-z0-9_]+")


def families_of(assignment: str) -> dict:
    """{grade_id: Family} of one assignment (``cnn.grading.assignments.<assignment>``)."""
    if not _ASSIGNMENT.fullmatch(assignment or ""):
        raise KeyError(f"no assignment named {assignment!r}")
    try:
        module = importlib.import_module(f"cnn.grading.assignments.{assignment}")
    except ModuleNotFoundError:
        raise KeyError(f"no assignment named {assignment!r}") from None
    return module.FAMILIES


@dataclass
class Attempt:
    assignment: str
    family: str
    cases: list
    passed: dict = field(default_factory=dict)        # case index -> bool
    failure: str = ""
    own_work: list | None = None                      # the kernel's report: problems found (None: not reported)
    needs_own_work: bool = True
    sealed: bool = True


class Session:
    """What the referee keeps for one kernel: its open attempts, and what earlier families left (``memory``)."""

    def __init__(self):
        self.attempts: dict[str, Attempt] = {}
        self.memory: dict = {}


class Referee:
    def __init__(self, key: bytes):
        self.key = key

    def handle(self, message: dict, session: Session) -> dict:
        operation = message.get("op")
        handler = {"open": self._open, "answer": self._answer, "own_work": self._own_work,
                   "close": self._close}.get(operation)
        if handler is None:
            raise KeyError(f"unknown operation {operation!r}")
        return handler(message, session)

    def _open(self, message, session):
        assignment, name = message.get("assignment"), message.get("family")
        families = families_of(assignment)
        if name not in families:
            raise KeyError(f"{assignment} has no test family {name!r}")
        family = families[name]
        cases = list(family.cases(np.random.default_rng(), message.get("config") or {}, session.memory))
        attempt_id = secrets.token_hex(8)
        session.attempts[attempt_id] = Attempt(assignment, name, cases, needs_own_work=family.own_work is not None,
                                               sealed=family.sealed)
        return {"attempt": attempt_id, "cases": [{"label": case.label, "inputs": case.inputs} for case in cases]}

    def _attempt(self, message, session) -> Attempt:
        attempt = session.attempts.get(message.get("attempt"))
        if attempt is None:
            raise KeyError("no such attempt: open the family first")
        return attempt

    def _answer(self, message, session):
        attempt = self._attempt(message, session)
        index = message.get("case")
        if not isinstance(index, int) or not 0 <= index < len(attempt.cases) or index in attempt.passed:
            raise KeyError(f"case {index!r} is not a case of this attempt, or was answered already")
        verdicts = attempt.cases[index].judge(message.get("outputs") or {})
        ok = all(verdict.ok for verdict in verdicts)
        attempt.passed[index] = ok
        failure = next((verdict.message for verdict in verdicts if not verdict.ok), "")
        attempt.failure = attempt.failure or failure
        return {"ok": ok, "lines": [verdict.line for verdict in verdicts if verdict.line], "message": failure}

    def _own_work(self, message, session):
        attempt = self._attempt(message, session)
        attempt.own_work = [str(problem) for problem in message.get("problems") or []]
        return {}

    def _close(self, message, session):
        attempt = self._attempt(message, session)
        del session.attempts[message["attempt"]]
        unanswered = [index for index in range(len(attempt.cases)) if index not in attempt.passed]
        if attempt.failure:
            reason = attempt.failure
        elif unanswered:
            reason = f"{len(unanswered)} of the family's {len(attempt.cases)} cases were never answered"
        elif attempt.needs_own_work and attempt.own_work is None:
            reason = "the check of your own work did not run"
        elif attempt.own_work:
            reason = "; ".join(attempt.own_work)
        else:
            return {"passed": True, "seal": seal_line(self.key, attempt.assignment, attempt.family) if attempt.sealed else ""}
        return {"passed": False, "message": reason}


def _serve_connection(connection, referee: Referee) -> None:
    session = Session()
    with connection:
        while True:
            try:
                frame = connection.recv_bytes()
            except (EOFError, OSError):
                return
            try:
                reply = referee.handle(decode(frame), session)
            except Exception as err:                     # a bad request, or a family that failed: say so
                detail = traceback.format_exception_only(type(err), err)[-1].strip()
                reply = {"error": detail}
            try:
                connection.send_bytes(encode(reply))
            except (OSError, TypeError) as err:
                connection.send_bytes(encode({"error": f"the referee could not send its reply: {err}"}))


def serve(preload=()) -> None:
    """The referee's main: import the assignments it will judge (and so the library references they use),
    announce the address and the key on stdout, serve until stdin closes."""
    from multiprocessing.connection import Listener

    for assignment in preload:
        families_of(assignment)

    folder = tempfile.mkdtemp(prefix="cnn-referee-")
    address = os.path.join(folder, "socket")
    key = secrets.token_bytes(32)
    listener = Listener(address, family="AF_UNIX")
    referee = Referee(key)

    def accept_forever():
        while True:
            try:
                connection = listener.accept()
            except OSError:
                return
            threading.Thread(target=_serve_connection, args=(connection, referee), daemon=True).start()

    threading.Thread(target=accept_forever, daemon=True).start()
    print(json.dumps({"address": address, "key": key.hex()}), flush=True)
    try:
        sys.stdin.buffer.read()                           # returns when the parent closes our stdin or exits
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)


class RefereeProcess:
    """A referee in its own process: ``address`` for kernels to connect to, ``key`` to check its seals.

    ``preload`` names the assignments it will judge: their tests, and the library's references they
    compare with, are imported before the referee announces itself — before the student's code runs,
    so that a library file the student's code rewrites on disk is not what the referee compares with."""

    def __init__(self, preload=()):
        environment = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}    # it never runs a kernel: never touch a GPU
        command = [sys.executable, "-I", "-m", "cnn.grading.referee", *preload]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment)
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the grader's referee did not start (exit code {self._process.wait()})")
        announced = json.loads(line)
        self.address, self.key = announced["address"], bytes.fromhex(announced["key"])

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


if __name__ == "__main__":
    serve(sys.argv[1:])
