"""What a checkpoint file must hold, checked field by field before anything in it is allocated or trusted.

A checkpoint is a file a student downloads or a classmate sends, so ``read_checkpoint`` trusts nothing
in it, and checks in this order — each step only reads what the steps before it have bounded::

    the container     a regular file holding a zip archive (an .npz); a bare .npy array is named as one
    the directory     every member one of FIELDS (or rows_NAME), at most once, stored or deflated, not
                      encrypted, its declared bytes inside the file (a truncated file is caught here)
    each .npy header  read with numpy.lib.format's own header readers, inside a guard; its dtype is the
                      field's kind (never ``object``), and shape × itemsize + header = the declared size,
                      so no header can make the reader allocate more than the file holds
    the settings      config: TrainConfig.check, the command line's own rules -> the model -> its size
    the position      epoch, batch: integers in range; the rng state in numpy's PCG64 format
    the arrays        params, momentum: float32/float64 vectors of the network's size (the shape is
                      checked before the bytes are read), finite; rows_*: one such row per worker
    the records       history: the lists the trainer appends to; parallel: the distributed run's fields

An array is read whole, so the zip's CRC-32 of its bytes is checked too. Each violation is one
ValueError line naming the file and the field: ``ck.npz: not a valid checkpoint: epoch: must be >= 0,
got -5``. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
from numpy.lib import format as npy

from cnn.argtypes import count, positive_int
from cnn.config import TrainConfig
from cnn.model import get_network

#: field -> kind: "vector" (a float32/float64 array of the network's size), "integer" (a 0-d integer),
#: "text" (a 0-d string holding JSON)
FIELDS = {"params": "vector", "momentum": "vector", "epoch": "integer", "batch": "integer",
          "rng_state": "text", "config": "text", "history": "text", "parallel": "text"}
REQUIRED = ("params", "momentum", "epoch", "batch", "rng_state", "config", "history")
ROWS = re.compile(r"rows_[A-Za-z0-9_]{1,64}")          # a distributed run's per-worker arrays
TEXT_LIMITS = {"rng_state": 1 << 16, "config": 1 << 20, "history": 1 << 28, "parallel": 1 << 28}   # bytes
MAX_HEADER = 10_000            # numpy's own default limit on a .npy header
MAX_ROWS = 1024                # rows of a rows_* array: workers, or L-BFGS pairs
DEFLATE_MAX_RATIO = 1032       # no deflate stream expands more than this: a larger declared size is a lie
RNG_STATE_KEYS = {"bit_generator", "state", "has_uint32", "uinteger"}


class Invalid(ValueError):
    """One violation: ``field`` (what is wrong) and ``problem`` (how), joined as "field: problem"."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")


