"""Checkpoints are verified, not trusted: checksums, fallback to the newest intact one, and writes that fail cleanly."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import Crash, crash_after, fingerprints, run_schedule, tiny_config

from taxbench.checkpoint.store import PROGRESS_FILE, CheckpointError, RunCheckpoints, commit, resume_step
from taxbench.design import ALL_RUNS
from taxbench.parallel.distributed import DistContext, free_port
from taxbench.rundir.records import RunWriteError, write_atomically
from taxbench.rundir.run_manifest import Manifest
from taxbench.train.trainer import RunSpec, Trainer


class Saver:
    """Writes what a rank writes into a checkpoint directory (a DCP data file; rank 0 also the metadata)."""

    def __init__(self, rank: int = 0, size: int = 4096) -> None:
        self.rank, self.size = rank, size

    def save_checkpoint(self, directory: Path) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        files = [directory / f"__{self.rank}_0.distcp"] + ([directory / ".metadata"] if self.rank == 0 else [])
        for file in files:
            file.write_bytes(os.urandom(self.size))
        return files


def shard(checkpoints: RunCheckpoints, step: int) -> Path:
    return checkpoints.path(step) / f"__{checkpoints.rank}_0.distcp"


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_64_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def committed(tmp_path: Path, steps: tuple[int, ...] = (6, 12)) -> RunCheckpoints:
    checkpoints = RunCheckpoints(tmp_path / "deterministic-1", rank=0)
    for step in steps:
        commit(step, [(checkpoints, Saver())])
    return checkpoints


def test_a_committed_checkpoint_carries_its_checksums_and_damage_is_named(tmp_path: Path) -> None:
    checkpoints = committed(tmp_path)
    assert checkpoints.complete() == [6, 12]
    records = json.loads(checkpoints.checksum_path(12).read_text())["files"]
    assert [r["file"] for r in records] == ["__0_0.distcp", ".metadata"]
    assert all(r["bytes"] == 4096 and len(r["sha256"]) == 64 for r in records)
    assert checkpoints.checksum_path(12) == checkpoints.path(12) / "rank0.sha256"
    assert checkpoints.problem(6) is None and checkpoints.problem(12) is None

    truncate(shard(checkpoints, 12))
    assert checkpoints.problem(12) == f"{shard(checkpoints, 12)}: truncated (2048 of 4096 bytes)"
    flip_64_bytes(checkpoints.path(6) / ".metadata")
    expected = f"{checkpoints.path(6) / '.metadata'}: checksum mismatch (sha256 differs from rank0.sha256)"
    assert checkpoints.problem(6) == expected
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        checkpoints.require_intact(6)
    shard(checkpoints, 12).unlink()
    assert checkpoints.problem(12) == f"{shard(checkpoints, 12)}: missing"
    checkpoints.checksum_path(6).unlink()
    assert "no checksum recorded" in str(checkpoints.problem(6))


def test_a_damaged_checkpoint_falls_back_to_the_previous_intact_one_and_says_so(tmp_path: Path, capsys) -> None:
    checkpoints = committed(tmp_path)
    truncate(shard(checkpoints, 12))
    assert resume_step([checkpoints]) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"taxbench: warning: {shard(checkpoints, 12)}: truncated (2048 of 4096 bytes); deterministic-1 "
                   "resume from step 6"]
    # The damaged, newer checkpoint is forgotten: the run rewrites that step.
    assert checkpoints.complete() == [6]
    assert sorted(p.name for p in checkpoints.dir.iterdir()) == [PROGRESS_FILE, "step6"]
    assert sorted(p.name for p in checkpoints.path(6).iterdir()) == [".metadata", "__0_0.distcp", "rank0.sha256"]


def test_no_intact_checkpoint_left_means_starting_from_scratch(tmp_path: Path, capsys) -> None:
    checkpoints = committed(tmp_path)
    truncate(shard(checkpoints, 12))
    flip_64_bytes(shard(checkpoints, 6))
    assert resume_step([checkpoints]) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated" in err[0] and "(and 1 more)" in err[0] and "from scratch" in err[0]
    assert checkpoints.complete() == [] and not list(checkpoints.dir.glob("step*"))


@pytest.mark.parametrize("content", ["{\"complete\": [6, 1", "[]", "{\"complete\": \"x\", \"finished\": false}"])
def test_a_corrupt_progress_record_is_rebuilt_from_the_intact_files(tmp_path: Path, capsys, content: str) -> None:
    checkpoints = committed(tmp_path)
    (checkpoints.dir / PROGRESS_FILE).write_text(content)
    assert checkpoints.complete() == [] and not checkpoints.finished
    assert resume_step([checkpoints]) == 12
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"taxbench: warning: {checkpoints.dir / PROGRESS_FILE}: not ")
    assert err[0].endswith("; using the checkpoints present instead")
    assert checkpoints.complete() == [6, 12]  # rewritten


def test_the_timed_pair_resumes_both_arms_from_a_step_intact_in_both(tmp_path: Path) -> None:
    baseline, deterministic = (RunCheckpoints(tmp_path / name, rank=0) for name in ("baseline-0", "deterministic-0"))
    for step in (6, 12):
        commit(step, [(baseline, Saver()), (deterministic, Saver())])
    flip_64_bytes(shard(deterministic, 12))
    assert resume_step([baseline, deterministic]) == 6
    assert baseline.complete() == deterministic.complete() == [6]


# ---- writes that fail: one line naming the file, no .tmp left behind ----------------------------------------------

def test_a_failed_atomic_write_removes_its_tmp_and_names_the_file(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"

    def disk_full(handle) -> None:
        handle.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(RunWriteError) as caught:
        write_atomically(target, disk_full)
    assert caught.value.errno == errno.ENOSPC and str(caught.value).startswith(f"no space left on {target}")
    assert list(tmp_path.iterdir()) == []

    def torch_style(handle) -> None:  # torch.save wraps the OSError of the file it writes in a RuntimeError
        try:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534") from None

    with pytest.raises(RunWriteError, match=rf"^{target}: Input/output error$"):
        write_atomically(target, torch_style)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real, tiny file system (tmpfs; needs root) that fills up."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_checkpoint_and_a_manifest_on_a_full_disk_fail_in_one_line_and_leave_no_tmp(full_disk: Path) -> None:
    cfg = tiny_config()
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    trainer = Trainer(RunSpec.of(cfg, "deterministic", "1", cfg.arms["deterministic"], full_disk / "run"), ctx)
    trainer.run_block(1, 0)
    checkpoints = RunCheckpoints(full_disk / "run", rank=0)
    with pytest.raises(RunWriteError) as caught:
        commit(1, [(checkpoints, trainer)])
    assert caught.value.errno == errno.ENOSPC
    assert str(caught.value).startswith(f"no space left on {checkpoints.path(1)}")
    filler = full_disk / "filler"
    with pytest.raises(OSError):  # fill what is left
        filler.write_bytes(b"\0" * (1 << 20))
    with pytest.raises(RunWriteError, match=f"^no space left on {full_disk / 'run' / 'manifest.json'}"):
        Manifest.of({"config": {"x": "y"}}).write(full_disk / "run")
    assert not list(full_disk.rglob("*.tmp"))
    assert checkpoints.complete() == []  # nothing was recorded as complete


# ---- the schedule: crash, damage a checkpoint, continue ------------------------------------------------------------

DAMAGE = {"truncated": truncate, "flipped": flip_64_bytes}


@pytest.mark.parametrize("damage", ["truncated", "flipped", "progress"])
def test_a_damaged_checkpoint_is_named_and_the_continued_experiment_still_agrees_bitwise(
        tmp_path: Path, capfd, damage: str) -> None:
    cfg = tiny_config()
    root = tmp_path / "ckpt"
    root.mkdir()
    # The four interleaved runs crash in their third round (3-step blocks: 24 steps done, then 8 more), after
    # committing steps 3 and 6.
    with pytest.raises(Crash):
        run_schedule(cfg, root, crash_after(24 + 8))
    checkpoints = RunCheckpoints(root / "deterministic-1", rank=0)
    assert checkpoints.complete() == [3, 6]
    if damage == "progress":
        (checkpoints.dir / PROGRESS_FILE).write_text("{\"complete\": [3,")
    else:
        DAMAGE[damage](shard(checkpoints, 6))
    capfd.readouterr()

    run_schedule(cfg, root)
    err = capfd.readouterr().err
    expected = {"truncated": f"{shard(checkpoints, 6)}: truncated (",
                "flipped": f"{shard(checkpoints, 6)}: checksum mismatch",
                "progress": f"{checkpoints.dir / PROGRESS_FILE}: not valid JSON"}[damage]
    warnings = [line for line in err.splitlines() if line.startswith("taxbench: warning:")]
    assert len(warnings) == 1 and expected in warnings[0], err
    assert "Traceback" not in err
    reference = fingerprints(root / "deterministic-0")
    assert [r[0] for r in reference] == list(range(1, 13))
    for ref in ALL_RUNS:
        if ref.arm == "deterministic":
            assert fingerprints(root / ref.name) == reference, ref.name  # each step once, bitwise the same
    assert checkpoints.finished and not list(checkpoints.dir.glob("step*"))


def _rank_resumes(rank: int, root: str, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        checkpoints = RunCheckpoints(Path(root) / "deterministic-1", rank)
        for step in (6, 12):
            commit(step, [(checkpoints, Saver(rank))])
        dist.barrier()
        if rank == 1:
            flip_64_bytes(shard(checkpoints, 12))
        dist.barrier()
        (Path(root) / f"chosen.rank{rank}").write_text(str(resume_step([checkpoints])))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_falls_back_to_the_same_step_when_one_rank_holds_a_damaged_file(tmp_path: Path, capfd) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_rank_resumes, args=(str(tmp_path), free_port()), nprocs=2, join=True, start_method="spawn")
    assert [(tmp_path / f"chosen.rank{r}").read_text() for r in (0, 1)] == ["6", "6"]
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("taxbench: warning:")]
    damaged = shard(RunCheckpoints(tmp_path / "deterministic-1", 1), 12)
    assert warnings == [f"taxbench: warning: {damaged}: checksum mismatch (sha256 differs from rank1.sha256); "
                        "deterministic-1 resume from step 6"]
    checkpoints = tmp_path / "deterministic-1" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [PROGRESS_FILE, "step6"]
    assert sorted(p.name for p in (checkpoints / "step6").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "rank0.sha256", "rank1.sha256"]
