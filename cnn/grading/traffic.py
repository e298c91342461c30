"""Count a kernel's memory traffic by running its Python source on arrays that count their accesses.

A GPU kernel is limited by how often it goes to global memory long before it is limited by
arithmetic, and a tiled kernel is fast *because* it goes there less: T × T tiles in shared memory
divide the global reads of a matrix product by T. That is a count, not a time, so it can be
measured exactly on a laptop with no GPU:

    traffic = count_cuda(kernel, grid, block, x, w, b, y)
    traffic.loads("w") / y.size          # global reads of w per output element
    traffic.shared_loads() / (y.size * K)   # shared-memory reads per multiply-add

How it works. The kernel's Python function (``py_func``) runs in Numba's CUDA simulator machinery —
one Python thread per CUDA thread, ``syncthreads`` included — on the very objects a simulated launch
hands a kernel (the simulator's device arrays), whose element reads and writes are tallied per array,
under the kernel's parameter name, while the count runs. ``cuda.shared.array`` hands out ndarrays that
count their reads and writes (tallied as shared memory), and ``cuda.atomic`` counts each atomic update
once, apart from plain stores. Because the kernel's Python source is run, not the compiled kernel, the
count is the same on a machine with a GPU as without one (and the simulator need not be switched on).

``count_python`` does the same for a CPU function (the Python function behind an ``@njit``
dispatcher; ``prange`` is ``range`` there): it counts the element reads and writes of its array
arguments and records every array the function allocates with numpy's constructors (``np.empty``,
``np.zeros`` … — through the module or a global bound to one of them) — how large a temporary a fused
loop needs is what fusion is about.

A count can be cheated only by code that knows it is counted. ``compiled_code_problems`` refuses what
could tell: calling ``type``, ``isinstance``, ``getattr`` … or reading a private attribute (``x._ary``)
— none of which compiles in a GPU kernel or an ``@njit`` function anyway. And the families that grade a
count also check that the counted run computed the right values and read every input at least once: a
kernel that hid its reads from the counter reads fewer than any correct kernel can.

What it cannot see: arrays that are not arguments, caches (a re-read that a GPU's L1 would serve still
counts), registers (a value kept in a local variable is not counted, as it should not be), and
anything about time. docs/instructor-guide.md ("Grading speed without a GPU") says what that means.
"""

from __future__ import annotations