def said(err: BaseException) -> str:
    """An exception from a library, as a short single line: "BadZipFile: Bad CRC-32 for file 'params.npy'"."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:117] + '...' if len(text) > 120 else text}"


@dataclass
class Member:
    """One .npy file of the archive, as its header describes it (nothing of its data read yet)."""

    field: str
    info: zipfile.ZipInfo
    header_size: int
    shape: tuple
    fortran: bool
    dtype: np.dtype


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint at ``path``, every field checked; ValueError (one line naming the file and the field).

    Returns params, momentum (native-order float arrays), epoch, batch (ints), rng_state, config,
    history (parsed JSON), parallel (the distributed run's record, or None) and rows ({name: array}).
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:             # one open file throughout: a writer may replace the path
            return _read(handle, os.fstat(handle.fileno()).st_size)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such checkpoint") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not a checkpoint") from None
    except Invalid as err:
        raise ValueError(f"{path}: not a valid checkpoint: {err}") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read the checkpoint ({err.strerror or err})") from None


def _read(handle, size: int) -> dict:
    if handle.read(6) == b"\x93NUMPY":
        raise Invalid("the file", "is a single .npy array (np.save), not a checkpoint (an .npz archive "
                                  "of parameters, momentum, position and settings, as python -m cnn train writes)")
    handle.seek(0)
    with _open_zip(handle) as archive:
        members = {field: _header(archive, info, field) for field, info in _directory(archive, size).items()}
        for field, member in members.items():
            _check_kind(member)
        texts = {field: _json(archive, member) for field, member in members.items() if FIELDS.get(field) == "text"}
        config = _check_config(texts["config"])
        num_params = get_network(config["model"]).num_params
        epoch, batch = (_integer(archive, members[field]) for field in ("epoch", "batch"))
        _check_position(epoch, batch, config)
        _check_rng_state(texts["rng_state"])
        _check_history(texts["history"])
        parallel = texts.get("parallel")
        if parallel is not None:
            _check_parallel(parallel, batch)
        arrays = {field: _floats(archive, member, num_params, config["model"])
                  for field, member in members.items() if FIELDS.get(field) != "text" and field not in ("epoch", "batch")}
    if parallel is None and any(ROWS.fullmatch(field) for field in arrays):
        raise Invalid(next(field for field in arrays if ROWS.fullmatch(field)),
                      "per-worker rows belong to a distributed run's checkpoint, and this one has no parallel record")
    return {"params": arrays["params"], "momentum": arrays["momentum"], "epoch": epoch, "batch": batch,
            "parallel": parallel, "rng_state": texts["rng_state"], "config": config, "history": texts["history"],
            "rows": {field[len("rows_"):]: array for field, array in arrays.items() if ROWS.fullmatch(field)}}


# -- the container and its directory ----------------------------------------------------------------

def _open_zip(handle) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(handle)
    # a damaged end record or central directory surfaces as any of these, depending on which byte
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OverflowError, EOFError, OSError,
            NotImplementedError) as err:                # NotImplementedError: "zip file version 20.7"
        raise Invalid("the archive", f"is not a readable zip (.npz) archive ({said(err)})") from None


def _directory(archive: zipfile.ZipFile, size: int) -> dict[str, zipfile.ZipInfo]:
    """{field: its zip entry}, after checking every entry's name, method and declared sizes."""
    members = {}
    for info in archive.infolist():
        field = info.filename[:-len(".npy")] if info.filename.endswith(".npy") else info.filename
        if field not in FIELDS and not ROWS.fullmatch(field):
            raise Invalid(f"member {info.filename[:80]!r}", "is not a field of a checkpoint")
        if field in members:
            raise Invalid(field, "appears twice in the archive")
        if info.flag_bits & 0x1:
            raise Invalid(field, "is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise Invalid(field, f"uses zip compression method {info.compress_type}; a checkpoint is stored or deflated")
        if info.header_offset < 0 or info.header_offset + info.compress_size > size:
            raise Invalid(field, f"declares {info.compress_size} bytes at offset {info.header_offset}, beyond the "
                                 f"end of the {size}-byte file (truncated?)")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise Invalid(field, f"is stored uncompressed but declares {info.file_size} bytes in {info.compress_size}")
        if info.file_size > DEFLATE_MAX_RATIO * info.compress_size + 1024:
            raise Invalid(field, f"declares {info.file_size} bytes deflated into {info.compress_size}: more than "
                                 "deflate can expand")
        members[field] = info
    missing = [field for field in REQUIRED if field not in members]
    if missing:
        raise Invalid(missing[0], "is missing")
    return members


def _header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, field: str) -> Member:
    """The member's .npy header, read with numpy's readers from the start of the member only."""
    try:
        with archive.open(info) as stream, warnings.catch_warnings():
            warnings.simplefilter("ignore")         # ast's SyntaxWarning about a damaged header's backslash
            version = npy.read_magic(stream)
            if version not in ((1, 0), (2, 0)):
                raise Invalid(field, f".npy format version {version[0]}.{version[1]}; np.savez writes 1.0 or 2.0")
            reader = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, fortran, dtype = reader(stream, max_header_size=MAX_HEADER)
            header_size = stream.tell()
    except Invalid:
        raise
    except Exception as err:    # noqa: BLE001 — numpy parses the header text with tokenize and ast: damaged
        # bytes raise ValueError, SyntaxError, tokenize.TokenError, TypeError, ... and zipfile BadZipFile
        raise Invalid(field, f"its zip entry or .npy header is damaged ({said(err)})") from None
    if any(not isinstance(length, int) or length < 0 for length in shape):
        raise Invalid(field, f"its header declares the shape {shape}")
    member = Member(field, info, header_size, tuple(shape), bool(fortran), dtype)
    declared = info.file_size - header_size
    if dtype.hasobject:
        raise Invalid(field, "holds Python objects (dtype object): a checkpoint never unpickles anything")
    if math.prod(shape) * dtype.itemsize != declared:
        raise Invalid(field, f"its header describes {math.prod(shape) * dtype.itemsize} bytes ({dtype.str} "
                             f"{shape}), the archive declares {declared}")
    return member


