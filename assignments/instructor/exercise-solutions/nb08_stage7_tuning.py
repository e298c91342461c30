"""Notebook 08, stage 7 `cuda-tuned`: worked solutions of its four exercises (in the simulator without a GPU;
exercise 4 reads the committed static report and Nsight Compute profile, and needs no GPU either)."""

from __future__ import annotations

import functools

from common import random_array, tiny_lenet, use_simulator_without_gpu

SIMULATED = use_simulator_without_gpu()      # before numba is imported

import numpy as np  # noqa: E402

from cnn.bench.census import ARRAY_ARG_US, LAUNCH_US, census_runner, step_census  # noqa: E402
from cnn.bench.predict_step import LAUNCH_NO_ARRAY_US, LAUNCH_PER_ARRAY_US  # noqa: E402
from cnn.model import lenet5  # noqa: E402
from cnn.stages import get_stage  # noqa: E402
from cnn.stages.s5_cuda_fused import memory_saved  # noqa: E402

ARITHMETIC_US = 50.0        # the exercise's GPU time of LeNet-5's arithmetic in one step


@functools.cache
def census_of(name: str) -> dict:
    """step_census of a stage on LeNet-5 (its layer kinds on tiny shapes in the simulator: the same counts)."""
    net, batch = (tiny_lenet(), 1) if SIMULATED else (lenet5(), 64)      # counts do not depend on the batch
    rng = np.random.default_rng(15)
    images = random_array(rng, 4 * batch, *net.input_shape, dtype=np.float32)
    labels = rng.integers(0, 10, len(images))
    stage = get_stage(name)(net).init("he", seed=0)
    return step_census(stage, census_runner(stage, images, labels, batch, (0.05, 0.9, 5e-4)), steps=1)


def censuses(names) -> dict:
    return {name: census_of(name) for name in names}


def launches_of(name: str) -> float:
    """Launches a step: the census for stage 7 (whose steps run as a request), else one train_step's count."""
    if name == "cuda-tuned":
        return census_of(name)["launches"]
    net, batch = (tiny_lenet(), 2) if SIMULATED else (lenet5(), 64)
    rng = np.random.default_rng(16)
    stage = get_stage(name)(net).init("he", seed=0)
    stage.train_step(random_array(rng, batch, *net.input_shape, dtype=np.float32), rng.integers(0, 10, batch), 0.05)
    return stage.launches_per_step()


def exercise_1(fast: bool) -> None:
    """From the census, the host time of one step's launches at both rates; with ~50 µs of arithmetic, what fraction
    is overhead?

    Answer. At numba-cuda's own figures (6.6 µs a launch plus 3.5 µs an array argument, NVIDIA/numba-cuda#288 —
    measured by numba-cuda's developers, not on the course's GPU), stage 6 (`cuda-ring`), 26 kernels a LeNet-5
    step with 81 array arguments, costs 26·6.6 + 81·3.5 ≈ 455 µs of host time; at the rate the H100 measured
    (27.7 µs with one array argument, 87.5 µs with eight: 19.2 µs + 8.5 µs an array) it is ≈ 1190 µs. Against
    ~50 µs of GPU arithmetic, 90 % and 96 % of the step is launch overhead — the GPU waits for the host. Stage 7
    (`cuda-tuned`) launches fewer kernels (21) but with more array arguments (110: its tiled convolutions take
    more arrays, their offset tables and the layer's geometry among them): ≈ 524 µs and ≈ 1342 µs, 91 % and
    96 %. Counted launch
    by launch the fixes hardly move the host cost; what they remove is copies and waits (the batch copy of every
    step, the loss round trip), and on a GPU the `cuda-graph` fix turns all of a step's launches into one graph
    launch — the only way below this wall. The measured rate is the one to believe: it is the H100's own. The
    counts printed below are the census's, per step.
    """
    found = censuses(("cuda-ring", "cuda-tuned"))
    fractions = {}
    for name, census in found.items():
        host = LAUNCH_US * census["launches"] + ARRAY_ARG_US * census["array_args"]
        measured = LAUNCH_NO_ARRAY_US * census["launches"] + LAUNCH_PER_ARRAY_US * census["array_args"]
        fractions[name] = host / (host + ARITHMETIC_US), measured / (measured + ARITHMETIC_US)
        print(f"{name:<11} {census['launches']:5.1f} launches, {census['array_args']:6.1f} array arguments: "
              f"{host:6.1f} µs of host time a step at numba-cuda's figures, {measured:6.1f} µs at the H100's; with "
              f"{ARITHMETIC_US:.0f} µs of arithmetic {fractions[name][0]:.0%} and {fractions[name][1]:.0%} of the "
              f"step is launch overhead")
        assert abs(host - census["modelled_launch_us"]) < 1e-6 and abs(measured - census["h100_launch_us"]) < 1e-6
    assert found["cuda-tuned"]["launches"] < found["cuda-ring"]["launches"]
    assert min(f for pair in fractions.values() for f in pair) > 0.75, "launches dominate before and after the fixes"


