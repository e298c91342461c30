"""MNIST's four IDX files: their names, the checksums and counts of the real ones, the checks each must pass.

``read_mnist(directory)`` reads and checks the four files of a directory. A file with the real
file's count must have the real content (``MNIST_SHA256``, of the *uncompressed* content); a file
with another count is a custom dataset in MNIST's layout, format-checked only.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from cnn.data.dataset import DataError, check_labels, shape_str
from cnn.data.files import read_file, verify_sha256
from cnn.data.idx import decode_idx, idx_magic


MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

#: SHA256 of each file's *uncompressed* content. The .gz files differ between
#: copies (gzip's output depends on the compressor and its settings); the
#: content inside them does not.
MNIST_SHA256 = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}

#: How many items the real files hold. A file with another count is not MNIST
#: but a custom dataset in MNIST's layout: it is format-checked, not checksummed.
MNIST_COUNTS = {
    "train-images-idx3-ubyte": 60_000,
    "train-labels-idx1-ubyte": 60_000,
    "t10k-images-idx3-ubyte": 10_000,
    "t10k-labels-idx1-ubyte": 10_000,
}

_NOT_KNOWN = "not a known MNIST file (format checked only)"


class MnistFile(NamedTuple):
    path: Path
    array: np.ndarray
    checksum: str  # "sha256 ok" or _NOT_KNOWN


def check_mnist_array(array: np.ndarray, name: str, source) -> None:
    """MNIST's rules for one file: the right magic, 28×28 images, labels 0..9."""
    is_images = "images" in name
    kind, ndim = ("images", 3) if is_images else ("labels", 1)
    expected, found = idx_magic(np.uint8, ndim), idx_magic(array.dtype, array.ndim)
    if found != expected:
        raise DataError(f"{source}: magic number 0x{found:08x}, expected 0x{expected:08x} "
                        f"(uint8, {ndim} dimensions) for MNIST {kind}")
    if is_images and array.shape[1:] != (28, 28):
        raise DataError(f"{source}: images are {shape_str(array.shape[1:])}, MNIST's are 28×28")
    if not is_images:
        check_labels(array, source)


def _checksum_status(content: bytes, name: str, count: int, source) -> str:
    # Only a file with the real file's count claims to be MNIST; others are
    # custom datasets in MNIST's layout, which no checksum can vouch for.
    if MNIST_COUNTS[name] != count:
        return _NOT_KNOWN
    verify_sha256(content, MNIST_SHA256[name], source)
    return "sha256 ok"


def _mnist_path(directory: Path, name: str) -> Path | None:
    """The file `name` in `directory`, gzip-compressed or raw; None if absent."""
    for candidate in (directory / f"{name}.gz", directory / name):
        if candidate.is_file():
            return candidate
    return None


def missing_mnist_files(directory: Path) -> list[str]:
    return [name for name in MNIST_FILES if _mnist_path(directory, name) is None]


def _read_mnist_file(directory: Path, name: str) -> MnistFile:
    path = _mnist_path(directory, name)
    if path is None:
        raise DataError(f"{directory / name}(.gz): no such file")
    content = read_file(path)
    array = decode_idx(content, path)
    check_mnist_array(array, name, path)
    return MnistFile(path, array, _checksum_status(content, name, len(array), path))


def read_mnist(directory: Path) -> dict[str, MnistFile]:
    """Read and check the four files of `directory`, by name."""
    files = {name: _read_mnist_file(directory, name) for name in MNIST_FILES}
    for split in ("train", "t10k"):
        images = files[f"{split}-images-idx3-ubyte"]
        labels = files[f"{split}-labels-idx1-ubyte"]
        if len(images.array) != len(labels.array):
            raise DataError(f"{labels.path}: {len(labels.array)} labels, but "
                            f"{images.path.name} holds {len(images.array)} images")
    return files