def _check_kind(member: Member) -> None:
    """The member's dtype and shape are those of its field's kind (its size against the network comes later)."""
    dtype, shape, field = member.dtype, member.shape, member.field
    kind = FIELDS.get(field, "rows")
    plain = dtype.names is None and dtype.subdtype is None
    if kind == "text":
        if not (plain and dtype.kind == "U" and shape == ()):
            raise Invalid(field, f"must be text (a 0-d string of JSON), is {dtype.str} of shape {shape}")
        if member.info.file_size > TEXT_LIMITS[field]:
            raise Invalid(field, f"declares {member.info.file_size} bytes, more than the {TEXT_LIMITS[field]} allowed")
    elif kind == "integer":
        if not (plain and dtype.kind in "iu" and shape == ()):
            raise Invalid(field, f"must be an integer, is {dtype.str} of shape {shape}")
    elif not (plain and dtype.kind == "f" and dtype.itemsize in (4, 8) and len(shape) == (1 if kind == "vector" else 2)):
        raise Invalid(field, f"must be a float32 or float64 {'vector' if kind == 'vector' else 'matrix'}, "
                             f"is {dtype.str} of shape {shape}")


# -- reading the members: only after their headers are checked ----------------------------------------

def _data(archive: zipfile.ZipFile, member: Member) -> bytes:
    """The member's bytes after its header, read to the end so that the zip checks their CRC-32."""
    try:
        with archive.open(member.info) as stream:
            raw = stream.read()
    except Exception as err:    # noqa: BLE001 — BadZipFile (CRC), zlib.error, EOFError, OSError: damaged bytes
        raise Invalid(member.field, f"its bytes are damaged ({said(err)})") from None
    if len(raw) != member.info.file_size:
        raise Invalid(member.field, f"holds {len(raw)} bytes, its entry declares {member.info.file_size}")
    return raw[member.header_size:]


def _array(archive: zipfile.ZipFile, member: Member) -> np.ndarray:
    array = np.frombuffer(_data(archive, member), dtype=member.dtype)
    return array.reshape(member.shape, order="F" if member.fortran else "C")


def _json(archive: zipfile.ZipFile, member: Member):
    try:
        text = str(_array(archive, member)[()])
        return json.loads(text)
    except (ValueError, RecursionError) as err:     # not JSON, nested too deep, an invalid code point
        raise Invalid(member.field, f"is not valid JSON ({said(err)})") from None


def _integer(archive: zipfile.ZipFile, member: Member) -> int:
    value = int(_array(archive, member)[()])
    problem = count.problem(value)
    if problem:
        raise Invalid(member.field, f"{problem}, got {value}")
    return value


def _floats(archive: zipfile.ZipFile, member: Member, num_params: int, model: str) -> np.ndarray:
    """A params/momentum vector or a rows_* matrix of ``num_params`` columns: shape checked, read, finite."""
    width = member.shape[-1]
    if width != num_params:
        raise Invalid(member.field, f"holds {width:,} values a row; {model} has {num_params:,} parameters")
    if len(member.shape) == 2 and member.shape[0] > MAX_ROWS:
        raise Invalid(member.field, f"has {member.shape[0]} rows, more than the {MAX_ROWS} allowed")
    array = _array(archive, member)
    array = array.astype(array.dtype.newbyteorder("="))      # a writable copy, in this machine's byte order
    bad = array.size - int(np.isfinite(array).sum())
    if bad:
        what = "the weights are not finite" if member.field == "params" else "its values must be finite"
        raise Invalid(member.field, f"{bad:,} of {array.size:,} values are NaN or infinite: {what}")
    return array


# -- the parsed fields ----------------------------------------------------------------------------------

