"""``python -m cnn bench --census``: what a training step does besides arithmetic, counted.

Per training step of stage 6 (``cuda-ring``) and stage 7 (``cuda-tuned``): kernel launches, the
array arguments of those launches, host↔device copies and their bytes, device allocations, and
the host launch cost those launches and arguments model. Counts do not depend on speed, so they
are exact in Numba's CUDA simulator too (``--reduced``: the same counts on the networks' narrow
copies, in seconds). The table this prints is the one in stage 7's docstring
(``cnn/stages/s7_cuda_tuned.py``), which a test keeps equal to what this code counts.

The two host-cost rows are the counts priced at two rates, neither of them measured by this command:

- numba-cuda's own figures (NVIDIA/numba-cuda#288, on its developers' machine): 6.6 µs a launch plus
  3.5 µs an array argument — the rate the course first planned with;
- the rate MEASURED on the course's H100 (``benchmarks/results/probes-…json``): 27.7 µs for a launch
  with one array argument and 87.5 µs with eight, i.e. 19.2 µs + 8.5 µs an array argument — about
  three times more, and what ``cnn/bench/predict_step.py`` uses.
"""

from __future__ import annotations

import numpy as np

from cnn.bench.back_to_back import EpochLoop
from cnn.bench.predict_step import LAUNCH_NO_ARRAY_US, LAUNCH_PER_ARRAY_US    # measured on the H100
from cnn.model import get_network
from cnn.stages import get_stage
from cnn.stages.s6_cuda_ring import CudaRingStage
from cnn.stages.s7_cuda_tuned import CudaTunedStage
from kernels.streams import AllocationCounter, CopyCounter

LAUNCH_US, ARRAY_ARG_US = 6.6, 3.5        # numba-cuda's own figures (NVIDIA/numba-cuda#288), not measured here
ROWS = [("launches", "kernel launches"), ("array_args", "array arguments of those launches"),
        ("copies_to_device", "host→device copies"), ("bytes_to_device", "  bytes per sample"),
        ("copies_to_host", "device→host copies (besides the ring)"),
        ("device_allocations", "device allocations after warm-up"),
        ("modelled_launch_us", "host launch µs, numba-cuda#288's rate"),
        ("h100_launch_us", "host launch µs, H100-measured rate")]


def step_census(stage, run_steps, steps: int = 2) -> dict:
    """Launches, array arguments, copies and device allocations per step of ``run_steps(n)``.

    After two warm-up steps (compilation, buffers for the batch size, and the second set of input
    buffers that overlap-copies fills from the second step on).
    """
    run_steps(2)
    stage.synchronize()
    launches, array_args = stage.launch.count, getattr(stage.launch, "array_args", 0)
    with CopyCounter() as copies, AllocationCounter() as allocations:
        run_steps(steps)
        stage.synchronize()
    # one gradient copy a step on the ring's copy stream (none when the whole step runs on the device)
    ring_copies = steps if hasattr(stage, "ring") and getattr(stage, "epoch_state", None) is None else 0
    per_step = {"launches": (stage.launch.count - launches) / steps,
                "array_args": (getattr(stage.launch, "array_args", 0) - array_args) / steps,
                "copies_to_device": copies.to_device / steps, "bytes_to_device": copies.bytes_to_device / steps,
                "copies_to_host": (copies.to_host - ring_copies) / steps,
                "device_allocations": allocations.count / steps}
    per_step["modelled_launch_us"] = LAUNCH_US * per_step["launches"] + ARRAY_ARG_US * per_step["array_args"]
    per_step["h100_launch_us"] = LAUNCH_NO_ARRAY_US * per_step["launches"] + LAUNCH_PER_ARRAY_US * per_step["array_args"]
    return per_step


def census_runner(stage, images, labels, batch_size, hyper):
    """``run_steps(n)`` for ``step_census``: n steps through the stage's epoch API, as the trainer runs them."""
    batches = [(images[start:start + batch_size], labels[start:start + batch_size])
               for start in range(0, len(images) - batch_size + 1, batch_size)]
    return EpochLoop(stage, batches, hyper, steps_per_epoch=len(batches))


def census_counts(models=("lenet5", "alexnet-small"), batch_size: int = 2, steps: int = 4,
                  reduced_copy: bool = False) -> dict:
    """{(model, stage): ``step_census``'s counts} of cuda-ring and cuda-tuned on each network.

    ``reduced_copy`` counts on the networks' narrow copies (``cnn.model.REDUCED``): the same
    launches, arguments, copies and allocations — only the bytes shrink — in seconds in the simulator.
    """
    rows, hyper = {}, (0.01, 0.9, 0.0)
    for model in models:
        net = get_network(model, reduced_copy)
        rng = np.random.default_rng(0)
        images = rng.standard_normal(((2 + steps) * batch_size, *net.input_shape)).astype(np.float32)
        labels = rng.integers(0, net.num_classes, len(images))
        for stage_class in (CudaRingStage, CudaTunedStage):
            stage = stage_class(net).init("he", 0)
            rows[model, stage_class.name] = step_census(
                stage, census_runner(stage, images, labels, batch_size, hyper), steps)
    return rows


def census_table(rows: dict, batch_size: int = 2) -> str:
    """The before/after count table of stage 7's docstring (cuda-ring against cuda-tuned) from ``census_counts``'s
    rows (counted at ``batch_size``), as text."""
    columns = list(rows)
    lines = [f"{'per training step':<40}" + "".join(f"{f'{model} {stage}':>26}" for model, stage in columns)]
    for key, label in ROWS:
        values = [rows[column][key] / (batch_size if key == "bytes_to_device" else 1) for column in columns]
        lines.append(f"{label:<40}" + "".join(f"{v:>26.1f}" if key.endswith("launch_us") else f"{v:>26g}"
                                             for v in values))
    return "\n".join(lines)


def cmd_census(args) -> int:
    """``--census [--reduced]``: print the table (the simulator counts as well as a GPU)."""
    for name in ("cuda-ring", "cuda-tuned"):
        get_stage(name)                        # StageUnavailable: one line, why and what to try
    print(census_table(census_counts(reduced_copy=args.reduced)))
    return 0
