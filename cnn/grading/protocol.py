"""How a notebook's kernel and the referee talk: frames of JSON and numpy arrays — never pickle.

A message is a dict of JSON values, tuples and numpy arrays, nested in lists and dicts. A frame is the
JSON (each array replaced by ``{"__array__": i}``, each tuple by ``{"__tuple__": [...]}``), then the
arrays in one ``.npz`` archive::

    4 bytes: length of the JSON | JSON | npz archive of arr_0, arr_1, …

The referee holds the key that seals its verdicts, and the kernel runs the student's code: a frame
from the kernel must not be able to run code in the referee. ``pickle`` could (an object's
``__reduce__`` runs on loading); JSON and ``np.load(allow_pickle=False)`` cannot.
"""

from __future__ import annotations

import io
import json
import struct

import numpy as np

_LENGTH = struct.Struct("!I")


def encode(message: dict) -> bytes:
    """One frame holding ``message``."""
    arrays: list[np.ndarray] = []

    def pack(value):
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise TypeError("an array of Python objects cannot be sent to the referee")
            arrays.append(value)
            return {"__array__": len(arrays) - 1}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, dict):
            return {str(key): pack(item) for key, item in value.items()}
        if isinstance(value, tuple):
            return {"__tuple__": [pack(item) for item in value]}
        if isinstance(value, list):
            return [pack(item) for item in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"a {type(value).__name__} cannot be sent to the referee (numbers, text, arrays, lists, dicts)")

    header = json.dumps(pack(message)).encode()
    archive = io.BytesIO()
    np.savez(archive, *arrays)
    return _LENGTH.pack(len(header)) + header + archive.getvalue()


def decode(frame: bytes) -> dict:
    """The message of one frame."""
    if len(frame) < _LENGTH.size:
        raise ValueError("a frame shorter than its header")
    (length,) = _LENGTH.unpack_from(frame)
    header = json.loads(frame[_LENGTH.size:_LENGTH.size + length])
    with np.load(io.BytesIO(frame[_LENGTH.size + length:]), allow_pickle=False) as archive:
        arrays = [archive[f"arr_{index}"] for index in range(len(archive.files))]

    def unpack(value):
        if isinstance(value, dict):
            if set(value) == {"__array__"}:
                return arrays[value["__array__"]]
            if set(value) == {"__tuple__"}:
                return tuple(unpack(item) for item in value["__tuple__"])
            return {key: unpack(item) for key, item in value.items()}
        if isinstance(value, list):
            return [unpack(item) for item in value]
        return value

    return unpack(header)
