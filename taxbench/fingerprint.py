"""Bitwise fingerprints of tensors.

torch.hash_tensor is a plain XOR reduction: blind to permutations, equal values cancel, and float32 upcasting keeps
only ~35 useful bits. Here the raw bytes are viewed as int64 lanes laid out in rows; every lane is mixed with its
column key, each row digest is mixed with its row index, and rows are combined by wrapping int64 addition. Integer
addition is associative, so the result does not depend on reduction order or device: CPU and CUDA give the same
digest for the same bytes. Digests stay on the tensor's device (no host sync); callers copy them when they log.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

ROW_LANES = 1024
_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(sorted(str(d) for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)))}


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 lanes, with wrapping multiplication."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


_column_keys: dict[torch.device, torch.Tensor] = {}


def _column_key(device: torch.device) -> torch.Tensor:
    if device not in _column_keys:
        lanes = torch.arange(1, ROW_LANES + 1, dtype=torch.int64, device=device) * _GOLDEN
        _column_keys[device] = mix(lanes)
    return _column_keys[device]


def _as_local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # DTensor: fingerprint this rank's shard
    return to_local() if callable(to_local) else tensor


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """0-d int64 tensor on the tensor's device: digest of its bytes, dtype and numel."""
    tensor = _as_local(tensor).detach()
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % (8 * ROW_LANES)
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    elif raw.storage_offset() % 8:  # a view starting mid-lane cannot be reinterpreted as int64 in place
        raw = raw.clone()
    lanes = raw.view(torch.int64).view(-1, ROW_LANES)
    rows = (mix(lanes ^ _column_key(lanes.device)).sum(dim=1))
    row_keys = mix(torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=rows.device) * _M2)
    body = mix(rows ^ row_keys).sum()
    header = _signed(tensor.numel() * 0x100000001B3 + _DTYPE_CODES.get(str(tensor.dtype), 0))
    return mix(body ^ header)


def combine(digests: Iterable[torch.Tensor]) -> torch.Tensor:
    """Order-sensitive combination of digests: the k-th digest is mixed with k before summing."""
    digests = list(digests)
    device = next((d.device for d in digests if d.device.type != "cpu"), digests[0].device)
    stacked = torch.stack([d.to(device, non_blocking=True) for d in digests])
    keys = mix(torch.arange(1, stacked.numel() + 1, dtype=torch.int64, device=stacked.device) * _GOLDEN)
    return mix(mix(stacked ^ keys).sum())


def tensors_digest(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Digest of an ordered collection of tensors (None when it is empty)."""
    digests = [tensor_digest(t) for t in tensors]
    return combine(digests) if digests else None


def to_hex(digest: int) -> str:
    return f"{digest & _MASK64:016x}"


_FLOAT_AS_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                 torch.bfloat16: torch.int16}


def float_bits(value: torch.Tensor) -> torch.Tensor:
    """Exact bit pattern of a scalar float tensor as a 0-d int64 tensor on its device (zero-extended, no sync)."""
    value = value.detach().reshape(1)
    width = value.element_size() * 8
    bits = value.view(_FLOAT_AS_INT[value.dtype]).to(torch.int64)
    return (bits & ((1 << width) - 1) if width < 64 else bits).reshape(())


def bits_hex(bits: int, dtype: torch.dtype) -> str:
    width = torch.finfo(dtype).bits
    return f"{bits & ((1 << width) - 1):0{width // 4}x}"
