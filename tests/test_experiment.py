"""End to end through `python -m taxbench` with real gloo processes: gates, fault detection, manifests."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from taxbench.rundir.read import load_run

pytestmark = pytest.mark.slow

SMALL = ["experiment.steps=24", "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=12"]


def run(taxbench_cli, tmp_path: Path, name: str, *extra: str):
    result = taxbench_cli(*SMALL, f"experiment.out_dir={tmp_path}", f"experiment.name={name}", *extra,
                          cwd=tmp_path, timeout=600, env={"COLUMNS": "200"})
    return result, tmp_path / name


def test_two_rank_experiment_passes_the_gates_and_reports_the_tax(taxbench_cli, tmp_path: Path) -> None:
    result, root = run(taxbench_cli, tmp_path, "clean")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "95% CI " in result.stdout and "baseline" in result.stdout and "deterministic" in result.stdout
    # One line per gate (the equivalence line may say "bitwise identical" of the baselines too).
    gate_lines = re.findall(r"^(repeatability|restart_replay|baseline_sanity) +bitwise identical", result.stdout, re.M)
    assert sorted(gate_lines) == ["baseline_sanity", "repeatability", "restart_replay"]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["deterministic_ok"] is True
    gates = {v["gate"]: v for v in summary["verdicts"]}
    assert gates["repeatability"]["agree"] and gates["repeatability"]["compared_steps"] == 24
    assert gates["restart_replay"]["agree"] and gates["restart_replay"]["compared_steps"] == 12
    tax = summary["tax"]
    assert tax["low"] <= tax["tax"] <= tax["high"] and tax["pairs"] >= 3

    for run_name in ("baseline-0", "deterministic-0", "deterministic-1", "deterministic-resumed", "baseline-1"):
        frame = load_run(root / run_name)
        assert sorted(frame["rank"].unique()) == [0, 1]
        assert list(frame.groupby("rank")["step"].apply(list)[0]) == list(range(1, 25))
    manifest = json.loads((root / "deterministic-0" / "manifest.json").read_text())
    assert manifest["policy_applied"]["use_deterministic_algorithms"] is True
    assert manifest["policy_applied"]["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert manifest["layout"]["world_size"] == 2 and manifest["layout"]["backend"] == "gloo"
    assert manifest["stack"]["torch"] and len(manifest["stack"]["ranks"]) == 2
    baseline_manifest = json.loads((root / "baseline-0" / "manifest.json").read_text())
    assert baseline_manifest["policy_applied"]["use_deterministic_algorithms"] is False
    # Both timed arms were interleaved in blocks: each has records in every block.
    blocks = load_run(root / "baseline-0")["block"].unique()
    assert sorted(blocks) == [0, 1, 2, 3]


def test_flipped_parameter_bit_is_caught_at_its_step_rank_and_metric(taxbench_cli, tmp_path: Path) -> None:
    result, root = run(taxbench_cli, tmp_path, "faulty", "experiment.fault.enabled=true", "experiment.fault.step=3",
                       "experiment.fault.rank=1", "experiment.fault.replica=1")
    assert result.returncode == 3, result.stderr[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    gates = {v["gate"]: v for v in summary["verdicts"]}
    mismatch = gates["repeatability"]["first_mismatch"]
    assert (mismatch["step"], mismatch["rank"], mismatch["metric"]) == (3, 1, "params")
    assert gates["restart_replay"]["agree"]
    assert "step 3, rank 1, params" in result.stdout
    assert summary["deterministic_ok"] is False
    # The fault says where it fired, on its rank only; the other rank's file is there and empty.
    events = [json.loads(line) for line in (root / "deterministic-1" / "faults.rank1.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"], e["rank"]) for e in events] == [("flip_param_bit", 3, 1)]
    assert (root / "deterministic-1" / "faults.rank0.jsonl").read_text() == ""
    assert not (root / "deterministic-0" / "faults.rank1.jsonl").exists()


def test_inprocess_launcher_runs_one_rank(taxbench_cli, tmp_path: Path) -> None:
    result, root = run(taxbench_cli, tmp_path, "single", "cluster=inprocess")
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(load_run(root / "deterministic-0")["rank"].unique()) == [0]


def test_existing_results_are_never_overwritten(taxbench_cli, tmp_path: Path) -> None:
    (tmp_path / "taken" / "deterministic-0").mkdir(parents=True)
    result, _ = run(taxbench_cli, tmp_path, "taken")
    assert result.returncode == 2
    assert "already holds results" in result.stderr


def test_crashed_experiment_continues_without_losing_or_duplicating_records(taxbench_cli, tmp_path: Path) -> None:
    """SIGKILL the whole job in the middle of the schedule, then continue it: every run ends with each step exactly
    once per rank and all gates still agree bitwise."""
    args = ["experiment.steps=36", "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=12",
            "experiment.checkpoint_every_steps=6", f"experiment.out_dir={tmp_path}", "experiment.name=crash",
            "report.wandb=false", "report.html=false"]
    root = tmp_path / "crash"
    victim = subprocess.Popen([sys.executable, "-m", "taxbench", *args], cwd=tmp_path, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    repeat_records = root / "deterministic-1" / "steps.rank0.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and victim.poll() is None:
        if repeat_records.exists() and len(repeat_records.read_text().splitlines()) >= 8:
            break
        time.sleep(0.05)
    assert victim.poll() is None, "the run finished before it could be interrupted"
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()

    refused = taxbench_cli(*args, cwd=tmp_path, timeout=120)
    assert refused.returncode == 2 and "experiment.continue_existing=true" in refused.stderr
    changed = taxbench_cli(*args, "experiment.continue_existing=true", "experiment.steps=42", cwd=tmp_path, timeout=120)
    assert changed.returncode == 2 and "experiment.steps: was 36, now 42" in changed.stderr

    result = taxbench_cli(*args, "experiment.continue_existing=true", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["deterministic_ok"] and all(v["agree"] for v in summary["verdicts"])
    for run_name in ("baseline-0", "deterministic-0", "deterministic-1", "deterministic-resumed", "baseline-1"):
        frame = load_run(root / run_name)
        for rank in (0, 1):
            assert list(frame.loc[frame["rank"] == rank, "step"]) == list(range(1, 37)), (run_name, rank)
    attempts = {run: len(json.loads((root / run / "manifest.json").read_text())["attempts"])
                for run in ("deterministic-0", "deterministic-1", "deterministic-resumed")}
    # deterministic-0 and -1 were interleaved (both unfinished: restarted); the resumed run had not started yet.
    assert attempts == {"deterministic-0": 2, "deterministic-1": 2, "deterministic-resumed": 1}


def _processes_with(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes() and " Z" not in _state(entry):
                found.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def _state(proc: Path) -> str:
    return next((line for line in (proc / "status").read_text().splitlines() if line.startswith("State:")), "")


def _wait_for_records(victim: subprocess.Popen, records: Path, lines: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and victim.poll() is None:
        if records.exists() and len(records.read_text().splitlines()) >= lines:
            return
        time.sleep(0.05)
    raise AssertionError(f"{records} never reached {lines} records (exit {victim.poll()})")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """Started as a background job of a script (`python -m taxbench ... &`), whose SIGINT is ignored: torch's own
    parent-death signal for spawned processes (SIGINT) then does nothing."""
    marker = f"TAXBENCH_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    long_enough = [*SMALL, "experiment.steps=240"]  # ranks left running would still be at work after the deadline
    victim = subprocess.Popen([sys.executable, "-m", "taxbench", *long_enough, f"experiment.out_dir={tmp_path}",
                               "experiment.name=orphans", "report.wandb=false", "report.html=false"], cwd=tmp_path,
                              env={**os.environ, key: value}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        _wait_for_records(victim, tmp_path / "orphans" / "baseline-0" / "steps.rank1.jsonl", 2)
        ranks = [pid for pid in _processes_with(marker) if pid != victim.pid]
        assert len(ranks) >= 2, ranks
        victim.kill()  # the launcher only, as `kill -9 <pid>` would
        victim.wait()
        deadline = time.monotonic() + 120
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_with(marker) == [], "rank processes outlived their launcher"
    finally:
        victim.kill()
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def _children(parent: int) -> list[tuple[int, bytes]]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
            cmdline = (entry / "cmdline").read_bytes() if status else b""
        except OSError:
            continue
        if f"\nPPid:\t{parent}\n" in status:
            found.append((int(entry.name), cmdline))
    return found


def _rank_pids(launcher: int) -> list[int]:
    """The launcher's rank processes: forked by its fork server (taxbench.launchers.local), or spawned by it."""
    ranks = [pid for pid, cmdline in _children(launcher) if b"spawn_main" in cmdline]
    for server, cmdline in _children(launcher):
        if b"forkserver" in cmdline:
            ranks += [pid for pid, _ in _children(server)]
    return sorted(ranks)


