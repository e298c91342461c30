"""Dataset files read and written safely: gunzipped when named .gz, written atomically
(``cnn.atomic.replaced_on_success``), checksummed, and unpickled only as far as numpy arrays and
plain values go.

Downloads are pooch's (``cnn.data.fetch``); what stays here is what the project writes and reads
itself — the IDX files converted from PyPI's pickle, the marker beside fetched files — through the
same atomic writer as every other file of the project, and an unpickler that refuses to build
anything but arrays (the standard library's is the only one, and it would run any code a doctored
pickle names).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import zlib
from collections.abc import Mapping
from pathlib import Path

from cnn.atomic import replaced_on_success
from cnn.data.dataset import DataError


def read_file(path: Path) -> bytes:
    """The content of `path`, gunzipped if its name ends in .gz."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read it ({error.strerror or error})") from None
    return uncompressed(raw, path)


def uncompressed(raw: bytes, source) -> bytes:
    """`raw` gunzipped if `source` (a path or URL) ends in .gz, else `raw` itself."""
    if not str(source).endswith(".gz"):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{source}: not a valid gzip file ({error})") from None


def write_file(path: Path, content: bytes) -> None:
    """Write `content` to `path` atomically, gzip-compressed if the name ends in .gz."""
    if path.name.endswith(".gz"):
        content = gzip.compress(content, compresslevel=6, mtime=0)
    with replaced_on_success(path) as temporary:
        temporary.write_bytes(content)


def verify_sha256(content: bytes, expected: str, source) -> None:
    """Raise DataError("checksum mismatch") unless SHA256(content) is `expected`."""
    actual = hashlib.sha256(content).hexdigest()
    if actual != expected:
        raise DataError(f"{source}: checksum mismatch: sha256 {actual}, expected {expected}")


def verify_if_known(content: bytes, name: str, source, checksums: Mapping[str, str]) -> None:
    if name in checksums:
        verify_sha256(content, checksums[name], source)


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


def read_pickle(path: Path, encoding: str):
    content = read_file(path)
    try:
        return _ArrayUnpickler(io.BytesIO(content), encoding=encoding).load()
    except Exception as error:  # a damaged pickle can fail in almost any way
        reason = f"{type(error).__name__}: {error}"
        raise DataError(f"{path}: not a readable pickle ({reason})") from None
