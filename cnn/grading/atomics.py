"""Which statements of a CUDA kernel write into its output arrays, and whether each is an atomic.

Numba's CUDA simulator runs its threads in a way that seldom exposes a race, so a push kernel whose
threads add into shared outputs with a plain ``+=`` usually gets the right numbers there. Assignment 5
therefore reads the kernel: ``writes_into(kernel, outputs)`` parses its source (Python's ``ast``) and
finds every statement that writes into an output — ``dx[i] += g`` and the long-hand
``dx[i] = dx[i] + g`` alike, through another name bound to the array (``row = dx[n, c]``), or inside a
device function the kernel hands the array to. Only ``cuda.atomic.<op>(array, …)`` is one indivisible
read-modify-write.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from cnn.grading.bytecode import python_function


def array_name(node):
    """The variable an expression takes elements or attributes of: ``dx`` for dx, dx[i], dx[n][c], dx.shape[0]."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def stored_into(target):
    """The subscripted targets of an assignment: ``dx[i]`` in ``dx[i] = v`` and in ``a, dx[i] = u, v``."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [part for element in target.elts for part in stored_into(element)]
    if isinstance(target, ast.Starred):
        return stored_into(target.value)
    return [target] if isinstance(target, ast.Subscript) else []


def is_atomic(call) -> bool:
    """``cuda.atomic.add(...)`` (or any ``….atomic.<op>``): one indivisible read-modify-write."""
    return isinstance(call.func, ast.Attribute) and ast.unparse(call.func.value).split(".")[-1] == "atomic"


def writes_into(kernel, outputs) -> list[tuple[int, str, str, bool]]:
    """Every write into the arrays named ``outputs`` in ``kernel``: (line, code, array, is_atomic) tuples.

    A name bound to an output or a part of it (``d = dx`` or ``row = dx[n, c]``) counts as that output; a
    device function that an output is handed to is read the same way, with its parameter as the output.
    Lines count from the first line of the function's source (the ``@cuda.jit`` line)."""
    function = python_function(kernel)
    lines, first = inspect.getsourcelines(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    outputs = set(outputs)
    for node in ast.walk(tree):                                 # aliases, in the order they are bound
        if isinstance(node, ast.Assign) and array_name(node.value) in outputs:
            outputs |= {target.id for target in node.targets if isinstance(target, ast.Name)}

    def where(node):
        return first + node.lineno - 1, ast.unparse(node).splitlines()[0]

    found = []
    for node in ast.walk(tree):
        targets = {ast.Assign: lambda n: n.targets, ast.AugAssign: lambda n: [n.target],
                   ast.AnnAssign: lambda n: [n.target]}.get(type(node), lambda n: [])(node)
        for target in (part for t in targets for part in stored_into(t)):
            if array_name(target) in outputs:
                found.append((*where(node), array_name(target), False))
        if isinstance(node, ast.Call):
            handed = [(position, array_name(arg)) for position, arg in enumerate(node.args)
                      if isinstance(arg, (ast.Name, ast.Subscript)) and array_name(arg) in outputs]
            if is_atomic(node) and handed and handed[0][0] == 0:
                found.append((*where(node), handed[0][1], True))
            elif handed and isinstance(node.func, ast.Name):
                inner = python_function(function.__globals__.get(node.func.id))
                if inspect.isfunction(inner) and inner is not function:
                    parameters = list(inspect.signature(inner).parameters)
                    chosen = {parameters[position] for position, _ in handed if position < len(parameters)}
                    found += [(line, f"{code}   (in {inner.__name__}, called at line {where(node)[0]})", name, atomic)
                              for line, code, name, atomic in writes_into(inner, chosen)]
    return found