def _kill_rank_mid_run(tmp_path: Path, args: list[str], records: Path, lines: int, world: int,
                       victim_rank: int) -> tuple[str, list[str]]:
    """Launch `python -m taxbench *args`, SIGKILL one rank once `records` holds `lines` records, and return the
    launch's one error line (it must exit 1 without a traceback) and the continue command it prints."""
    victim = subprocess.Popen([sys.executable, "-m", "taxbench", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    _wait_for_records(victim, records, lines)
    ranks = _rank_pids(victim.pid)
    assert len(ranks) == world, ranks
    os.kill(ranks[victim_rank], signal.SIGKILL)
    _, stderr = victim.communicate(timeout=120)
    assert victim.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    error = [line for line in stderr.splitlines() if line.startswith("taxbench: error:")]
    assert len(error) == 1, stderr[-3000:]
    return error[0], shlex.split(error[0].split("continue the experiment with: ", 1)[1])


def test_a_killed_rank_ends_in_one_line_with_the_command_that_continues(tmp_path: Path) -> None:
    """SIGKILL one rank: the launch ends with exit 1 and one line naming the rank and the continue command; a damaged
    checkpoint on top is passed over with a warning, and the printed command finishes the experiment bitwise."""
    args = ["experiment.steps=36", "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=12",
            "experiment.checkpoint_every_steps=6", f"experiment.out_dir={tmp_path}", "experiment.name=killed",
            "report.wandb=false", "report.html=false"]
    root = tmp_path / "killed"
    error, command = _kill_rank_mid_run(tmp_path, args, root / "deterministic-1" / "steps.rank0.jsonl", 14, world=2,
                                        victim_rank=1)
    assert re.match(r"taxbench: error: rank 1 died \(SIGKILL\); continue the experiment with: ", error), error
    assert command[-2:] == ["experiment.name=killed", "experiment.continue_existing=true"]

    # Damage the newest checkpoint of the interrupted run: the continue falls back to the one before it.
    from taxbench.checkpoint.store import RunCheckpoints

    checkpoints = RunCheckpoints(root / "deterministic-1", rank=0)
    newest = checkpoints.latest()
    assert newest is not None and len(checkpoints.complete()) == 2
    shard = checkpoints.path(newest) / "__0_0.distcp"  # rank 0's DCP data file
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 3])

    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{shard}: truncated (" in result.stderr
    summary = json.loads((root / "summary.json").read_text())
    assert summary["deterministic_ok"] and all(v["agree"] for v in summary["verdicts"])
    for run_name in ("baseline-0", "deterministic-0", "deterministic-1", "deterministic-resumed", "baseline-1"):
        frame = load_run(root / run_name)
        for rank in (0, 1):
            assert list(frame.loc[frame["rank"] == rank, "step"]) == list(range(1, 37)), (run_name, rank)


def test_killed_rank_of_the_moe_1t_proxy_continues_with_every_fingerprint_intact(tmp_path: Path) -> None:
    """The proxy (pp=2 x dp=2 with ep=2, FSDP2) loses a rank of its second pipeline stage mid-schedule; the printed
    command continues it: every step recorded exactly once on every rank, and the resumed runs reproduce the
    uninterrupted ones bit for bit (the gates)."""
    args = ["+recipe=moe_1t_proxy", "experiment.steps=12", "experiment.block_steps=6", "experiment.warmup_steps=2",
            "experiment.resume_step=6", "experiment.checkpoint_every_steps=6", f"experiment.out_dir={tmp_path}",
            "experiment.name=proxy",
            "report.wandb=false", "report.html=false"]
    root = tmp_path / "proxy"
    error, command = _kill_rank_mid_run(tmp_path, args, root / "deterministic-1" / "steps.rank0.jsonl", 8, world=4,
                                        victim_rank=3)
    assert "rank 3 died (SIGKILL)" in error, error
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["deterministic_ok"] and all(v["agree"] for v in summary["verdicts"][:2]), summary["verdicts"]
    for run_name in ("baseline-0", "deterministic-0", "deterministic-1", "deterministic-resumed", "baseline-1"):
        frame = load_run(root / run_name)
        for rank in range(4):
            assert list(frame.loc[frame["rank"] == rank, "step"]) == list(range(1, 13)), (run_name, rank)


def test_a_full_disk_ends_in_one_line_and_leaves_no_tmp_files(taxbench_cli, tmp_path: Path) -> None:
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        result, root = run(taxbench_cli, mount, "full")
        assert result.returncode == 1, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and "iostream error" not in result.stderr, result.stderr[-3000:]
        error = [line for line in result.stderr.splitlines() if line.startswith("taxbench: error:")]
        assert len(error) == 1 and f"no space left on {root}/" in error[0], result.stderr[-3000:]
        assert not list(mount.rglob("*.tmp"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
