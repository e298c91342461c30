"""Every kernel launch of one training step, recorded in Numba's CUDA simulator without running it.

The first half of the static report (``cnn/bench/static_report.py``): which kernels a stage's
training step launches, with which argument types, grid and block — at the network's real size.
It runs as a script in its own process, with the simulator on and the source tree to record as
its working directory (the report can record an older commit the same way: the measurements a
prediction is checked against were made with older kernels)::

    NUMBA_ENABLE_CUDASIM=1 python cnn/bench/static_record.py STAGE MODEL BATCH FIXES OUT.json

How: ``FakeCUDAKernel.__call__`` — the simulator's launch — is replaced by one that writes down
the kernel, grid, block and arguments and runs the kernel only when it is one block (the
bookkeeping kernels a step counter lives in); the others are skipped, so a
full-size AlexNet-small step takes a second instead of an hour in the simulator. Results are
garbage — only what was launched, and with what, is kept. Host↔device copies are recorded in the same list
(``{"copy": "to_device" | "to_host", "bytes", "phase"}``). The same step is recorded twice: phase
by phase (``load_batch``, ``forward``, ``backward``, ``update``, ``fetch_loss``: what
``python -m cnn bench`` times) and as the trainer runs it (``run_steps``: back to back), each after
two warm-up steps (``train_steps`` where an older tree has no ``run_steps``).

A kernel is written down as how to build it again in the compiling process (``static_compile.py``):
a module attribute (``{"module", "name"}``), or the result of a cached kernel factory of
``kernels/`` (``gemm_kernel(loaders…, tiles)``, ``smem_kernels(C, K)``, …: ``{"module",
"factory", "args", "index"}``), whose calls are recorded by wrapping every ``functools.lru_cache``
function of the ``kernels`` modules. A new stage's kernels need nothing more, as long as they
are module attributes or come out of such a factory.

This file imports nothing of ``cnn.bench``: it runs against whatever tree is the working directory.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys

PHASES = ("load_batch", "forward", "backward", "update", "fetch_loss")


def describe(value, kernel_functions):
    """A JSON description of a kernel or factory argument, from which its Numba type can be rebuilt."""
    import numpy as np

    array = getattr(value, "_ary", value)              # the simulator's FakeCUDAArray wraps an ndarray
    if isinstance(array, np.ndarray):
        layout = "C" if array.flags.c_contiguous else "F" if array.flags.f_contiguous else "A"
        return {"array": array.dtype.str, "ndim": array.ndim, "layout": layout, "shape": list(array.shape)}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": value}
    if isinstance(value, np.generic):
        return {"scalar": value.dtype.str, "value": value.item()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        cls = type(value)
        return {"namedtuple": f"{cls.__module__}:{cls.__qualname__}",
                "fields": [describe(item, kernel_functions) for item in value]}
    if isinstance(value, tuple):
        return {"tuple": [describe(item, kernel_functions) for item in value]}
    if id(value) in kernel_functions:
        return {"function": kernel_functions[id(value)]}
    raise TypeError(f"cannot describe a {type(value).__name__} argument")


def module_functions():
    """{id(kernel or device function): {"module", "name"}} for every jitted attribute of the kernels modules."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    found = {}
    for name, module in list(sys.modules.items()):
        if not (name == "kernels" or name.startswith("kernels.")) or module is None:
            continue
        for attribute, value in vars(module).items():
            if isinstance(value, FakeCUDAKernel) and getattr(value.fn, "__module__", None) == name:
                found[id(value)] = {"module": name, "name": attribute}
    return found


def hook_factories(made):
    """Wrap every lru_cache'd function of the kernels modules so that what it returns is traced to its call."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    factories = {}
    for name, module in list(sys.modules.items()):
        if (name == "kernels" or name.startswith("kernels.")) and module is not None:
            for attribute, value in vars(module).items():
                if hasattr(value, "cache_info") and getattr(value, "__module__", None) == name:
                    factories[id(value)] = (value, name, attribute)

    def traced(cached, module, factory):
        @functools.wraps(cached)
        def call(*args):
            result = cached(*args)
            parts = result if isinstance(result, tuple) else (result,)
            for index, part in enumerate(parts):
                if isinstance(part, FakeCUDAKernel):
                    made[id(part)] = {"module": module, "factory": factory, "args": args,
                                      "index": index if isinstance(result, tuple) else None}
            return result
        return call

    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("kernels") or name.startswith("cnn")):
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in factories:
                cached, home, factory = factories[id(value)]
                setattr(module, attribute, traced(cached, home, factory))


class Recorder:
    """Replaces the simulator's launch: records (kernel, grid, block, arguments, phase), runs only tiny kernels."""

    def __init__(self):
        from numba.cuda.simulator.kernel import FakeCUDAKernel

        self.launches, self.phase, self.made = [], "setup", {}
        self.original = FakeCUDAKernel.__call__
        recorder = self

        def launch(kernel, *args):
            if kernel._device:
                return recorder.original(kernel, *args)
            grid, block = tuple(kernel.grid_dim), tuple(kernel.block_dim)
            recorder.launches.append((kernel, grid, block, kernel.dynshared_size, args, recorder.phase))
            if grid == (1, 1, 1):                  # one block: a step counter, a flag, a loss sum
                try:
                    return recorder.original(kernel, *args)
                except Exception:                  # it read what a skipped kernel should have written
                    return None
            return None

        FakeCUDAKernel.__call__ = launch
        self.hook_copies()

    def hook_copies(self):
        """Host↔device copies go into the same list: ("copy", direction, bytes, phase)."""
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        recorder = self
        for method, direction in (("copy_to_device", "to_device"), ("copy_to_host", "to_host")):
            original = getattr(FakeCUDAArray, method)

            def copy(array, *args, _original=original, _direction=direction, **kwargs):
                recorder.launches.append(("copy", _direction, int(array.nbytes), recorder.phase))
                return _original(array, *args, **kwargs)

            setattr(FakeCUDAArray, method, copy)

    def describe_launches(self, launches):
        functions = module_functions()
        out = []
        for entry in launches:
            if entry[0] == "copy":
                out.append({"copy": entry[1], "bytes": entry[2], "phase": entry[3]})
                continue
            kernel, grid, block, shared, args, phase = entry
            ref = functions.get(id(kernel))
            if ref is None and id(kernel) in self.made:
                made = self.made[id(kernel)]
                ref = {"module": made["module"], "factory": made["factory"], "index": made["index"],
                       "args": [describe(arg, functions) for arg in made["args"]]}
            out.append({"kernel": ref, "function": kernel.fn.__name__, "grid": list(grid), "block": list(block),
                        "shared_dynamic": shared, "args": [describe(arg, functions) for arg in args], "phase": phase})
        return out


