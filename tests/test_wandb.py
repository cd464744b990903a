"""wandb logging, read back from the offline run files with `wandb leet inspect --json`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from taxbench.analysis.document import HTML_FILE, REPORT_DIR
from taxbench.analysis.publish import publish
from taxbench.analysis.report import write_experiment_report
from taxbench.analysis.summary import analyse_experiment
from taxbench.analysis.sweep import analyse_sweep
from taxbench.analysis.synthetic import Injection, SyntheticExperiment, change_config, write_experiment
from taxbench.analysis.wandb_log import WandbUnavailable, import_wandb, log_experiment, log_sweep
from taxbench.config.schema import ReportConfig
from taxbench.rundir.experiment_folder import mark_sweep
from taxbench.rundir.read import step_times

pytest.importorskip("wandb")

WANDB_CLI = str(Path(sys.executable).with_name("wandb"))
SETTINGS = ReportConfig(wandb=True, wandb_project="taxbench-test")


def inspect(run_dir: Path, *flags: str) -> list[dict]:
    out = subprocess.run([WANDB_CLI, "leet", "inspect", "--json", *flags, str(run_dir)], capture_output=True,
                         text=True, check=True, timeout=120)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()] if not flags else [
        json.loads(out.stdout)]


@pytest.fixture
def no_wandb_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)


def test_experiment_run_logs_step_times_tax_and_verdicts(tmp_path: Path, no_wandb_mode: None) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, seed=5),
                            Injection("deterministic-resumed", step=25, rank=1, metric="optim"))
    analysis = analyse_experiment(root)
    report_dir = write_experiment_report(analysis).parent
    run_dir = log_experiment(analysis, SETTINGS, report_dir)
    assert "WANDB_MODE" not in os.environ  # offline was the default for the call only
    assert run_dir.parent == root / "wandb" and run_dir.name.startswith("offline-run-")

    overview = inspect(run_dir, "--summary")[0]
    summary, tax = overview["summary"], analysis.summary.tax
    assert overview["project"] == "taxbench-test" and overview["state"] == "finished"
    assert summary["tax/tax"] == pytest.approx(tax.tax, rel=1e-12)
    assert summary["tax/low"] == pytest.approx(tax.low, rel=1e-12)
    assert summary["gate/repeatability/agree"] is True
    assert summary["gate/restart_replay/agree"] is False
    assert summary["gate/restart_replay/first_mismatch"] == "step 25, rank 1, optim"
    assert summary["deterministic_ok"] is False
    assert summary["plots/step_times"]["_type"] == "image-file"
    assert overview["config"]["world_size"] == 2

    history = [r["history"]["item"] for r in inspect(run_dir) if r["type"] == "history"]
    logged = {row["step"]: row for row in history if "step_time/baseline_s" in row}
    expected = step_times(analysis.runs["baseline-0"]).set_index("step")["time_s"]
    assert sorted(logged) == expected.index.tolist()
    assert all(logged[s]["step_time/baseline_s"] == pytest.approx(t, rel=1e-12) for s, t in expected.items())
    expected_det = step_times(analysis.runs["deterministic-0"]).set_index("step")["time_s"]
    assert all(logged[s]["step_time/deterministic_s"] == pytest.approx(t, rel=1e-12) for s, t in expected_det.items())
    gates = json.loads(next((run_dir / "files" / "media" / "table").glob("gates_*.table.json")).read_text())
    assert [row[0] for row in gates["data"]] == ["repeatability", "restart_replay", "baseline_sanity"]


def test_summary_holds_results_only_and_history_holds_loss_grad_norm_and_tokens(tmp_path: Path,
                                                                                no_wandb_mode: None) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, seed=3),
                            Injection("deterministic-1", step=7, rank=1, metric="params"))
    analysis = analyse_experiment(root)
    run_dir = log_experiment(analysis, SETTINGS)

    summary = inspect(run_dir, "--summary")[0]["summary"]
    ours = {key for key in summary if not key.startswith("_")}
    assert not {key for key in ours if key.split("/")[0] in ("step_time", "block_tax", "loss", "grad_norm",
                                                              "tokens_per_s")}
    assert not ours & {"step", "block"}  # x axes are not results either
    assert {"tax/tax", "tax/low", "tax/high", "outcome", "deterministic_ok", "gates"} <= ours
    assert summary["outcome"] == "failed" and summary["gate/repeatability/first_mismatch"] == "step 7, rank 1, params"

    table = json.loads(next((run_dir / "files" / "media" / "table").glob("gates_*.table.json")).read_text())
    gates = {row[0]: dict(zip(table["columns"], row, strict=True)) for row in table["data"]}
    repeat = gates["repeatability"]
    assert repeat["strict"] is True and repeat["agree"] is False and repeat["outcome"] == "differs"
    assert (repeat["mismatch_step"], repeat["mismatch_rank"], repeat["mismatch_metric"]) == (7, 1, "params")
    assert type(repeat["compared_steps"]) is int and gates["baseline_sanity"]["strict"] is False
    assert gates["restart_replay"]["mismatch_step"] is None and gates["restart_replay"]["agree"] is True

    history = [r["history"]["item"] for r in inspect(run_dir) if r["type"] == "history"]
    by_step = {row["step"]: row for row in history if "loss/baseline" in row}
    frame = analysis.runs["baseline-0"]
    rank0 = frame[frame["rank"] == 0].set_index("step")
    assert sorted(by_step) == sorted(rank0.index)
    assert by_step[5]["loss/baseline"] == pytest.approx(frame[frame["step"] == 5]["loss"].mean(), rel=1e-12)
    assert by_step[5]["grad_norm/deterministic"] == pytest.approx(
        analysis.runs["deterministic-0"].set_index(["step", "rank"]).loc[(5, 0), "grad_norm"], rel=1e-12)
    dp = analysis.manifests["baseline-0"].data_parallel
    slowest = frame[frame["step"] == 5]["time_s"].max()
    assert by_step[5]["tokens_per_s/baseline"] == pytest.approx(rank0.loc[5, "tokens"] * dp / slowest, rel=1e-12)


def test_equivalence_reaches_the_summary_and_a_typed_per_step_table(tmp_path: Path, no_wandb_mode: None) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, seed=4, loss_noise=0.01))
    analysis = analyse_experiment(root)
    run_dir = log_experiment(analysis, SETTINGS, write_experiment_report(analysis).parent)

    summary = inspect(run_dir, "--summary")[0]["summary"]
    equivalence = analysis.summary.equivalence
    assert summary["equivalence/verdict"] == "equivalent within baseline noise" and summary["equivalence/equivalent"]
    assert summary["equivalence/statistic"] == pytest.approx(equivalence.statistic, rel=1e-12)
    assert summary["equivalence/n_steps"] == equivalence.n_steps == 60 - 6
    assert summary["plots/equivalence"]["_type"] == "image-file"
    table = json.loads(next((run_dir / "files" / "media" / "table").glob("equivalence_*.table.json")).read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert [row["step"] for row in rows] == equivalence.steps.tolist()
    assert type(rows[0]["step"]) is int and type(rows[0]["inside"]) is bool
    assert rows[0]["deterministic"] == pytest.approx(equivalence.deterministic[0], rel=1e-12)


def write_multirun_sweep(sweep_root: Path) -> list[Path]:
    """Two points as a `-m cluster.cpu_ranks=2,4` multirun leaves them: each manifest's provenance lists the point's
    overrides."""
    mark_sweep(sweep_root)
    points = []
    for number, ranks in enumerate((2, 4)):
        root = write_experiment(sweep_root / f"point{number}", SyntheticExperiment(ranks=ranks, seed=ranks))
        for manifest_path in root.glob("*/manifest.json"):
            manifest = json.loads(manifest_path.read_text())
            manifest["provenance"]["overrides"] = ["experiment.steps=60", f"cluster.cpu_ranks={ranks}",
                                                   "+recipe=dense_tiny"]
            manifest_path.write_text(json.dumps(manifest))
        points.append(root)
    return points


@pytest.mark.slow  # over 10 s: a real multi-process or CLI run (the fast tier stays under 8 min)
def test_report_twice_leaves_one_offline_run_per_point_named_by_its_overrides(tmp_path: Path,
                                                                               no_wandb_mode: None) -> None:
    sweep_root = tmp_path / "sweep-3"
    points = write_multirun_sweep(sweep_root)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "taxbench", "report", str(sweep_root), "--wandb"],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
    for point, ranks in zip(points, (2, 4), strict=True):
        (run_dir,) = (point / "wandb").glob("offline-run-*")
        header = next(r for r in inspect(run_dir) if r["type"] == "run")["run"]
        assert header["display_name"] == f"cpu_ranks={ranks}" and header["tags"] == [f"cpu_ranks={ranks}"]
        assert header["run_group"] == "sweep-3"
    (summary_run,) = (sweep_root / "wandb").glob("offline-run-*")
    table = json.loads(next((summary_run / "files" / "media" / "table").glob("sweep_*.table.json")).read_text())
    assert [row[table["columns"].index("point")] for row in table["data"]] == ["cpu_ranks=2", "cpu_ranks=4"]


def test_incomplete_experiment_and_fault_reach_the_wandb_summary(tmp_path: Path, no_wandb_mode: None) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    stream = root / "deterministic-1" / "steps.rank1.jsonl"
    stream.write_text("".join(stream.read_text().splitlines(keepends=True)[:8]))
    change_config(root, lambda config: config["experiment"].update(fault={
        "enabled": True, "arm": "deterministic", "replica": 1, "kind": "flip_param_bit", "step": 12, "rank": 1}))
    run_dir = log_experiment(analyse_experiment(root), SETTINGS)
    summary = inspect(run_dir, "--summary")[0]["summary"]
    assert summary["outcome"] == "incomplete" and summary["exit_code"] == 4 and summary["deterministic_ok"] is False
    assert summary["incomplete"] == "deterministic-1 rank 1: steps 9-12 missing"
    assert summary["gate/repeatability/outcome"] == "incomplete" and summary["gate/repeatability/agree"] is False
    assert summary["fault"] == ("deterministic-1: fault flip_param_bit configured but never fired: the self-test "
                                "tested nothing")


def test_sweep_logs_a_table_of_all_points_in_one_group(tmp_path: Path, no_wandb_mode: None) -> None:
    sweep_root = tmp_path / "sweep-7"
    for world in (4, 8):
        write_experiment(sweep_root / str(world) / "exp", SyntheticExperiment(ranks=world, seed=world))
    sweep = analyse_sweep(sweep_root)
    run_dir = log_sweep(sweep, SETTINGS)
    header = next(r for r in inspect(run_dir) if r["type"] == "run")["run"]
    assert header["run_group"] == "sweep-7" and header["job_type"] == "sweep"
    table = json.loads(next((run_dir / "files" / "media" / "table").glob("sweep_*.table.json")).read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert [r["world_size"] for r in rows] == [4, 8]
    assert [r["tax"] for r in rows] == pytest.approx(sweep.points["tax"].tolist(), rel=1e-12)


def test_secrets_stay_out_of_wandb_files(tmp_path: Path, no_wandb_mode: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    secret_key, secret_token = "0123456789abcdef0123456789abcdef01234567", "hf_" + "Q" * 34
    monkeypatch.setenv("WANDB_API_KEY", secret_key)
    monkeypatch.setenv("HF_TOKEN", secret_token)
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, seed=2))
    manifest_path = root / "deterministic-0" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())  # as an older taxbench, without redaction, would have written it
    manifest["config"]["cluster"]["setup"] = [f"export HF_TOKEN={secret_token}", f"wandb login {secret_key}"]
    manifest["policy_applied"]["env"]["WANDB_API_KEY"] = secret_key
    manifest_path.write_text(json.dumps(manifest))
    published = publish(root, SETTINGS, console=Console(file=open(os.devnull, "w")))
    assert published.wandb_runs
    for path in (root / "wandb").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret_key.encode() not in data and secret_token.encode() not in data, path
    page = (root / REPORT_DIR / HTML_FILE).read_text()
    assert secret_key not in page and secret_token not in page


def test_user_chosen_wandb_mode_is_respected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    log_experiment(analyse_experiment(root), SETTINGS)
    assert not list(root.glob("wandb/offline-run-*"))
    assert os.environ["WANDB_MODE"] == "disabled"


def test_missing_wandb_is_a_clear_error_or_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when the extra is not installed
    with pytest.raises(WandbUnavailable, match=r"pip install 'taxbench\[wandb\]'.*report\.wandb=false"):
        import_wandb()
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6))
    published = publish(root, SETTINGS, console=Console(file=open(os.devnull, "w")))  # after a run: warn, go on
    assert published.report is not None and published.report.is_file() and not published.wandb_runs
    assert "wandb logging skipped" in capsys.readouterr().err
    with pytest.raises(WandbUnavailable):
        publish(root, SETTINGS, strict_wandb=True)  # `taxbench report --wandb`: the user asked for it
