"""Fingerprints: every kernel bit-identical to an independent pure-Python reference and to pinned values, on every
dtype and layout, and sensitive where XOR hashes are blind."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from taxbench import fingerprint
from taxbench.config.schema import Device
from taxbench.parallel import distributed

MASK = (1 << 64) - 1
ROW_LANES = 1024
KERNELS = ["c", "torch"]  # the host kernels; triton is checked in its interpreter below and on CUDA in test_gpu.py


def _mix_ref(x: int) -> int:
    x &= MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _bytes_ref(tensor: torch.Tensor) -> bytes:
    return tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def reference_digest(tensor: torch.Tensor) -> int:
    """The format spelled out in plain Python: zero-padded rows of little-endian 64-bit lanes, each lane keyed by its
    column, each row sum keyed by its row index, wrapping sums, then the dtype|numel|shape header."""
    raw = _bytes_ref(tensor)
    raw += b"\0" * ((-len(raw)) % (8 * ROW_LANES))
    lanes = struct.unpack(f"<{len(raw) // 8}Q", raw)
    column_keys = [_mix_ref((col + 1) * 0x9E3779B97F4A7C15) for col in range(ROW_LANES)]
    body = 0
    for row in range(len(lanes) // ROW_LANES):
        row_sum = sum(_mix_ref(lanes[row * ROW_LANES + col] ^ column_keys[col]) for col in range(ROW_LANES))
        body += _mix_ref((row_sum & MASK) ^ _mix_ref((row + 1) * 0x94D049BB133111EB))
    shape = tuple(tensor.shape)
    text = f"{tensor.dtype}|{tensor.numel()}|{','.join(str(size) for size in shape)}"
    header = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return _mix_ref((body & MASK) ^ header)


def digest(tensor: torch.Tensor, kernel: fingerprint.Kernel = "auto") -> int:
    return int(fingerprint.tensor_digest(tensor, kernel)) & MASK


def _sample(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 7919 + numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=generator) > 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        high = 256 if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else 1 << 7
        return torch.randint(0, high, (numel,), generator=generator).to(dtype)
    if dtype is getattr(torch, "float8_e8m0fnu", None):  # powers of two only, no sign
        return (2.0 ** torch.randint(-20, 20, (numel,), generator=generator).float()).to(dtype)
    return (torch.randn(numel, generator=generator) * 100).to(dtype)


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2] + [d for d in [getattr(torch, "float8_e8m0fnu", None)] if d]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, *FLOAT8,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.bool, torch.complex64]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 7, 1024, 2053])
def test_every_host_kernel_matches_the_reference(kernel: fingerprint.Kernel, dtype: torch.dtype, numel: int) -> None:
    tensor = _sample(dtype, numel)
    assert digest(tensor, kernel) == reference_digest(tensor)


PINNED = {  # name: (tensor, its digest); a changed value changes every stored digest: bump the schema versions
    "arange10_f32": (lambda: torch.arange(10, dtype=torch.float32), "6089b75c858f7446"),
    "arange12_i64_3x4": (lambda: torch.arange(12).reshape(3, 4), "b57c9b7bb66befb3"),
    "bytes3000_u8": (lambda: (torch.arange(3000) % 251).to(torch.uint8), "2bf2b178d9c60787"),
    "arange9_bf16": (lambda: torch.arange(9, dtype=torch.bfloat16), "d555f3636b1163cf"),
    "arange16_fp8": (lambda: torch.arange(16, dtype=torch.float32).to(torch.float8_e4m3fn), "6c9088c3bac22f2a"),
    "arange16_fp8_e5m2": (lambda: torch.arange(16, dtype=torch.float32).to(torch.float8_e5m2), "46423986f119c395"),
    "bools": (lambda: torch.tensor([True, False, True]), "4d1e4970043f8c36"),
    "scalar_f16": (lambda: torch.tensor(1.5, dtype=torch.float16), "6c36b152d439c7e3"),
    "empty_0x3": (lambda: torch.zeros(0, 3), "28783d15a32b21ee"),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned_reference_values(name: str) -> None:
    make, expected = PINNED[name]
    tensor = make()
    assert fingerprint.to_hex(reference_digest(tensor)) == expected
    for kernel in KERNELS:
        assert fingerprint.to_hex(digest(tensor, kernel)) == expected, kernel


def _layouts(device: str = "cpu") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(view, its contiguous copy) for views whose bytes are not a plain aligned block."""
    base = torch.randn(4099, generator=torch.Generator().manual_seed(3)).to(device)
    matrix = torch.randn(37, 301, generator=torch.Generator().manual_seed(4)).to(device)
    halves = torch.randn(5000, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
    complex_values = torch.randn(300, dtype=torch.complex64, generator=torch.Generator().manual_seed(6)).to(device)
    views = {
        "bytes_at_offset_3": base.view(torch.uint8)[3:3 + 9001],
        "bf16_at_offset_1": halves[1:4098],
        "transposed": matrix.t(),
        "strided": base[::3],
        "expanded": base[:5].expand(700, 5),
        "column": matrix[:, 7],
        "conjugated": complex_values.conj(),
        "negative_view": torch._neg_view(base[:100]),
    }
    return {name: (view, view.clone(memory_format=torch.contiguous_format).resolve_conj().resolve_neg())
            for name, view in views.items()}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_views_digest_like_their_contiguous_copies(kernel: fingerprint.Kernel, layout: str) -> None:
    view, copy = _layouts()[layout]
    assert digest(view, kernel) == digest(copy, kernel) == reference_digest(copy)


def test_large_tensors_match_the_torch_kernel() -> None:
    tensor = torch.randn((17 << 18) + 5, generator=torch.Generator().manual_seed(8))  # 17 MiB and an odd tail
    assert digest(tensor, "c") == digest(tensor, "torch")


def test_permutation_changes_digest_where_xor_hash_is_blind() -> None:
    tensor = torch.arange(4096, dtype=torch.float32)
    permuted = tensor[torch.randperm(4096, generator=torch.Generator().manual_seed(0))]
    assert digest(tensor) != digest(permuted)
    swapped = tensor.clone()
    swapped[[10, 2000]] = swapped[[2000, 10]]  # same row set, different rows
    assert digest(tensor) != digest(swapped)
    halves = torch.zeros(4, dtype=torch.float32)
    halves[1] = -0.0  # lane 0 = 0x80000000_00000000, which multiplicative keys could not place
    assert digest(halves) != digest(halves.roll(2))


def test_equal_values_do_not_cancel() -> None:
    assert digest(torch.tensor([1.5, 1.5])) != digest(torch.tensor([2.5, 2.5]))
    assert digest(torch.full((2048,), 3.0)) != digest(torch.zeros(2048))


def test_every_single_bit_flip_is_detected() -> None:
    tensor = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    base = digest(tensor)
    bits = tensor.view(torch.int32)
    for index in (0, 1, 150, 2047, 2999):
        for bit in (0, 13, 31):
            flipped = bits.clone()
            flipped[index] ^= 1 << bit if bit < 31 else -(1 << 31)
            assert digest(flipped.view(torch.float32)) != base


def test_two_sign_flips_in_one_row_do_not_cancel() -> None:
    tensor = torch.randn(2048, generator=torch.Generator().manual_seed(2))
    seen = {digest(tensor)}
    for first, second in ((1, 3), (5, 1023), (0, 2047), (100, 101)):
        flipped = tensor.clone()
        flipped[[first, second]] *= -1
        seen.add(digest(flipped))
    assert len(seen) == 5


def test_dtype_numel_and_shape_are_part_of_the_digest() -> None:
    assert digest(torch.zeros(4, dtype=torch.float32)) != digest(torch.zeros(4, dtype=torch.int32))
    assert digest(torch.zeros(4, dtype=torch.float8_e4m3fn)) != digest(torch.zeros(4, dtype=torch.float8_e5m2))
    assert digest(torch.zeros(1)) != digest(torch.zeros(2))
    assert digest(torch.zeros(3, 4)) != digest(torch.zeros(12)) != digest(torch.zeros(4, 3))
    assert digest(torch.zeros(())) != digest(torch.zeros(1))
    assert digest(torch.zeros(0, 3)) != digest(torch.zeros(3, 0))


def test_combine_is_order_sensitive_and_agrees_across_host_and_tensor_paths() -> None:
    a, b = fingerprint.tensor_digest(torch.ones(3)), fingerprint.tensor_digest(torch.zeros(3))
    assert int(fingerprint.combine([a, b])) != int(fingerprint.combine([b, a]))
    # one host call digests them all: views (a transposed copy, an unaligned slice) ride in the batch too
    tensors = [torch.ones(3), torch.arange(5000.0), torch.zeros(2, 2), torch.arange(5000.0).view(50, 100).t(),
               torch.arange(100, dtype=torch.uint8)[3:50]]
    host = fingerprint.tensors_digest(tensors, kernel="c")
    eager = fingerprint.tensors_digest(tensors, kernel="torch")
    assert host is not None and eager is not None and int(host) == int(eager)
    mixed = fingerprint.combined([fingerprint.digests(tensors[:1], "c")[0], *fingerprint.digests(tensors[1:], "torch")])
    assert isinstance(mixed, torch.Tensor) and int(mixed) == int(host)
    assert fingerprint.tensors_digest([]) is None


@pytest.mark.slow
def test_c_kernel_is_built_once_per_cache_and_its_absence_falls_back_to_torch(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import json, warnings, torch
        from taxbench import fingerprint
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel = fingerprint.kernel_for(torch.device("cpu"))
        tensor = torch.arange(5000, dtype=torch.float32)
        print(json.dumps({"kernel": kernel, "digest": fingerprint.to_hex(int(fingerprint.tensor_digest(tensor))),
                          "warnings": [str(w.message) for w in caught]}))
    """)

    def run(**env: str) -> dict:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env})
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    expected = fingerprint.to_hex(reference_digest(torch.arange(5000, dtype=torch.float32)))
    built = run()
    assert built == {"kernel": "c", "digest": expected, "warnings": []}
    assert len(list((tmp_path / "cache" / "taxbench").glob("fingerprint-*.so"))) == 1
    assert run(CC="false") == built  # the cached build serves; no compiler is needed again
    for path in (tmp_path / "cache" / "taxbench").glob("*.so"):
        path.unlink()
    missing = run(CC="false")
    assert missing["kernel"] == "torch" and missing["digest"] == expected
    assert len(missing["warnings"]) == 1 and "C fingerprint kernel is unavailable" in missing["warnings"][0]


def _triton_cases() -> list[torch.Tensor]:
    return [_sample(dtype, numel) for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int64)
            for numel in (0, 1, 1027, 5003)] + [view for view, _ in _layouts().values()]


@pytest.mark.slow
def test_triton_kernel_matches_the_reference_in_its_interpreter() -> None:
    """The CUDA kernel's code run by Triton's CPU interpreter (where triton is installed; CUDA: tests/test_gpu.py)."""
    pytest.importorskip("triton")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_fingerprint import _triton_cases
        from taxbench import fingerprint
        tensors = _triton_cases()
        singles = [fingerprint.to_hex(int(fingerprint.tensor_digest(t, kernel="triton"))) for t in tensors]
        batch = fingerprint.to_hex(int(fingerprint.tensors_digest(tensors, kernel="triton")))
        print(json.dumps({{"singles": singles, "batch": batch}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    tensors = _triton_cases()
    assert out["singles"] == [fingerprint.to_hex(reference_digest(t)) for t in tensors]
    host = fingerprint.tensors_digest(tensors, kernel="c")
    assert host is not None and out["batch"] == fingerprint.to_hex(int(host))


def _dtensor_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    distributed.init(rank, world, rank, Device.cpu, "127.0.0.1", port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(7 * 1029, dtype=torch.float32).reshape(7, 1029).bfloat16()
        results = []
        for placement in (Shard(0), Shard(1)):
            shard = distribute_tensor(full, mesh, [placement])
            results.append({"local": shard.to_local().clone(), "auto": digest(shard), "torch": digest(shard, "torch"),
                            "group": int(fingerprint.tensors_digest([shard, full])) & MASK})
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        distributed.shutdown()


@pytest.mark.slow
def test_dtensor_shards_digest_like_their_local_tensors(tmp_path: Path) -> None:
    world = 2
    mp.start_processes(_dtensor_worker, args=(world, distributed.free_port(), str(tmp_path)), nprocs=world,
                       join=True, start_method="spawn")
    full = torch.arange(7 * 1029, dtype=torch.float32).reshape(7, 1029).bfloat16()
    locals_seen = set()
    for rank in range(world):
        for result in torch.load(tmp_path / f"rank{rank}.pt"):
            local = result["local"]
            expected = reference_digest(local)
            assert result["auto"] == result["torch"] == expected
            assert result["group"] == fingerprint.combined([expected, digest(full)])
            locals_seen.add(expected)
    assert len(locals_seen) == 4  # each rank's shard is its own bytes, under both placements


def test_float_bits_are_exact() -> None:
    assert fingerprint.bits_hex(int(fingerprint.float_bits(torch.tensor(1.5))), torch.float32) == "3fc00000"
    assert fingerprint.bits_hex(int(fingerprint.float_bits(torch.tensor(-0.0))), torch.float32) == "80000000"
    nudged = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert fingerprint.bits_hex(int(fingerprint.float_bits(nudged)), torch.float32) == "3f800001"
    one_bf16 = fingerprint.float_bits(torch.tensor(1.0, dtype=torch.bfloat16))
    assert fingerprint.bits_hex(int(one_bf16), torch.bfloat16) == "3f80"


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="this torch has no float8_e8m0fnu")
def test_e8m0_scales_are_pinned() -> None:
    scales = (2.0 ** torch.arange(-8, 8, dtype=torch.float32)).to(torch.float8_e8m0fnu)
    assert fingerprint.to_hex(digest(scales)) == "d6a2c7ea3651e238" == fingerprint.to_hex(reference_digest(scales))


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_same_bytes_in_two_float8_dtypes_digest_differently(kernel: fingerprint.Kernel) -> None:
    raw = (torch.arange(64) % 120).to(torch.uint8)
    found = {dtype: digest(raw.view(dtype), kernel) for dtype in FLOAT8}
    assert len(set(found.values())) == len(FLOAT8)
    assert digest(raw, kernel) not in found.values()


class ScaledTensor(torch.Tensor):
    """The smallest wrapper subclass that carries scales, as torchao's Float8/MX tensors do: float8 data and a float32
    scale per row, exposed through __tensor_flatten__."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor) -> ScaledTensor:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        self._data, self._scale = data, scale

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, object]]:
        return ["_data", "_scale"], {}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):  # type: ignore[no-untyped-def]
        return ScaledTensor(inner["_data"], inner["_scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError(f"{func} on ScaledTensor: a digest must read the inner tensors only")


def _scaled(scale_row0: float = 0.5) -> ScaledTensor:
    data = (torch.arange(32, dtype=torch.float32).reshape(4, 8) / 4).to(torch.float8_e4m3fn)
    scale = torch.tensor([scale_row0, 1.0, 2.0, 4.0])
    return ScaledTensor(data, scale)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_scaled_subclass_digests_its_data_and_its_scales(kernel: fingerprint.Kernel) -> None:
    base = digest(_scaled(), kernel)
    assert digest(_scaled(), kernel) == base  # reproducible
    assert digest(_scaled(scale_row0=0.25), kernel) != base  # one scale changed
    flipped = _scaled()
    flipped._data.view(torch.uint8)[3, 5] ^= 1
    assert digest(flipped, kernel) != base  # one data bit changed
    plain = _scaled()
    assert base not in (digest(plain._data, kernel), digest(plain._scale, kernel))
    assert fingerprint.tensors_digest([_scaled(), torch.ones(2)], kernel) is not None  # mixed with plain tensors


def test_torchao_float8_and_mx_tensors_digest_their_scales() -> None:
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    values = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    float8 = [hp_tensor_and_scale_to_float8(values, torch.tensor(scale), torch.float8_e4m3fn) for scale in (2.0, 4.0)]
    assert digest(float8[0]) != digest(float8[1])
    assert digest(float8[0]) == digest(hp_tensor_and_scale_to_float8(values, torch.tensor(2.0), torch.float8_e4m3fn))
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
    except ImportError:
        return
    mx = MXTensor.to_mx(values, torch.float8_e4m3fn, 32)
    before = digest(mx)
    mx.scale.view(torch.uint8)[0] += 1
    assert digest(mx) != before
