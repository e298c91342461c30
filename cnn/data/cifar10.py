"""CIFAR-10 as a ``Dataset``, from the official "python version" batches; never downloaded automatically."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cnn.data.dataset import DataError, Dataset, PathLike, labels_uint8, shape_str
from cnn.data.files import read_pickle
from cnn.data.locations import check_given_dir, find_dataset_dir, places_looked


CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
_CIFAR10_HINT = (f"CIFAR-10 is not downloaded automatically: get {CIFAR10_URL}, "
                 "extract it and pass the folder with --data-dir")


def load_cifar10(data_dir: PathLike | None = None) -> Dataset:
    """CIFAR-10 from the official python batches, as a Dataset.

    `data_dir` holds `cifar-10-batches-py/` (what CIFAR10_URL extracts to) or
    is that folder itself; without it, $CNN_DATA_DIR and the repository's
    data/ are searched the same way.
    """
    directory = _find_cifar10(data_dir)
    train = [_read_cifar_batch(directory / name) for name in CIFAR10_TRAIN_BATCHES]
    test_images, test_labels = _read_cifar_batch(directory / CIFAR10_TEST_BATCH)
    return Dataset(
        name="cifar10",
        train_images=np.concatenate([images for images, _ in train]),
        train_labels=np.concatenate([labels for _, labels in train]),
        test_images=test_images,
        test_labels=test_labels,
        classes=list(CIFAR10_CLASSES),
        source=directory,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        origin=f"CIFAR-10's python batches in {directory}",
    )


def _find_cifar10(data_dir: PathLike | None) -> Path:
    def holds(directory: Path) -> bool:
        names = (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH)
        return all((directory / name).is_file() for name in names)

    if data_dir is not None:
        check_given_dir(data_dir)
    found = find_dataset_dir(data_dir, "cifar-10-batches-py", holds)
    if found is not None:
        return found[0]
    if data_dir is None:
        raise DataError(f"CIFAR-10: not found in {places_looked()}; {_CIFAR10_HINT}")
    # Incomplete: point at the folder so that the missing batch gets named.
    subfolder = Path(data_dir) / "cifar-10-batches-py"
    return subfolder if subfolder.is_dir() else Path(data_dir)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch: images (N, 3, 32, 32) uint8 and labels (N,) uint8.

    A batch is a pickled dict: b"data" is a uint8 array N×3072 whose rows
    hold an image's 1024 red, then 1024 green, then 1024 blue values, each
    channel row by row; b"labels" is a list of N ints 0..9.
    """
    if not path.is_file():
        raise DataError(f"{path}: no such file; {_CIFAR10_HINT}")
    # Written by Python 2: "bytes" keeps its str keys as bytes (b"data").
    batch = read_pickle(path, encoding="bytes")
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path}: not a CIFAR-10 batch "
                        '(expected a dict with b"data" and b"labels")')
    data = np.asarray(batch[b"data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: data is {shape_str(data.shape)} {data.dtype}, "
                        "expected uint8 N×3072")
    labels = labels_uint8(batch[b"labels"], path)
    if len(labels) != len(data):
        raise DataError(f"{path}: {len(labels)} labels for {len(data)} images")
    return data.reshape(-1, 3, 32, 32), labels
