"""Reading commands touch only what they were pointed at; odd files in a run folder never hang or crash analysis; a
refused analysis withdraws the verdict it would otherwise leave behind; unreadable records are exit 4 everywhere."""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rich.console import Console

from taxbench import exit_codes
from taxbench.analysis.document import HTML_FILE, MARKDOWN_FILE, REPORT_DIR
from taxbench.analysis.publish import WITHDRAWN, publish, read_and_report
from taxbench.analysis.summary import SUMMARY_FILE
from taxbench.analysis.sweep import SWEEP_FILE
from taxbench.analysis.synthetic import SyntheticExperiment, change_config, write_experiment
from taxbench.cli import subcommand
from taxbench.config.schema import ReportConfig
from taxbench.rundir.evidence import NotEvidence, check_regular
from taxbench.rundir.experiment_folder import LOCK_FILE, SWEEP_MARKER, held_by, is_marked_sweep, mark_sweep
from taxbench.rundir.read import RecordError, UnreadableRecords, load_run
from taxbench.rundir.step_stream import mirror_file, run_mirror_file

SMALL = {"ranks": 2, "steps": 12, "block_steps": 3, "resume_step": 6}
QUIET = Console(file=open(os.devnull, "w"))  # noqa: SIM115 (lives as long as the tests)
HTML = ReportConfig(html=True, wandb=False)
TEXT = ReportConfig(html=False, wandb=False)  # no report/: its plots cost seconds


def _tree(folder: Path) -> dict[str, str]:
    """Every file below folder (not following symlinks) -> sha256 of its bytes: the folder byte for byte."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and not path.is_symlink()}


def _experiment(where: Path, seed: int = 1) -> Path:
    return write_experiment(where, SyntheticExperiment(seed=seed, **SMALL))


def _cli_all(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """As _cli, with stdout and stderr together."""
    capsys.readouterr()
    try:
        code = subcommand(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """`taxbench <argv>` through the command line's own entry, in this process: (exit code, stderr)."""
    capsys.readouterr()
    try:
        code = subcommand(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


# -------------------------------------------------------------------------------------- rule 1: what was pointed at
def test_report_of_a_folder_of_two_unrelated_experiments_exits_2_and_touches_neither(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    _experiment(shared / "alice" / "exp-a", seed=1)
    _experiment(shared / "bob" / "exp-b", seed=2)
    before = _tree(shared)
    for command in ("report", "analyse"):
        code, err = _cli(capsys, command, str(shared))
        assert code == exit_codes.CONFIG_ERROR, err
        assert "found 2 experiment folders below it (alice/exp-a, bob/exp-b)" in err
        assert f"taxbench report {shared / 'alice' / 'exp-a'}" in err
        assert _tree(shared) == before  # byte-identical, and nothing new (no sweep.csv, no report/)


@pytest.mark.slow
def test_report_of_a_shared_folder_exits_2_as_a_process(tmp_path: Path, taxbench_cli) -> None:
    shared = tmp_path / "shared"
    _experiment(shared / "alice" / "exp-a", seed=1)
    _experiment(shared / "bob" / "exp-b", seed=2)
    before = _tree(shared)
    result = taxbench_cli("report", str(shared), cwd=tmp_path)
    assert result.returncode == exit_codes.CONFIG_ERROR and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"taxbench: error: {shared} is neither an experiment folder")
    assert _tree(shared) == before


def test_an_empty_or_foreign_folder_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not an experiment")
    with pytest.raises(RecordError, match=r"holds 1 entry and no experiment within 3 levels; name an experiment"):
        publish(tmp_path, HTML, console=QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    root = _experiment(tmp_path / "exp")
    with pytest.raises(RecordError, match=rf"is one run of an experiment, .*: taxbench report {root}$"):
        publish(root / "baseline-0", HTML, console=QUIET)


def test_a_sweep_folder_a_multirun_marked_is_reported_as_a_whole(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    mark_sweep(sweep)
    assert is_marked_sweep(sweep)
    _experiment(sweep / "point0", seed=1)
    _experiment(sweep / "point1", seed=2)
    assert publish(sweep, TEXT, console=QUIET).exit_code == exit_codes.OK
    assert (sweep / SWEEP_FILE).is_file() and (sweep / "point1" / SUMMARY_FILE).is_file()


def test_mark_sweep_leaves_a_folder_that_already_holds_something_unmarked(tmp_path: Path) -> None:
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "data.csv").write_text("1,2\n")
    mark_sweep(tmp_path / "theirs")
    assert not (tmp_path / "theirs" / SWEEP_MARKER).exists()
    mark_sweep(tmp_path / "new" / "sweep")
    mark_sweep(tmp_path / "new" / "sweep")  # a second point of the same multirun
    assert is_marked_sweep(tmp_path / "new" / "sweep")


def test_a_multirun_marks_its_sweep_folder(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from taxbench.launchers.multirun import MULTIRUN_YAML, MultirunReport

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "runs" / "sweep-1")}}})
    MultirunReport().on_multirun_start(config)
    assert is_marked_sweep(tmp_path / "runs" / "sweep-1")
    assert (tmp_path / "runs" / "sweep-1" / MULTIRUN_YAML).is_symlink()


