"""`taxbench run -- COMMAND`: the probe's step folding, the arms' edits, whole-run pairs, and real commands.

The user programs under tests/user_programs/ know nothing of taxbench: they are written as users write them and run
by taxbench through their own launcher (torchrun), with the probe loaded at interpreter start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from taxbench.analysis.verdicts import compare_runs
from taxbench.commands.run import command_label, quoted_argument_lists, split_command
from taxbench.config.command import (
    ArmEdits,
    CommandConfig,
    CommandError,
    RestartArgs,
    edited_command,
    set_dotted,
    validate_command,
    with_args,
)
from taxbench.probe.steps import ClosedStep, NotAligned, StepFolder, resumed_after
from taxbench.stats.tax import estimate_pairs_tax

PROGRAMS = Path(__file__).parent / "user_programs"
DDP = str(PROGRAMS / "ddp_train.py")


# ------------------------------------------------------------------------------------------------ step folding
def _call(folder: StepFolder, optimizer: object, key: tuple, now: float) -> None:
    outermost, closed = folder.on_pre_step(optimizer, key, now)
    assert closed is None
    folder.on_post_step(optimizer, now + 0.01, None)


def test_nested_calls_fold_into_the_outermost_one() -> None:
    folder, container, inner = StepFolder(0.0), object(), object()
    assert folder.on_pre_step(container, ("all",), 1.0) == (True, None)
    assert folder.on_pre_step(inner, ("a",), 1.0) == (False, None)  # the container's inner optimizer
    assert not folder.on_post_step(inner, 1.1, None)
    assert folder.on_post_step(container, 1.2, None)
    closed = folder.close(2.0)
    assert closed is not None and closed.number == 1 and closed.calls == 1


def test_per_group_calls_between_two_backwards_are_one_step_with_their_losses() -> None:
    folder, inner = StepFolder(0.0), object()
    for step in range(2):
        closed = folder.on_backward(10.0 * step + 1)
        assert (closed is None) == (step == 0)
        folder.add_loss(0x3F800000, torch.float32)  # two micro-batches: gradient accumulation
        folder.on_backward(10.0 * step + 2)
        folder.add_loss(0x40000000, torch.float32)
        _call(folder, inner, ("group0",), 10.0 * step + 3)  # ZeRO-2: once per parameter group
        _call(folder, inner, ("group1",), 10.0 * step + 4)
    closed = folder.close(30.0)
    assert closed is not None and closed.number == 2 and closed.calls == 2
    values = closed.values()
    assert values["loss_bits"] == "3f80000040000000" and values["loss"] == 1.5


def test_a_repeat_call_without_a_backward_starts_a_new_step_and_times_exclude_the_probe() -> None:
    folder, optimizer = StepFolder(0.0), object()
    _call(folder, optimizer, ("p",), 1.0)  # ends at 1.01
    folder.add_overhead(0.5)  # the probe's own digests after the step
    outermost, closed = folder.on_pre_step(optimizer, ("p",), 3.0)
    assert outermost and closed is not None and closed.number == 1
    folder.on_post_step(optimizer, 3.01, None)
    second = folder.close(4.0)
    assert second is not None and second.number == 2
    assert second.time_s == pytest.approx(3.01 - 1.01 - 0.5)


def test_a_skipped_step_is_a_step_of_its_own_with_its_losses() -> None:
    folder, optimizer = StepFolder(0.0), object()
    folder.on_backward(1.0)
    _call(folder, optimizer, ("p",), 1.5)
    first = folder.on_backward(2.0)
    assert first is not None and first.number == 1 and not first.skipped
    folder.add_loss(0x7F800000, torch.float32)  # the scaled loss overflowed: the scaler steps no optimizer
    assert folder.on_skipped(2.5, None)
    assert not folder.on_skipped(2.6, None)  # the same skip reported twice (a scaler inside a stack's engine)
    skipped = folder.on_backward(3.0)
    assert skipped is not None and skipped.number == 2 and skipped.skipped and skipped.calls == 0
    assert skipped.values()["loss_bits"] == "7f800000" and skipped.time_s == pytest.approx(2.5 - 1.51)
    _call(folder, optimizer, ("p",), 3.5)
    assert folder.on_pre_step(optimizer, ("q",), 4.0)[0]
    assert not folder.on_skipped(4.1, None)  # inside an optimizer call: that call is the step
    folder.on_post_step(optimizer, 4.2, None)
    third = folder.close(5.0)
    assert third is not None and third.number == 3 and third.calls == 2 and not third.skipped


def _gated(skipped: list[bool]) -> pd.DataFrame:
    steps = len(skipped)
    return pd.DataFrame({"step": range(1, steps + 1), "rank": 0, "loss_bits": "3f800000", "grads": "00ab",
                         "grad_norm_bits": "", "params": "00cd", "optim": "00ef", "skipped": skipped})


def test_gates_compare_the_skipped_mark() -> None:
    same = compare_runs("repeatability", "a", _gated([False, True, False]), "b", _gated([False, True, False]))
    assert same.outcome == "identical"
    one = compare_runs("repeatability", "a", _gated([False, True, False]), "b", _gated([False, False, False]))
    assert one.outcome == "differs" and one.first_mismatch is not None
    assert (one.first_mismatch.step, one.first_mismatch.metric) == (2, "skipped")
    assert (one.first_mismatch.expected, one.first_mismatch.actual) == ("skipped", "stepped")
    older = _gated([False, False, False]).drop(columns=["skipped"])  # records without the mark: steps taken
    assert compare_runs("repeatability", "a", older, "b", _gated([False, False, False])).outcome == "identical"


# ------------------------------------------------------------------------------------------------ edits
def _first_step(own_count: int | None, skipped: bool = False) -> ClosedStep:
    return ClosedStep(1, 0 if skipped else 1, skipped, own_count, 0.1, 0.0, [], [], [], [], None, None)


def test_a_resumed_process_is_placed_by_the_saving_runs_optimizer_counts() -> None:
    no_skip = [(step, step, False) for step in range(1, 9)]
    assert resumed_after(_first_step(6), no_skip) == 5
    assert resumed_after(_first_step(6), []) == 5  # no records to read: the count is the step, as without skips
    skip_at_3 = [(1, 1, False), (2, 2, False), (3, 2, True), (4, 3, False), (5, 4, False), (6, 5, False)]
    assert resumed_after(_first_step(5), skip_at_3) == 5  # loaded 4: held after step 5
    assert resumed_after(_first_step(4, skipped=True), skip_at_3) == 5  # its own first step skipped: loaded 4
    with pytest.raises(NotAligned, match=r"held after steps \[2, 3\]"):
        resumed_after(_first_step(3), skip_at_3)  # loaded 2: after step 2 or after step 3
    with pytest.raises(NotAligned, match="held after no step"):
        resumed_after(_first_step(9), skip_at_3)
    with pytest.raises(NotAligned, match="keeps no step count"):
        resumed_after(_first_step(None), no_skip)


def test_arguments_are_appended_or_replace_the_same_flag() -> None:
    argv = ["torchrun", "train.py", "--lr", "1e-3", "--mode=fast"]
    assert with_args(argv, ["--deterministic-mode"]) == [*argv, "--deterministic-mode"]
    assert with_args(argv, ["--lr", "2e-3", "--mode=exact"]) == ["torchrun", "train.py", "--lr", "2e-3",
                                                                 "--mode=exact"]
    assert with_args(argv, ["--mode", "exact"]) == ["torchrun", "train.py", "--lr", "1e-3", "--mode", "exact"]


def test_a_config_file_is_edited_into_a_copy_and_the_command_pointed_at_it(tmp_path: Path) -> None:
    user = tmp_path / "ds_config.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": True}, "train_batch_size": 8}))
    run = CommandConfig(command=["deepspeed", "train.py", "--deepspeed_config", "ds_config.json"], cwd=str(tmp_path),
                        deterministic=ArmEdits(config_file="ds_config.json",
                                               config_set={"zero_optimization.stage": 2, "deterministic_mode": True}))
    validate_command(run)
    run_dir = tmp_path / "runs" / "deterministic-0"
    run_dir.mkdir(parents=True)
    edited = edited_command(run, "deterministic", run_dir)
    copy = json.loads(Path(edited.argv[-1]).read_text())
    assert edited.argv[:3] == run.command[:3] and Path(edited.argv[-1]).parent == run_dir
    assert copy == {"zero_optimization": {"stage": 2, "overlap_comm": True}, "train_batch_size": 8,
                    "deterministic_mode": True}
    assert json.loads(user.read_text())["zero_optimization"]["stage"] == 3  # never edited in place
    assert edited_command(run, "baseline", run_dir).argv == run.command


@pytest.mark.parametrize(("run", "words"), [
    (CommandConfig(command=[]), "no command after `--`"),
    (CommandConfig(command=["python", "t.py"], deterministic=ArmEdits(config_file="ds.json")),
     "is not among the command's arguments"),
    (CommandConfig(command=["python", "t.py"], restart=RestartArgs(save_args=["--save", "x"])),
     "needs both save_args and resume_args"),
    (CommandConfig(command=["python", "t.py"], restart=RestartArgs(["--save", "x"], ["--resume", "x"])),
     "names no {checkpoint}"),
    (CommandConfig(command=["python", "t.py"], pairs=1), "run.pairs=1 must be >= 2"),
    (CommandConfig(command=["python", "t.py"], deterministic=ArmEdits(env={"A B": "1"})), "environment variable"),
])
def test_bad_commands_and_edits_are_refused_naming_the_value(run: CommandConfig, words: str) -> None:
    with pytest.raises(CommandError, match=None) as raised:
        validate_command(run)
    assert words in str(raised.value)


def test_command_line_words() -> None:
    assert split_command(["a=1", "--", "torchrun", "x.py", "--", "y"]) == (["a=1"], ["torchrun", "x.py", "--", "y"])
    with pytest.raises(CommandError, match="put the training command after `--`"):
        split_command(["a=1"])
    assert command_label(["torchrun", "--nproc-per-node", "2", "/x/pretrain_gpt.py"]) == "pretrain_gpt"
    assert command_label(["torchrun", "-m", "torchtitan.train"]) == "torchtitan.train"
    assert quoted_argument_lists(["run.restart.save_args=[--save,{checkpoint}]", "experiment.steps=3"]) == [
        "run.restart.save_args=['--save','{checkpoint}']", "experiment.steps=3"]
    assert set_dotted({"a": {"b": 1}}, {"a.c": 2, "d": 3}) == {"a": {"b": 1, "c": 2}, "d": 3}


# ------------------------------------------------------------------------------------------------ whole-run pairs
def _run_frame(median: float, steps: int = 20, ranks: int = 2, seed: int = 0) -> pd.DataFrame:
    noise = np.random.default_rng(seed).normal(0, 0.002 * median, (steps, ranks))
    return pd.DataFrame({"step": np.repeat(np.arange(1, steps + 1), ranks), "rank": np.tile(np.arange(ranks), steps),
                         "time_s": (median + noise).ravel(), "block": 0})


def test_the_tax_of_whole_run_pairs_covers_a_known_ratio() -> None:
    pairs = [(_run_frame(0.100 * drift, seed=2 * i), _run_frame(0.110 * drift, seed=2 * i + 1))
             for i, drift in enumerate((1.0, 1.05, 0.97, 1.02))]
    estimate = estimate_pairs_tax(pairs, min_warmup=3)
    assert estimate.pairs == 4 and estimate.timed_runs == 8
    assert estimate.low < 0.10 < estimate.high and estimate.tax == pytest.approx(0.10, abs=0.005)


# ------------------------------------------------------------------------------------------------ real commands
def _taxbench_run(tmp_path: Path, *overrides: str, command: list[str], timeout: int = 400
                  ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": ""}
    return subprocess.run(
        [sys.executable, "-m", "taxbench", "run", f"experiment.out_dir={tmp_path}", "experiment.name=job",
         "report.wandb=false", "report.html=false", "run.timeout_s=180", *overrides, "--", *command],
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "job" / "summary.json").read_text())


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", DDP, "--steps", "10", *args]


SAVE_RESUME = ("run.restart.save_args=[--save,{checkpoint},--save-step,5]",
               "run.restart.resume_args=[--resume,{checkpoint}]")


@pytest.mark.slow
def test_a_torchrun_ddp_script_passes_all_gates_while_its_nondeterministic_op_shows_in_the_baseline(
        tmp_path: Path) -> None:
    result = _taxbench_run(tmp_path, *SAVE_RESUME, command=_torchrun("--scatter-add"))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = _summary(tmp_path)
    outcomes = {v["gate"]: v["outcome"] for v in summary["verdicts"]}
    assert outcomes == {"repeatability": "identical", "restart_replay": "identical", "baseline_sanity": "differs"}
    restart = next(v for v in summary["verdicts"] if v["gate"] == "restart_replay")
    assert restart["from_step"] == 5 and restart["compared_steps"] == 5
    assert summary["tax"]["pairs"] == 2 and summary["world_size"] == 2
    manifest = json.loads((tmp_path / "job" / "deterministic-0" / "manifest.json").read_text())
    assert manifest["command"]["argv"][-3:] == ["--steps", "10", "--scatter-add"]
    assert manifest["policy_applied"]["use_deterministic_algorithms"] is True
    base = json.loads((tmp_path / "job" / "baseline-0" / "manifest.json").read_text())
    assert base["policy_applied"]["use_deterministic_algorithms"] is False
    # analyse reads the folder as a recipe experiment's, to the same verdict
    again = subprocess.run([sys.executable, "-m", "taxbench", "analyse", str(tmp_path / "job")], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and "pairs of whole runs" in again.stdout
    # verify and certificate of a command experiment: tests/test_run_verify.py


@pytest.mark.slow
def test_urandom_in_the_deterministic_arm_fails_repeatability_at_its_step(tmp_path: Path) -> None:
    result = _taxbench_run(tmp_path, "run.deterministic.args=[--urandom-step,4]", command=_torchrun())
    assert result.returncode == 3, result.stdout + result.stderr
    repeat = next(v for v in _summary(tmp_path)["verdicts"] if v["gate"] == "repeatability")
    # the noise lands after step 4's optimizer step: the gradients of step 5 are the first to differ
    assert repeat["first_mismatch"]["step"] == 5 and repeat["first_mismatch"]["rank"] in (0, 1)
    assert "restart_replay: not run" in result.stdout + result.stderr or \
        any("not run" in line for line in _summary(tmp_path)["incomplete"])


@pytest.mark.slow
def test_a_resume_that_forgets_the_rng_state_fails_restart_replay(tmp_path: Path) -> None:
    result = _taxbench_run(tmp_path, SAVE_RESUME[0], "run.restart.resume_args=[--resume,{checkpoint},--forget-rng]",
                           command=_torchrun())
    assert result.returncode == 3, result.stdout + result.stderr
    verdicts = {v["gate"]: v for v in _summary(tmp_path)["verdicts"]}
    assert verdicts["repeatability"]["outcome"] == "identical"
    assert verdicts["restart_replay"]["outcome"] == "differs"
    assert verdicts["restart_replay"]["first_mismatch"]["step"] == 6


@pytest.mark.slow
@pytest.mark.parametrize(("command", "code", "words"), [
    (_torchrun("--steps", "x"), 1, "the command exited with code"),
    (_torchrun("--no-optimizer"), 4, "none stepped a torch optimizer"),
    ([sys.executable, "-I", DDP, "--steps", "2"], 4, "probe never loaded"),
])
def test_a_command_that_fails_or_leaves_no_evidence_is_one_line_with_its_code(
        tmp_path: Path, command: list[str], code: int, words: str) -> None:
    result = _taxbench_run(tmp_path, command=command, timeout=200)
    assert result.returncode == code, result.stdout + result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
    if code == 1:
        assert "continue with:" in result.stderr and "experiment.continue_existing=true" in result.stderr


def _deepspeed_installed() -> bool:
    return (Path(sys.executable).parent / "deepspeed").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _deepspeed_installed(), reason="needs taxbench[deepspeed]")
@pytest.mark.parametrize(("stage", "width", "fp16"), [(2, 64, False), (3, 63, True)])
def test_a_deepspeed_script_with_its_json_passes_its_gates_under_its_own_launcher(
        tmp_path: Path, stage: int, width: int, fp16: bool) -> None:
    """At ZeRO-3 the model's parameters do not divide by the world of 2 (width 63): the last rank's flat partitions
    end in uninitialized padding, which the probe leaves out (fill_uninitialized_memory stays off). Under fp16 the
    loss scaler skips the steps that overflow (the first ones, from its initial scale, and a planted one): each is
    recorded as skipped. Restart replay runs through the script's own DeepSpeed checkpoint after step 4, after the
    first skips under fp16: the resumed process is placed by the saving run's records (docs/your-job.md)."""
    (tmp_path / "ds_config.json").write_text((PROGRAMS / "ds_config.json").read_text())
    edits = [f"run.{arm}.config_file=ds_config.json" for arm in ("baseline", "deterministic")]
    edits += [f"+run.{arm}.config_set={{zero_optimization.stage: {stage}, fp16.enabled: {str(fp16).lower()}}}"
              for arm in ("baseline", "deterministic")]
    launcher = str(Path(sys.executable).parent / "deepspeed")
    overflow = ["--cpu-fp16", "--overflow-step", "6"] if fp16 else []
    restart = ["run.restart.save_args=[--save,{checkpoint},--save-step,4]",
               "run.restart.resume_args=[--resume,{checkpoint}]"]
    command = [launcher, "--num_gpus", "2", str(PROGRAMS / "ds_train.py"), "--deepspeed_config", "ds_config.json",
               "--width", str(width), *overflow]
    result = _taxbench_run(tmp_path, *edits, *restart, command=command)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = _summary(tmp_path)
    verdicts = {v["gate"]: v for v in summary["verdicts"]}
    assert {gate: v["outcome"] for gate, v in verdicts.items()} == {
        "repeatability": "identical", "restart_replay": "identical", "baseline_sanity": "identical"}
    assert verdicts["restart_replay"]["from_step"] == 4 and verdicts["restart_replay"]["compared_steps"] == 4
    assert summary["world_size"] == 2 and summary["steps"] == 8
    manifest = json.loads((tmp_path / "job" / "deterministic-0" / "manifest.json").read_text())
    copy = Path(manifest["command"]["config_copy"])
    argv = manifest["command"]["argv"]
    assert argv[argv.index("--deepspeed_config") + 1] == str(copy)
    assert copy.parent == tmp_path / "job" / "deterministic-0"
    assert json.loads(copy.read_text())["zero_optimization"]["stage"] == stage
    assert json.loads((tmp_path / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
    for rank in (0, 1):
        records = [json.loads(line) for line in (tmp_path / "job" / "deterministic-0" / f"steps.rank{rank}.jsonl")
                   .open()]
        skipped = [r["step"] for r in records if r["skipped"]]
        assert (6 in skipped and 8 not in skipped) if fp16 else skipped == []
        assert all(r["calls"] == 0 for r in records if r["skipped"])


def _amp_save_resume(save_step: int) -> tuple[str, str]:
    return (f"run.restart.save_args=[--save,{{checkpoint}},--save-step,{save_step}]",
            "run.restart.resume_args=[--resume,{checkpoint}]")


@pytest.mark.slow
def test_a_step_the_loss_scaler_skips_is_recorded_as_skipped_and_repeats(tmp_path: Path) -> None:
    """The skip at step 3 leaves the optimizer's count a step behind the run's: the resume from the checkpoint after
    step 5 (count 4) is placed after step 5 by the saving run's records, and restart replay passes from there."""
    result = _taxbench_run(tmp_path, *_amp_save_resume(5),
                           command=[sys.executable, str(PROGRAMS / "amp_train.py"), "--overflow-step", "3"])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = _summary(tmp_path)
    verdicts = {v["gate"]: v for v in summary["verdicts"]}
    assert {gate: v["outcome"] for gate, v in verdicts.items()} == {
        "repeatability": "identical", "restart_replay": "identical", "baseline_sanity": "identical"}
    assert verdicts["restart_replay"]["from_step"] == 5 and verdicts["restart_replay"]["compared_steps"] == 3
    assert not summary["nonfinite"]  # the overflow the scaler caught is no divergence
    records = [json.loads(line) for line in (tmp_path / "job" / "deterministic-0" / "steps.rank0.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["step"] for r in records if r["skipped"]] == [3]
    assert records[2]["params"] == records[1]["params"] and records[2]["loss_bits"] == "7f800000"
    assert records[2]["optimizer_step"] == records[3]["optimizer_step"] - 1 == 2


@pytest.mark.slow
@pytest.mark.parametrize(("steps", "code"), [(8, 1), (3, 4)])
def test_a_resume_from_a_checkpoint_next_to_a_skipped_step_is_refused_not_guessed(
        tmp_path: Path, steps: int, code: int) -> None:
    """Saved after step 2, then step 3 skipped: both left the optimizer at count 2, so the step the resumed process
    continues from is not known. With steps to go the probe stops the resumed command with the reason (exit 1); when
    its one step is closed only as the process exits, the process records nothing of its own (exit 4). Never a pass:
    the saving process's records are no evidence of the resume."""
    result = _taxbench_run(tmp_path, *_amp_save_resume(2), command=[
        sys.executable, str(PROGRAMS / "amp_train.py"), "--overflow-step", "3", "--steps", str(steps)])
    assert result.returncode == code, result.stdout + result.stderr
    assert "deterministic-resumed" in result.stderr
    log = (tmp_path / "job" / "deterministic-resumed" / "command.log").read_text()
    assert "held after steps [2, 3] (a loss scaler skipped steps there)" in log
    if code == 4:
        assert "the resumed process recorded no step of its own" in result.stderr


@pytest.mark.slow
def test_a_hugging_face_trainer_script_passes_its_gates(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    # the Trainer's own checkpoint-4 (optimizer, scheduler, RNG states), and its own resume from it
    restart = ["run.restart.save_args=[--output,{checkpoint},--save-steps,4]",
               "run.restart.resume_args=[--output,{checkpoint},--resume,{checkpoint}/checkpoint-4]"]
    result = _taxbench_run(tmp_path, *restart, command=[sys.executable, str(PROGRAMS / "hf_train.py"), "--output",
                                                        str(tmp_path / "hf-out")])
    assert result.returncode == 0, result.stdout + result.stderr
    verdicts = {v["gate"]: v for v in _summary(tmp_path)["verdicts"]}
    assert {gate: v["outcome"] for gate, v in verdicts.items()} == {
        "repeatability": "identical", "restart_replay": "identical", "baseline_sanity": "identical"}
    assert verdicts["restart_replay"]["from_step"] == 4 and verdicts["restart_replay"]["compared_steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "job" / "deterministic-0" / "steps.rank0.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 7)) and all(r["loss_bits"] for r in records)


def test_no_command_after_the_separator_is_bad_input(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "taxbench", "run", f"experiment.out_dir={tmp_path}", "--"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no command after `--`" in result.stderr
    assert "Traceback" not in result.stderr and not any(tmp_path.iterdir())
