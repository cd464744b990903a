"""Fingerprints: exact against an independent reference, and sensitive where XOR hashes are blind."""

from __future__ import annotations

import struct

import pytest
import torch

from taxbench import fingerprint

MASK = (1 << 64) - 1


def _mix_ref(x: int) -> int:
    x &= MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def reference_digest(tensor: torch.Tensor) -> int:
    """Pure-Python digest of the same scheme (int64 lanes in rows, column keys, row keys, wrapping sums)."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    row_bytes = 8 * fingerprint.ROW_LANES
    raw += b"\0" * ((-len(raw)) % row_bytes)
    lanes = struct.unpack(f"<{len(raw) // 8}Q", raw)
    body = 0
    for row in range(len(lanes) // fingerprint.ROW_LANES):
        row_sum = 0
        for col in range(fingerprint.ROW_LANES):
            key = _mix_ref((col + 1) * 0x9E3779B97F4A7C15)
            row_sum += _mix_ref(lanes[row * fingerprint.ROW_LANES + col] ^ key)
        row_key = _mix_ref((row + 1) * 0x94D049BB133111EB)
        body += _mix_ref((row_sum & MASK) ^ row_key)
    header = tensor.numel() * 0x100000001B3 + fingerprint._DTYPE_CODES[str(tensor.dtype)]
    return _mix_ref((body & MASK) ^ (header & MASK))


def digest(tensor: torch.Tensor) -> int:
    return int(fingerprint.tensor_digest(tensor)) & MASK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32])
@pytest.mark.parametrize("numel", [1, 7, 1024, 1500])
def test_digest_matches_reference_implementation(dtype: torch.dtype, numel: int) -> None:
    tensor = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 100).to(dtype)
    assert digest(tensor) == reference_digest(tensor)


def test_permutation_changes_digest_where_xor_hash_is_blind() -> None:
    tensor = torch.arange(4096, dtype=torch.float32)
    permuted = tensor[torch.randperm(4096, generator=torch.Generator().manual_seed(0))]
    assert digest(tensor) != digest(permuted)
    swapped = tensor.clone()
    swapped[[10, 2000]] = swapped[[2000, 10]]  # same row set, different rows
    assert digest(tensor) != digest(swapped)


def test_equal_values_do_not_cancel() -> None:
    assert digest(torch.tensor([1.5, 1.5])) != digest(torch.tensor([2.5, 2.5]))
    assert digest(torch.full((2048,), 3.0)) != digest(torch.zeros(2048))


def test_every_single_bit_flip_is_detected() -> None:
    tensor = torch.randn(300, generator=torch.Generator().manual_seed(1))
    base = digest(tensor)
    bits = tensor.view(torch.int32)
    for index in (0, 150, 299):
        for bit in (0, 13, 31):
            flipped = bits.clone()
            flipped[index] ^= 1 << bit if bit < 31 else -(1 << 31)
            assert digest(flipped.view(torch.float32)) != base


def test_dtype_and_length_are_part_of_the_digest() -> None:
    assert digest(torch.zeros(4, dtype=torch.float32)) != digest(torch.zeros(4, dtype=torch.int32))
    assert digest(torch.zeros(1)) != digest(torch.zeros(2))
    assert digest(torch.zeros(3, 4)) == digest(torch.zeros(12))  # shape is metadata, bytes are what is compared


def test_combine_is_order_sensitive() -> None:
    a, b = fingerprint.tensor_digest(torch.ones(3)), fingerprint.tensor_digest(torch.zeros(3))
    assert int(fingerprint.combine([a, b])) != int(fingerprint.combine([b, a]))


def test_float_bits_are_exact() -> None:
    assert fingerprint.bits_hex(int(fingerprint.float_bits(torch.tensor(1.5))), torch.float32) == "3fc00000"
    assert fingerprint.bits_hex(int(fingerprint.float_bits(torch.tensor(-0.0))), torch.float32) == "80000000"
    nudged = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert fingerprint.bits_hex(int(fingerprint.float_bits(nudged)), torch.float32) == "3f800001"
    one_bf16 = fingerprint.float_bits(torch.tensor(1.0, dtype=torch.bfloat16))
    assert fingerprint.bits_hex(int(one_bf16), torch.bfloat16) == "3f80"