def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value) -> str:
    """What a parsed JSON value is, in JSON's words: "a list", "a number", "null" ..."""
    kinds = {dict: "an object", list: "a list", str: "a text", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def _check_config(config) -> dict:
    """The saved settings obey the same rules as the command line's (TrainConfig.check); returns them."""
    if not isinstance(config, dict):
        raise Invalid("config", f"must be a JSON object of settings, is {_kind(config)}")
    if "model" not in config:
        raise Invalid("config", "names no model")
    known = {field.name for field in fields(TrainConfig)}
    try:
        TrainConfig(**{key: value for key, value in config.items() if key in known}).check()
    except ValueError as err:
        raise Invalid("config", str(err)) from None
    return config


def _check_position(epoch: int, batch: int, config: dict) -> None:
    epochs = config.get("epochs", TrainConfig.epochs)
    if epoch > epochs:
        raise Invalid("epoch", f"is {epoch}, beyond the {epochs} epochs of its own configuration")
    if epoch == epochs and batch:
        raise Invalid("batch", f"is {batch} after the last of the {epochs} epochs: a finished run resumes at batch 0")


def _check_rng_state(state) -> None:
    """numpy's PCG64 state, as ``Generator.bit_generator.state`` gives it (what ``default_rng`` uses)."""
    if not isinstance(state, dict) or set(state) != RNG_STATE_KEYS:
        raise Invalid("rng_state", f"must be numpy's generator state {{{', '.join(sorted(RNG_STATE_KEYS))}}}, "
                                   f"got {repr(state)[:60]}")
    inner = state["state"]
    if state["bit_generator"] != "PCG64" or not isinstance(inner, dict) or set(inner) != {"state", "inc"}:
        raise Invalid("rng_state", "must be the state of a PCG64 generator (numpy's default_rng)")
    for name, value, limit in (("state", inner["state"], 2**128), ("inc", inner["inc"], 2**128),
                               ("has_uint32", state["has_uint32"], 2), ("uinteger", state["uinteger"], 2**32)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
            raise Invalid("rng_state", f"{name} must be an integer in [0, {limit}), got {repr(value)[:40]}")
    try:
        np.random.PCG64().state = state
    except (ValueError, TypeError, OverflowError) as err:
        raise Invalid("rng_state", f"numpy refuses it ({said(err)})") from None


def _check_history(history) -> None:
    """The lists and totals the trainer appends to when it resumes (cnn.train, cnn.parallel)."""
    if not isinstance(history, dict):
        raise Invalid("history", f"must be a JSON object, is {_kind(history)}")
    for key in ("steps", "evals", "epochs"):
        if not isinstance(history.get(key), list):
            raise Invalid("history", f"{key} must be a list, got {repr(history[key])[:40] if key in history else 'nothing'}")
    seconds = history.get("train_seconds")
    if not _is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
        raise Invalid("history", f"train_seconds must be a finite number >= 0, got {repr(seconds)[:40]}")
    for index, step in enumerate(history["steps"]):
        if not (isinstance(step, list) and len(step) == 4 and isinstance(step[0], int) and not isinstance(step[0], bool)
                and all(_is_number(value) or value is None for value in step[1:])):
            raise Invalid("history", f"steps[{index}] must be [step, loss, lr, seconds], got {repr(step)[:60]}")
    for index, entry in enumerate(history["evals"]):
        if not (isinstance(entry, list) and len(entry) == 4 and all(_is_number(value) for value in entry)):
            raise Invalid("history", f"evals[{index}] must be [step, accuracy, loss, seconds], got {repr(entry)[:60]}")
    for index, entry in enumerate(history["epochs"]):
        if not (isinstance(entry, dict) and all(_is_number(entry.get(key)) for key in ("test_accuracy", "test_loss"))):
            raise Invalid("history", f"epochs[{index}] must hold a test_accuracy and a test_loss, got {repr(entry)[:60]}")


def _check_parallel(record, batch: int) -> None:
    """The distributed run's record (cnn.parallel.checkpoint): who wrote it, and where it stands in images."""
    from cnn.parallel import STRATEGIES

    if not isinstance(record, dict):
        raise Invalid("parallel", f"must be a JSON object, is {_kind(record)}")
    if record.get("strategy") not in STRATEGIES:
        raise Invalid("parallel", f"strategy {repr(record.get('strategy'))[:40]} is none of {', '.join(STRATEGIES)}")
    for name, rule in (("ranks", positive_int), ("workers", positive_int), ("global_batch", positive_int),
                       ("images_into_epoch", count)):
        try:
            rule.check(record.get(name), name)
        except ValueError as err:
            raise Invalid("parallel", str(err)) from None
    if record["workers"] > record["ranks"]:
        raise Invalid("parallel", f"{record['workers']} workers on {record['ranks']} ranks")
    if record["images_into_epoch"] // record["global_batch"] != batch:
        raise Invalid("parallel", f"images_into_epoch {record['images_into_epoch']} is not batch {batch} "
                                  f"of {record['global_batch']} images")
    if not isinstance(record.get("state", {}), dict) or not isinstance(record.get("lacks", ""), str):
        raise Invalid("parallel", "state must be a JSON object and lacks a text")