import inspect
import linecache
import threading
from collections import defaultdict
from contextlib import ExitStack, contextmanager

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from cnn.grading.bytecode import attributes_used, builtins_called, python_function, referenced_globals

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
    What it holds is private: code that reaches for it is refused (``compiled_code_problems``).
    """

    __slots__ = ("_array", "_name", "_tally", "_space")

    def __init__(self, array: np.ndarray, name: str, tally: Tally, space: str = GLOBAL):
        self._array, self._name, self._tally, self._space = array, name, tally, space

    shape = property(lambda self: self._array.shape)
    size = property(lambda self: self._array.size)
    ndim = property(lambda self: self._array.ndim)
    dtype = property(lambda self: self._array.dtype)

    def __len__(self) -> int:
        return len(self._array)

    def __getitem__(self, index):
        value = self._array[index]
        if isinstance(value, np.ndarray):
            return CountedArray(value, self._name, self._tally, self._space)
        self._tally.add(self._space, LOADS, self._name)
        return value

    def __setitem__(self, index, value) -> None:
        if isinstance(value, CountedArray):
            value = np.asarray(value)
        self._array[index] = value
        self._tally.add(self._space, STORES, self._name, int(np.size(self._array[index])))

    def __iter__(self):
        return (self[i] for i in range(len(self._array)))

    def __array__(self, dtype=None, copy=None):
        self._tally.add(self._space, LOADS, self._name, self._array.size)
        return self._array if dtype is None else self._array.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        inputs = tuple(np.asarray(value) if isinstance(value, CountedArray) else value for value in inputs)
        if out is not None:
            for target in out:
                if isinstance(target, CountedArray):
                    target._tally.add(target._space, STORES, target._name, target._array.size)
            kwargs["out"] = tuple(target._array if isinstance(target, CountedArray) else target for target in out)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getattr__(self, attribute):            # a method (a.sum(), a.max()) reads the whole array
        if attribute.startswith("_"):             # numpy probing for its protocols, or a look inside: no
            raise AttributeError(attribute)
        return getattr(np.asarray(self), attribute)

    # Views and copies stay counted: a copy reads every element once, and reading the copy still counts
    # (``x = x.copy()`` must not take a function's later reads past the counter).
    def _view(self, array: np.ndarray) -> "CountedArray":
        return CountedArray(array, self._name, self._tally, self._space)

    def _copied(self, array: np.ndarray) -> "CountedArray":
        self._tally.add(self._space, LOADS, self._name, self._array.size)
        with self._tally._lock:
            self._tally.allocations.append(("copy", array.shape))
        return self._view(array)

    def copy(self, *args, **kwargs):
        return self._copied(self._array.copy(*args, **kwargs))

    def astype(self, *args, **kwargs):
        return self._copied(self._array.astype(*args, **kwargs))

    def flatten(self, *args, **kwargs):
        return self._copied(self._array.flatten(*args, **kwargs))

    def reshape(self, *args, **kwargs):
        return self._view(self._array.reshape(*args, **kwargs))

    def ravel(self, *args, **kwargs):
        return self._view(self._array.ravel(*args, **kwargs))

    def transpose(self, *args, **kwargs):
        return self._view(self._array.transpose(*args, **kwargs))

    T = property(lambda self: self._view(self._array.T))

    def __repr__(self) -> str:
        return f"CountedArray({self._name!r}, shape={self._array.shape}, dtype={self._array.dtype})"


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
    the names of the kernel's parameters. The kernel sees them as a simulated launch shows them, as
    the simulator's device arrays. Works with or without a GPU and with or without the simulator
    switched on, because only the kernel's Python function runs.
    """
    from numba.cuda.errors import normalize_kernel_dimensions
    from numba.cuda.simulator.kernel import BlockManager, _push_kernel_context
    from numba.cuda.simulator.kernelapi import swapped_cuda_module

    function = python_function(kernel)
    tally = Tally()
    arrays = _named_arrays(function, args)
    devices = _DeviceArrays(tally)
    launched = [devices.wrap(value, name) if isinstance(value, np.ndarray) else value
                for name, value in zip(inspect.signature(function).parameters, args)]
    grid_dim, block_dim = normalize_kernel_dimensions(grid, block)
    module = _counting_cuda_module(grid_dim, block_dim, tally, devices)
    with ExitStack() as stack:
        stack.enter_context(devices.counting())
        stack.enter_context(_push_kernel_context(module))
        stack.enter_context(swapped_cuda_module(function, module))
        stack.enter_context(_compiled_helpers_as_python(function, cuda=True))
        for block_index in np.ndindex(*grid_dim):
            BlockManager(function, grid_dim, block_dim, False).run(block_index, *launched)
    return Traffic(tally, arrays)


class _DeviceArrays:
    """The simulator's device arrays of a counted launch: while ``counting()``, their element reads and
    writes are tallied (views count under their parent's name); other device arrays are left alone."""

    def __init__(self, tally: Tally):
        self.tally, self.names = tally, {}          # id(FakeCUDAArray) -> (the array, its name)

    def wrap(self, array: np.ndarray, name: str):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray

        device = FakeCUDAArray(array)
        self.names[id(device)] = (device, name)
        return FakeWithinKernelCUDAArray(device)

    def name_of(self, device) -> str | None:
        entry = self.names.get(id(device))
        return entry[1] if entry is not None else None

    @contextmanager
    def counting(self):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        get, put = FakeCUDAArray.__getitem__, FakeCUDAArray.__setitem__
        tally, names = self.tally, self.names

        def counted_get(device, index):
            value = get(device, index)
            name = self.name_of(device)
            if name is not None:
                if isinstance(value, FakeCUDAArray):
                    names[id(value)] = (value, name)
                else:
                    tally.add(GLOBAL, LOADS, name)
            return value

        def counted_put(device, index, value):
            put(device, index, value)
            name = self.name_of(device)
            if name is not None:
                tally.add(GLOBAL, STORES, name, int(np.size(device._ary[index])))

        FakeCUDAArray.__getitem__, FakeCUDAArray.__setitem__ = counted_get, counted_put
        try:
            yield
        finally:
            FakeCUDAArray.__getitem__, FakeCUDAArray.__setitem__ = get, put


