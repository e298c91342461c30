"""Notebook 10, results: worked solutions of its three exercises."""

from __future__ import annotations

import numpy as np

from cnn.model import Conv, Dense, lenet5
from cnn.stages import get_stage
from cnn.train import TrainConfig, load_dataset, train

H100_FP32_TFLOPS = 60.0          # NVIDIA H100 SXM, float32 (non-tensor) peak, in 10^12 FLOP/s
LAUNCH_US_MEASURED = 27.7        # one numba-cuda launch with one array argument, measured on an H100 (docs/profiling.md)


def step_flops(net, batch: int) -> float:
    """FLOPs of one training step: 2 per multiply-add; the backward pass costs about twice the forward."""
    shapes, forward = net.activation_shapes(), 0
    for index, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            _, out_h, out_w = shapes[index + 1]
            forward += layer.out_channels * layer.in_channels * layer.kernel ** 2 * out_h * out_w
        elif isinstance(layer, Dense):
            forward += layer.in_features * layer.out_features
    return 2 * 3 * forward * batch


def exercise_1(fast: bool) -> None:
    """bench on two machines: which stage gains most from the GPU, and why does `cuda` not beat numba-cpu by peak FLOP/s?

    Answer. The CPU stages run on either machine's CPU; only the CUDA stages gain from the GPU, and the
    one that gains most is the last, `cuda-tuned` (on the course's first H100 measurement, 2026-11-23,
    LeNet-5 at batch 64: cuda 8.7–9.3 ms a step, cuda-fused 3.1–4.7, cuda-tuned 2.4–3.3, against numba-cpu
    2.2–6.8 ms on the host's 16 cores — stage `cuda` was *slower* than the CPU). The GPU's peak (~60
    TFLOP/s in float32) would do LeNet-5's whole step, about 0.1 GFLOP at batch 64, in 2 µs. The step takes
    thousands of times longer because it is not arithmetic-bound at all: stage 4 queues 34 kernel launches
    a step, each costing the host ~28 µs on that machine (about 1 ms a step before any GPU work), copies
    the batch in and the loss out with a synchronisation, and its kernels are far too small to fill the
    GPU (even stage 7's convolution backward kernel ran at 5 % of the multiprocessors' throughput on
    LeNet-5). numba-cpu has no launches and no copies,
    and its compiled loops run near the cores' speed. Stages 5–7 attack exactly these costs — fewer
    launches, no copies, better-shaped kernels — which is why they, not raw FLOP/s, decide the speed of a
    network this small; a larger network (AlexNet-small at batch 128) leaves the GPU much further ahead.
    """
    net, batch = lenet5(), 64
    flops = step_flops(net, batch)
    at_peak_us = flops / (H100_FP32_TFLOPS * 1e12) * 1e6
    launches = 34                                            # stage cuda, LeNet-5 (notebook 05, exercise 2)
    print(f"LeNet-5, batch {batch}: {flops / 1e6:.0f} MFLOP a step = {at_peak_us:.1f} µs at an H100's float32 peak; "
          f"{launches} launches × {LAUNCH_US_MEASURED} µs = {launches * LAUNCH_US_MEASURED / 1e3:.2f} ms of host time")
    assert 90e6 < flops < 120e6 and launches * LAUNCH_US_MEASURED > 100 * at_peak_us


def losses_of(history) -> np.ndarray:
    return np.array([loss for _, loss, _, _ in history["steps"]])


def accuracy_noise(accuracy: float, images: int) -> float:
    """The standard error of an accuracy measured on ``images`` test images: √(p(1 − p)/n)."""
    return float(np.sqrt(accuracy * (1 - accuracy) / images))


