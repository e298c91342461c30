"""How the kernel runs a student's answer on a case: the common ``run`` halves of the test families.

A family's ``run(inputs, *answers)`` gets the inputs the referee drew (``inputs["args"]``: the
arguments, in order) and returns the outputs, by name, for the referee to judge. Most families need
one of these:

- ``call("dx", "dW", "db")``: the answer is a function; its result, one value or a tuple, is named;
- ``call_in_place("params", "velocity", at=(0, 1))``: the answer writes into its arguments;
- ``launch_1d(over=2, y=2)``: the answer is a CUDA kernel, launched with one thread per element of
  argument ``over`` on device copies of the arrays; outputs are arguments copied back;

``library_for_blanks``: a part that builds on another part's function runs with the library's
version of it when the student left that part blank, so that every part can be graded alone; and
``once_per_answer``: a run several families judge (a counted run) is made once for the same answer on
the same inputs.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

import numpy as np

from cnn.grading.bytecode import is_blank, python_function
from cnn.grading.client import lend


def named(result, returns: tuple) -> dict:
    """The outputs of a function that returned ``result``, named ``returns``."""
    if len(returns) == 1:
        return {returns[0]: result}
    if not isinstance(result, (tuple, list)) or len(result) != len(returns):
        got = "None" if result is None else f"a {type(result).__name__}" + (
            f" of {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise AssertionError(f"return the {len(returns)} results ({', '.join(returns)}); your function returned {got}")
    return dict(zip(returns, result))


def call(*returns):
    """Run ``answer(*args)``; its result is the outputs ``returns``."""
    def run(inputs, answer, *others):
        return named(answer(*inputs["args"]), returns)
    return run


def call_in_place(*names, at: tuple):
    """Run ``answer(*args)``; the outputs ``names`` are the arguments at positions ``at`` afterwards."""
    def run(inputs, answer, *others):
        args = inputs["args"]
        answer(*args)
        return {name: args[position] for name, position in zip(names, at)}
    return run


def launch_1d(over: int, **outputs: int):
    """Launch the kernel with at least one thread per element of argument ``over`` (``grid_1d``), on
    device copies of the array arguments; the outputs are the arguments at the given positions."""
    def run(inputs, kernel, *others):
        from kernels.device import cuda
        from kernels.launch import grid_1d

        args = [cuda.to_device(value) if isinstance(value, np.ndarray) else value for value in inputs["args"]]
        kernel[grid_1d(inputs["args"][over].size)](*args)
        return {name: args[position].copy_to_host() for name, position in outputs.items()}
    return run


@contextmanager
def library_for_blanks(function, **library):
    """While inside, every global of ``function``'s notebook named in ``library`` that is a part left blank
    (it only raises ``NotImplementedError``) is the library's version instead, lent by the grader."""
    namespace = python_function(function).__globals__
    saved = {name: namespace[name] for name in library if name in namespace and is_blank(namespace[name])}
    namespace.update({name: lend(library[name]) for name in saved})
    try:
        yield
    finally:
        namespace.update(saved)


_RUNS: dict = {}          # (the answer's code, a digest of the inputs) -> the outputs of its run


def _digest(value, into=None):
    """A digest of a case's inputs: the bytes of every array, the repr of everything else."""
    into = into or hashlib.sha256()
    if isinstance(value, np.ndarray):
        into.update(repr((value.dtype.str, value.shape)).encode())
        into.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        for key in sorted(value):
            into.update(repr(key).encode())
            _digest(value[key], into)
    elif isinstance(value, (list, tuple)):
        into.update(b"[")
        for item in value:
            _digest(item, into)
        into.update(b"]")
    else:
        into.update(repr(value).encode())
    return into


def once_per_answer(run):
    """``run``, made once for the same answer (its code) on the same inputs, then remembered: the counted
    run that several families judge (the referee hands them the same case)."""
    def remembered(inputs, answer, *others):
        key = (python_function(answer).__code__, _digest(inputs).hexdigest())
        if key not in _RUNS:
            _RUNS[key] = run(inputs, answer, *others)
        return _RUNS[key]
    return remembered
