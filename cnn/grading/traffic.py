"""Count a kernel's memory traffic by running its Python source on arrays that count their accesses.

A GPU kernel is limited by how often it goes to global memory long before it is limited by
arithmetic, and a tiled kernel is fast *because* it goes there less: T × T tiles in shared memory
divide the global reads of a matrix product by T. That is a count, not a time, so it can be
measured exactly on a laptop with no GPU:

    traffic = count_cuda(kernel, grid, block, x, w, b, y)
    traffic.loads("w") / y.size          # global reads of w per output element
    traffic.shared_loads() / (y.size * K)   # shared-memory reads per multiply-add

How it works. Every numpy array handed to the kernel is wrapped in a ``CountedArray``, which
forwards each ``a[i, j]`` read and ``a[i, j] = v`` write to the real array and adds one to a tally
kept per array name (the kernel's parameter name). The kernel's Python function (``py_func``) runs
in Numba's CUDA simulator machinery — one Python thread per CUDA thread, ``syncthreads`` included —
with a ``cuda`` module whose ``shared.array`` hands out counted arrays too (tallied as shared
memory) and whose ``atomic`` functions count each atomic update once, apart from plain stores.
Because the kernel's Python source is run, not the compiled kernel, the count is the same on a
machine with a GPU as without one (and the simulator need not be switched on).

``count_python`` does the same for a CPU function (the Python function behind an ``@njit``
dispatcher; ``prange`` is ``range`` there): it counts the element reads and writes of its array
arguments and records every array the function allocates with ``np.empty``, ``np.zeros`` … — how
large a temporary a fused loop needs is what fusion is about.

What it cannot see: accesses through another name for numpy or for the cuda module, arrays that
are not arguments, caches (a re-read that a GPU's L1 would serve still counts), registers
(a value kept in a local variable is not counted, as it should not be), and anything about time.
docs/instructor-guide.md ("Grading speed without a GPU") says what that means for grading.
"""

from __future__ import annotations

import inspect
import linecache
import threading
from collections import defaultdict
from contextlib import ExitStack, contextmanager

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

GLOBAL, SHARED = "global", "shared"
LOADS, STORES, ATOMICS = "loads", "stores", "atomics"
ALLOCATORS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like",
              "copy", "array", "ascontiguousarray")


