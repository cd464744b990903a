"""Token shards: format, builder, deterministic seeded order per dp rank, bitwise resume, backends, bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import compose_config
from hydra.errors import ConfigCompositionException

from taxbench.config.schema import ConfigError, DataConfig
from taxbench.datasets.build import build_shards
from taxbench.datasets.dali_reader import DaliUnavailable, dali_available
from taxbench.datasets.order import SampleOrder, shard_order
from taxbench.datasets.shards import INDEX_FILE, ShardError, TokenShards
from taxbench.datasets.source import build_shard_source
from taxbench.train.data import build_source

SEQ_LEN, MICRO = 16, 2
WORDS = "the quick brown fox jumps over a lazy dog while bitwise determinism costs some tax".split()


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    rng = random.Random(0)
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(900)) + " naïve ünïcode\n", encoding="utf-8")
    return path


@pytest.fixture
def shard_dir(tmp_path: Path, text_file: Path) -> Path:
    out = tmp_path / "shards"
    build_shards(text_file, out, tokens_per_shard=1000)
    return out


def reader(path: Path, seed: int = 7, dp_rank: int = 0, dp_size: int = 1, **data: object):
    return build_source(DataConfig(kind="shards", path=str(path), seed=seed, **data), 256, SEQ_LEN, MICRO,
                        dp_rank, dp_size)


def take(source, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [source.next_batch() for _ in range(n)]


def assert_same_stream(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == xb.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_build_writes_shards_that_hold_exactly_the_text_bytes(text_file: Path, shard_dir: Path) -> None:
    raw = text_file.read_bytes()
    index = json.loads((shard_dir / INDEX_FILE).read_text())
    assert index["total_tokens"] == len(raw) and index["dtype"] == "uint16" and index["tokenizer"] == "bytes"
    assert [s["tokens"] for s in index["shards"]][:-1] == [1000] * (len(index["shards"]) - 1)
    assert len(index["shards"]) == -(-len(raw) // 1000)
    shards = TokenShards(shard_dir)
    assert shards.window(0, len(raw)).astype(np.uint8).tobytes() == raw
    shards.verify_checksums()
    # A sample spanning a shard boundary is read across both files.
    crossing = 999 // SEQ_LEN
    start = crossing * SEQ_LEN
    assert start < 1000 < start + SEQ_LEN + 1
    assert shards.sample(crossing, SEQ_LEN).astype(np.uint8).tobytes() == raw[start : start + SEQ_LEN + 1]


def test_uint32_shards_give_the_same_batches(tmp_path: Path, text_file: Path, shard_dir: Path) -> None:
    wide = tmp_path / "wide"
    build_shards(text_file, wide, tokens_per_shard=700, dtype="uint32")
    assert TokenShards(wide).dtype == np.uint32
    assert_same_stream(take(reader(wide), 5), take(reader(shard_dir), 5))


def test_build_refuses_to_overwrite_and_empty_input(tmp_path: Path, text_file: Path, shard_dir: Path) -> None:
    with pytest.raises(ShardError, match="already holds a token-shard folder"):
        build_shards(text_file, shard_dir)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ShardError, match=f"text file {empty} is empty"):
        build_shards(empty, tmp_path / "out")
    with pytest.raises(ShardError, match="does not exist"):
        build_shards(tmp_path / "nope.txt", tmp_path / "out2")


def test_order_depends_only_on_seed_not_on_workers(shard_dir: Path) -> None:
    first = take(reader(shard_dir, seed=7), 6)
    assert_same_stream(first, take(reader(shard_dir, seed=7, num_workers=2), 6))
    other = take(reader(shard_dir, seed=8), 6)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other, strict=True))
    # Targets are the inputs shifted by one token of the same sample.
    inputs, targets = first[0]
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_dp_ranks_read_disjoint_samples_that_cover_the_epoch(shard_dir: Path) -> None:
    shards = TokenShards(shard_dir)
    dp_size = 3
    orders = [shard_order(shards, 7, SEQ_LEN, MICRO, rank, dp_size) for rank in range(dp_size)]
    per_epoch = orders[0].batches_per_epoch
    seen = [np.concatenate([o.batch(0, b) for b in range(per_epoch)]) for o in orders]
    for a in range(dp_size):
        for b in range(a + 1, dp_size):
            assert not set(seen[a]) & set(seen[b])
    union = np.concatenate(seen)
    assert len(set(union)) == len(union) == per_epoch * MICRO * dp_size
    assert per_epoch * MICRO * dp_size > shards.num_samples(SEQ_LEN) - MICRO * dp_size
    # The readers deliver exactly those samples, rank by rank.
    for rank in range(dp_size):
        inputs, targets = reader(shard_dir, dp_rank=rank, dp_size=dp_size).next_batch()
        expected = np.stack([shards.sample(i, SEQ_LEN) for i in orders[rank].batch(0, 0)]).astype(np.int64)
        assert torch.equal(inputs, torch.from_numpy(expected[:, :-1]))
        assert torch.equal(targets, torch.from_numpy(expected[:, 1:]))


def test_resume_mid_epoch_replays_the_stream_bitwise(tmp_path: Path, shard_dir: Path) -> None:
    uninterrupted = reader(shard_dir, num_workers=2)
    per_epoch = uninterrupted.order.batches_per_epoch
    stop = per_epoch - 3  # resume three batches before the epoch ends, continue well into the next one
    take(uninterrupted, stop)
    state = uninterrupted.state_dict()
    assert (state["epoch"], state["position"]) == (0, stop * MICRO)
    torch.save({"data": state}, tmp_path / "ckpt.pt")
    expected = take(uninterrupted, 8)

    resumed = reader(shard_dir)  # another worker count: prefetching must not leak into the state
    take(resumed, 2)  # a reader that already moved on is rewound by the state too
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False)["data"])
    assert_same_stream(take(resumed, 8), expected)
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_epoch_rollover_reshuffles_and_visits_each_sample_once(shard_dir: Path) -> None:
    source = reader(shard_dir)
    order: SampleOrder = source.order
    per_epoch = order.batches_per_epoch
    take(source, per_epoch)
    assert (source.state_dict()["epoch"], source.state_dict()["position"]) == (1, 0)
    epoch0 = np.concatenate([order.batch(0, b) for b in range(per_epoch)])
    epoch1 = np.concatenate([order.batch(1, b) for b in range(per_epoch)])
    assert len(set(epoch0)) == len(epoch0) and len(set(epoch1)) == len(epoch1)
    assert not np.array_equal(epoch0, epoch1)
    inputs, _ = source.next_batch()
    shards = TokenShards(shard_dir)
    expected = np.stack([shards.sample(i, SEQ_LEN)[:-1] for i in order.batch(1, 0)]).astype(np.int64)
    assert torch.equal(inputs, torch.from_numpy(expected))


def test_state_of_another_dataset_or_layout_is_refused(tmp_path: Path, text_file: Path, shard_dir: Path) -> None:
    state = reader(shard_dir).state_dict()
    other = tmp_path / "other"
    build_shards(text_file, other, tokens_per_shard=500)  # same tokens, other index: still another dataset file
    with pytest.raises(ShardError, match="resume with the same shard folder"):
        reader(other).load_state_dict(state)
    with pytest.raises(ValueError, match="dp_size=1 but this run has dp_size=2"):
        reader(shard_dir, dp_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="kind 'synthetic'"):
        reader(shard_dir).load_state_dict({"kind": "synthetic", "seed": 7, "position": 0})


def first_shard(shard_dir: Path) -> Path:
    return shard_dir / json.loads((shard_dir / INDEX_FILE).read_text())["shards"][1]["file"]


def test_missing_shard_names_the_file(shard_dir: Path) -> None:
    victim = first_shard(shard_dir)
    victim.unlink()
    with pytest.raises(ShardError, match=f"shard {victim} listed in .* is missing"):
        reader(shard_dir)


def test_truncated_shard_names_the_file(shard_dir: Path) -> None:
    victim = first_shard(shard_dir)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    with pytest.raises(ShardError, match=f"shard {victim} is truncated or corrupt"):
        reader(shard_dir)


def test_corrupt_header_names_the_file(shard_dir: Path) -> None:
    victim = first_shard(shard_dir)
    victim.write_bytes(b"garbage, not an npy file" + victim.read_bytes()[24:])
    with pytest.raises(ShardError, match=f"shard {victim} is corrupt"):
        reader(shard_dir)


def test_changed_content_fails_the_checksum(shard_dir: Path) -> None:
    victim = first_shard(shard_dir)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    TokenShards(shard_dir)  # same header and length: only the checksum can tell
    with pytest.raises(ShardError, match=f"shard {victim} fails its checksum"):
        TokenShards(shard_dir).verify_checksums()


def test_dtype_mismatch_between_index_and_file_names_the_file(shard_dir: Path) -> None:
    index_path = shard_dir / INDEX_FILE
    index = json.loads(index_path.read_text())
    index["dtype"] = "uint32"
    index_path.write_text(json.dumps(index))
    victim = shard_dir / index["shards"][0]["file"]
    with pytest.raises(ShardError, match=f"shard {victim} holds uint16 tokens but .* says dtype=uint32"):
        reader(shard_dir)


def test_too_few_tokens_for_seq_len_names_the_index(tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_bytes(b"x" * (SEQ_LEN * MICRO))  # one sample short of a micro-batch of seq_len+1 windows
    build_shards(text, tmp_path / "short")
    with pytest.raises(ShardError, match=f"{tmp_path / 'short' / INDEX_FILE}: 32 tokens give 1 samples"):
        reader(tmp_path / "short")


def test_token_ids_beyond_the_model_vocabulary_are_refused(shard_dir: Path) -> None:
    cfg = DataConfig(kind="shards", path=str(shard_dir))
    with pytest.raises(ShardError, match="recipe.model.vocab_size=100"):
        build_shard_source(cfg, 100, SEQ_LEN, MICRO, 0, 1)


def test_config_validation_reports_shard_problems_before_ranks_start(tmp_path: Path, shard_dir: Path) -> None:
    compose_config("recipe.data.kind=shards", f"recipe.data.path={shard_dir}", "recipe.data.verify_checksums=true")
    with pytest.raises(ConfigError, match=f"recipe.data.path={tmp_path / 'nope'}: token-shard folder"):
        compose_config("recipe.data.kind=shards", f"recipe.data.path={tmp_path / 'nope'}")
    # The loader is an enum: Hydra itself refuses an unknown one and lists the choices.
    with pytest.raises(ConfigCompositionException, match="recipe.data.loader=fastest") as excinfo:
        compose_config("recipe.data.kind=shards", f"recipe.data.path={shard_dir}", "recipe.data.loader=fastest")
    assert "expected one of [auto, torch, dali]" in str(excinfo.value.__cause__)


def test_dali_loader_without_dali_names_the_extra(shard_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where DALI is installed, hide it the way an environment without it looks: no module spec."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("nvidia.dali") else real_find_spec(name, *a))
    with pytest.raises(DaliUnavailable, match=r"pip install 'taxbench\[dali\]'"):
        reader(shard_dir, loader="dali")
    assert type(reader(shard_dir, loader="auto")).__name__ == "TorchShardReader"


@pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not installed (optional extra: "
                    "pip install 'taxbench[dali]'), so the DALI path cannot be compared with the torch path")
def test_dali_and_torch_yield_identical_batches_and_resume(shard_dir: Path) -> None:
    per_epoch = reader(shard_dir, loader="torch").order.batches_per_epoch
    n = per_epoch + 3
    torch_stream = take(reader(shard_dir, loader="torch"), n)
    dali = reader(shard_dir, loader="dali", num_workers=2)
    dali_stream = [(x.cpu(), y.cpu()) for x, y in take(dali, n - 6)]
    state = dali.state_dict()
    assert "dali" in state
    resumed = reader(shard_dir, loader="dali")
    resumed.load_state_dict(state)
    dali_stream += [(x.cpu(), y.cpu()) for x, y in take(resumed, 6)]
    assert_same_stream(dali_stream, torch_stream)
    # A DALI checkpoint also resumes on the torch path, from the (epoch, position) cursor.
    fallback = reader(shard_dir, loader="torch")
    fallback.load_state_dict(state)
    assert_same_stream(take(fallback, 6), torch_stream[n - 6 :])


def test_build_shards_command(tmp_path: Path, text_file: Path, taxbench_cli) -> None:
    out = tmp_path / "cli-shards"
    done = taxbench_cli("build-shards", str(text_file), str(out), "--tokens-per-shard", "4096", "--dtype", "uint32",
                        cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"recipe.data.path={out}" in done.stdout
    assert TokenShards(out).index.dtype == "uint32"
    again = taxbench_cli("build-shards", str(text_file), str(out), cwd=tmp_path, timeout=120)
    assert again.returncode == 2 and "already holds a token-shard folder" in again.stderr


@pytest.mark.slow
def test_experiment_on_shards_replays_a_restart_bitwise(tmp_path: Path, shard_dir: Path, taxbench_cli) -> None:
    done = taxbench_cli(
        "recipe.data.kind=shards", f"recipe.data.path={shard_dir}", "recipe.model.seq_len=16",
        "experiment.steps=12", "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=6",
        "cluster.cpu_ranks=1", f"experiment.out_dir={tmp_path / 'runs'}", "experiment.name=shards",
        cwd=tmp_path, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    root = tmp_path / "runs" / "shards"
    summary = json.loads((root / "summary.json").read_text())
    verdicts = {v["gate"]: v for v in summary["verdicts"]}
    assert verdicts["restart_replay"]["agree"] and verdicts["repeatability"]["agree"]
    records = [json.loads(line) for line in (root / "deterministic-0" / "steps.rank0.jsonl").read_text().splitlines()]
    assert len(records) == 12 and all(r["data_s"] >= 0 for r in records)
    manifest = json.loads((root / "deterministic-0" / "manifest.json").read_text())
    assert manifest["config"]["recipe"]["data"]["kind"] == "shards"
