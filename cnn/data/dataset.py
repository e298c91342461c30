"""What every dataset of the course is: a ``Dataset`` of uint8 arrays, ``normalize``, and ``DataError``.

Every file is checked before use; anything wrong raises ``DataError``, whose message is one line
naming the file and the problem. Labels are checked here too (integers 0..9), for every dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PathLike = str | os.PathLike

#: MNIST's mean and std (of the pixels scaled to [0, 1]): what ``normalize`` uses unless told otherwise
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


class DataError(Exception):
    """A dataset file is missing, damaged, or not what it claims to be.

    The message is one line that starts with the file (or URL) and says what
    is wrong, so a command-line tool can print it as it is.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # always a single line


@dataclass(eq=False)  # eq=False: numpy arrays do not compare with a plain ==
class Dataset:
    """A labelled image dataset: uint8 images (N, C, H, W), uint8 labels (N,)."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    classes: list[str]
    source: Path  # the directory the files were read from
    mean: tuple[float, ...]  # per channel, of the pixels scaled to [0, 1]
    std: tuple[float, ...]
    origin: str = ""  # one line: where the files came from and what they are (printed by the trainer)


def normalize(images: np.ndarray, mean=MNIST_MEAN, std=MNIST_STD,
              dtype=np.float32) -> np.ndarray:
    """Scale uint8 pixels to [0, 1], then standardize each channel.

    Returns (images/255 - mean) / std as `dtype`. The channel axis is third
    from the end, as in (N, C, H, W) or (C, H, W); `mean` and `std` hold one
    value per channel (`Dataset.mean` and `Dataset.std`).
    """
    mean = np.asarray(mean, dtype).reshape(-1, 1, 1)
    std = np.asarray(std, dtype).reshape(-1, 1, 1)
    return (images.astype(dtype) / 255 - mean) / std


def pixel_statistics(images: np.ndarray, block: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (N, C, H, W) scaled to [0, 1]: what ``normalize`` takes.

    Counted exactly from how often each value 0..255 occurs (a block of images at a time, so no
    float copy of the whole set is made): with c_v the count of value v and n = Σ c_v,

        mean = Σ c_v · (v/255) / n        std = √( Σ c_v · (v/255 − mean)² / n )

    A channel whose pixels are all one value has std 0; it gets std 1 (centred only), not a division by 0.
    """
    counts = np.zeros((images.shape[1], 256))
    for start in range(0, len(images), block):
        for channel, pixels in enumerate(images[start:start + block].swapaxes(0, 1)):
            counts[channel] += np.bincount(pixels.ravel(), minlength=256)
    values = np.arange(256) / 255
    total = np.maximum(counts.sum(axis=1), 1)
    mean = counts @ values / total
    std = np.sqrt((counts * (values - mean[:, None]) ** 2).sum(axis=1) / total)
    return tuple(mean.tolist()), tuple(np.where(std > 0, std, 1.0).tolist())


def check_labels(labels: np.ndarray, source) -> None:
    out_of_range = np.flatnonzero((labels < 0) | (labels > 9))
    if out_of_range.size:
        index = out_of_range[0]
        raise DataError(f"{source}: label {labels[index]} at index {index} out of range 0..9")


def labels_uint8(labels, source) -> np.ndarray:
    """Labels from a pickle (a list or array of ints 0..9) as a uint8 array."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DataError(f"{source}: labels are {shape_str(labels.shape)} {labels.dtype}, "
                        "expected a list of integers")
    check_labels(labels, source)
    return labels.astype(np.uint8)


def shape_str(shape: tuple[int, ...]) -> str:
    return "×".join(str(size) for size in shape)
