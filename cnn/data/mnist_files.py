"""MNIST's four IDX files: their names, the checksums of the real ones, the checks each must pass.

``read_mnist(directory)`` reads and checks the four files of a directory. Every file must be a valid
IDX file in MNIST's layout (28×28 uint8 images, labels 0..9, as many labels as images). Whether it
*is* MNIST is its SHA256 (``MNIST_SHA256``, of the *uncompressed* content). MNIST's checksums vouch
for MNIST, not for every set of four files: the project refuses to *fetch* a file whose checksum
differs (``cnn.data.fetch``), but four files with other content in a directory the user gives are
another dataset in MNIST's layout, which loads, with its own normalisation (``cnn.data.mnist``).
Damage is still caught: a file that is not valid IDX in MNIST's layout is refused, and every fetched
file is gzip'd, whose CRC-32 fails on a changed byte.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cnn.data.dataset import DataError, check_labels, shape_str
from cnn.data.files import read_file
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

#: SHA256 of each .gz file as the mirrors serve it (Yann LeCun's originals, byte for byte): what a
#: download must match before it takes its name (``cnn.data.fetch``). A copy gzip'd again differs here,
#: not in MNIST_SHA256.
MNIST_GZ_SHA256 = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}

#: Written by ``cnn.data.fetch`` beside the four files it fetched: one line saying where they came from.
FETCHED_FROM = "fetched-from.txt"


class MnistFile(NamedTuple):
    path: Path
    array: np.ndarray
    is_mnist: bool  # its SHA256 is that of MNIST's file of this name

    @property
    def checksum(self) -> str:
        return "sha256 ok" if self.is_mnist else "not MNIST's content (its sha256 differs)"


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


def fetched_from(directory: Path) -> str | None:
    """Where the project fetched the MNIST files of `directory` from; None if it did not fetch them."""
    marker = directory / FETCHED_FROM
    return marker.read_text().strip() if marker.is_file() else None


def _is_mnist(content: bytes, name: str) -> bool:
    return hashlib.sha256(content).hexdigest() == MNIST_SHA256[name]


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
    return MnistFile(path, array, _is_mnist(content, name))


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
