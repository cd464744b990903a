"""Build a token-shard folder from a text file (`taxbench build-shards TEXT_FILE OUT_DIR`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from taxbench.datasets.shards import DTYPES, INDEX_FILE, ShardEntry, ShardError, ShardIndex, file_sha256, write_index
from taxbench.datasets.tokenizer import ByteTokenizer
from taxbench.oserrors import describe_os_error

DEFAULT_TOKENS_PER_SHARD = 1 << 24  # 32 MiB per uint16 shard
READ_CHUNK_BYTES = 1 << 22


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.npy"


def _write_shard(directory: Path, number: int, tokens: np.ndarray) -> ShardEntry:
    path = directory / shard_name(number)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        np.save(handle, tokens, allow_pickle=False)
    tmp.replace(path)
    return ShardEntry(path.name, int(tokens.size), file_sha256(path))


def build_shards(
    text_file: str | Path,
    out_dir: str | Path,
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD,
    dtype: str = "uint16",
    tokenizer: ByteTokenizer | None = None,
) -> ShardIndex:
    """Tokenize `text_file` in chunks and write shards of `tokens_per_shard` tokens (the last may be shorter)."""
    text_file, out_dir = Path(text_file), Path(out_dir)
    tokenizer = tokenizer or ByteTokenizer()
    if dtype not in DTYPES:
        raise ShardError(f"--dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    if tokenizer.vocab_size - 1 > np.iinfo(DTYPES[dtype]).max:
        raise ShardError(f"--dtype {dtype} cannot hold token ids up to {tokenizer.vocab_size - 1}; use uint32")
    if tokens_per_shard < 1:
        raise ShardError(f"--tokens-per-shard {tokens_per_shard} must be >= 1")
    if text_file.is_dir():
        raise ShardError(f"{text_file} is a directory; pass one text file (concatenate a corpus first)")
    if not text_file.is_file():
        raise ShardError(f"text file {text_file} does not exist")
    if out_dir.exists() and not out_dir.is_dir():
        raise ShardError(f"OUT_DIR {out_dir} is a file, not a folder; pick a new or empty folder")
    if (out_dir / INDEX_FILE).exists():
        raise ShardError(f"{out_dir} already holds a token-shard folder ({INDEX_FILE}); pick another OUT_DIR or "
                         "remove it first")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ShardError(f"{out_dir} is not empty; pick a new or empty OUT_DIR")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        return _tokenize_into(text_file, out_dir, tokens_per_shard, dtype, tokenizer)
    except OSError as exc:
        for partial in out_dir.glob("*.tmp"):
            partial.unlink(missing_ok=True)
        raise ShardError(f"cannot write token shards: {describe_os_error(exc)}") from exc


def _tokenize_into(text_file: Path, out_dir: Path, tokens_per_shard: int, dtype: str,
                   tokenizer: ByteTokenizer) -> ShardIndex:
    entries: list[ShardEntry] = []
    buffer = np.empty(tokens_per_shard, dtype=DTYPES[dtype])
    filled, max_token = 0, -1
    with text_file.open("rb") as handle:
        while chunk := handle.read(READ_CHUNK_BYTES):
            tokens = tokenizer.encode(chunk)
            if tokens.size:
                max_token = max(max_token, int(tokens.max()))
            while tokens.size:
                take = min(tokens.size, tokens_per_shard - filled)
                buffer[filled : filled + take] = tokens[:take]
                filled, tokens = filled + take, tokens[take:]
                if filled == tokens_per_shard:
                    entries.append(_write_shard(out_dir, len(entries), buffer))
                    filled = 0
    if filled:
        entries.append(_write_shard(out_dir, len(entries), buffer[:filled]))
    if not entries:
        raise ShardError(f"text file {text_file} is empty: no tokens to write")
    index = ShardIndex(dtype, tokenizer.name, tokenizer.vocab_size, max_token, sum(e.tokens for e in entries),
                       tuple(entries))
    write_index(out_dir, index)
    return index


def build_shards_command(text_file: Path, out_dir: Path, tokens_per_shard: int, dtype: str) -> int:
    """`taxbench build-shards`: build, then say what was written and how to use it."""
    index = build_shards(text_file, out_dir, tokens_per_shard, dtype)
    print(f"wrote {index.total_tokens} {index.tokenizer} tokens ({index.dtype}) in {len(index.shards)} shard(s) to "
          f"{out_dir}; train on them with: python -m taxbench recipe.data.kind=shards recipe.data.path={out_dir}")
    return 0