def exercise_2(fast: bool) -> None:
    """A whole epoch with every fast stage: how different are the accuracies at the end, and why?

    Answer. Close, and no further apart than two runs of one stage from different seeds — the run below
    computes it: stages numpy and numba-cpu with the notebook's recipe (the course's defaults, seed 0, the
    same batches), and numpy again from seed 1. The difference is not one stage being better. Every stage
    computes the same function from the same initial weights on the same batches; they differ only in the
    order of float32 additions (BLAS's blocking, Numba's loops, and on a GPU the tiles and the atomic adds,
    whose order even changes from run to run). Those rounding differences — a relative 1e-8 to 1e-7 of
    the loss over the first steps (printed) — grow step by step, since SGD is a chaotic map (the last
    steps' difference is printed beside the first's), and over an epoch the two stages become two samples
    of the same training process, as two seeds do. Whether their gap is larger than the test set's own
    noise — the standard error √(p(1 − p)/n) of an accuracy measured on n images, printed beside it —
    says whether it is the training that varies or only the measurement.
    """
    steps, batch = (40, 64) if fast else (937, 64)
    data = load_dataset(TrainConfig(limit_train=steps * batch, limit_test=500 if fast else None))
    test_images = len(data[3])
    runs = {}
    for stage, seed in (("numpy", 0), ("numba-cpu", 0), ("numpy", 1)):
        runs[stage, seed] = train(TrainConfig(stage=stage, epochs=1, batch_size=batch, seed=seed, progress=False),
                                  data)
        print(f"{stage:<10} seed {seed}: test accuracy {runs[stage, seed]['final_test_accuracy']:.2%}")
    first, second = (losses_of(runs[stage, 0]) for stage in ("numpy", "numba-cpu"))
    drift = np.abs(first - second) / first
    print(f"relative difference of the loss, numpy against numba-cpu: step 1 {drift[0]:.1e}, largest over the first "
          f"5 steps {drift[:5].max():.1e}, over the last 5 {drift[-5:].max():.1e}")
    accuracy = {key: history["final_test_accuracy"] for key, history in runs.items()}
    stages_apart = abs(accuracy["numpy", 0] - accuracy["numba-cpu", 0])
    seeds_apart = abs(accuracy["numpy", 0] - accuracy["numpy", 1])
    noise = accuracy_noise(accuracy["numpy", 0], test_images)
    print(f"after {steps} steps: the two stages {stages_apart:.2%} apart, two seeds of numpy {seeds_apart:.2%} apart; "
          f"the test set's standard error at this accuracy on {test_images:,} images: {noise:.2%}")
    assert drift[:5].max() < 1e-4, "the same function, to rounding, at the start"
    assert drift[-5:].max() > drift[:5].max(), "rounding differences grow"
    assert stages_apart <= max(seeds_apart, 3 * noise), "as close as a change of seed, or within the test set's noise"


def exercise_3(fast: bool) -> None:
    """Train with init="uniform" (seed 000's scheme): compare the filters and the learning curve with He.

    Answer. `uniform` draws every weight from U(−0.05, 0.05), a standard deviation of 0.029 whatever the
    layer; He uses √(2/fan_in): 0.28 for the first layer (25 inputs), 0.065 for the second (150 inputs).
    With uniform weights each layer shrinks the signal (a ReLU layer keeps the scale only when
    n·Var(w) ≈ 2), so the logits start nearly equal — the loss sits at ln 10 — and the gradients reaching
    the first layers are tiny: the curve shows a plateau at ln 10 for the first steps before learning
    starts, while He learns from the first steps. After the same number of steps He's first-layer filters
    have become smooth stroke and edge detectors; uniform's stay a tenth of He's scale (their standard
    deviation, printed below) and noisy, and its accuracy lags. Given enough steps both get there —
    uniform was seed 000's cure for *exploding* early gradients, at the price of this slow start.
    """
    steps, batch = (40, 32) if fast else (938, 64)
    data = load_dataset(TrainConfig(limit_train=steps * batch, limit_test=300 if fast else None))
    net = lenet5()
    first_conv = next(slot for slot in net.param_layout() if slot.layer == 0 and slot.name == "W")
    part = slice(first_conv.offset, first_conv.offset + first_conv.size)
    results = {}
    for init in ("uniform", "he"):
        stage = get_stage("numpy")(net).init(init, seed=0)
        start = stage.get_params()[part].copy()
        history = train(TrainConfig(stage="numpy", epochs=1, batch_size=batch, lr=0.05, momentum=0.9, init=init,
                                    progress=False), data, stage=stage)
        losses = losses_of(history)
        results[init] = history["final_test_accuracy"], losses
        print(f"{init:<8} first-layer filters: std {start.std():.3f} at the start, {stage.get_params()[part].std():.3f} "
              f"after {len(losses)} steps; "
              f"loss {losses[0]:.2f} → mean of the last 10 {losses[-10:].mean():.2f}; test accuracy "
              f"{history['final_test_accuracy']:.1%}")
    assert results["he"][0] > results["uniform"][0], "He learns faster"
    assert abs(results["uniform"][1][:10].mean() - np.log(10)) < 0.1, "uniform: a plateau at ln 10 at first"
