"""Reports, sweeps, the fast record loader, redaction and the compact console summary."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest
from rich.console import Console

from taxbench import exit_codes
from taxbench.analysis.console import render, render_sweep
from taxbench.analysis.document import HTML_FILE, MARKDOWN_FILE, REPORT_DIR
from taxbench.analysis.publish import publish
from taxbench.analysis.report import STEP_TIME_PNG, SWEEP_PNG
from taxbench.analysis.summary import analyse_experiment
from taxbench.analysis.sweep import SWEEP_FILE, analyse_sweep, find_experiments
from taxbench.analysis.synthetic import Injection, SyntheticExperiment, change_config, write_experiment
from taxbench.config.schema import ReportConfig
from taxbench.redaction import REDACTED, redact, redact_text
from taxbench.rundir.experiment_folder import mark_sweep
from taxbench.rundir.read import RecordError, load_run
from taxbench.rundir.records import SCHEMA_VERSION
from taxbench.rundir.run_manifest import Manifest
from taxbench.rundir.step_stream import RUN_MIRROR

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NO_WANDB = ReportConfig(html=True, wandb=False)


@pytest.fixture
def failing_experiment(tmp_path: Path) -> Path:
    return write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=3, tax=0.05, seed=1),
                            Injection("deterministic-1", step=30, rank=2, metric="params"))


# ------------------------------------------------------------------------------------------------- record loading
def test_loader_reads_every_record_through_the_mirrors_and_refreshes_them(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=3, steps=12, block_steps=3, resume_step=6))
    run = root / "baseline-0"
    assert sorted(p.name for p in run.glob("steps.rank*.arrow")) == [f"steps.rank{r}.arrow" for r in range(3)]
    with mock.patch("taxbench.rundir.step_stream.parse_records", side_effect=AssertionError("parsed the JSONL")):
        frame = load_run(run, leave_mirrors=True)  # the ranks' mirrors cover every line: nothing is parsed
    assert len(frame) == 36 and list(frame[["rank", "step"]].iloc[11:14].itertuples(index=False)) == [
        (0, 12), (1, 1), (1, 2)]
    assert frame.equals(load_run(run, use_mirrors=False))
    stream = run / "steps.rank1.jsonl"
    with stream.open("a") as f:  # lines the mirror does not cover yet: parsed, then mirrored too
        f.write(json.dumps({**json.loads(stream.read_text().splitlines()[-1]), "step": 13}) + "\n")
    assert len(load_run(run, leave_mirrors=True)) == 37
    parsed = load_run(run, use_mirrors=False)
    with mock.patch("taxbench.rundir.step_stream.parse_records", side_effect=AssertionError("parsed the JSONL")):
        assert load_run(run, leave_mirrors=True).equals(parsed)


def test_loader_tolerates_a_torn_last_line_and_names_bad_lines(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    stream = root / "baseline-0" / "steps.rank0.jsonl"
    text = stream.read_text()
    stream.write_text(text + '{"schema_version":1,"step":1')  # a crash mid-write
    assert len(load_run(root / "baseline-0")) == 24
    lines = text.splitlines()
    lines[4] = lines[4][:30]
    stream.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecordError, match=rf"{re.escape(str(stream))}:5: not a JSON record"):
        load_run(root / "baseline-0")
    stream.write_text(text.replace(f'"schema_version":{SCHEMA_VERSION}', '"schema_version":7', 1))
    expected = rf"steps.rank0.jsonl:1: schema_version=7, this taxbench reads {SCHEMA_VERSION}"
    with pytest.raises(RecordError, match=expected):
        load_run(root / "baseline-0")


def test_a_mirror_is_tied_to_the_bytes_of_its_stream(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    run = root / "deterministic-0"
    stream = run / "steps.rank1.jsonl"
    before = stream.stat()
    text = stream.read_text()
    digit = text.index('"params":"') + len('"params":"')
    edited = text[:digit] + ("1" if text[digit] != "1" else "2") + text[digit + 1:]  # same size
    stream.write_text(edited)
    os.utime(stream, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same mtime: only the bytes tell
    assert load_run(run, leave_mirrors=True).equals(load_run(run, use_mirrors=False))
    flipped = load_run(run, leave_mirrors=True)["params"] != load_run(run.parent / "deterministic-1")["params"]
    assert flipped.sum() == 1
    stream.write_text(text[: text.index("\n") + 1])  # cut back to one line: the mirror claims more than there is
    assert len(load_run(run, leave_mirrors=True)) == 12 + 1


@pytest.mark.parametrize("name", ["steps.rank0.arrow", RUN_MIRROR])
def test_every_flipped_byte_of_a_mirror_is_caught(tmp_path: Path, name: str) -> None:
    """A single-byte flip anywhere in steps.rank<R>.arrow or the run's steps.arrow (header, data, metadata, trailer)
    fails the mirror's own hash: the run is read stream by stream and the frame read back always equals the true one."""
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    run = root / "baseline-0"
    truth = load_run(run, use_mirrors=False)
    load_run(run, leave_mirrors=True)  # leaves the run mirror
    mirror = run / name
    good = mirror.read_bytes()
    offsets = sorted(set(range(0, len(good), max(1, len(good) // 300))) | set(range(len(good) - 64, len(good))))
    for offset in offsets:
        flipped = bytearray(good)
        flipped[offset] ^= 0xFF
        mirror.write_bytes(bytes(flipped))
        if name != RUN_MIRROR:
            (run / RUN_MIRROR).unlink()  # else the intact run mirror is read and this one never looked at
        read_back = load_run(run, leave_mirrors=True)
        assert read_back.equals(truth), f"a flip at byte {offset} of {len(good)} changed the frame"
        assert mirror.read_bytes() == good, f"a flip at byte {offset} went unnoticed"  # caught and rewritten


# ----------------------------------------------------------------------------------------------- experiment report
def test_experiment_report_is_self_contained_and_shows_tax_gates_and_differences(failing_experiment: Path) -> None:
    published = publish(failing_experiment, NO_WANDB, console=Console(file=open("/dev/null", "w")))
    assert not published.deterministic_ok
    out = failing_experiment / REPORT_DIR
    assert published.report == out / HTML_FILE
    page = (out / HTML_FILE).read_text()
    summary = json.loads((failing_experiment / "summary.json").read_text())
    tax = summary["tax"]
    assert f"{tax['tax'] * 100:+.2f}%" in page and f"{tax['low'] * 100:+.2f}%" in page
    assert "step 30, rank 2, params" in page and "ffffffffffffffff" in page
    # First screen: the verdict with the localize command to copy, then the gates with the failing one in red.
    root = failing_experiment
    localize = f"<code>taxbench localize {root / 'deterministic-0'} {root / 'deterministic-1'}</code>"
    assert page.index("deterministic: NO") < page.index(localize) < page.index("<tr class='bad'><td>repeatability")
    assert page.index("<tr class='bad'><td>repeatability") < page.index("<h2>Determinism tax</h2>")
    assert "data:image/png;base64," in page
    assert not re.search(r"(src|href)=['\"](https?:|//)", page)  # nothing fetched from elsewhere
    # the arms' differing settings are highlighted, identical ones are not
    assert re.search(r"<tr class='hl'><td>policy\.deterministic</td><td>False</td><td>True</td>", page)
    assert re.search(r"<tr><td>layout\.world_size</td><td>3</td><td>3</td>", page)
    markdown = (out / MARKDOWN_FILE).read_text()
    assert f"]({STEP_TIME_PNG})" in markdown and "**DIFFERS**" in markdown
    assert (out / STEP_TIME_PNG).read_bytes().startswith(PNG_MAGIC)


def test_console_summary_is_compact(failing_experiment: Path) -> None:
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    render(analyse_experiment(failing_experiment).summary, console)
    lines = console.export_text().rstrip().splitlines()
    table, paths = lines[:-2], lines[-2:]  # paths and commands are never folded, so they can be copied whole
    assert len(table) <= 12 and all(len(line) <= 80 for line in table)
    # The verdict breaks between its phrases, never inside one ("rank | 2, params)" was seen at 80 columns).
    assert lines[1].rstrip() == "verdict          deterministic: NO"
    assert lines[2].strip() == "(repeatability differs first at step 30, rank 2, params)"
    root = failing_experiment
    assert paths == [f"localize         taxbench localize {root / 'deterministic-0'} {root / 'deterministic-1'}",
                     f"results          {root}"]
    assert any(line.startswith("repeatability") and "DIFFERS" in line and "step 30, rank 2" in line for line in lines)


# --------------------------------------------------------------------------------------- fail closed: incomplete runs
DET_RUNS = ("deterministic-0", "deterministic-1", "deterministic-resumed")
QUIET = Console(file=open(os.devnull, "w"))


@pytest.fixture
def last_step_failure(tmp_path: Path) -> Path:
    """The issue's scenario: repeatability fails at the last step on rank 1 only."""
    return write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=60, seed=3),
                            Injection("deterministic-1", step=60, rank=1, metric="params"))


def _console_text(root: Path) -> str:
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    render(analyse_experiment(root).summary, console)
    return console.export_text()


def _truncate(stream: Path, last_step: int) -> None:
    lines = stream.read_text().splitlines(keepends=True)
    stream.write_text("".join(line for line in lines if json.loads(line)["step"] <= last_step))


def test_deleting_a_rank_stream_everywhere_is_incomplete_not_a_pass(last_step_failure: Path) -> None:
    root = last_step_failure
    assert publish(root, NO_WANDB, console=QUIET).exit_code == exit_codes.NOT_DETERMINISTIC
    for stream in root.glob("*/steps.rank1.jsonl"):
        stream.unlink()
    published = publish(root, NO_WANDB, console=QUIET)
    assert published.exit_code == exit_codes.INCOMPLETE and not published.deterministic_ok
    summary = json.loads((root / "summary.json").read_text())
    assert summary["outcome"] == "incomplete" and summary["exit_code"] == 4 and summary["world_size"] == 2
    assert "deterministic-1 rank 1: no steps.rank1.jsonl (all 60 steps missing)" in summary["incomplete"]
    assert [v["outcome"] for v in summary["verdicts"][:2]] == ["incomplete", "incomplete"]
    text = _console_text(root)
    assert re.search(r"repeatability\s+INCOMPLETE", text) and "deterministic-0 rank 1: no steps.rank1.jsonl" in text
    markdown = (root / REPORT_DIR / MARKDOWN_FILE).read_text()
    assert "**deterministic: no verdict, incomplete evidence: " in markdown
    assert "deterministic-resumed rank 1: no steps.rank1.jsonl" in markdown
    assert "bitwise identical" not in markdown.split("## Bitwise gates")[1].split("baseline_sanity")[0]


def test_truncating_the_deterministic_runs_before_the_failure_is_incomplete(last_step_failure: Path) -> None:
    root = last_step_failure
    for name in DET_RUNS:
        for stream in (root / name).glob("steps.rank*.jsonl"):
            _truncate(stream, 29)
    published = publish(root, NO_WANDB, console=QUIET)
    assert published.exit_code == exit_codes.INCOMPLETE and not published.deterministic_ok
    summary = json.loads((root / "summary.json").read_text())
    assert summary["incomplete"] == [f"{name} ranks 0-1: steps 30-60 missing" for name in DET_RUNS]
    assert "steps 30-60 missing" in _console_text(root)
    assert "deterministic-1 ranks 0-1: steps 30-60 missing" in (root / REPORT_DIR / HTML_FILE).read_text()


def test_duplicated_records_and_a_rank_outside_the_world_are_incomplete(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    stream = root / "deterministic-1" / "steps.rank0.jsonl"
    stream.write_text(stream.read_text() * 2)  # a resumed run that did not drop its records past the checkpoint
    summary = analyse_experiment(root).summary
    assert summary.exit_code == exit_codes.INCOMPLETE and not summary.deterministic_ok
    assert summary.problems == ["deterministic-1 rank 0: steps 1-12 recorded more than once"]
    stream.write_text(stream.read_text()[: len(stream.read_text()) // 2])
    assert analyse_experiment(root).summary.exit_code == exit_codes.OK
    (root / "baseline-1" / "steps.rank2.jsonl").write_text((root / "baseline-1" / "steps.rank1.jsonl").read_text())
    summary = analyse_experiment(root).summary
    assert summary.exit_code == exit_codes.INCOMPLETE and summary.deterministic_ok  # the strict gates' runs are whole
    assert summary.problems[0].startswith("baseline-1 rank 2: steps.rank2.jsonl outside its world of 2 ranks")


def test_a_run_without_any_record_is_incomplete_and_still_reported(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    for stream in (root / "deterministic-0").glob("steps.rank*.jsonl"):
        stream.unlink()  # crashed before its first step: no tax, no gate, but a report that says why
    (root / "baseline-1" / "steps.rank0.jsonl").write_text("")
    published = publish(root, NO_WANDB, console=QUIET)
    assert published.exit_code == exit_codes.INCOMPLETE and published.report is not None
    summary = json.loads((root / "summary.json").read_text())
    assert summary["incomplete"] == ["baseline-1 rank 0: steps 1-12 missing",
                                     "deterministic-0 ranks 0-1: no step record files (all 12 steps missing)"]
    assert math.isnan(summary["tax"]["tax"])
    assert "tax              no estimate: too few timed steps" in _console_text(root)


def test_a_proven_mismatch_outranks_missing_records(last_step_failure: Path) -> None:
    root = last_step_failure
    _truncate(root / "baseline-1" / "steps.rank0.jsonl", 40)
    summary = analyse_experiment(root).summary
    assert summary.problems == ["baseline-1 rank 0: steps 41-60 missing"]
    assert summary.outcome == "failed" and summary.exit_code == exit_codes.NOT_DETERMINISTIC


def _enable_fault(root: Path, **fault: object) -> None:
    change_config(root, lambda config: config["experiment"].update(fault={
        "enabled": True, "arm": "deterministic", "replica": 1, "step": 60, "rank": 1, "kind": "flip_param_bit",
        **fault}))


def test_a_fault_that_never_fired_is_a_self_test_that_tested_nothing(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=60, seed=3))
    _enable_fault(root, kind="nondeterministic_op", op="aten.matmull.default")
    published = publish(root, NO_WANDB, console=QUIET)
    assert published.exit_code == exit_codes.INCOMPLETE and published.deterministic_ok
    summary = json.loads((root / "summary.json").read_text())
    line = "deterministic-1: fault nondeterministic_op configured but never fired: the self-test tested nothing"
    assert summary["faults"] == [line] and summary["fault_fired"] is False
    assert line in _console_text(root) and line in (root / REPORT_DIR / MARKDOWN_FILE).read_text()


def test_a_fault_that_fired_is_named_with_step_rank_and_place(last_step_failure: Path) -> None:
    root = last_step_failure
    _enable_fault(root)
    event = {"schema_version": SCHEMA_VERSION, "kind": "flip_param_bit", "step": 60, "rank": 1,
             "where": "params after step 60"}
    (root / "deterministic-1" / "faults.rank1.jsonl").write_text(json.dumps(event) + "\n")
    published = publish(root, NO_WANDB, console=QUIET)
    assert published.exit_code == exit_codes.NOT_DETERMINISTIC
    line = "deterministic-1: fault flip_param_bit fired at step 60, rank 1 (params after step 60)"
    assert json.loads((root / "summary.json").read_text())["faults"] == [line]
    assert line in _console_text(root) and line in (root / REPORT_DIR / HTML_FILE).read_text()


# ------------------------------------------------------------------------------------------------------------ sweeps
def _sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "sweep"
    mark_sweep(sweep)  # as a multirun creates its sweep folder: only such a folder is reported as a whole
    for world, where in ((32, "2/exp"), (8, "0/exp"), (16, "point1")):  # depths 2 and 1, listed out of order
        write_experiment(sweep / where, SyntheticExperiment(ranks=world, tax=0.01 * world / 8, seed=world))
    broken = sweep / "3" / "crashed"
    Manifest.of({"experiment": "crashed"}).write(broken / "deterministic-0")  # a job that died before its records
    return sweep


def test_sweep_finds_points_and_reports_tax_vs_gpus(tmp_path: Path) -> None:
    sweep_root = _sweep(tmp_path)
    assert [p.relative_to(sweep_root).as_posix() for p in find_experiments(sweep_root)] == [
        "0/exp", "2/exp", "3/crashed", "point1"]
    published = publish(sweep_root, NO_WANDB, console=Console(file=open("/dev/null", "w")))
    assert not published.deterministic_ok  # one point could not be analysed
    assert published.exit_code == exit_codes.INCOMPLETE
    table = analyse_sweep(sweep_root).points
    assert table["world_size"].iloc[:3].tolist() == [8, 16, 32]
    assert table["tax"].iloc[:3].is_monotonic_increasing
    assert table["error"].iloc[3].startswith("UnreadableRecords") and "crashed" in table["path"].iloc[3]
    assert (sweep_root / SWEEP_FILE).is_file()
    out = sweep_root / REPORT_DIR
    assert (out / SWEEP_PNG).read_bytes().startswith(PNG_MAGIC)
    page = (out / HTML_FILE).read_text()
    assert "href='../0/exp/report/report.html'" in page and "not analysed" in page
    assert (sweep_root / "0" / "exp" / REPORT_DIR / HTML_FILE).is_file()  # each point's own report
    assert "[point1](../point1/report/report.md)" in (out / MARKDOWN_FILE).read_text()


def test_sweep_exit_code_is_its_worst_point(tmp_path: Path) -> None:
    sweep_root = tmp_path / "sweep"
    mark_sweep(sweep_root)
    small = {"steps": 12, "block_steps": 3, "resume_step": 6}
    write_experiment(sweep_root / "a", SyntheticExperiment(ranks=2, seed=1, **small))
    assert publish(sweep_root, NO_WANDB, console=QUIET).exit_code == exit_codes.OK
    incomplete = write_experiment(sweep_root / "b", SyntheticExperiment(ranks=2, seed=2, **small))
    (incomplete / "deterministic-resumed" / "steps.rank1.jsonl").unlink()
    published = publish(sweep_root, NO_WANDB, console=QUIET)
    assert published.exit_code == exit_codes.INCOMPLETE
    table = analyse_sweep(sweep_root).points.set_index("path")
    assert table.loc["b", "outcome"] == "incomplete" and table.loc["b", "restart_replay"] == "incomplete"
    assert "deterministic-resumed rank 1: no steps.rank1.jsonl" in table.loc["b", "incomplete"]
    assert "deterministic-resumed rank 1" in (sweep_root / REPORT_DIR / MARKDOWN_FILE).read_text()
    write_experiment(sweep_root / "c", SyntheticExperiment(ranks=2, seed=3, **small),
                     Injection("deterministic-1", step=3, rank=0))
    assert publish(sweep_root, NO_WANDB, console=QUIET).exit_code == exit_codes.NOT_DETERMINISTIC


def test_sweep_points_of_one_recipe_and_size_are_told_apart_by_name(tmp_path: Path) -> None:
    """A sweep of modes (mode@arms.deterministic=deterministic,deterministic_tree): same recipe, same ranks."""
    sweep_root = tmp_path / "sweep"
    mark_sweep(sweep_root)
    small = {"steps": 12, "block_steps": 3, "resume_step": 6}
    for seed, where in enumerate(("ring", "tree")):
        write_experiment(sweep_root / where, SyntheticExperiment(ranks=2, seed=seed, **small))
    console = Console(file=io.StringIO(), width=200)
    render_sweep(analyse_sweep(sweep_root), console)
    lines = console.file.getvalue().splitlines()
    header = next(i for i, line in enumerate(lines) if "┃" in line)
    assert lines[header].split()[:2] == ["point", "┃"]
    assert [line.split()[0] for line in lines[header + 2:header + 4]] == ["ring", "tree"]
    write_experiment(sweep_root / "four", SyntheticExperiment(ranks=4, seed=3, **small))
    (sweep_root / "tree").rename(tmp_path / "tree")  # one point per world size: no name column
    console = Console(file=io.StringIO(), width=200)
    render_sweep(analyse_sweep(sweep_root), console)
    assert next(line for line in console.file.getvalue().splitlines() if "┃" in line).split()[0] == "recipe"


@pytest.mark.slow  # over 10 s: a real multi-process or CLI run (the fast tier stays under 8 min)
def test_damaged_manifest_or_unwritable_report_is_one_clear_line(tmp_path: Path, taxbench_cli) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    (root / REPORT_DIR).write_text("a file where the report folder goes")
    blocked = taxbench_cli("report", str(root), cwd=tmp_path)
    assert blocked.returncode == 2 and "Traceback" not in blocked.stderr, blocked.stderr
    assert f"cannot create the report folder {root / REPORT_DIR}" in blocked.stderr
    (root / REPORT_DIR).unlink()
    (root / REPORT_DIR / HTML_FILE).mkdir(parents=True)  # report.html cannot be replaced
    blocked = taxbench_cli("report", str(root), cwd=tmp_path)
    assert blocked.returncode == 2 and "Traceback" not in blocked.stderr, blocked.stderr
    assert f"cannot write {root / REPORT_DIR / HTML_FILE}" in blocked.stderr
    manifest = root / "baseline-1" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    damaged = taxbench_cli("analyse", str(root), cwd=tmp_path)  # unreadable evidence: incomplete, exit 4
    assert damaged.returncode == exit_codes.INCOMPLETE and "Traceback" not in damaged.stderr
    assert f"taxbench: error: {manifest}: not valid JSON" in damaged.stderr
    manifest.write_text('"a string"')
    damaged = taxbench_cli("analyse", str(root), cwd=tmp_path)
    assert damaged.returncode == exit_codes.INCOMPLETE and f"{manifest}: not a JSON object" in damaged.stderr


def test_analyse_rewrites_an_existing_report_with_the_summary(tmp_path: Path, taxbench_cli) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    assert publish(root, NO_WANDB, console=QUIET).exit_code == exit_codes.OK
    assert "INCOMPLETE" not in (root / REPORT_DIR / MARKDOWN_FILE).read_text()
    (root / "deterministic-1" / "steps.rank1.jsonl").unlink()
    result = taxbench_cli("analyse", str(root), cwd=tmp_path)
    assert result.returncode == exit_codes.INCOMPLETE, result.stderr
    summary = json.loads((root / "summary.json").read_text())
    assert summary["outcome"] == "incomplete"
    for name in (MARKDOWN_FILE, HTML_FILE):
        assert "deterministic-1 rank 1: no steps.rank1.jsonl" in (root / REPORT_DIR / name).read_text()
    shutil.rmtree(root / REPORT_DIR)  # a run with report.html=false: analyse writes no report of its own
    assert taxbench_cli("analyse", str(root), cwd=tmp_path).returncode == exit_codes.INCOMPLETE
    assert not (root / REPORT_DIR).exists()


@pytest.mark.slow
def test_report_subcommand_exit_codes(tmp_path: Path, failing_experiment: Path, taxbench_cli) -> None:
    bad = taxbench_cli("report", str(failing_experiment), cwd=tmp_path)
    assert bad.returncode == 3, bad.stderr
    assert (failing_experiment / REPORT_DIR / HTML_FILE).is_file()
    assert "DIFFERS" in bad.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = taxbench_cli("report", str(empty), cwd=tmp_path)
    assert nothing.returncode == 2 and "holds 0 entries and no experiment within 3 levels" in nothing.stderr


# --------------------------------------------------------------------------------------------------------- redaction
def test_redaction_removes_secrets_and_keeps_the_rest() -> None:
    value = {
        "env": {"WANDB_API_KEY": "k1", "NCCL_ALGO": "Ring", "HF_TOKEN": "k2"},
        "setup": ["export GITHUB_TOKEN=ghp_abc", "module load cuda/12.4", "srun --password hunter2 x",
                  "wandb login --relogin 0f0f0f0f; echo done"],
        "tokens": 4096,
        "max_tokens": 7,
        "url": "https://bob:pa55word@example.com/data",
        "note": "key hf_" + "a" * 30,
    }
    clean = redact(value)
    text = json.dumps(clean)
    for secret in ("k1", "k2", "ghp_abc", "hunter2", "0f0f0f0f", "pa55word", "hf_aaaa"):
        assert secret not in text
    assert clean["env"]["NCCL_ALGO"] == "Ring" and clean["tokens"] == 4096 and clean["max_tokens"] == 7
    assert clean["setup"][1] == "module load cuda/12.4"
    assert redact_text("WANDB_API_KEY=abc123 python train.py") == f"WANDB_API_KEY={REDACTED} python train.py"


def test_manifests_never_hold_secrets(tmp_path: Path) -> None:
    Manifest.of({"config": {"cluster": {"setup": ["export WANDB_API_KEY=0123456789abcdef"]}},
                 "policy_applied": {"env": {"NCCL_ALGO": "Ring", "SECRET_TOKEN": "s3cr3t"}}}).write(tmp_path)
    text = (tmp_path / "manifest.json").read_text()
    assert "0123456789abcdef" not in text and "s3cr3t" not in text and '"NCCL_ALGO": "Ring"' in text


# ---------------------------------------------------------------------------------------------- real experiment run
@pytest.mark.slow
def test_experiment_run_writes_report_and_respects_report_wandb_false(tmp_path: Path, taxbench_cli) -> None:
    result = taxbench_cli(
        f"experiment.out_dir={tmp_path}", "experiment.name=tiny", "cluster=inprocess", "experiment.steps=12",
        "experiment.block_steps=3", "experiment.warmup_steps=2", "experiment.resume_step=6", "report.wandb=false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    root = tmp_path / "tiny"
    assert (root / REPORT_DIR / HTML_FILE).is_file() and (root / REPORT_DIR / STEP_TIME_PNG).is_file()
    assert not (root / "wandb").exists()
    assert "report.html" in result.stdout and "baseline_sanity" in result.stdout
    equivalence = json.loads((root / "summary.json").read_text())["equivalence"]
    assert equivalence["verdict"] != "not evaluated" and equivalence["n_steps"] == 10  # steps after the warmup
    assert "equivalence" in result.stdout


@pytest.mark.slow
def test_real_gate_failure_cannot_be_turned_into_a_pass_by_removing_records(tmp_path: Path, taxbench_cli) -> None:
    """The issue's reproduction on a real 2-rank run: a fault at the last step on rank 1 fails repeatability; deleting
    rank 1's streams, or truncating the deterministic runs before the fault, must give exit 4, never 0."""
    result = taxbench_cli(
        f"experiment.out_dir={tmp_path}", "experiment.name=fault", "experiment.steps=12", "experiment.block_steps=6",
        "experiment.warmup_steps=2", "experiment.resume_step=6", "experiment.fault.enabled=true",
        "experiment.fault.step=12", "experiment.fault.rank=1", "report.wandb=false", cwd=tmp_path,
    )
    assert result.returncode == exit_codes.NOT_DETERMINISTIC, result.stderr[-2000:]
    root = tmp_path / "fault"
    verdicts = {v["gate"]: v for v in json.loads((root / "summary.json").read_text())["verdicts"]}
    assert verdicts["repeatability"]["first_mismatch"]["step"] == 12
    truncated = tmp_path / "truncated"
    shutil.copytree(root, truncated)

    for stream in root.glob("*/steps.rank1.jsonl"):
        stream.unlink()
    deleted = taxbench_cli("analyse", str(root), cwd=tmp_path)
    assert deleted.returncode == exit_codes.INCOMPLETE, deleted.stdout + deleted.stderr
    summary = json.loads((root / "summary.json").read_text())
    assert not summary["deterministic_ok"] and summary["world_size"] == 2
    assert "deterministic-1 rank 1: no steps.rank1.jsonl (all 12 steps missing)" in summary["incomplete"]
    assert "INCOMPLETE" in deleted.stdout

    for name in DET_RUNS:
        for stream in (truncated / name).glob("steps.rank*.jsonl"):
            _truncate(stream, 11)
    cut = taxbench_cli("analyse", str(truncated), cwd=tmp_path)
    assert cut.returncode == exit_codes.INCOMPLETE, cut.stdout + cut.stderr
    assert "deterministic-1 ranks 0-1: step 12 missing" in json.loads(
        (truncated / "summary.json").read_text())["incomplete"]


def test_the_screenshot_script_says_what_it_needs_without_chromium(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    publish(root, NO_WANDB, console=QUIET)
    bare = tmp_path / "bin"  # a PATH with what the script needs besides a browser
    bare.mkdir()
    for tool in ("bash", "realpath", "tail"):
        (bare / tool).symlink_to(shutil.which(tool))
    script = Path(__file__).resolve().parents[1] / "scripts" / "report_screenshot.sh"
    result = subprocess.run([str(bare / "bash"), str(script), str(root)], capture_output=True, text=True,
                            env={"PATH": str(bare)}, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "needs chromium on PATH" in result.stderr
    missing = subprocess.run([str(bare / "bash"), str(script), str(tmp_path / "nothing")], capture_output=True,
                             text=True, env={"PATH": str(bare)}, cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and "no report at" in missing.stderr
