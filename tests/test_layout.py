"""The layout: imports run one way, from the commands down to the kernels — no cycle in ``cnn/`` or ``kernels/``.

The imports are read from the source with ``ast``, not by importing anything: every ``import``
and ``from … import`` statement of every module, at module level and inside functions alike (a
function-level import is still a dependency, only a later one). ``from package import name``
points at ``package.name`` when that is a module, else at ``package``. Importing ``a.b.c`` from
outside ``a.b`` also runs ``a/b/__init__.py``, so that counts as an edge to ``a.b`` as well.
Imports made by name at run time (``importlib.import_module``, as the stage registry does) are
not statements and are not counted.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cnn", "kernels")


def module_files(root: Path = ROOT, packages=PACKAGES) -> dict[str, Path]:
    """{dotted module name: file} of every module under the packages (a package is its __init__.py)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _nearest_module(dotted: str, modules) -> str | None:
    """``dotted`` if it is one of ``modules``, else the longest prefix that is (a name inside it); None outside."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _statement_targets(node, importer: str, modules) -> list[str]:
    """The dotted names one import statement brings in."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:                                   # relative: from . import x, from ..y import z
        package = importer if _is_package(importer, modules) else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def imports_of(importer: str, modules) -> set[str]:
    """The modules of ``modules`` that ``importer`` imports, anywhere in its file, with their packages' __init__."""
    tree = ast.parse(modules[importer].read_text(), filename=str(modules[importer]))
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for dotted in _statement_targets(node, importer, modules):
            target = _nearest_module(dotted, modules)
            if target is None:
                continue
            found.add(target)
            parts = target.split(".")
            for end in range(1, len(parts)):          # the packages it runs on the way, unless already running
                package = ".".join(parts[:end])
                if importer != package and not importer.startswith(package + "."):
                    found.add(package)
    found.discard(importer)
    return found


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: imports_of(name, modules) for name in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, …, a], or None: depth-first search, a back edge closes a cycle."""
    state, path = {}, []                             # state: 1 on the current path, 2 done

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_no_import_cycles_in_cnn_and_kernels():
    graph = import_graph()
    assert {"cnn.bench", "cnn.cli", "cnn.plots", "kernels.device"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _imports_numba_cuda(path: Path) -> bool:
    """Does the file import Numba's CUDA target (``numba.cuda``, ``from numba import cuda``, numba_cuda)?"""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == "numba.cuda" or name.startswith(("numba.cuda.", "numba_cuda")) for name in names):
            return True
    return False


def test_stage_3_kernels_never_reach_numba_cuda():
    """kernels/cpu/ and stage 3 itself import no CUDA: a CPU-only install (no numba-cuda) trains numba-cpu."""
    modules, graph = module_files(), import_graph()
    reached, todo = set(), [name for name in modules if name.startswith("kernels.cpu")]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += graph[name]
    assert "kernels.device" not in reached
    offenders = [name for name in sorted(reached | {"cnn.stages.s3_numba_cpu"}) if _imports_numba_cuda(modules[name])]
    assert offenders == [], f"these import numba.cuda: {offenders}"
    assert _imports_numba_cuda(modules["kernels.device"])          # the check itself can see one


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Module-level and function-level, absolute and relative, a package's __init__ on the way."""
    files = {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n",
             "pkg/b.py": "def later():\n    from . import c\n", "pkg/c.py": "from pkg.sub.d import name\n",
             "pkg/sub/__init__.py": "from pkg.sub import d\n", "pkg/sub/d.py": "from ..a import x\nimport numpy\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.sub", "pkg.sub.d"},
                     "pkg.sub": {"pkg.sub.d"}, "pkg.sub.d": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.sub", "pkg.sub.d", "pkg.a"]


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),                 # a diamond is not a cycle
    ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
    ({"x": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
])
def test_find_cycle(graph, expected):
    assert find_cycle(graph) == expected
