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
_NIBBLE = np.full(256, 255, dtype=np.uint8)  # ASCII -> the digit's value; 255: no lowercase hex digit
_NIBBLE[_DIGITS] = np.arange(16, dtype=np.uint8)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # bytes -> dtype (a hex digit is 4 bits)


def is_packed(column: pd.Series) -> bool:
    return column.dtype.kind == "u"


def packed(column: pd.Series) -> pd.Series:
    """`column` as unsigned integers when that is lossless (see the module's docstring), else `column` itself."""
    if column.empty or not (column.dtype == object or isinstance(column.dtype, pd.StringDtype)):
        return column
    try:
        strings = pa.array(column.array, from_pandas=True)  # arrow-backed strings: their own buffers, no copy
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return column
    if strings.null_count or not (pa.types.is_string(strings.type) or pa.types.is_large_string(strings.type)):
        return column
    chunks = strings.chunks if isinstance(strings, pa.ChunkedArray) else [strings]
    values = [_packed_chunk(chunk) for chunk in chunks if len(chunk)]
    if any(v is None for v in values) or len({v.dtype for v in values}) != 1:  # type: ignore[union-attr]
        return column
    return pd.Series(np.concatenate(values) if len(values) > 1 else values[0], index=column.index, name=column.name)


def _packed_chunk(chunk: pa.Array) -> np.ndarray | None:
    offset_type = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
    _, offsets_buffer, data_buffer = chunk.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=offset_type)[chunk.offset: chunk.offset + len(chunk) + 1]
    width = int(offsets[1] - offsets[0])
    if width // 2 not in _UNSIGNED or width % 2 or not (np.diff(offsets) == width).all():
        return None
    text = np.frombuffer(data_buffer, dtype=np.uint8)[int(offsets[0]): int(offsets[-1])].reshape(len(chunk), width)
    nibbles = _NIBBLE[text]
    if (nibbles == 255).any():
        return None
    big_endian = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]  # two digits a byte, most significant first
    dtype = _UNSIGNED[width // 2]
    return np.ascontiguousarray(big_endian).view(np.dtype(dtype).newbyteorder(">")).ravel().astype(dtype)


def hex_text(value: object, dtype: np.dtype) -> str:
    """One value of a column as the records spell it (a packed one as zero-padded lowercase hex)."""
    return f"{int(value):0{dtype.itemsize * 2}x}" if dtype.kind == "u" else str(value)  # type: ignore[call-overload]


def unpacked(column: pd.Series) -> pd.Series:
    """`column` as the strings the records hold (a column that is no packed one is returned as it is)."""
    if not is_packed(column):
        return column
    width = column.dtype.itemsize * 2
    big_endian = column.to_numpy().astype(column.dtype.newbyteorder(">")).view(np.uint8).reshape(len(column), -1)
    nibbles = np.empty((len(column), width), dtype=np.uint8)
    nibbles[:, 0::2], nibbles[:, 1::2] = big_endian >> 4, big_endian & 15
    offsets = np.arange(len(column) + 1, dtype=np.int64) * width
    strings = pa.LargeStringArray.from_buffers(len(column), pa.py_buffer(offsets), pa.py_buffer(_DIGITS[nibbles]))
    return strings.to_pandas().set_axis(column.index).rename(column.name)


def alike(reference: pd.Series, candidate: pd.Series) -> bool:
    """Whether two columns compare as the strings they hold as they are: packed alike, or neither packed (otherwise
    unpack both first)."""
    return reference.dtype == candidate.dtype or not (is_packed(reference) or is_packed(candidate))