def _counting_cuda_module(grid_dim, block_dim, tally: Tally, devices: _DeviceArrays):
    """The simulator's in-kernel ``cuda`` module, with counted shared arrays and counted atomics."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    module = FakeCUDAModule(grid_dim, block_dim, 0)
    module._shared = _CountedShared(tally)
    module._atomic = _CountedAtomic(module._atomic, tally, devices)
    return module


class SharedTile(np.ndarray):
    """A shared-memory array that tallies its element reads and writes (views share the tally)."""

    def __array_finalize__(self, parent):
        self._tally, self._name = getattr(parent, "_tally", None), getattr(parent, "_name", "shared")

    def __getitem__(self, index):
        value = super().__getitem__(index)
        if not isinstance(value, np.ndarray) and self._tally is not None:
            self._tally.add(SHARED, LOADS, self._name)
        return value

    def __setitem__(self, index, value):
        super().__setitem__(index, value)
        if self._tally is not None:
            self._tally.add(SHARED, STORES, self._name, int(np.size(np.ndarray.__getitem__(self, index))))


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
                tile = np.zeros(shape, dtype).view(SharedTile)
                tile._tally, tile._name = self._tally, _declared_name(*where)
                self._arrays[where] = tile
            return self._arrays[where]


def _declared_name(filename: str, line: int) -> str:
    """The variable a shared array is assigned to on its line of source (``x_tile = cuda.shared.array(…)``)."""
    target = linecache.getline(filename, line).split("=")[0].strip()
    return target if target.isidentifier() else f"the shared array of line {line}"


class _CountedAtomic:
    """``cuda.atomic``: each update of a counted array is tallied once as an atomic, then done for real."""

    def __init__(self, atomic, tally: Tally, devices: _DeviceArrays):
        self._atomic, self._tally, self._devices = atomic, tally, devices

    def __getattr__(self, operation):
        real = getattr(self._atomic, operation)

        def counted(array, index, *values):
            device = getattr(array, "_item", None)             # a launch's FakeWithinKernelCUDAArray
            name = self._devices.name_of(device) if device is not None else None
            if name is not None:
                self._tally.add(GLOBAL, ATOMICS, name)
                array = device._ary
            elif isinstance(array, SharedTile):
                self._tally.add(SHARED, ATOMICS, array._name)
                array = array.view(np.ndarray)
            elif isinstance(array, CountedArray):
                self._tally.add(array._space, ATOMICS, array._name)
                array = array._array
            return real(array, index, *values)
        return counted


# -- running a CPU function's Python source, counted -----------------------------------------------

def count_python(function, *args):
    """Run the Python function behind ``function`` (an ``@njit`` dispatcher or a plain function) on
    counted arrays; return (its result, Traffic). Allocations through numpy's constructors are recorded."""
    python = python_function(function)
    tally = Tally()
    arrays = _named_arrays(python, args)
    counted = [CountedArray(value, name, tally) if isinstance(value, np.ndarray) else value
               for name, value in zip(inspect.signature(python).parameters, args)]
    with _compiled_helpers_as_python(python, cuda=False), _numpy_recording_allocations(python, tally):
        result = python(*counted)
    return result, Traffic(tally, arrays)


