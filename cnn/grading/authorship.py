"""Own work: what a student's function uses of the course library — followed, not searched for by name.

The library holds a working version of everything the assignments ask for, so each test also checks
that the answer did not simply call it. Searching the function's source for ``s1_loops`` is not
enough: ``_theirs = s1_loops.conv_forward`` kept outside the function, then ``return _theirs(...)``,
mentions no library name inside it. So the grader follows what the function reaches:

- ``library_reached(function)``, without running it: the globals its bytecode loads, the objects they
  hold — a module's attributes named in the code, the contents of closures, default arguments, lists
  and dicts, bound methods, ``functools.partial`` — and, recursively, the notebook's own functions and
  classes it calls. Every object of the course library (``cnn``, ``kernels``) met on the way is named,
  with the global it was reached through;
- ``library_calls()``, while the tests run it: a profile hook records every call that enters the course
  library from code outside it — whatever name, ``getattr`` or ``sys.modules`` lookup it came through;
- ``library_replacements()``: library functions or methods that the notebook replaced with its own
  (``s1_loops.conv_forward = conv_forward_naive``). The referee's references cannot be reached that
  way, so such a replacement changes nothing but the student's score; the grader refuses it by name.

Each family says what its answers may use (``cnn.grading.family.OwnWork``: rules of (pattern,
allowed), the last match deciding: assignment 4 may call ``kernels.conv2d.conv_window_sum``, assignment
8's loop the stage's methods). The grader itself may hand library functions to the student's code
(``update=sgd_momentum_update``, or the library's ``im2col`` in place of a part left blank): those are
``exempt`` from the record, with everything they call.

Kernels compiled for a GPU run no Python, so for them only the first look applies; the instructor
guide says what a determined student can still hide.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
from contextlib import contextmanager
from fnmatch import fnmatchcase

from cnn.grading.bytecode import attributes_used, globals_loaded, modules_imported, python_function

COURSE_PACKAGES = ("cnn", "kernels")
GRADER = "cnn.grading"
IMPORTED = "an import"      # the grader's own frames (it calls the student's code) are not the student's calls


def in_course(module_name: str) -> bool:
    return any(module_name == package or module_name.startswith(package + ".") for package in COURSE_PACKAGES)


def allowed(qualified: str, rules) -> bool:
    """Whether ``rules`` — (pattern, allowed) pairs, the last match deciding — allow ``qualified``."""
    verdict = True
    for pattern, allow in rules:
        if fnmatchcase(qualified, pattern):
            verdict = allow
    return verdict


def qualified_name(obj) -> str | None:
    """``module.qualname`` of a module, function, class or dispatcher; of an instance's class otherwise."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    inner = python_function(obj)
    module = getattr(inner, "__module__", None)
    name = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
    if isinstance(module, str) and isinstance(name, str) and (inspect.isroutine(inner) or inspect.isclass(inner)):
        return f"{module}.{name}"
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _from_notebook(obj) -> bool:
    inner = python_function(obj)
    return (inspect.isfunction(inner) or inspect.isclass(inner)) and getattr(inner, "__module__", None) == "__main__"


def _contents(value):
    """The objects a value hands on: items of containers, the function of a partial or a bound method."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()]
    if inspect.ismethod(value):
        return [value.__func__, value.__self__]
    return []


def _functions_of(obj) -> list:
    """The Python function behind ``obj``, or every method of a class."""
    inner = python_function(obj)
    if inspect.isclass(inner):
        return [python_function(getattr(member, "__func__", member)) for member in vars(inner).values()]
    return [inner]


def _objects_reached(current) -> list[tuple[object, str]]:
    """(object, the name it was reached through) of everything one function refers to: the globals its
    code loads, module attributes it names, closures, default arguments, and what those contain."""
    names = attributes_used(current)
    queue = [(current.__globals__[name], name) for name in globals_loaded(current) if name in current.__globals__]
    for variable, cell in zip(current.__code__.co_freevars, current.__closure__ or ()):
        try:
            queue.append((cell.cell_contents, variable))
        except ValueError:                           # an empty cell
            pass
    queue += [(value, "a default argument") for value in current.__defaults__ or ()]
    queue += [(value, "a default argument") for value in (current.__kwdefaults__ or {}).values()]
    reached, seen = [], set()
    while queue:
        value, via = queue.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        reached.append((value, via))
        queue += [(item, via) for item in _contents(value)]
        if isinstance(value, types.ModuleType):
            queue += [(getattr(value, name), f"{via}.{name}") for name in names if hasattr(value, name)]
    return reached


def _walk(function, stop=()):
    """Yield (function, object, via) for every object reached by ``function`` and, recursively, by the
    notebook functions and classes it reaches — but not into ``stop``: other parts' answers, graded on their own."""
    done = {id(inner) for obj in stop for inner in _functions_of(obj)}
    pending = _functions_of(function)
    while pending:
        current = pending.pop()
        if id(current) in done or not inspect.isfunction(current):
            continue
        done.add(id(current))
        for value, via in _objects_reached(current):
            if _from_notebook(value) and not isinstance(value, types.ModuleType):
                pending += _functions_of(value)
            yield current, value, via