def exercise_2(fast: bool) -> None:
    """step_census on stage cuda (4) as well: how many launches did fusion (5) remove, and the tuning (7)?

    Answer. Stage 4 launches 34 kernels a LeNet-5 step, stage 5 26, stage 7 21: fusion removed 8 and the
    tuning 5 more. Fusion replaces, in each of the two Conv → ReLU → MaxPool blocks, three forward kernels
    (conv, bias_relu, maxpool) by one, and the four or five backward kernels (pool, ReLU mask, bias,
    filter and input gradients) by one push kernel plus the zero-fills of the buffers its atomics add into;
    stage 6 launches what stage 5 does. The tuning folds bias and ReLU into the Dense kernels, fuses the
    loss with the last Dense layer and zeroes every push buffer with one launch — while its tiled
    convolutions take a few kernels a block more, so the net gain in launches is modest. The counts are
    the stages' own counts, per step.
    """
    launches = {name: launches_of(name) for name in ("cuda", "cuda-fused", "cuda-tuned")}
    print(f"launches a step: {launches}; fusion removed {launches['cuda'] - launches['cuda-fused']:.0f}, "
          f"the tuning {launches['cuda-fused'] - launches['cuda-tuned']:.0f} more")
    assert launches["cuda"] == 34 and launches["cuda"] > launches["cuda-fused"] > launches["cuda-tuned"]


def exercise_3(fast: bool) -> None:
    """smem-weights and memory_saved("alexnet-small", 128): global atomics per dW address of the first conv?

    Answer. AlexNet-small's first convolution (3 → 32 channels, 5×5, pad 2, on 32×32) is followed by a
    2×2 pool: 16×16 pooled outputs per filter and image, so at batch 128 every dW address of filter f
    receives N·Hp·Wp = 128·16·16 = 32 768 atomic adds without the fix (`writers_per_weight`). With
    `smem-weights` a block of 128 threads sums its contributions to each weight in shared memory first and
    then adds them to global memory with one atomic per weight: 32 768 / 128 = 256 global atomic adds per
    address, 128 times less contention (the shared-memory atomics remain, but they are on-chip and spread
    over the multiprocessors).
    """
    row = memory_saved("alexnet-small", 128)["blocks"][0]
    writers, per_block = row["writers_per_weight"], 128
    print(f"alexnet-small, batch 128, first convolution (layers {row['layers']}, pooled {row['pooled']}): "
          f"{writers:,} global atomic adds per dW address without smem-weights, {writers // per_block} with blocks "
          f"of {per_block}")
    assert writers == 128 * 16 * 16 and writers // per_block == 256


def exercise_4(fast: bool) -> None:
    """Predict the time of `gemm_store_partial` (AlexNet-small's conv2 dW, as the H100 ran it at commit ecf7081)
    and check it against Nsight Compute's measurement.

    Answer. The committed report of the measured kernels (`static-sm90-cuda-tuned-alexnet-small-b128-at-ecf7081.json`)
    gives the launch: grid (26, 1, 11) — 286 blocks — of 32 threads, 130 registers a thread. Registers go to warps
    in units of 256: 130 × 32 = 4160 rounds up to 4352 a warp, and each of an SM's 4 sub-partitions (16,384
    registers) holds 3 such warps: 12 warps an SM, 12 blocks of one warp (occupancy 19 %, limited by
    registers); the grid's 286 blocks take one wave of 132 SMs × 12. Its loaders split each element of B
    with integer divisions and a branch between the loads of one element, so a thread waits for memory once
    an element: the latency time (its round trips, one after the other, × 0.65 µs) is about three times its
    issue time, and the kernel is latency-bound — what Nsight Compute's 10-12 % of SM throughput said.
    PREDICTED: about 1.4 ms of issue and 4.0 ms of latency (6,000 round trips), so ≈ 4.0 ms against the
    3.0 ms measured: 1.33× too slow, within the 2× the calibration reaches for 62 of the 75 profiled launches.
    """
    import json
    import math

    from cnn.bench import predict_step
    from cnn.bench.nsight import read_launches
    from pathlib import Path

    RESULTS_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
    report = json.loads((RESULTS_DIR / "static-sm90-cuda-tuned-alexnet-small-b128-at-ecf7081.json").read_text())
    launch = next(op for op in report["phase_by_phase"] if "copy" not in op and op["grid"] == [26, 1, 11])
    kernel = report["kernels"][launch["kernel"]]
    registers, block = kernel["resources"]["registers"], math.prod(launch["block"])
    occupancy = kernel["occupancy"][0]
    predicted = predict_step.kernel_us(kernel, launch, predict_step.CALIBRATED)
    profile = next(RESULTS_DIR.glob("ncu-cuda-tuned-alexnet-small-b128-*-2026-11-23.csv"))
    measured = next(row["time_ns"] / 1e3 for row in read_launches(profile)
                    if row["kernel"] == "gemm_store_partial" and row["grid"] == "(26, 1, 11)")
    waves = math.ceil(math.prod(launch["grid"]) / (132 * occupancy["blocks_per_sm"]))
    print(f"{kernel['function']}: grid {launch['grid']} × {block} threads, {registers} registers → "
          f"{occupancy['blocks_per_sm']} blocks an SM ({occupancy['occupancy']:.0%}, {occupancy['limited_by']}), "
          f"{waves} wave(s)")
    print(f"PREDICTED: issue {predicted['issue']:.0f} µs, latency {predicted['latency']:.0f} µs "
          f"({predicted['round_trips']:.0f} round trips), memory {predicted['memory']:.1f} µs → {predicted['us']:.0f} µs "
          f"({predicted['bound']}-bound); measured by Nsight Compute: {measured:.0f} µs "
          f"(predicted / measured {predicted['us'] / measured:.2f}×)")
    assert predicted["bound"] == "latency" and predicted["latency"] > 2 * predicted["issue"]
    assert 0.5 < predicted["us"] / measured < 2