@contextmanager
def _numpy_recording_allocations(function, tally: Tally):
    """While inside, the function's global names for numpy, and for numpy's array constructors
    (``from numpy import empty``, ``_empty = np.empty``), are stand-ins that record allocations."""
    recorder = _AllocationRecorder(tally)
    constructors = {id(getattr(np, name)): name for name in ALLOCATORS + ("asarray", "asfortranarray")}

    def stand_in(value):
        if value is np:
            return recorder
        name = constructors.get(id(value))
        return getattr(recorder, name) if name is not None else None
    with _globals_replaced(function, stand_in):
        yield


class _AllocationRecorder:
    """numpy, except that the array constructors record the shape of what they make."""

    def __init__(self, tally: Tally):
        self._tally = tally

    def __getattr__(self, name):
        real = getattr(np, name)
        if name in ("asarray", "ascontiguousarray", "asfortranarray"):
            return lambda a, *args, **kwargs: a if isinstance(a, CountedArray) else real(a, *args, **kwargs)
        if name not in ALLOCATORS:
            return real

        def allocate(*args, **kwargs):
            if name in ("array", "copy") and args and isinstance(args[0], CountedArray):
                return args[0].copy()                  # a counted copy: its reads still count
            args = tuple(np.asarray(a) if isinstance(a, CountedArray) else a for a in args)
            result = real(*args, **kwargs)
            with self._tally._lock:
                self._tally.allocations.append((name, np.shape(result)))
            return result
        return allocate


# -- what compiled code cannot do ---------------------------------------------------------------------

#: builtins that inspect an object instead of computing with it: none compiles in a GPU kernel or in
#: Numba's nopython mode, and any could tell a counted array from a plain one
INTROSPECTION = ("type", "isinstance", "issubclass", "getattr", "hasattr", "setattr", "delattr", "vars", "dir", "id",
                 "globals", "locals", "eval", "exec", "compile", "__import__", "open", "repr", "callable", "super",
                 "object", "memoryview", "breakpoint", "input")


#: attributes that read an array other than by indexing it: the counter would not see those reads
UNWRAPPING = ("copy_to_host", "view", "base", "data", "ctypes", "tolist", "item", "tobytes", "flat")


def compiled_code_problems(function) -> list[str]:
    """Why the grader refuses to count ``function`` (and the notebook functions it calls): it inspects
    what it is given — an introspection builtin, or a private attribute (``x._ary``) — which compiled
    code cannot do, and which is the only way to tell a counted array from a plain one. Empty if none."""
    from cnn.grading.authorship import notebook_functions

    problems = []
    for current in notebook_functions(function):
        called = sorted(builtins_called(current) & set(INTROSPECTION))
        private = sorted(name for name in attributes_used(current) if name.startswith("_") or name in UNWRAPPING)
        if called:
            problems.append(f"{current.__name__} calls {', '.join(name + '()' for name in called)}, which compiled "
                            f"code cannot: the grader does not count code that inspects what it is given — refused")
        if private:
            problems.append(f"{current.__name__} reads {', '.join('.' + name for name in private)}: it reaches inside "
                            f"what it is given instead of indexing it, which a GPU kernel cannot — the grader does "
                            f"not count code that inspects what it is given, refused")
    return problems


# -- shared plumbing ---------------------------------------------------------------------------------

def _named_arrays(function, args) -> dict[str, np.ndarray]:
    """{parameter name: array} of the numpy arrays among ``args``; checks the count of arguments."""
    names = list(inspect.signature(function).parameters)
    if len(args) != len(names):
        raise TypeError(f"{function.__name__} takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
    for name, value in zip(names, args):
        if hasattr(value, "copy_to_host"):
            raise TypeError(f"argument {name}: pass numpy arrays, not device arrays, to count a kernel's traffic")
    return {name: value for name, value in zip(names, args) if isinstance(value, np.ndarray)}


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
    for name in referenced_globals(function):
        if name in namespace and name not in saved:
            new = replacement(namespace[name])
            if new is not None:
                saved[name] = namespace[name]
                namespace[name] = new
    try:
        yield
    finally:
        namespace.update(saved)
