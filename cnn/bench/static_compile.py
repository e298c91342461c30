"""The recorded kernels compiled to PTX for sm_90 by Numba's real CUDA compiler — no GPU needed.

The second step of the static report (``cnn/bench/static_report.py``), run as a script in its own
process with the simulator OFF and the source tree as its working directory::

    NUMBA_ENABLE_CUDASIM=0 python cnn/bench/static_compile.py JOBS.json OUT_DIR

JOBS.json lists ``{"kernel": ref, "args": [description…]}`` as ``static_record.py`` wrote them.
Each kernel is built again from its reference (a module attribute, or a cached factory called with
the same arguments), its argument types rebuilt from the descriptions, and its Python function
compiled with ``cuda.compile_ptx(..., cc=(9, 0))`` — libNVVM only. numba-cuda asks the device for
its compute capability even then, so the (absent) device is stubbed first (docs/profiling.md).
Writes ``OUT_DIR/N.ptx`` for job N, or ``OUT_DIR/N.error`` with one line when it cannot.
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def numba_type(description):
    """The Numba type of a kernel argument described by ``static_record.describe``."""
    import numpy as np
    from numba import from_dtype, types

    if "array" in description:
        return types.Array(from_dtype(np.dtype(description["array"])), description["ndim"], description["layout"])
    if "bool" in description:
        return types.boolean
    if "int" in description:
        return types.int64
    if "float" in description:
        return types.float64
    if "scalar" in description:
        return from_dtype(np.dtype(description["scalar"]))
    if "tuple" in description:
        return types.BaseTuple.from_types([numba_type(item) for item in description["tuple"]])
    if "namedtuple" in description:
        return types.BaseTuple.from_types([numba_type(item) for item in description["fields"]],
                                          named_class(description["namedtuple"]))
    raise TypeError(f"no Numba type for {description}")


def named_class(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def python_value(description):
    """A factory argument again: a plain value, a named tuple, or a module's device function."""
    for key in ("bool", "int", "float"):
        if key in description:
            return description[key]
    if "scalar" in description:
        return description["value"]
    if "tuple" in description:
        return tuple(python_value(item) for item in description["tuple"])
    if "namedtuple" in description:
        return named_class(description["namedtuple"])(*(python_value(item) for item in description["fields"]))
    if "function" in description:
        ref = description["function"]
        return getattr(importlib.import_module(ref["module"]), ref["name"])
    raise TypeError(f"cannot rebuild the factory argument {description}")


def kernel_function(ref):
    """The Python function of the kernel ``ref`` names, built again in this (real CUDA) process."""
    module = importlib.import_module(ref["module"])
    if "name" in ref:
        return getattr(module, ref["name"]).py_func
    made = getattr(module, ref["factory"])(*(python_value(arg) for arg in ref["args"]))
    return (made if ref["index"] is None else made[ref["index"]]).py_func


def stub_device(cc=(9, 0)):
    """numba-cuda looks up the current device's compute capability even for compile_ptx: pretend one."""
    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: type("Device", (), {"compute_capability": cc})()


def main(argv) -> int:
    jobs_path, out_dir = argv
    sys.path.insert(0, os.getcwd())
    stub_device()
    from numba import cuda

    jobs = json.load(open(jobs_path))
    for number, job in enumerate(jobs):
        try:
            signature = tuple(numba_type(arg) for arg in job["args"])
            ptx, _ = cuda.compile_ptx(kernel_function(job["kernel"]), signature, cc=(9, 0), lineinfo=True)
            with open(os.path.join(out_dir, f"{number}.ptx"), "w") as file:
                file.write(ptx)
        except Exception as err:          # one kernel that cannot compile must not hide the others
            with open(os.path.join(out_dir, f"{number}.error"), "w") as file:
                file.write(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
