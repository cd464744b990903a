"""Bitwise fingerprints of tensors, computed in one pass over memory.

torch.hash_tensor is a plain XOR reduction: blind to permutations, equal values cancel, and float32 upcasting keeps
only ~35 useful bits. The digest here (format 2):

- bytes: the tensor's elements in C order (a non-contiguous tensor digests like its contiguous copy, a DTensor like
  this rank's shard), zero-padded to rows of ROW_LANES 64-bit lanes, read little-endian (as x86-64 and aarch64
  hosts and CUDA devices store them);
- body = sum over rows r of mix(row_r ^ mix((r + 1) * M2)), where row_r = sum over columns j of
  mix(lane_rj ^ mix((j + 1) * GOLDEN)) and mix is the splitmix64 finalizer (a bijection). Every lane is keyed by its
  column and every row by its index, so a permutation changes the digest; sums (not XOR) keep equal values from
  cancelling, and one changed lane always changes the body. All sums wrap mod 2**64, and integer addition is
  associative, so no reduction order, thread count or device can change the result;
- digest = mix(body ^ header), header = 64-bit blake2b of "dtype|numel|shape". Low-precision dtypes (float8_e4m3fn,
  float8_e5m2, float8_e8m0fnu) digest their bytes under their own dtype, so equal bytes of two dtypes differ;
- a wrapper subclass carrying scales (torchao Float8/MX tensors; anything with `__tensor_flatten__`) digests every
  inner tensor, data and scales, combined under a header of its class, inner names, dtype and shape.

Three kernels compute it, bit-identical to each other and to the pure-Python reference in the tests:
- "c": host tensors. A 40-line C loop built on first use by the system C compiler (cached per user) and called
  through ctypes once per batch of tensors (a call per tensor cost a step more than the bytes did): it reads each byte
  once, straight from the tensor's memory (unaligned views and odd sizes included), with no temporaries. Unsigned C
  arithmetic pins the wraparound and logical shifts; torch.compile was not used because its integer semantics
  differed from eager on CPU. Chunked eager torch ops were measured too:
  int64 multiplication has no AVX2 instruction and splitmix needs ~11 passes per chunk, about 11x a sum().
- "triton": CUDA tensors. One fused kernel per tensor adds its row values into a device slot with integer atomics
  (exact, so order-independent); digests stay on the device, with no host sync.
- "torch": eager torch ops on chunks of rows with reused buffers; the fallback where neither applies.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Literal

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

try:  # ships with CUDA builds of torch; CPU-only installs use the C or torch kernels
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ROW_LANES = 1024
ROW_BYTES = 8 * ROW_LANES
MASK64 = (1 << 64) - 1
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
GOLDEN = 0x9E3779B97F4A7C15

Kernel = Literal["auto", "c", "triton", "torch"]
# A digest as its kernel returns it: an unsigned 64-bit int when computed on the host, else a 0-d int64 tensor on the
# tensor's device (copied to the host once, by whoever logs it).
Digest = int | torch.Tensor


def signed64(value: int) -> int:
    """An unsigned 64-bit value as the int64 that has its bits (torch multiplies int64 tensors)."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix_int(x: int) -> int:
    """splitmix64 finalizer on one unsigned 64-bit int."""
    x &= MASK64
    x ^= x >> 30
    x = (x * M1) & MASK64
    x ^= x >> 27
    x = (x * M2) & MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 lanes, with wrapping multiplication."""
    x = x ^ _shr(x, 30)
    x = x * signed64(M1)
    x = x ^ _shr(x, 27)
    x = x * signed64(M2)
    return x ^ _shr(x, 31)


def _mix_(x: torch.Tensor, scratch: torch.Tensor) -> None:
    """mix() in place, with one scratch buffer of x's shape: no temporaries."""
    for shift, multiplier in ((30, M1), (27, M2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=scratch)
        scratch.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(scratch)
        if multiplier is not None:
            x.mul_(signed64(multiplier))


@functools.lru_cache(maxsize=1 << 14)
def header(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """64-bit digest of a tensor's dtype, numel and shape."""
    text = f"{dtype}|{math.prod(shape)}|{','.join(map(str, shape))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


_column_keys: dict[torch.device, torch.Tensor] = {}


def _column_key(device: torch.device) -> torch.Tensor:
    if device not in _column_keys:
        columns = torch.arange(1, ROW_LANES + 1, dtype=torch.int64, device=device)
        _column_keys[device] = mix(columns * signed64(GOLDEN))
    return _column_keys[device]


def _row_keys(rows: int, device: torch.device) -> torch.Tensor:
    return mix(torch.arange(1, rows + 1, dtype=torch.int64, device=device) * signed64(M2))


def _as_local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # DTensor: fingerprint this rank's shard
    return to_local() if callable(to_local) else tensor


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with its bytes in C order (conjugate and negative views resolved)."""
    if tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg():
        return tensor
    return tensor.detach().resolve_conj().resolve_neg().contiguous()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return _plain(tensor).detach().reshape(-1).view(torch.uint8)


# -- torch kernel: chunks of rows through reused buffers ----------------------------------------------------------
_CHUNK_ROWS = {"cpu": 32}  # 256 KiB of lanes stays in cache; other devices take large chunks (few launches)
_DEVICE_CHUNK_ROWS = 1 << 11  # 16 MiB per buffer


def _chunk_lanes(piece: torch.Tensor, rows: int) -> torch.Tensor:
    """`piece` (bytes of `rows` rows, possibly short or unaligned) as a (rows, ROW_LANES) int64 view or padded copy."""
    if piece.numel() == rows * ROW_BYTES and piece.storage_offset() % 8 == 0:
        return piece.view(torch.int64).view(rows, ROW_LANES)
    staged = piece.new_zeros(rows * ROW_BYTES)
    staged[: piece.numel()].copy_(piece)
    return staged.view(torch.int64).view(rows, ROW_LANES)


def _torch_body(raw: torch.Tensor) -> torch.Tensor:
    """Body of the bytes `raw` (1-d uint8) as a 0-d int64 tensor on their device."""
    device = raw.device
    rows = -(-raw.numel() // ROW_BYTES)
    if rows == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    chunk = min(rows, _CHUNK_ROWS.get(device.type, _DEVICE_CHUNK_ROWS))
    work = torch.empty((2, chunk, ROW_LANES), dtype=torch.int64, device=device)
    keys = _column_key(device)
    row_sums = torch.empty(rows, dtype=torch.int64, device=device)
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        lanes = _chunk_lanes(raw[start * ROW_BYTES: stop * ROW_BYTES], stop - start)
        values, scratch = work[0, : stop - start], work[1, : stop - start]
        torch.bitwise_xor(lanes, keys, out=values)
        _mix_(values, scratch)
        torch.sum(values, dim=1, out=row_sums[start:stop])
    return mix(row_sums ^ _row_keys(rows, device)).sum()


# -- C kernel: one pass over host memory --------------------------------------------------------------------------
_C_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ROW_LANES 1024
#define M1 0xBF58476D1CE4E5B9ULL
#define M2 0x94D049BB133111EBULL
#define GOLDEN 0x9E3779B97F4A7C15ULL

#if defined(TAXBENCH_CLONES) && defined(__x86_64__)
/* one build serves every x86-64 CPU: the loader picks the widest clone the CPU runs */
#define TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TARGETS
#endif

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= M1;
    x ^= x >> 27;
    x *= M2;
    return x ^ (x >> 31);
}

static inline uint64_t row_sum(const unsigned char *row, const uint64_t *keys) {
    uint64_t sum = 0;
    for (size_t j = 0; j < ROW_LANES; j++) {
        uint64_t lane;
        memcpy(&lane, row + 8 * j, 8); /* any alignment */
        sum += mix(lane ^ keys[j]);
    }
    return sum;
}

/* Body of `nbytes` bytes. The last row is zero-padded: its missing lanes add padding[first missing lane], the
   precomputed suffix sums of mix(keys[j]). */
static inline uint64_t rows_body(const unsigned char *bytes, size_t nbytes, const uint64_t *keys,
                                 const uint64_t *padding) {
    const size_t row_bytes = 8 * ROW_LANES;
    uint64_t body = 0, row = 0;
    for (; nbytes >= row_bytes; bytes += row_bytes, nbytes -= row_bytes) {
        row += 1;
        body += mix(row_sum(bytes, keys) ^ mix(row * M2));
    }
    if (nbytes) {
        size_t lanes = nbytes / 8, rest = nbytes % 8;
        uint64_t sum = 0, lane;
        for (size_t j = 0; j < lanes; j++) {
            memcpy(&lane, bytes + 8 * j, 8);
            sum += mix(lane ^ keys[j]);
        }
        if (rest) {
            lane = 0;
            memcpy(&lane, bytes + 8 * lanes, rest);
            sum += mix(lane ^ keys[lanes]);
            lanes += 1;
        }
        row += 1;
        body += mix((sum + padding[lanes]) ^ mix(row * M2));
    }
    return body;
}

/* Tensors in one call (a step digests ~100 small ones, and a call each cost more than their bytes): out[i] is the
   digest of the i-th, mix(body ^ headers[i]); returns their order-sensitive combination (combined() in Python). */
TARGETS uint64_t taxbench_digests(size_t n, const uint64_t *addresses, const uint64_t *sizes, const uint64_t *headers,
                                  const uint64_t *keys, const uint64_t *padding, uint64_t *out) {
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        out[i] = mix(rows_body((const unsigned char *)(uintptr_t)addresses[i], sizes[i], keys, padding) ^ headers[i]);
        sum += mix(out[i] ^ mix((uint64_t)(i + 1) * GOLDEN));
    }
    return mix(sum);
}
"""
_C_ATTEMPTS = (("-O3", "-DTAXBENCH_CLONES"), ("-O3",))  # without clones where the toolchain lacks them
# (count, addresses, sizes, headers, keys, padding, out): the combination; every pointer an address
_CKernelFn = Callable[[int, int, int, int, int, int, int], int]


def _kernel_cache_dir() -> Path:
    """A per-user cache (builds are reused across processes), else a directory private to this process."""
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "taxbench"
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        if os.access(base, os.W_OK):
            return base
    except (OSError, RuntimeError):  # unwritable, or no home directory
        pass
    return Path(tempfile.mkdtemp(prefix="taxbench-kernel-"))


def _build_c_kernel() -> Path:
    """The kernel's shared library: a cached build if there is one, else built now (and cached)."""
    directory = _kernel_cache_dir()
    targets = {}
    for flags in _C_ATTEMPTS:
        key = hashlib.sha256("\0".join([_C_SOURCE, *flags, platform.machine(), sys.platform]).encode()).hexdigest()
        targets[flags] = directory / f"fingerprint-{key[:16]}.so"
    cached = [target for target in targets.values() if target.exists()]
    if cached:
        return cached[0]
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or "cc"]
    error = ""
    for flags, target in targets.items():
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            source, built = Path(tmp) / "fingerprint.c", Path(tmp) / target.name
            source.write_text(_C_SOURCE)
            result = subprocess.run([*compiler, *flags, "-shared", "-fPIC", "-o", str(built), str(source)],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                os.replace(built, target)  # atomic: concurrent ranks may build the same file
                return target
            error = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
    raise OSError(f"{' '.join(compiler)} failed: {error}")


@functools.cache
def c_kernel() -> _CKernelFn | None:
    """The compiled host kernel, or None (with one warning) where no C compiler can build it."""
    try:
        library = ctypes.CDLL(str(_build_c_kernel()))
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"taxbench: the C fingerprint kernel is unavailable ({exc}); host fingerprints use the slower "
                      "torch kernel (same digests). Install a C compiler (cc) or set CC to one.",
                      RuntimeWarning, stacklevel=2)
        return None
    function = library.taxbench_digests
    function.restype = ctypes.c_uint64
    function.argtypes = [ctypes.c_size_t, *[ctypes.c_void_p] * 6]
    return function


@functools.cache
def _host_tables() -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """The column keys, their padding suffix sums (ROW_LANES + 1 entries, the last 0) and both addresses."""
    keys = _column_key(torch.device("cpu"))
    suffix = mix(keys).flip(0).cumsum(0).flip(0)  # wrapping int64 sums
    padding = torch.cat([suffix, suffix.new_zeros(1)])
    return keys, padding, (keys.data_ptr(), padding.data_ptr())


def _host_digests(kernel: _CKernelFn, tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Each host tensor's digest and their combination (combined()), in one call that releases the GIL."""
    plain = [_plain(t) for t in tensors]  # held until the call returns: a copy's memory must outlive it
    addresses = array.array("Q", [t.data_ptr() for t in plain])
    sizes = array.array("Q", [t.nbytes for t in plain])
    headers = array.array("Q", [header(t.dtype, t.shape) for t in tensors])
    out = array.array("Q", bytes(8 * len(tensors)))
    _, _, (keys, padding) = _host_tables()
    total = kernel(len(tensors), addresses.buffer_info()[0], sizes.buffer_info()[0], headers.buffer_info()[0], keys,
                   padding, out.buffer_info()[0])
    return out.tolist(), total


# -- Triton kernel: fused rows on the device ----------------------------------------------------------------------
_TRITON_ROWS = 4  # rows per program

if triton is not None:

    @triton.jit
    def _mix_lanes(x):
        x ^= x >> 30
        x *= 0xBF58476D1CE4E5B9
        x ^= x >> 27
        x *= 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _rows_kernel(lanes, n_lanes, bodies, slot, ROWS: tl.constexpr, LANES: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        columns = tl.arange(0, LANES)
        index = rows[:, None] * LANES + columns[None, :]
        x = tl.load(lanes + index, mask=index < n_lanes, other=0).to(tl.uint64, bitcast=True)
        keys = _mix_lanes((columns + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        sums = tl.sum(_mix_lanes(x ^ keys[None, :]), axis=1)
        values = _mix_lanes(sums ^ _mix_lanes((rows + 1).to(tl.uint64) * 0x94D049BB133111EB))
        values = tl.where(rows * LANES < n_lanes, values, 0)  # rows past the end are absent, not zero
        tl.atomic_add(bodies + slot, tl.sum(values, axis=0).to(tl.int64, bitcast=True))


def _lanes(raw: torch.Tensor) -> torch.Tensor:
    """The bytes as int64 lanes: a view when aligned, else a zero-padded copy (odd sizes, unaligned views)."""
    if raw.numel() % 8 == 0 and raw.storage_offset() % 8 == 0 and raw.data_ptr() % 8 == 0:
        return raw.view(torch.int64)
    padded = raw.new_zeros(-(-raw.numel() // 8) * 8)
    padded[: raw.numel()].copy_(raw)
    return padded.view(torch.int64)


def _triton_bodies(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("fingerprint kernel 'triton' needs the triton package (it ships with CUDA builds of torch)")
    bodies = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        for slot, tensor in enumerate(tensors):
            lanes = _lanes(_bytes(tensor))
            if lanes.numel():
                grid = (triton.cdiv(lanes.numel(), _TRITON_ROWS * ROW_LANES),)
                _rows_kernel[grid](lanes, lanes.numel(), bodies, slot, ROWS=_TRITON_ROWS, LANES=ROW_LANES)
    return bodies


def _small_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device`, copied without a host sync on CUDA (pinned, non-blocking)."""
    host = torch.tensor([signed64(v) for v in values], dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _device_digests(tensors: Sequence[torch.Tensor], device: torch.device, kernel: Kernel) -> torch.Tensor:
    """Digests of tensors that live on `device`, as one int64 vector there."""
    if kernel == "triton":
        bodies = _triton_bodies(tensors, device)
    else:
        bodies = torch.stack([_torch_body(_bytes(t)) for t in tensors])
    headers = [header(t.dtype, tuple(t.shape)) for t in tensors]
    return mix(bodies ^ (signed64(headers[0]) if len(headers) == 1 else _small_tensor(headers, device)))


# -- public API ---------------------------------------------------------------------------------------------------
def kernel_for(device: torch.device, kernel: Kernel = "auto") -> Kernel:
    """The kernel that digests tensors on `device`: an explicit choice is checked, "auto" takes the fastest."""
    if kernel == "auto":
        if device.type == "cpu":
            return "c" if c_kernel() is not None else "torch"
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    if kernel == "c" and device.type != "cpu":
        raise ValueError(f"fingerprint kernel 'c' digests host tensors; got a tensor on {device} (use auto)")
    if kernel == "c" and c_kernel() is None:
        raise RuntimeError("fingerprint kernel 'c' needs a C compiler (cc, or set CC); use kernel auto or torch")
    if kernel not in ("c", "triton", "torch"):
        raise ValueError(f"fingerprint kernel={kernel!r}; expected auto, c, triton or torch")
    return kernel


@functools.lru_cache(maxsize=1 << 10)
def _subclass_header(kind: str, inner: tuple[str, ...], dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    text = f"{kind}|{','.join(inner)}|{header(dtype, shape)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _subclass_digest(tensor: torch.Tensor, kernel: Kernel) -> Digest:
    """A wrapper subclass that keeps its values in inner tensors (torchao's Float8TrainingTensor: data and scale; MX
    formats: qdata and per-block scales): every inner tensor (`__tensor_flatten__`, in its order) combined, keyed by
    the subclass, the inner names and the outer dtype and shape: a changed scale changes the digest as a changed data
    byte does."""
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    body = combined(digests([getattr(tensor, name) for name in names], kernel))
    key = _subclass_header(type(tensor).__qualname__, tuple(names), tensor.dtype, tuple(tensor.shape))
    return mix_int(body ^ key) if isinstance(body, int) else mix(body ^ signed64(key))


def digests(tensors: Iterable[torch.Tensor], kernel: Kernel = "auto") -> list[Digest]:
    """Each tensor's digest: an int for host tensors, a 0-d int64 tensor on the device otherwise (no host sync).
    Wrapper subclasses that carry scales digest their inner tensors (see _subclass_digest)."""
    return _digests_and_combination(tensors, kernel)[0]


def _digests_and_combination(tensors: Iterable[torch.Tensor], kernel: Kernel) -> tuple[list[Digest], int | None]:
    """digests(), and their combination when every tensor was digested on the host in one call (else None)."""
    local = [_as_local(t) for t in tensors]
    if any(is_traceable_wrapper_subclass(t) for t in local):
        return [_subclass_digest(t, kernel) if is_traceable_wrapper_subclass(t) else digests([t], kernel)[0]
                for t in local], None
    out: list[Digest] = [0] * len(local)
    chosen_for: dict[torch.device, Kernel] = {}
    groups: dict[tuple[torch.device, Kernel], list[int]] = {}
    for index, tensor in enumerate(local):
        device = tensor.device
        chosen = chosen_for.get(device) or chosen_for.setdefault(device, kernel_for(device, kernel))
        groups.setdefault((device, chosen), []).append(index)
    combination = None
    for (device, chosen), indices in groups.items():
        if chosen == "c":
            host_kernel = c_kernel()
            assert host_kernel is not None
            values, total = _host_digests(host_kernel, [local[i] for i in indices])
            combination = total if len(indices) == len(local) else None
        else:
            values = _device_digests([local[i] for i in indices], device, chosen)
        for position, index in enumerate(indices):
            out[index] = values[position]
    return out, combination


def combined(values: Sequence[Digest]) -> Digest:
    """Order-sensitive combination: the k-th digest is mixed with k before summing (on a device if any is there)."""
    host = [v for v in values if isinstance(v, int)]
    if len(host) == len(values):
        return mix_int(sum(mix_int(v ^ mix_int(k * GOLDEN)) for k, v in enumerate(host, start=1)))
    on_devices = [v for v in values if isinstance(v, torch.Tensor)]
    device = next((v.device for v in on_devices if v.device.type != "cpu"), on_devices[0].device)
    stacked = torch.stack([v.to(device, non_blocking=True) if isinstance(v, torch.Tensor)
                           else _small_tensor([v], device)[0] for v in values])
    positions = torch.arange(1, stacked.numel() + 1, dtype=torch.int64, device=device)
    return mix(mix(stacked ^ mix(positions * signed64(GOLDEN))).sum())


def as_tensor(digest: Digest) -> torch.Tensor:
    """A digest as a 0-d int64 tensor (host ints become CPU tensors)."""
    return digest if isinstance(digest, torch.Tensor) else torch.tensor(signed64(digest), dtype=torch.int64)


def tensor_digest(tensor: torch.Tensor, kernel: Kernel = "auto") -> torch.Tensor:
    """0-d int64 tensor on the tensor's device: digest of its bytes, dtype, numel and shape."""
    return as_tensor(digests([tensor], kernel)[0])


def combine(values: Iterable[torch.Tensor]) -> torch.Tensor:
    """Order-sensitive combination of digest tensors."""
    return as_tensor(combined(list(values)))


def collection_digest(tensors: Iterable[torch.Tensor], kernel: Kernel = "auto") -> Digest | None:
    """Digest of an ordered collection of tensors (None when it is empty): an int when every tensor is on the host,
    else a 0-d int64 tensor on a device."""
    values, combination = _digests_and_combination(tensors, kernel)
    if not values:
        return None
    return combination if combination is not None else combined(values)


def tensors_digest(tensors: Iterable[torch.Tensor], kernel: Kernel = "auto") -> torch.Tensor | None:
    """collection_digest as a 0-d int64 tensor (None when the collection is empty)."""
    found = collection_digest(tensors, kernel)
    return None if found is None else as_tensor(found)


def to_hex(digest: int) -> str:
    return f"{digest & MASK64:016x}"


_FLOAT_AS_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                 torch.bfloat16: torch.int16}


def float_bits(value: torch.Tensor) -> Digest:
    """Exact bit pattern of a scalar float tensor, zero-extended: an int for a host tensor, a 0-d int64 tensor on
    the device otherwise (no sync)."""
    value = value.detach().reshape(1)
    width = value.element_size() * 8
    as_int = value.view(_FLOAT_AS_INT[value.dtype])
    if value.device.type == "cpu":
        return int(as_int.item()) & ((1 << width) - 1)
    bits = as_int.to(torch.int64)
    return (bits & ((1 << width) - 1) if width < 64 else bits).reshape(())


def bits_hex(bits: int, dtype: torch.dtype) -> str:
    width = torch.finfo(dtype).bits
    return f"{bits & ((1 << width) - 1):0{width // 4}x}"
