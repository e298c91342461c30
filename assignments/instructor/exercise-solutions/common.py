"""What the exercise solutions share: the fast switch, the simulator switch, and small networks.

- ``fast_mode()``: True when ``CNN_FAST=1`` — the solutions then run on tiny shapes and few steps (the
  test suite runs them that way); without it they run at the sizes the exercises name.
- ``use_simulator_without_gpu()``: Numba's CUDA simulator on a machine without an NVIDIA GPU. Numba reads
  the switch once, at import, so a CUDA solution calls this before it imports anything that imports numba.
- ``tiny_lenet()``: LeNet-5's layer kinds on 12×12 images with a few channels — the same kernels and the
  same launches per step as LeNet-5, a hundred times fewer threads (what the CUDA notebooks use in the
  simulator).
"""

from __future__ import annotations

import os

import numpy as np

from cnn.machine import use_cuda_simulator_unless_gpu


def fast_mode() -> bool:
    return os.environ.get("CNN_FAST", "0") not in ("", "0")


def use_simulator_without_gpu() -> bool:
    """Turn the simulator on unless a GPU is present; True when the kernels are simulated."""
    return bool(use_cuda_simulator_unless_gpu())


def tiny_lenet():
    from cnn.model import Conv, Dense, Flatten, MaxPool, Network, ReLU

    return Network("lenet5-tiny", (1, 12, 12), (
        Conv(1, 2, 5), ReLU(), MaxPool(2, 2),          # 2×8×8 → 2×4×4
        Conv(2, 3, 3), ReLU(), MaxPool(2, 2),          # 3×2×2 → 3×1×1
        Flatten(), Dense(3, 6), ReLU(), Dense(6, 5), ReLU(), Dense(5, 10)))


def random_array(rng, *shape, dtype=np.float64) -> np.ndarray:
    """Standard normal values of ``dtype``: never zeros, so a forgotten term shows."""
    return rng.standard_normal(shape).astype(dtype)


def mpi_options(fast: bool) -> dict:
    """Options of a distributed run for ``cnn.parallel.launch.run``: a few steps in fast mode, else one epoch."""
    if fast:
        return dict(epochs=1, limit_train=256, limit_test=100, batch_size=32, init="xavier", progress=False, timeout=600)
    return dict(epochs=1, batch_size=32, init="xavier", progress=False, timeout=3600)
