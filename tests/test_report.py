"""Reports, sweeps, the fast record loader, redaction and the compact console summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from taxbench.analysis.publish import publish
from taxbench.analysis.records import CACHE_FILE, RecordError, load_run
from taxbench.analysis.report import HTML_FILE, MARKDOWN_FILE, REPORT_DIR, STEP_TIME_PNG, SWEEP_PNG
from taxbench.analysis.summary import analyse_experiment, render
from taxbench.analysis.sweep import SWEEP_FILE, analyse_sweep, find_experiments
from taxbench.analysis.synthetic import Injection, SyntheticExperiment, write_experiment
from taxbench.config import ReportConfig
from taxbench.records import write_manifest
from taxbench.redaction import REDACTED, redact, redact_text

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NO_WANDB = ReportConfig(html=True, wandb=False)


@pytest.fixture
def failing_experiment(tmp_path: Path) -> Path:
    return write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=3, tax=0.05, seed=1),
                            Injection("deterministic-1", step=30, rank=2, metric="params"))


# ------------------------------------------------------------------------------------------------- record loading
def test_loader_reads_every_record_and_caches_as_parquet(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=3, steps=12, block_steps=3, resume_step=6))
    run = root / "baseline-0"
    frame = load_run(run)
    assert len(frame) == 36 and list(frame[["step", "rank"]].iloc[:4].itertuples(index=False)) == [
        (1, 0), (1, 1), (1, 2), (2, 0)]
    assert (run / CACHE_FILE).is_file()
    assert load_run(run).equals(frame)
    with (run / "steps.rank1.jsonl").open("a") as f:  # a changed stream invalidates the cache
        f.write(json.dumps({**json.loads((run / "steps.rank1.jsonl").read_text().splitlines()[-1]), "step": 13}) + "\n")
    assert len(load_run(run)) == 37


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
    stream.write_text(text.replace('"schema_version":1', '"schema_version":7', 1))
    with pytest.raises(RecordError, match=r"steps.rank0.jsonl:1: schema_version=7, this taxbench reads 1"):
        load_run(root / "baseline-0")


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
    assert len(lines) <= 12 and all(len(line) <= 80 for line in lines)
    assert any(line.startswith("repeatability") and "DIFFERS" in line and "step 30, rank 2" in line for line in lines)


# ------------------------------------------------------------------------------------------------------------ sweeps
def _sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "sweep"
    for world, where in ((32, "2/exp"), (8, "0/exp"), (16, "point1")):  # depths 2 and 1, listed out of order
        write_experiment(sweep / where, SyntheticExperiment(ranks=world, tax=0.01 * world / 8, seed=world))
    broken = sweep / "3" / "crashed"
    write_manifest(broken / "deterministic-0", {"experiment": "crashed"})  # a job that died before its records
    return sweep


def test_sweep_finds_points_and_reports_tax_vs_gpus(tmp_path: Path) -> None:
    sweep_root = _sweep(tmp_path)
    assert [p.relative_to(sweep_root).as_posix() for p in find_experiments(sweep_root)] == [
        "0/exp", "2/exp", "3/crashed", "point1"]
    published = publish(sweep_root, NO_WANDB, console=Console(file=open("/dev/null", "w")))
    assert not published.deterministic_ok  # one point could not be analysed
    table = analyse_sweep(sweep_root).points
    assert table["world_size"].iloc[:3].tolist() == [8, 16, 32]
    assert table["tax"].iloc[:3].is_monotonic_increasing
    assert table["error"].iloc[3].startswith("RecordError") and "crashed" in table["path"].iloc[3]
    assert (sweep_root / SWEEP_FILE).is_file()
    out = sweep_root / REPORT_DIR
    assert (out / SWEEP_PNG).read_bytes().startswith(PNG_MAGIC)
    page = (out / HTML_FILE).read_text()
    assert "href='../0/exp/report/report.html'" in page and "not analysed" in page
    assert (sweep_root / "0" / "exp" / REPORT_DIR / HTML_FILE).is_file()  # each point's own report
    assert "[point1](../point1/report/report.md)" in (out / MARKDOWN_FILE).read_text()


@pytest.mark.slow
def test_report_subcommand_exit_codes(tmp_path: Path, failing_experiment: Path, taxbench_cli) -> None:
    bad = taxbench_cli("report", str(failing_experiment), cwd=tmp_path)
    assert bad.returncode == 3, bad.stderr
    assert (failing_experiment / REPORT_DIR / HTML_FILE).is_file()
    assert "DIFFERS" in bad.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = taxbench_cli("report", str(empty), cwd=tmp_path)
    assert nothing.returncode == 2 and "no experiment directories" in nothing.stderr


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
    write_manifest(tmp_path, {"config": {"cluster": {"setup": ["export WANDB_API_KEY=0123456789abcdef"]}},
                              "policy_applied": {"env": {"NCCL_ALGO": "Ring", "SECRET_TOKEN": "s3cr3t"}}})
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
