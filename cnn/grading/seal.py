"""Sealed verdicts: a test cell's "passed" that only the referee can write.

nbgrader gives a test cell its points when it runs without an error — and a student's code runs in
the same kernel before the tests, so it can make a test cell not fail: redefine the function the
cell calls, or rewrite the cell's code before it runs (an IPython input transformer), and print
"10/10". What it cannot do is write the referee's seal. The referee, a process outside the kernel,
prints a seal only for a family of cases it has judged itself, as an HMAC of the family's name under
a key that never enters the kernel::

    graded outside the kernel: test_forward_stride1 passed · seal 0c6f3e…

After the kernel has run, nbgrader's preprocessor ``cnn.grading.nbgrader_plugin.CheckSeals`` (which
holds the key) gives no points to a test cell whose output lacks its valid seal.
"""

from __future__ import annotations

import hashlib
import hmac
import re

DIGITS = 40
_LINE = re.compile(r"graded outside the kernel: (?P<family>\S+) passed · seal (?P<mac>[0-9a-f]{%d})" % DIGITS)


def mac(key: bytes, assignment: str, family: str) -> str:
    """The seal of ``family`` of ``assignment`` under ``key``."""
    return hmac.new(key, f"{assignment}/{family}/passed".encode(), hashlib.sha256).hexdigest()[:DIGITS]


def seal_line(key: bytes, assignment: str, family: str) -> str:
    """The line the kernel prints when the referee has judged ``family`` passed."""
    return f"graded outside the kernel: {family} passed · seal {mac(key, assignment, family)}"


def is_sealed(text: str, key: bytes, assignment: str, family: str) -> bool:
    """True when ``text`` holds a valid seal for ``family`` of ``assignment``."""
    expected = mac(key, assignment, family)
    return any(found["family"] == family and hmac.compare_digest(found["mac"], expected)
               for found in _LINE.finditer(text))
