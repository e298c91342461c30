"""A learnable stand-in for MNIST in tests and fault drills: no file, no download, a second to train on.

``corner_digits`` draws 28×28 images of Gaussian noise and writes each one's class into the brightness
of its top-left 7×7 corner (+0.5 per class), so LeNet-5 can learn it within a few dozen steps.
"""

from __future__ import annotations

import numpy as np


def corner_digits(n_train: int = 96, n_test: int = 40, seed: int = 0):
    """(train_x, train_y, test_x, test_y): float32 images (N, 1, 28, 28) and int labels 0..9."""
    rng = np.random.default_rng(seed)

    def make(count):
        labels = rng.integers(0, 10, count)
        images = rng.normal(0, 1, (count, 1, 28, 28)).astype(np.float32)
        images[:, 0, :7, :7] += labels[:, None, None] * 0.5
        return images, labels
    return (*make(n_train), *make(n_test))
