"""Fingerprint columns held as unsigned integers: the step records' hex strings, packed losslessly.

The records hold each fingerprint as lowercase hex of a fixed width (16 digits for a digest, 8 for float32 bits):
as strings, 24 bytes a record and column in Arrow (16 characters and an offset), 120 bytes a record for the five
METRICS. An experiment of 1,000 ranks x 1,000 steps holds 5 million records, so analysis keeps a column packed as the
unsigned integer that the hex spells (uint64 for 16 digits, uint32 for 8, uint16 for 4, uint8 for 2): 8 bytes or
fewer, and compared at numpy speed.

Packing is exact or not done: a column is packed only when every value is lowercase hex of one of those widths, the
same for every record, and none is missing; then the integer and its dtype give back the very string (the dtype's
width in digits, zero-padded). Anything else (an uppercase digit, a width of its own, a missing value) stays the
strings it was. Two columns compare equal only as the strings they hold: packed alike they compare as integers,
otherwise both as text (`alike`), so a uint32 5 never equals a uint64 5 ("00000005" is not "0000000000000005").
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
# Two ASCII characters, read as one little-endian uint16 -> the byte their hex spells; 256: not two lowercase digits
_PAIR = np.full(1 << 16, 256, dtype=np.uint16)
_PAIR[(_DIGITS[:, None].astype(np.uint16) | _DIGITS[None, :].astype(np.uint16) << 8).ravel()] = np.arange(256)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # bytes -> dtype (a hex digit is 4 bits)


def pack(array: pa.Array) -> pa.Array:
    """`array` of hex strings as unsigned integers (memory of their own) when that is lossless (see the module's
    docstring), else `array` itself."""
    if not len(array) or array.null_count or not (pa.types.is_string(array.type)
                                                  or pa.types.is_large_string(array.type)):
        return array
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64 if pa.types.is_large_string(array.type) else np.int32)
    offsets = offsets[array.offset: array.offset + len(array) + 1]
    width = int(offsets[1] - offsets[0])
    if width % 2 or width // 2 not in _UNSIGNED or not (np.diff(offsets) == width).all():
        return array
    text = np.frombuffer(data_buffer, dtype=np.uint8)[int(offsets[0]): int(offsets[-1])]
    pairs = _PAIR[text.view("<u2")]  # one lookup per two digits: the bytes, most significant first
    if (pairs > 255).any():
        return array
    dtype = np.dtype(_UNSIGNED[width // 2])
    return pa.array(pairs.astype(np.uint8).view(dtype.newbyteorder(">")).astype(dtype))


def unpack(array: pa.Array) -> pa.Array:
    """A packed array as the large strings the records hold (any other array as it is)."""
    if not pa.types.is_unsigned_integer(array.type):
        return array
    values = array.to_numpy()
    width = values.dtype.itemsize * 2
    big_endian = values.astype(values.dtype.newbyteorder(">")).view(np.uint8).reshape(len(values), -1)
    nibbles = np.empty((len(values), width), dtype=np.uint8)
    nibbles[:, 0::2], nibbles[:, 1::2] = big_endian >> 4, big_endian & 15
    offsets = np.arange(len(values) + 1, dtype=np.int64) * width
    return pa.LargeStringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(_DIGITS[nibbles]))


def pack_column(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A column packed chunk by chunk where every chunk packs alike (else the column as it is)."""
    chunks = [pack(chunk) for chunk in column.chunks if len(chunk)]
    if not chunks or len({chunk.type for chunk in chunks}) != 1 or not pa.types.is_unsigned_integer(chunks[0].type):
        return column
    return pa.chunked_array(chunks)


def is_packed(column: pd.Series) -> bool:
    return column.dtype.kind == "u"


def unpacked(column: pd.Series) -> pd.Series:
    """`column` as the strings the records hold (a column that is no packed one is returned as it is)."""
    if not is_packed(column):
        return column
    return unpack(pa.array(column.to_numpy())).to_pandas().set_axis(column.index).rename(column.name)


def hex_text(value: object, dtype: np.dtype) -> str:
    """One value of a column as the records spell it (a packed one as zero-padded lowercase hex)."""
    return f"{int(value):0{dtype.itemsize * 2}x}" if dtype.kind == "u" else str(value)  # type: ignore[call-overload]


def alike(reference: pd.Series, candidate: pd.Series) -> bool:
    """Whether two columns compare as the strings they hold as they are: packed alike, or neither packed (otherwise
    unpack both first)."""
    return reference.dtype == candidate.dtype or not (is_packed(reference) or is_packed(candidate))