@contextmanager
def _held_elsewhere(root: Path) -> Iterator[None]:
    """`root` held by a live launch of another process, whose lock file names pid 4242 on host elsewhere (record
    locks of this process never conflict with its own probe)."""
    with open(root / LOCK_FILE, "a+", encoding="utf-8") as lock:
        lock.write(json.dumps({"pid": 4242, "host": "elsewhere", "started_utc": "2026-12-05T11:00:00+00:00"}))
        lock.flush()
        holder = os.fork()
        if holder == 0:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            time.sleep(3600)  # until killed below, however long the test takes on a loaded machine
            os._exit(0)
        try:
            deadline = time.monotonic() + 120
            while held_by(root) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held_by(root) is not None
            yield
        finally:
            os.kill(holder, 9)
            os.waitpid(holder, 0)


RUNNING_BY = "is running: the launch with pid 4242 on host elsewhere (started 2026-12-05T11:00:00+00:00) still writes"


def test_a_folder_a_live_launch_holds_is_analysed_read_only(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    root = _experiment(tmp_path / "exp")
    for stream in root.glob("*/steps.rank*.jsonl"):
        mirror_file(stream).unlink()  # analysis would write them again
    with _held_elsewhere(root):
        before = _tree(root)
        for command in ("analyse", "report"):
            code, err = _cli(capsys, command, str(root))
            # Complete records so far, but the launch may still add to them: no verdict yet.
            assert code == exit_codes.INCOMPLETE, err
            assert f"{root} {RUNNING_BY}" in err and "analysed read-only" in err
            assert _tree(root) == before and not (root / SUMMARY_FILE).exists() and not (root / REPORT_DIR).exists()
    assert held_by(root) is None  # the holder died: the folder is writable again
    assert read_and_report(root, TEXT) == exit_codes.OK
    assert (root / SUMMARY_FILE).is_file() and mirror_file(root / "baseline-0" / "steps.rank0.jsonl").is_file()
    assert run_mirror_file(root / "baseline-0").is_file()  # and the run mirror the next analysis reads


def test_a_running_experiment_whose_later_runs_have_not_started_is_named_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _experiment(tmp_path / "exp")
    for name in ("deterministic-resumed", "baseline-1"):  # the launch has not got to them yet
        for path in sorted((root / name).iterdir()):
            path.unlink()
        (root / name).rmdir()
    with _held_elsewhere(root):
        before = _tree(root)
        code, out_and_err = _cli_all(capsys, "analyse", str(root))
        assert code == exit_codes.INCOMPLETE, out_and_err
        assert "missing manifest" not in out_and_err and "Traceback" not in out_and_err
        assert "running: no verdict yet" in out_and_err, out_and_err
        assert "(the launch with pid 4242 on host elsewhere still records it)" in out_and_err, out_and_err
        assert "not started yet (the experiment is running)" in " ".join(out_and_err.split())
        assert _tree(root) == before and not (root / SUMMARY_FILE).exists()
        assert read_and_report(root, HTML) == exit_codes.INCOMPLETE  # the API, a report asked for: none written
        assert _tree(root) == before and not (root / REPORT_DIR).exists()
        # Nothing started at all: said so in one line, exit 4.
        for name in ("baseline-0", "deterministic-0", "deterministic-1"):
            (root / name / "manifest.json").unlink()
        code, err = _cli(capsys, "analyse", str(root))
        assert code == exit_codes.INCOMPLETE and f"{root} is running (the launch with pid 4242" in err, err
        assert "has not started its runs yet" in err and len(err.strip().splitlines()) == 2, err  # + the warning


def test_verify_and_certificate_of_a_running_experiment_are_refused_naming_its_launch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], taxbench_cli) -> None:
    root = _experiment(tmp_path / "exp")
    with _held_elsewhere(root):
        before = _tree(tmp_path)
        for argv in (["verify", str(root)], ["verify", str(root / "deterministic-0")],
                     ["certificate", str(root), "-o", str(tmp_path / "exp.cert")]):
            done = taxbench_cli(*argv, cwd=tmp_path, timeout=600)
            code, err = done.returncode, done.stderr
            assert code == exit_codes.CONFIG_ERROR, err
            assert err.startswith(f"taxbench: error: {root} {RUNNING_BY}") and err.count("\n") == 1, err
            assert "wait for that launch to end" in err
        assert _tree(tmp_path) == before  # no rerun beside it, no mirror inside it, no certificate