class Tally:
    """Counts of (memory space, kind of access, array name), safe to add to from many threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str, str], int] = defaultdict(int)
        self.allocations: list[tuple[str, tuple[int, ...]]] = []      # (allocator, shape) of each temporary

    def add(self, space: str, kind: str, name: str, count: int = 1) -> None:
        with self._lock:
            self.counts[(space, kind, name)] += count


class CountedArray(NDArrayOperatorsMixin):
    """A numpy array that tallies every element read or written through it (views share the tally).

    ``a[i, j]`` is one load and ``a[i, j] = v`` one store; a slice is a view that counts when its
    elements are used; handing the array to numpy (``np.sum(a)``, ``a * 2``) loads every element.
    """

    __slots__ = ("array", "name", "tally", "space")

    def __init__(self, array: np.ndarray, name: str, tally: Tally, space: str = GLOBAL):
        self.array, self.name, self.tally, self.space = array, name, tally, space

    shape = property(lambda self: self.array.shape)
    size = property(lambda self: self.array.size)
    ndim = property(lambda self: self.array.ndim)
    dtype = property(lambda self: self.array.dtype)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):
        value = self.array[index]
        if isinstance(value, np.ndarray):
            return CountedArray(value, self.name, self.tally, self.space)
        self.tally.add(self.space, LOADS, self.name)
        return value

    def __setitem__(self, index, value) -> None:
        if isinstance(value, CountedArray):
            value = np.asarray(value)
        self.array[index] = value
        self.tally.add(self.space, STORES, self.name, int(np.size(self.array[index])))

    def __iter__(self):
        return (self[i] for i in range(len(self.array)))

    def __array__(self, dtype=None, copy=None):
        self.tally.add(self.space, LOADS, self.name, self.array.size)
        return self.array if dtype is None else self.array.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        inputs = tuple(np.asarray(value) if isinstance(value, CountedArray) else value for value in inputs)
        if out is not None:
            for target in out:
                if isinstance(target, CountedArray):
                    target.tally.add(target.space, STORES, target.name, target.array.size)
            kwargs["out"] = tuple(target.array if isinstance(target, CountedArray) else target for target in out)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getattr__(self, attribute):            # a method (a.sum(), a.copy()) reads the whole array
        if attribute.startswith("__"):            # numpy probing for its protocols: not a method call
            raise AttributeError(attribute)
        return getattr(np.asarray(self), attribute)

    def __repr__(self) -> str:
        return f"CountedArray({self.name!r}, shape={self.array.shape}, dtype={self.array.dtype})"


class Traffic:
    """What ``count_cuda`` or ``count_python`` counted, by array name."""

    def __init__(self, tally: Tally, arrays: dict[str, np.ndarray]):
        self.counts = dict(tally.counts)
        self.allocations = list(tally.allocations)
        self.arrays = arrays                       # the kernel's arrays by parameter name, after the run

    def _get(self, space: str, kind: str, name: str | None) -> int:
        return sum(count for (s, k, n), count in self.counts.items()
                   if s == space and k == kind and (name is None or n == name))

    def loads(self, name: str | None = None) -> int:
        """Global-memory element reads of array ``name`` (of every argument when None)."""
        return self._get(GLOBAL, LOADS, name)

    def stores(self, name: str | None = None) -> int:
        """Plain (non-atomic) global-memory element writes."""
        return self._get(GLOBAL, STORES, name)

    def atomics(self, name: str | None = None) -> int:
        """Atomic read-modify-write updates (``cuda.atomic.*``), counted once each, apart from stores."""
        return self._get(GLOBAL, ATOMICS, name)

    def shared_loads(self) -> int:
        return self._get(SHARED, LOADS, None)

    def shared_stores(self) -> int:
        return self._get(SHARED, STORES, None)

    def largest_allocation(self) -> tuple[int, tuple[int, ...] | None]:
        """(number of elements, shape) of the largest array the function allocated; (0, None) if none."""
        if not self.allocations:
            return 0, None
        _, shape = max(self.allocations, key=lambda item: int(np.prod(item[1])))
        return int(np.prod(shape)), shape

    def summary(self, per: int, label: str = "output element") -> str:
        """One line per array and kind of access: count, and count per ``per`` units of work."""
        lines = []
        for (space, kind, name), count in sorted(self.counts.items()):
            where = "" if space == GLOBAL else " (shared memory)"
            lines.append(f"  {name}{where}: {count} {kind}, {count / per:.2f} per {label}")
        return "\n".join(lines)


# -- running a CUDA kernel's Python source, counted ------------------------------------------------

def count_cuda(kernel, grid, block, *args) -> Traffic:
    """Run ``kernel[grid, block](*args)`` from its Python source, counting every array access.

    Numpy arrays among ``args`` are updated in place, as a launch would; they are tallied under
    the names of the kernel's parameters. Works with or without a GPU and with or without the
    simulator switched on, because only the kernel's Python function runs.
    """
    from numba.cuda.errors import normalize_kernel_dimensions
    from numba.cuda.simulator.kernel import BlockManager, _push_kernel_context
    from numba.cuda.simulator.kernelapi import swapped_cuda_module

    function = python_function(kernel)
    tally = Tally()
    counted, arrays = _counted_arguments(function, args, tally)
    grid_dim, block_dim = normalize_kernel_dimensions(grid, block)
    module = _counting_cuda_module(grid_dim, block_dim, tally)
    with ExitStack() as stack:
        stack.enter_context(_push_kernel_context(module))
        stack.enter_context(swapped_cuda_module(function, module))
        stack.enter_context(_compiled_helpers_as_python(function, cuda=True))
        for block_index in np.ndindex(*grid_dim):
            BlockManager(function, grid_dim, block_dim, False).run(block_index, *counted)
    return Traffic(tally, arrays)


def _counting_cuda_module(grid_dim, block_dim, tally: Tally):
    """The simulator's in-kernel ``cuda`` module, with counted shared arrays and counted atomics."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    module = FakeCUDAModule(grid_dim, block_dim, 0)
    module._shared = _CountedShared(tally)
    module._atomic = _CountedAtomic(module._atomic, tally)
    return module


class _CountedShared:
    """``cuda.shared.array``: one array per block and per source line that declares it, counted."""

    def __init__(self, tally: Tally):
        self._tally, self._lock, self._arrays = tally, threading.Lock(), {}

    def array(self, shape, dtype, alignment=None):
        from numba.cuda import types
        from numba.cuda.np import numpy_support

        caller = inspect.currentframe().f_back
        where = (caller.f_code.co_filename, caller.f_lineno)
        with self._lock:
            if where not in self._arrays:
                dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
                self._arrays[where] = CountedArray(np.zeros(shape, dtype), _declared_name(*where), self._tally, SHARED)
            return self._arrays[where]


