"""The stages, in course order, behind one registry.

``get_stage(name)`` imports a stage's module only when asked, so that using the
numpy stages never imports the CUDA machinery. A stage that cannot run on this
machine (a CUDA stage with no GPU) raises ``StageUnavailable`` with one line that
says why and what to try for that stage instead (``stage_hint``).

``numba_cuda_problem()`` is the one check of the installed pair numba-cuda + numpy: a
numba-cuda that cannot compile kernels with this numpy (numba-cuda 0.30 with numpy 2.5:
``module 'numpy' has no attribute 'row_stack'`` at the first kernel compile) is named in one
line before any kernel is compiled.
"""

from __future__ import annotations

import functools
import importlib

from cnn.stages.base import Stage

# name -> "module:Class", in the order the course builds them.
REGISTRY: dict[str, str] = {
    "loops": "cnn.stages.s1_loops:LoopsStage",
    "numpy": "cnn.stages.s2_numpy:NumpyStage",
    "numba-cpu": "cnn.stages.s3_numba_cpu:NumbaCpuStage",
    "cuda": "cnn.stages.s4_cuda:CudaStage",
    "cuda-fused": "cnn.stages.s5_cuda_fused:CudaFusedStage",
    "cuda-ring": "cnn.stages.s6_cuda_ring:CudaRingStage",
    "cuda-tuned": "cnn.stages.s7_cuda_tuned:CudaTunedStage",
    "cuda-fused-net": "cnn.stages.s8_cuda_fused_net:CudaFusedNetStage",
}

#: the notebook that teaches each CUDA stage, and shows what it measured on a real GPU
NOTEBOOK_OF_STAGE = {"cuda": "notebooks/05_stage4_cuda.ipynb", "cuda-fused": "notebooks/06_stage5_fused.ipynb",
                     "cuda-ring": "notebooks/07_stage6_ring.ipynb", "cuda-tuned": "notebooks/08_stage7_tuning.ipynb",
                     "cuda-fused-net": "notebooks/09_stage8_fused_net.ipynb"}

#: the numpy the pinned numba-cuda (pyproject.toml: numba-cuda >=0.30,<0.31) can compile kernels with;
#: pyproject.toml's cuda and dev extras carry the same pin (tests/test_cli.py checks that they agree)
NUMPY_FOR_NUMBA_CUDA = "numpy<2.5"


class StageUnavailable(RuntimeError):
    """This stage cannot run here; the message is one line saying why."""


def stage_names() -> list[str]:
    return list(REGISTRY)


def get_stage(name: str) -> type[Stage]:
    """The stage class registered as ``name``, after checking it can run on this machine."""
    if name not in REGISTRY:
        raise ValueError(f"unknown stage {name!r}; choose one of {', '.join(REGISTRY)}")
    module_name, class_name = REGISTRY[name].split(":")
    stage_class = getattr(importlib.import_module(module_name), class_name)
    if stage_class.device == "cuda":
        reason = cuda_unavailable_reason(name)
        if reason:
            raise StageUnavailable(f"stage {name!r} needs a CUDA GPU: {reason}")
    return stage_class


def stage_hint(name: str) -> str:
    """What to try instead of CUDA stage ``name`` on a machine without a GPU: its own command and notebook."""
    hint = (f"to try it without a GPU (minutes, in Numba's simulator): NUMBA_ENABLE_CUDASIM=1 python -m cnn train "
            f"--stage {name} --limit-train 8 --limit-test 8 --epochs 1 --batch-size 8")
    if name in NOTEBOOK_OF_STAGE:
        hint += f"; what it did on a real GPU: {NOTEBOOK_OF_STAGE[name]}"
    return hint


def cuda_unavailable_reason(stage: str | None = None) -> str | None:
    """None when CUDA kernels can run here (a GPU, or the simulator), else a one-line reason and the way
    out (``stage_hint(stage)`` when a stage is named)."""
    try:
        from kernels.device import SIMULATOR_HINT, gpu_unavailable_reason, simulated
    except ImportError as err:
        return f"the CUDA kernels cannot be imported ({err}); install them with: pip install -e '.[cuda]'"
    reason = gpu_unavailable_reason()
    if reason is None:
        return None if simulated() else numba_cuda_problem()
    return reason.replace(SIMULATOR_HINT, stage_hint(stage)) if stage else reason


@functools.cache
def numba_cuda_problem() -> str | None:
    """None when the installed numba-cuda can compile kernels with the installed numpy, else one line:
    what is wrong and the fix.

    It imports the module of numba-cuda that the first kernel compilation imports (its numpy
    overloads), which is where a numpy newer than numba-cuda knows fails. Meaningless in the
    simulator, which compiles nothing.
    """
    import numpy

    try:
        importlib.import_module("numba.cuda.np.arrayobj")
    except ImportError:
        return None            # no numba-cuda at all: cuda_unavailable_reason says so
    except Exception as err:   # noqa: BLE001 — whatever the pair breaks with, in one line
        from importlib.metadata import PackageNotFoundError, version
        try:
            numba_cuda = f"numba-cuda {version('numba-cuda')}"
        except PackageNotFoundError:
            numba_cuda = "numba's CUDA target"
        return (f"{numba_cuda} cannot compile kernels with numpy {numpy.__version__} "
                f"({type(err).__name__}: {str(err).splitlines()[0]}); install a numpy it works with: "
                f"pip install '{NUMPY_FOR_NUMBA_CUDA}' (or pip install -e '.[cuda]', which pins it)")
    return None


def available_stages() -> list[tuple[str, str | None]]:
    """(name, reason it cannot run here or None) for every registered stage."""
    result = []
    for name in REGISTRY:
        try:
            get_stage(name)
            result.append((name, None))
        except StageUnavailable as err:
            result.append((name, str(err)))
    return result
