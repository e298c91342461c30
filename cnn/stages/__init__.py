"""The stages, in course order, behind one registry.

``get_stage(name)`` imports a stage's module only when asked, so that using the
numpy stages never imports the CUDA machinery. A stage that cannot run on this
machine (a CUDA stage with no GPU) raises ``StageUnavailable`` with one line that
says why and what to try instead.
"""

from __future__ import annotations

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
}


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
        reason = cuda_unavailable_reason()
        if reason:
            raise StageUnavailable(f"stage {name!r} needs a CUDA GPU: {reason}")
    return stage_class


def cuda_unavailable_reason() -> str | None:
    """None when CUDA kernels can run here (a GPU, or the simulator), else a one-line reason and the way out."""
    try:
        from kernels.device import gpu_unavailable_reason
    except ImportError as err:
        return f"the CUDA kernels cannot be imported ({err}); install them with: pip install -e '.[cuda]'"
    return gpu_unavailable_reason()


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