@pytest.mark.slow
def test_a_fifo_as_a_step_stream_is_incomplete_evidence_within_seconds(tmp_path: Path, taxbench_cli) -> None:
    root = _experiment(tmp_path / "exp")
    stream = root / "deterministic-1" / "steps.rank0.jsonl"
    stream.unlink()
    os.mkfifo(stream)
    # A reader that opened the FIFO would block until a writer came, i.e. forever: the subprocess's time limit (a
    # TimeoutExpired) tells that apart on any machine, however loaded.
    result = taxbench_cli("analyse", str(root), cwd=tmp_path, timeout=600)
    assert result.returncode == exit_codes.INCOMPLETE, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{stream}: cannot be read ({stream}: a FIFO (named pipe), not a regular file" in result.stderr


@pytest.mark.parametrize("name", ["steps.rank0.jsonl", "steps.rank0.arrow", "steps.arrow", "manifest.json",
                                  "faults.rank0.jsonl"])
def test_a_fifo_anywhere_in_a_run_folder_never_blocks_analysis(tmp_path: Path, name: str) -> None:
    root = _experiment(tmp_path / "exp")
    target = root / "deterministic-1" / name
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    os.mkfifo(root / "stop.json.fifo")
    (root / "stop.json").unlink()
    (root / "stop.json").symlink_to(root / "stop.json.fifo")
    try:
        code = publish(root, TEXT, console=QUIET).exit_code  # a mirror that is a FIFO is merely unusable
    except UnreadableRecords as exc:
        code = exc.exit_code
        assert f"{target}: cannot be read" in str(exc) and "FIFO" in str(exc)
    assert code == exit_codes.INCOMPLETE


def test_a_symlink_to_a_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    root = _experiment(tmp_path / "exp")
    stream = root / "baseline-0" / "steps.rank1.jsonl"
    stream.unlink()
    stream.symlink_to("/dev/zero")
    with pytest.raises(UnreadableRecords, match=r"steps.rank1.jsonl: a symlink to /dev/zero, outside the experiment"):
        load_run(root / "baseline-0")


def test_a_symlink_that_leaves_the_experiment_is_named_and_refused(tmp_path: Path) -> None:
    other = _experiment(tmp_path / "other", seed=2)
    root = _experiment(tmp_path / "exp")
    stream = root / "deterministic-0" / "steps.rank0.jsonl"
    stream.unlink()
    stream.symlink_to(other / "deterministic-0" / "steps.rank0.jsonl")
    with pytest.raises(UnreadableRecords, match=rf"a symlink to {other}/deterministic-0/steps.rank0.jsonl, outside"):
        publish(root, TEXT, console=QUIET)
    # A symlink between the experiment's own files stays inside it: allowed.
    inside = root / "deterministic-0" / "copy.jsonl"
    inside.symlink_to(root / "deterministic-1" / "steps.rank0.jsonl")
    assert check_regular(inside, root).st_size > 0
    with pytest.raises(NotEvidence, match="a folder"):
        check_regular(root / "deterministic-0", tmp_path)


# ------------------------------------------------------------------------------------------ rule 4: no stale verdict
def test_a_refused_analysis_withdraws_the_earlier_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _experiment(tmp_path / "exp")
    assert publish(root, HTML, console=QUIET).exit_code == exit_codes.OK
    assert json.loads((root / SUMMARY_FILE).read_text())["outcome"] == "passed"
    (root / "deterministic-0" / "manifest.json").unlink()
    code, err = _cli(capsys, "analyse", str(root))
    assert code == exit_codes.CONFIG_ERROR, err
    assert "deterministic-0/manifest.json: missing manifest" in err
    summary = json.loads((root / SUMMARY_FILE).read_text())
    assert summary["outcome"] == WITHDRAWN and summary["exit_code"] == 2 and not summary["deterministic_ok"]
    assert "missing manifest" in summary["withdrawn"]
    for name in (HTML_FILE, MARKDOWN_FILE):
        text = (root / REPORT_DIR / name).read_text()
        assert "withdrawn" in text and "passed" not in text and "deterministic: yes" not in text
    assert not any("passed" in path.read_text(errors="replace") for path in root.glob("*.json"))


def test_unreadable_records_withdraw_the_earlier_pass_too(tmp_path: Path) -> None:
    root = _experiment(tmp_path / "exp")
    assert publish(root, TEXT, console=QUIET).exit_code == exit_codes.OK
    with open(root / "baseline-1" / "steps.rank0.jsonl", "a") as stream:
        stream.write("not json\n")
    with pytest.raises(UnreadableRecords):
        publish(root, TEXT, console=QUIET)
    assert json.loads((root / SUMMARY_FILE).read_text())["outcome"] == WITHDRAWN


# ------------------------------------------------------------------------------ rule 5: one exit code per problem
@pytest.mark.parametrize("damage", ["not json", "[1, 2]", '{"schema_version": 3, "step": "seven"}'])
def test_unreadable_step_records_exit_4(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    root = _experiment(tmp_path / "exp")
    with open(root / "deterministic-1" / "steps.rank1.jsonl", "a") as stream:
        stream.write(damage + "\n")
    code, err = _cli(capsys, "analyse", str(root))
    assert code == exit_codes.INCOMPLETE, err
    assert err.startswith("taxbench: error: ") and "steps.rank1.jsonl" in err


def test_a_damaged_manifest_is_unreadable_evidence_but_a_missing_one_is_no_experiment(tmp_path: Path) -> None:
    root = _experiment(tmp_path / "exp")
    manifest = root / "baseline-1" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(UnreadableRecords) as damaged:
        publish(root, TEXT, console=QUIET)
    assert damaged.value.exit_code == exit_codes.INCOMPLETE
    manifest.unlink()
    with pytest.raises(RecordError) as missing:
        publish(root, TEXT, console=QUIET)
    assert missing.value.exit_code == exit_codes.CONFIG_ERROR


def test_a_manifest_config_the_schema_refuses_is_unreadable_evidence(tmp_path: Path) -> None:
    """The analysis reads the experiment's settings typed (the schema's defaults, none of its own): a recorded config
    the schema cannot load is a damaged manifest (exit 4), named, and no verdict is written."""
    root = _experiment(tmp_path / "exp")
    change_config(root, lambda config: config["experiment"].update(planted_tax="a lot"))
    with pytest.raises(UnreadableRecords, match=r"deterministic-0/manifest.json: its config does not load") as refused:
        publish(root, TEXT, console=QUIET)
    assert refused.value.exit_code == exit_codes.INCOMPLETE and "planted_tax" in str(refused.value)
    assert not (root / SUMMARY_FILE).exists()


# ------------------------------------------------------------------------------- rule 3: non-finite training named
def _set_value(root: Path, runs: tuple[str, ...], metric: str, value: float, from_step: int, rank: int) -> None:
    """`metric` := value in the records of `runs` from (from_step, rank) on (later steps: every rank), as a trainer
    that diverged there writes them (json.dumps writes NaN and Infinity)."""
    for run in runs:
        for stream in (root / run).glob("steps.rank*.jsonl"):
            records = [json.loads(line) for line in stream.read_text().splitlines()]
            for record in records:
                if record["step"] > from_step or (record["step"] == from_step and record["rank"] >= rank):
                    record[metric] = value
            stream.write_text("".join(json.dumps(record) + "\n" for record in records))


DETERMINISTIC = ("deterministic-0", "deterministic-1", "deterministic-resumed")


def test_a_nan_loss_in_both_deterministic_runs_is_never_a_pass(tmp_path: Path) -> None:
    root = _experiment(tmp_path / "exp")
    _set_value(root, DETERMINISTIC, "loss", float("nan"), from_step=7, rank=1)
    console = Console(file=open(os.devnull, "w"), record=True, width=300)  # noqa: SIM115
    published = publish(root, HTML, console=console)
    assert published.exit_code == exit_codes.INCOMPLETE and not published.deterministic_ok
    shown = console.export_text()
    assert "training diverged: deterministic-0: loss NaN first at step 7, rank 1" in shown
    assert "bitwise identical" in shown  # the bits do agree; they just prove nothing
    summary = json.loads((root / SUMMARY_FILE).read_text())
    assert summary["outcome"] == "diverged" and summary["exit_code"] == exit_codes.INCOMPLETE
    first = summary["nonfinite"][0]
    assert (first["run"], first["metric"], first["value"], first["step"], first["rank"]) == (
        "deterministic-0", "loss", "NaN", 7, 1)
    assert "Non-finite training" in (root / REPORT_DIR / MARKDOWN_FILE).read_text()
    equivalence = summary["equivalence"]
    assert equivalence["nonfinite_steps"] > 0 and equivalence["first_nonfinite_step"] >= 7
    assert equivalence["max_deviation"] is not None or equivalence["max_deviation_missing"]
    from taxbench.analysis.summary import analyse_experiment
    from taxbench.analysis.wandb_log import summary_values

    logged = summary_values(analyse_experiment(root).summary)  # the wandb run summary
    assert logged["diverged"] and logged["outcome"] == "diverged" and logged["exit_code"] == exit_codes.INCOMPLETE
    assert logged["nonfinite"].startswith("deterministic-0: loss NaN first at step 7, rank 1")


def test_a_proven_difference_outranks_divergence(tmp_path: Path) -> None:
    from taxbench.analysis.synthetic import Injection

    root = write_experiment(tmp_path / "exp", SyntheticExperiment(seed=1, **SMALL),
                            Injection("deterministic-1", step=3, rank=0))
    _set_value(root, DETERMINISTIC, "grad_norm", float("inf"), from_step=9, rank=0)
    assert publish(root, TEXT, console=QUIET).exit_code == exit_codes.NOT_DETERMINISTIC


def test_a_non_finite_baseline_is_named_but_decides_nothing(tmp_path: Path) -> None:
    root = _experiment(tmp_path / "exp")
    _set_value(root, ("baseline-1",), "grad_norm", float("-inf"), from_step=11, rank=0)
    assert publish(root, TEXT, console=QUIET).exit_code == exit_codes.OK
    summary = json.loads((root / SUMMARY_FILE).read_text())
    assert summary["outcome"] == "passed" and summary["nonfinite"] == [
        {"run": "baseline-1", "metric": "grad_norm", "value": "-Inf", "step": 11, "rank": 0, "records": 4}]


def test_equivalence_says_why_max_deviation_is_missing() -> None:
    import numpy as np
    import pandas as pd

    from taxbench.analysis.equivalence import compare_loss_curves

    steps = pd.Index(range(1, 21))
    base = pd.Series(5.0 / np.sqrt(steps), index=steps)
    partly = base.copy()
    partly.loc[15:] = np.nan
    result = compare_loss_curves(base, base + 1e-6, partly).to_dict()
    assert result["max_deviation"] is not None and math.isfinite(result["max_deviation"])
    assert result["nonfinite_steps"] == 6 and result["first_nonfinite_step"] == 15
    assert "deterministic loss not finite at 6 of 20 steps (first: step 15)" in result["description"]
    nothing = compare_loss_curves(base, base + 1e-6, base * np.nan).to_dict()
    assert math.isnan(nothing["max_deviation"]) and nothing["max_deviation_missing"].startswith(
        "deterministic loss not finite at 20 of 20 steps")
    baseline_nan = compare_loss_curves(base * np.nan, base, base).to_dict()
    assert baseline_nan["max_deviation_missing"] == "not evaluated: baseline loss not finite at step 1"


def test_unreadable_trace_records_are_exit_4_and_a_fifo_never_blocks(tmp_path: Path) -> None:
    from taxbench.tracing.trace_io import TraceError, UnreadableTrace, read_trace, trace_file

    run = tmp_path / "exp" / "deterministic-0"
    trace_file(run, 0).parent.mkdir(parents=True)
    trace_file(run, 0).write_text("{garbage\n")
    with pytest.raises(UnreadableTrace, match=r"trace.rank0.jsonl:1: not a JSON record") as corrupt:
        read_trace(run)
    assert corrupt.value.exit_code == exit_codes.INCOMPLETE
    trace_file(run, 0).unlink()
    os.mkfifo(trace_file(run, 0))
    with pytest.raises(UnreadableTrace, match=r"a FIFO \(named pipe\), not a regular file"):
        read_trace(run)
    trace_file(run, 0).unlink()
    with pytest.raises(TraceError, match="no trace.rank<R>.jsonl files") as nothing:
        read_trace(run)
    assert nothing.value.exit_code == exit_codes.CONFIG_ERROR  # nothing captured: bad input, not damaged evidence


def test_a_huge_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    root = _experiment(tmp_path / "exp")
    manifest = root / "baseline-1" / "manifest.json"
    with open(manifest, "r+b") as handle:
        handle.truncate(1 << 30)  # sparse: a gigabyte that costs no disk
    with pytest.raises(UnreadableRecords, match=r"manifest.json: cannot be read \(.*1073741824 bytes, more than"):
        publish(root, TEXT, console=QUIET)
