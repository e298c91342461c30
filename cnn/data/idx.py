"""The IDX file format MNIST is distributed in: ``read_idx`` and ``write_idx`` (the header is in ``read_idx``'s docstring).

Written by hand on purpose: the format is a 4-byte magic number, the sizes and the raw values — forty
lines a student can read next to the format's definition, with a one-line error for every way a file can
be wrong. A library (``idx2numpy``, ``python-mnist``) would hide the part worth learning and add a
dependency for it.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from cnn.data.dataset import DataError, PathLike, shape_str
from cnn.data.files import read_file, write_file


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
    return decode_idx(read_file(path), path)


def write_idx(path: PathLike, array: np.ndarray) -> None:
    """Write `array` as an IDX file, gzip-compressed if the name ends in .gz.

    The file appears all at once: it is written under a temporary name and
    renamed, so a crash never leaves half a file under `path`.
    """
    write_file(Path(path), encode_idx(np.asarray(array)))


def idx_magic(dtype: np.dtype, ndim: int) -> int:
    """The IDX magic number for an array of this dtype and number of dimensions."""
    for type_code, idx_dtype in IDX_DTYPES.items():
        if np.dtype(dtype).newbyteorder(">") == idx_dtype:
            return (type_code << 8) | ndim
    raise ValueError(f"IDX cannot store {np.dtype(dtype)} values")


def encode_idx(array: np.ndarray) -> bytes:
    magic = idx_magic(array.dtype, array.ndim)
    header = struct.pack(f">I{array.ndim}I", magic, *array.shape)
    return header + array.astype(IDX_DTYPES[magic >> 8]).tobytes()


def decode_idx(content: bytes, source) -> np.ndarray:
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
        raise DataError(f"{source}: {problem}: the header promises {shape_str(shape)} "
                        f"{dtype.name} = {expected} bytes of data, the file has {found}")
    array = np.frombuffer(content, dtype, count=math.prod(shape), offset=data_start)
    return array.reshape(shape).astype(dtype.newbyteorder("="))
