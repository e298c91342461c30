"""Notebook 00, quick start: worked solutions of its three exercises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from cnn.train import TrainConfig, TrainingDiverged, load_dataset, train


def losses_of(history) -> list[float]:
    return [loss for _, loss, _, _ in history["steps"]]


def exercise_1(fast: bool) -> None:
    """Train with lr=0.5 instead of 0.05: what does `train` say, and why does a large rate blow up?

    Answer. With lr=0.5 `train` reports no error: the loss leaps *above* its starting value ln 10 ≈ 2.30
    within the first steps, then falls back to about ln 10 and stays there, and the test accuracy is at
    chance (10 %). A gradient step of size η moves the weights along the steepest direction of the loss;
    when η is larger than about 2/λ (λ the loss's curvature along that direction; momentum 0.9 widens the
    bound only to 2(1+μ)/λ) each step overshoots the bottom of the valley and lands higher than it
    started, so the error grows geometrically instead of shrinking. Here the ReLUs stop it before the
    numbers overflow: the huge updates push whole layers to negative pre-activations, those units output
    0 and receive no gradient any more ("dead"), and the network answers the same for every image — the
    flat loss of ln 10. A rate ten times larger again (lr=5) makes activations grow until float32
    overflows and the loss is NaN: then `train` stops with its one-line error, "training diverged: loss
    is nan at epoch 1, batch …; lower --lr or the initial weight scale", and keeps the last good
    checkpoint. Seed 000 saw exactly this with its uniform initialisation, whose large initial weights
    made the first steps overshoot in the same way.

    (Since He initialisation gives the last layer 10× smaller weights, lr=0.5 no longer reaches NaN in a
    few hundred steps; the exercise's "blow up" is the leap of the first steps and, at lr=5, the NaN.)
    """
    steps, batch = (40, 32) if fast else (300, 64)
    data = load_dataset(TrainConfig(limit_train=steps * batch, limit_test=300 if fast else 2000))
    results = {}
    for lr in (0.05, 0.5):
        config = TrainConfig(stage="numpy", epochs=1, batch_size=batch, lr=lr, momentum=0.9, schedule="constant",
                             progress=False)
        history = train(config, data)
        losses = losses_of(history)
        results[lr] = losses, history["final_test_accuracy"]
        print(f"lr={lr}: loss {losses[0]:.2f} at step 1, highest {max(losses):.2f}, mean of the last five "
              f"{np.mean(losses[-5:]):.2f}; test accuracy {history['final_test_accuracy']:.1%}")
    try:
        history = train(TrainConfig(stage="numpy", epochs=1, batch_size=batch, lr=5.0, momentum=0.9,
                                    schedule="constant", progress=False), data)
        overflow = max(losses_of(history))
        print(f"lr=5: no NaN this time, but the loss reached {overflow:.3g}")
    except TrainingDiverged as error:
        overflow = np.inf
        print(f"lr=5: train stops with: {error}")
    losses_big, accuracy_big = results[0.5]
    assert max(losses_big[:10]) > losses_big[0], "lr=0.5 should overshoot: the loss rises above its start"
    assert abs(np.mean(losses_big[-5:]) - np.log(10)) < 0.3 and accuracy_big < 0.25, "lr=0.5 ends at chance"
    assert results[0.05][1] > accuracy_big + 0.2, "lr=0.05 learns"
    assert overflow > 10 * losses_big[0], "lr=5 blows up"


def exercise_2(fast: bool) -> None:
    """The same steps with stage numba-cpu instead of numpy: compare train_seconds and the accuracy.

    Answer. numba-cpu trains faster (on this course's quiet 2-core machine 4.9 s against 30.5 s an
    epoch; on a loaded machine or in a few steps the gap is smaller, and its first steps include loading
    the compiled code), and ends at (almost) the same accuracy, with the same loss step after step at
    first. Both stages compute the same function — the same network, the same initial weights (seed 0),
    the same batches in the same order (the trainer's seeded shuffle) and the same SGD update. What
    differs is only the order of the float32 additions inside each sum (BLAS blocks them one way,
    Numba's loops another), so the two runs differ by rounding, about 1e-7 relative per step; those
    differences grow slowly through training, so the curves drift apart only late and the final
    accuracies agree to a few images in a thousand.
    """
    steps, batch = (30, 32) if fast else (300, 64)
    data = load_dataset(TrainConfig(limit_train=steps * batch, limit_test=300 if fast else 2000))
    runs = {}
    for stage in ("numpy", "numba-cpu"):
        config = TrainConfig(stage=stage, epochs=1, batch_size=batch, lr=0.05, momentum=0.9, progress=False)
        runs[stage] = train(config, data)
        print(f"{stage:<10} {runs[stage]['train_seconds']:6.2f} s of training, "
              f"test accuracy {runs[stage]['final_test_accuracy']:.2%}")
    first, second = (np.array(losses_of(runs[stage])) for stage in ("numpy", "numba-cpu"))
    print(f"largest relative difference of the loss over the first 5 steps: "
          f"{np.max(np.abs(first[:5] - second[:5]) / first[:5]):.1e}")
    assert np.allclose(first[:5], second[:5], rtol=1e-4), "the same function: the same first losses"
    assert abs(runs["numpy"]["final_test_accuracy"] - runs["numba-cpu"]["final_test_accuracy"]) <= 0.03


def exercise_3(fast: bool) -> None:
    """Run `python -m cnn bench`: which phase of the training step dominates for each stage?

    Answer. On a CPU the backward pass dominates every stage, then the forward pass: the backward
    pass of a convolution is two convolution-sized products (the filter gradient and the input
    gradient) against the forward pass's one, so it costs about twice as much; the update (one pass
    over 44 426 parameters) and the copies (none on a CPU) are small. On a GPU (the recorded results of
    notebook 10) the picture changes: forward and backward shrink by orders of magnitude, and the
    host→device copy of the batch and the host time of launching dozens of kernels become a visible
    share of the step — what stages 6 and 7 then attack. `plots.breakdown_plot(result, save_to=None)`
    draws the same numbers as stacked bars.
    """
    flags = ["--stage", "numpy" if fast else "loops,numpy,numba-cpu", "--reference", "none", "--no-plots"]
    flags += ["--batch-size", "8", "--steps", "2", "--warmup", "1", "--min-steps", "1", "--budget", "2"] if fast else []
    environment = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}  # CPU stages
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-m", "cnn", "bench", *flags, "--out-dir", out], capture_output=True,
                              text=True, env=environment, timeout=1800)
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(next(Path(out).glob("bench-*.json")).read_text())
    print("python -m cnn bench " + " ".join(flags))
    for stage in result["stages"]:
        phases = {name: timing["median"] for name, timing in stage["phases_ms"].items()}
        dominant = max(phases, key=phases.get)
        print(f"{stage['name']:<10} " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in phases.items())
              + f"  -> {dominant} dominates")
        assert dominant in ("forward", "backward"), f"{stage['name']}: on a CPU the arithmetic dominates"
