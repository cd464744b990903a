"""The token-shard format on disk: a folder of 1-D `.npy` token arrays plus `index.json`, and its validation.

    <dir>/index.json        {"format": "taxbench-token-shards", "version": 1, "dtype": "uint16", "tokenizer": "bytes",
                             "vocab_size": 256, "max_token": 255, "total_tokens": N,
                             "shards": [{"file": "shard-00000.npy", "tokens": n0, "sha256": "..."}, ...]}
    <dir>/shard-00000.npy   numpy .npy, dtype uint16 or uint32, shape (n0,)

The index is written last, so a folder without one is an unfinished build. Shards are opened memory-mapped; opening
checks every file's header (exists, parses, dtype and length match the index) and names the file on any mismatch.
Content checksums are recorded at build time and verified on request (`verify_checksums`), since hashing a large
corpus on every start would cost minutes.

Sample i of a stream with sequence length S is the window tokens[i*S : i*S + S + 1] of the concatenated shards
(inputs are its first S tokens, targets its last S), so consecutive samples share one boundary token and a sample may
span two shards.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "taxbench-token-shards"
VERSION = 1
INDEX_FILE = "index.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class ShardError(ValueError):
    """A token-shard folder is missing, corrupt or unusable; the message names the file and the fix."""


@dataclass(frozen=True)
class ShardEntry:
    file: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class ShardIndex:
    dtype: str
    tokenizer: str
    vocab_size: int
    max_token: int
    total_tokens: int
    shards: tuple[ShardEntry, ...]

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["shards"] = [asdict(s) for s in self.shards]
        return {"format": FORMAT, "version": VERSION, **body}


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_index(directory: Path, index: ShardIndex) -> Path:
    """Write index.json atomically: it is the commit point of a build."""
    path = directory / INDEX_FILE
    tmp = path.with_name(INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index.to_json(), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def read_index(directory: Path) -> ShardIndex:
    path = Path(directory) / INDEX_FILE
    if not Path(directory).is_dir():
        raise ShardError(f"token-shard folder {directory} does not exist; build one with "
                         f"`taxbench build-shards TEXT_FILE {directory}`")
    if not path.is_file():
        raise ShardError(f"{path} is missing: {directory} is not a finished token-shard folder; build one with "
                         f"`taxbench build-shards TEXT_FILE {directory}`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise ShardError(f"{path} is not a {FORMAT} v{VERSION} index (format={raw.get('format')!r}, "
                             f"version={raw.get('version')!r}); rebuild the folder with `taxbench build-shards`")
        shards = tuple(ShardEntry(str(s["file"]), int(s["tokens"]), str(s["sha256"])) for s in raw["shards"])
        index = ShardIndex(str(raw["dtype"]), str(raw["tokenizer"]), int(raw["vocab_size"]), int(raw["max_token"]),
                           int(raw["total_tokens"]), shards)
    except ShardError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ShardError(f"{path} is corrupt ({type(exc).__name__}: {exc}); rebuild the folder with "
                         "`taxbench build-shards`") from exc
    if index.dtype not in DTYPES:
        raise ShardError(f"{path} has dtype={index.dtype!r}; supported: {sorted(DTYPES)}")
    if not index.shards:
        raise ShardError(f"{path} lists no shards; rebuild the folder from a non-empty text file")
    if sum(s.tokens for s in index.shards) != index.total_tokens:
        raise ShardError(f"{path} is inconsistent: total_tokens={index.total_tokens} but its shards hold "
                         f"{sum(s.tokens for s in index.shards)}; rebuild the folder")
    return index


def index_digest(directory: Path) -> str:
    """Identity of a dataset, stored in reader state so that a checkpoint cannot resume onto other data."""
    return hashlib.sha256((Path(directory) / INDEX_FILE).read_bytes()).hexdigest()[:16]


def _open_shard(path: Path, entry: ShardEntry, dtype: str) -> np.memmap:
    if not path.is_file():
        raise ShardError(f"shard {path} listed in {path.parent / INDEX_FILE} is missing; restore it or rebuild "
                         "the folder with `taxbench build-shards`")
    try:
        with path.open("rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ValueError(f"unsupported .npy version {version}")
            shape, fortran, file_dtype = read_header[version](handle)
    except (ValueError, OSError, SyntaxError) as exc:
        raise ShardError(f"shard {path} is corrupt: its .npy header does not parse ({exc}); rebuild the folder "
                         "with `taxbench build-shards`") from exc
    if np.dtype(file_dtype) != np.dtype(DTYPES[dtype]):
        raise ShardError(f"shard {path} holds {np.dtype(file_dtype).name} tokens but {path.parent / INDEX_FILE} "
                         f"says dtype={dtype}; the index and the shard disagree, rebuild the folder")
    if len(shape) != 1 or shape[0] != entry.tokens:
        raise ShardError(f"shard {path} has shape {shape} but {path.parent / INDEX_FILE} lists {entry.tokens} "
                         "tokens; rebuild the folder")
    try:
        array = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as exc:
        size = path.stat().st_size
        raise ShardError(f"shard {path} is truncated or corrupt ({size} bytes on disk for {entry.tokens} "
                         f"{dtype} tokens: {exc}); restore it or rebuild the folder") from exc
    if fortran or array.shape != (entry.tokens,):
        raise ShardError(f"shard {path} does not hold a flat array of {entry.tokens} tokens; rebuild the folder")
    return array


class TokenShards:
    """A validated, memory-mapped token-shard folder, read by global token offset or by sample."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.index = read_index(self.directory)
        self.digest = index_digest(self.directory)
        self.dtype = np.dtype(DTYPES[self.index.dtype])
        counts = np.array([s.tokens for s in self.index.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])  # starts[k] = first global offset of shard k
        self._arrays: list[np.memmap] | None = self._open()

    def _open(self) -> list[np.memmap]:
        return [_open_shard(self.directory / s.file, s, self.index.dtype) for s in self.index.shards]

    # Worker processes reopen the maps instead of pickling them.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def arrays(self) -> list[np.memmap]:
        if self._arrays is None:
            self._arrays = self._open()
        return self._arrays

    @property
    def total_tokens(self) -> int:
        return self.index.total_tokens

    def num_samples(self, seq_len: int) -> int:
        return max(0, (self.total_tokens - 1) // seq_len)

    def require_samples(self, seq_len: int, needed: int, why: str) -> int:
        """Number of samples of seq_len+1 tokens; raises if fewer than `needed`."""
        samples = self.num_samples(seq_len)
        if samples < needed:
            raise ShardError(
                f"{self.directory / INDEX_FILE}: {self.total_tokens} tokens give {samples} samples of "
                f"seq_len+1={seq_len + 1} tokens, but {needed} are needed ({why}); use a longer text, a shorter "
                "recipe.model.seq_len or a smaller batch"
            )
        return samples

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the concatenated shards, copied out of the maps."""
        if start < 0 or start + length > self.total_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside {self.directory} ({self.total_tokens})")
        out = np.empty(length, dtype=self.dtype)
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self.starts[shard])
            take = min(length - filled, int(self.starts[shard + 1]) - (start + filled))
            out[filled : filled + take] = self.arrays[shard][offset : offset + take]
            filled += take
            shard += 1
        return out

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        return self.window(index * seq_len, seq_len + 1)

    def verify_checksums(self) -> None:
        """Hash every shard file and compare with the index (reads the whole corpus)."""
        for entry in self.index.shards:
            path = self.directory / entry.file
            actual = file_sha256(path)
            if actual != entry.sha256:
                raise ShardError(f"shard {path} fails its checksum (sha256 {actual[:16]}..., index says "
                                 f"{entry.sha256[:16]}...): its content changed since the build; rebuild the folder")