def notebook_functions(function, stop=()) -> list:
    """``function`` and every function of the notebook it reaches (its helpers, their helpers …), not
    going into ``stop``."""
    found = {id(inner): inner for inner in _functions_of(function) if inspect.isfunction(inner)}
    stopped = {id(inner) for obj in stop for inner in _functions_of(obj)}
    for _, value, _ in _walk(function, stop):
        if _from_notebook(value):
            found.update({id(inner): inner for inner in _functions_of(value)
                          if inspect.isfunction(inner) and id(inner) not in stopped})
    return list(found.values())


def library_reached(function, stop=()) -> list[tuple[str, str]]:
    """(qualified name, the global it was reached through) of every course-library object that
    ``function`` — and the notebook functions it calls, other than ``stop`` — refers to or imports,
    without running anything."""
    found: dict[str, str] = {}
    root = _functions_of(function)

    def where(current, via):
        return via if current in root else f"{via} in {current.__name__}"
    for current in notebook_functions(function, stop):
        found.update({name: where(current, IMPORTED) for name in modules_imported(current) if in_course(name)})
    for current, value, via in _walk(function, stop):
        via = where(current, via)
        if isinstance(value, types.ModuleType):
            if in_course(value.__name__):
                found.setdefault(value.__name__, via)
        elif not _from_notebook(value):
            qualified = qualified_name(value)
            if qualified and in_course(qualified.rsplit(".", 1)[0]):
                found.setdefault(qualified, via)
    return sorted(found.items())


class Calls(dict):
    """{qualified name: caller's name} of the calls into the course library; ``exempt(obj)`` stops
    recording calls into ``obj`` and everything it calls (what the grader itself hands the student's code)."""

    def __init__(self):
        super().__init__()
        self.exempt_codes = set()

    def exempt(self, obj):
        code = getattr(python_function(obj), "__code__", None)
        if code is not None:
            self.exempt_codes.add(code)
        return obj


@contextmanager
def library_calls():
    """Record, while inside, every call from outside the course library into it, in every thread:
    yields a ``Calls`` dict {qualified name: caller's name}."""
    calls = Calls()
    exempt_codes = calls.exempt_codes
    state = threading.local()

    def hook(frame, event, arg):
        code = frame.f_code
        if event == "return":
            if code in exempt_codes or code.co_name == "<module>":
                state.depth = getattr(state, "depth", 1) - 1
            return
        if event != "call":
            return
        depth = getattr(state, "depth", 0)
        if code in exempt_codes or code.co_name == "<module>":      # an exempt call, or an import running
            state.depth = depth + 1
            return
        if depth:
            return
        module = frame.f_globals.get("__name__", "")
        if not isinstance(module, str) or not in_course(module) or module.startswith(GRADER):
            return
        caller = frame.f_back
        caller_module = caller.f_globals.get("__name__", "") if caller is not None else ""
        if not (isinstance(caller_module, str) and in_course(caller_module)):
            calls.setdefault(f"{module}.{code.co_qualname}", caller.f_code.co_qualname if caller else "?")

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        yield calls
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)


def library_replacements() -> list[str]:
    """'module.name is now X from this notebook' for every library function, class or method that the
    notebook replaced with one of its own."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not in_course(module_name):
            continue
        for attribute, value in list(vars(module).items()):
            if _from_notebook(value):
                found.append(f"{module_name}.{attribute} is now {python_function(value).__name__} from this notebook")
            elif inspect.isclass(value) and value.__module__ == module_name:
                found += [f"{module_name}.{value.__qualname__}.{member} is now {python_function(inner).__name__} "
                          f"from this notebook" for member, inner in list(vars(value).items()) if _from_notebook(inner)]
    return found


def replacement_refusal() -> str:
    """The refusal of a library the notebook changed (empty when it did not)."""
    replaced = library_replacements()
    if not replaced:
        return ""
    return ("the course library was changed: " + "; ".join(replaced) + ". The tests compare with references "
            "computed in a separate process, which this cannot reach: refused")


def own_work_problems(answers, rules, calls: dict, stop=()) -> list[str]:
    """Every library object an answer reaches (not through ``stop``: other parts' answers), or that was
    called while it ran, that ``rules`` do not allow."""
    problems = []
    for answer in answers:
        name = getattr(python_function(answer), "__name__", "your code")
        itself = qualified_name(answer)
        if not _from_notebook(answer) and itself and in_course(itself.rsplit(".", 1)[0]) and not allowed(itself, rules):
            problems.append(f"{name} is the library's {itself}, not a function of yours: write it yourself")
            continue
        for qualified, via in library_reached(answer, stop):
            if not allowed(qualified, rules):
                through = ("" if via == qualified.rsplit(".", 1)[-1] else " (imported in it)" if via == IMPORTED
                           else f" (imported{via[len(IMPORTED):]})" if via.startswith(IMPORTED) else f" (through {via})")
                problems.append(f"{name} uses {qualified}{through}: write it yourself")
    for qualified, caller in calls.items():
        if not allowed(qualified, rules):
            problems.append(f"{caller} called {qualified} while the tests ran it: write it yourself")
    return problems
