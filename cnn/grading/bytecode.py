"""What a function's code refers to, read from its bytecode: the globals it loads, the attributes it reads.

The grader asks two questions of a student's function without running it:

- what does it reach? (``cnn.grading.authorship``: a reference kept in a global, a library module's
  attribute, a helper that calls the library) — the globals it loads, followed through the objects
  they hold;
- does it do something compiled code cannot? (``cnn.grading.traffic``: a kernel that calls ``type()``
  or reads a private attribute to tell a counted array from a plain one would not compile for a GPU).

Both are read from the instructions (``dis``), not the source text: ``LOAD_GLOBAL`` names a global or a
builtin, ``LOAD_ATTR`` / ``LOAD_METHOD`` / ``STORE_ATTR`` an attribute — where ``co_names`` mixes both,
and a comment or a string that mentions a name is not a reference to it.
"""

from __future__ import annotations

import builtins
import dis
import inspect
from types import CodeType

GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME"}
ATTRIBUTE_ACCESS = {"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR"}


def python_function(obj):
    """The Python function behind a Numba dispatcher (``@njit``, ``@cuda.jit``, simulated), else ``obj``."""
    for attribute in ("py_func", "fn"):
        inner = getattr(obj, attribute, None)
        if callable(inner):
            return inner
    return obj


def code_objects(function) -> list[CodeType]:
    """The function's code and every code nested in it (inner functions, lambdas, comprehensions)."""
    codes, pending = [], [python_function(function).__code__]
    while pending:
        code = pending.pop()
        codes.append(code)
        pending.extend(const for const in code.co_consts if inspect.iscode(const))
    return codes


def globals_loaded(function) -> set[str]:
    """Names the function's code loads as globals or builtins."""
    return {instruction.argval for code in code_objects(function) for instruction in dis.get_instructions(code)
            if instruction.opname in GLOBAL_LOADS}


def attributes_used(function) -> set[str]:
    """Attribute names the function's code reads, writes or deletes (``a.b`` gives ``b``)."""
    return {instruction.argval for code in code_objects(function) for instruction in dis.get_instructions(code)
            if instruction.opname in ATTRIBUTE_ACCESS}


def modules_imported(function) -> set[str]:
    """Dotted names the function's code imports: ``import a.b`` gives a.b, ``from a import b`` gives a.b."""
    names = set()
    for code in code_objects(function):
        module = None
        for instruction in dis.get_instructions(code):
            if instruction.opname == "IMPORT_NAME":
                module = instruction.argval
                names.add(module)
            elif instruction.opname == "IMPORT_FROM" and module:
                names.discard(module)
                names.add(f"{module}.{instruction.argval}")
    return names


def builtins_called(function) -> set[str]:
    """The globals loaded that are Python builtins (not shadowed by a global of the function's module)."""
    namespace = python_function(function).__globals__
    return {name for name in globals_loaded(function) if name not in namespace and hasattr(builtins, name)}


def referenced_globals(function) -> set[str]:
    """Every name the code may look up as a global (``co_names``: globals and attribute names together)."""
    return {name for code in code_objects(function) for name in code.co_names}


def is_blank(function) -> bool:
    """True when the function is the student version's stub: its body (docstring aside) only raises
    ``NotImplementedError`` — the part was left unanswered."""
    function = python_function(function)
    if not inspect.isfunction(function):
        return False
    instructions = [instruction for instruction in dis.get_instructions(function.__code__)
                    if instruction.opname not in ("RESUME", "NOP", "CACHE", "PRECALL", "CALL", "PUSH_NULL",
                                                  "KW_NAMES")]
    return ([(instruction.opname, instruction.argval) for instruction in instructions]
            == [("LOAD_GLOBAL", "NotImplementedError"), ("RAISE_VARARGS", 1)])