def record(stage_name: str, model: str, batch: int, fixes: str | None) -> dict:
    """{"phase_by_phase": [launch…], "back_to_back": [launch…] or None} of one step after two warm-up steps (``train_steps`` where an older tree has no ``run_steps``)."""
    import numpy as np

    sys.path.insert(0, os.getcwd())
    from cnn.model import get_network
    from cnn.stages import get_stage

    importlib.import_module("kernels")
    for module in ("implicit_gemm", "conv_gemm", "dense_gemm", "dense_fused", "conv_pool_smem"):
        try:
            importlib.import_module(f"kernels.{module}")
        except ImportError:
            pass
    stage_class = get_stage(stage_name)
    recorder = Recorder()
    net = get_network(model)
    options = {} if fixes in (None, "", "all") else {"fixes": tuple(f for f in fixes.split(",") if f != "none")}
    rng = np.random.default_rng(0)
    images = rng.standard_normal((3 * batch, *net.input_shape)).astype(np.float32)
    labels = rng.integers(0, net.num_classes, 3 * batch)
    hyper = (0.01, 0.9, 5e-4)

    def fresh_stage():
        stage = stage_class(net, **options).init("he", 0)
        hook_factories(recorder.made)
        return stage

    stage = fresh_stage()
    for _ in range(2):
        stage.train_step(images[:batch], labels[:batch], *hyper)
    stage.synchronize()
    recorder.launches.clear()
    calls = {"load_batch": lambda: stage.load_batch(images[:batch], labels[:batch]), "forward": stage.forward,
             "backward": stage.backward, "update": lambda: stage.update(*hyper), "fetch_loss": stage.fetch_loss}
    for phase in PHASES:
        recorder.phase = phase
        calls[phase]()
    stage.synchronize()
    phase_by_phase = recorder.describe_launches(recorder.launches)

    back_to_back, steps_per_sync = None, 1
    if hasattr(stage, "train_steps") and not hasattr(stage, "begin_epoch"):     # older trees: train_steps(n, …)
        stage = fresh_stage()
        stage.load_dataset(images, labels)
        recorder.phase = "warm-up"
        stage.train_steps(2, batch, *hyper)
        stage.synchronize()
        recorder.launches.clear()
        recorder.phase = "step"
        stage.train_steps(1, batch, *hyper)
        stage.synchronize()
        back_to_back = recorder.describe_launches(recorder.launches)
    elif hasattr(stage, "run_steps") and hasattr(stage, "begin_epoch"):
        stage = fresh_stage()
        stage.load_dataset(images, labels)
        stage.begin_epoch(np.arange(3 * batch), np.full(3, hyper[0]), batch, hyper[1], hyper[2])
        recorder.phase = "warm-up"
        stage.run_steps(0, 2)
        stage.synchronize()
        recorder.launches.clear()
        recorder.phase = "step"
        stage.run_steps(2, 1)
        stage.synchronize()
        back_to_back = recorder.describe_launches(recorder.launches)
        steps_per_sync = getattr(stage, "steps_per_sync", 1)
    modules = sorted({os.path.relpath(module.__file__) for name, module in sys.modules.items()
                      if (name == "kernels" or name.startswith("kernels.")) and getattr(module, "__file__", None)})
    return {"stage": stage_name, "model": model, "batch_size": batch, "fixes": fixes, "kernel_modules": modules,
            "phase_by_phase": phase_by_phase, "back_to_back": back_to_back, "steps_per_sync": steps_per_sync}


def main(argv) -> int:
    stage_name, model, batch, fixes, out = argv
    result = record(stage_name, model, int(batch), fixes)
    with open(out, "w") as file:
        json.dump(result, file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