def _declared_name(filename: str, line: int) -> str:
    """The variable a shared array is assigned to on its line of source (``x_tile = cuda.shared.array(…)``)."""
    target = linecache.getline(filename, line).split("=")[0].strip()
    return target if target.isidentifier() else f"the shared array of line {line}"


class _CountedAtomic:
    """``cuda.atomic``: each update of a counted array is tallied once as an atomic, then done for real."""

    def __init__(self, atomic, tally: Tally):
        self._atomic, self._tally = atomic, tally

    def __getattr__(self, operation):
        real = getattr(self._atomic, operation)

        def counted(array, index, *values):
            if isinstance(array, CountedArray):
                self._tally.add(array.space, ATOMICS, array.name)
                array = array.array
            return real(array, index, *values)
        return counted


# -- running a CPU function's Python source, counted -----------------------------------------------

def count_python(function, *args):
    """Run the Python function behind ``function`` (an ``@njit`` dispatcher or a plain function) on
    counted arrays; return (its result, Traffic). Allocations through ``np.*`` are recorded."""
    python = python_function(function)
    tally = Tally()
    counted, arrays = _counted_arguments(python, args, tally)
    with _compiled_helpers_as_python(python, cuda=False), _numpy_recording_allocations(python, tally):
        result = python(*counted)
    return result, Traffic(tally, arrays)


@contextmanager
def _numpy_recording_allocations(function, tally: Tally):
    """While inside, the function's global name for numpy is a stand-in that records allocations."""
    recorder = _AllocationRecorder(tally)
    with _globals_replaced(function, lambda value: recorder if value is np else None):
        yield


class _AllocationRecorder:
    """numpy, except that the array constructors record the shape of what they make."""

    def __init__(self, tally: Tally):
        self._tally = tally

    def __getattr__(self, name):
        real = getattr(np, name)
        if name not in ALLOCATORS:
            return real

        def allocate(*args, **kwargs):
            args = tuple(np.asarray(a) if isinstance(a, CountedArray) else a for a in args)
            result = real(*args, **kwargs)
            with self._tally._lock:
                self._tally.allocations.append((name, np.shape(result)))
            return result
        return allocate


# -- shared plumbing ---------------------------------------------------------------------------------

def python_function(obj):
    """The Python function behind a Numba dispatcher (``@njit``, ``@cuda.jit``, simulated), else ``obj``."""
    for attribute in ("py_func", "fn"):
        inner = getattr(obj, attribute, None)
        if callable(inner):
            return inner
    return obj


def _counted_arguments(function, args, tally: Tally):
    """Wrap each numpy array argument in a CountedArray named after its parameter."""
    names = list(inspect.signature(function).parameters)
    if len(args) != len(names):
        raise TypeError(f"{function.__name__} takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
    counted, arrays = [], {}
    for name, value in zip(names, args):
        if hasattr(value, "copy_to_host"):          # a device array: count on its host copy
            raise TypeError(f"argument {name}: pass numpy arrays, not device arrays, to count a kernel's traffic")
        if isinstance(value, np.ndarray):
            arrays[name] = value
            value = CountedArray(value, name, tally)
        counted.append(value)
    return counted, arrays


def _referenced_globals(function) -> set[str]:
    """Global names the function's code (nested functions included) refers to."""
    names, codes = set(), [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(const for const in code.co_consts if inspect.iscode(const))
    return names


@contextmanager
def _compiled_helpers_as_python(function, cuda: bool):
    """Replace the compiled helpers a function calls (``@njit`` or CUDA device functions) by their
    Python versions while inside, transitively, so that they too see counted arrays."""
    with ExitStack() as stack:
        seen, pending = set(), [function]
        while pending:
            current = pending.pop()
            if current in seen:
                continue
            seen.add(current)

            def replacement(value, seen=seen, pending=pending):
                inner = python_function(value)
                if inner is value or not _is_numba_dispatcher(value):
                    return None
                pending.append(inner)
                return _as_device_function(inner) if cuda else inner
            stack.enter_context(_globals_replaced(current, replacement))
        yield


def _is_numba_dispatcher(value) -> bool:
    module = type(value).__module__
    return module.startswith("numba") and hasattr(value, "py_func") and not module.endswith("simulator.kernel")


def _as_device_function(python):
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    return FakeCUDAKernel(python, device=True)


@contextmanager
def _globals_replaced(function, replacement):
    """Swap the globals the function refers to for ``replacement(value)`` where that is not None."""
    namespace = function.__globals__
    saved = {}
    for name in _referenced_globals(function):
        if name in namespace and name not in saved:
            new = replacement(namespace[name])
            if new is not None:
                saved[name] = namespace[name]
                namespace[name] = new
    try:
        yield
    finally:
        namespace.update(saved)
