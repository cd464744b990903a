"""`taxbench stacks`: the matrix of training stacks under their own switch and under taxbench's policy. Its arguments
and refusals (one line, exit 2, nothing made), the cells that cannot run here (needs CUDA, not installed: listed,
never failures), the table from a prepared folder, and the real matrix on 2 gloo ranks for the stacks
installed here (taxbench's own and DeepSpeed, a few steps per run; Megatron-Core shows "needs CUDA")."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import compose_raw, compose_typed, has_deepspeed, run_taxbench

from taxbench import exit_codes
from taxbench.analysis.publish import publish
from taxbench.analysis.stacks_matrix import analyse_stacks
from taxbench.analysis.wandb_log import log_stacks
from taxbench.commands.stacks import main as run_stacks_command
from taxbench.config.schema import ConfigError, ReportConfig
from taxbench.launchers.stacks import DEFAULT_STEPS, cell_overrides, parse_stack_list, plan_cell
from taxbench.rundir.plans import NEEDS_CUDA, Cell, StacksPlan

REPO = Path(__file__).resolve().parent.parent


def _compose(overrides: list[str]):
    return compose_raw(*overrides)


# ------------------------------------------------------------------------------------------------------- arguments
def test_the_stack_list_names_each_known_stack_once() -> None:
    assert parse_stack_list(None) == ["taxbench", "titan", "megatron", "deepspeed"]
    assert parse_stack_list("[taxbench, deepspeed]") == ["taxbench", "deepspeed"]
    for bad in ("[taxbench, nemo]", "[taxbench, taxbench]", "[]"):
        with pytest.raises(ConfigError, match="name each stack once, from taxbench, titan, megatron, deepspeed"):
            parse_stack_list(bad)


def test_a_cell_runs_few_steps_unless_told() -> None:
    assert cell_overrides([], set()) == [f"experiment.steps={DEFAULT_STEPS}", "experiment.warmup_steps=2",
                                         "experiment.checkpoint_every_s=0", "experiment.interleave=pair"]
    given = ["experiment.steps=30", "experiment.interleave=all", "experiment.name=mine"]
    assert cell_overrides(given, {"experiment.steps", "experiment.interleave", "experiment.name"}) == [
        "experiment.steps=30", "experiment.interleave=all", "experiment.warmup_steps=2",
        "experiment.checkpoint_every_s=0"]  # the matrix's experiment.name names its folder, not a cell
    # the restart point follows the steps (the loader's default: half the gate runs' steps when they are few)
    assert compose_typed(*cell_overrides([], set())).experiment.resume_step == DEFAULT_STEPS // 2


@pytest.mark.parametrize(("args", "words"), [
    (["stacks=[taxbench, nemo]"], "stacks='[taxbench, nemo]': name each stack once"),
    (["stacks=[taxbench,", "nemo]"], "stacks='[taxbench, nemo]': name each stack once"),  # unquoted
    (["family=huge"], "family='huge': choose dense or moe"),
    (["+recipe=moe_tiny"], "+recipe=moe_tiny: taxbench stacks chooses each cell's recipe and deterministic arm"),
    (["mode@arms.deterministic=baseline"], "taxbench stacks chooses each cell's recipe and deterministic arm"),
    (["cluster=slurm_cpu"], "taxbench stacks launches the cells on this machine; cluster=slurm_cpu"),
    (["experiment.calibration=true"], "a stacks matrix answers for each stack's own switch"),
    (["stacks=[deepspeed]", "recipe.parallel.tp=2"], "deepspeed (deepspeed_dense_debug, mode@arms.deterministic="),
    (["stacks=[taxbench]", "experiment.steps=6", "experiment.resume_step=9"],
     "taxbench (dense_tiny, mode@arms.deterministic=stack_native): "),  # a cell's own check, before any runs
])
def test_bad_input_is_one_line_exit_2_before_anything_runs(args: list[str], words: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # the command in this process: the slow tests run the entry point
        run_stacks_command([*args, f"experiment.out_dir={tmp_path}", "experiment.name=m"])
    stderr = capsys.readouterr().err
    assert exited.value.code == exit_codes.CONFIG_ERROR, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("taxbench: error: ") and words in lines[0], stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # imports Megatron-Core to count its model on the meta device: about 7 s
def test_megatron_on_a_cpu_machine_is_a_needs_cuda_cell_with_its_size() -> None:
    cell, cfg = plan_cell("megatron", "deterministic", "dense", ["cluster.device=cpu"], _compose)
    assert cfg is None and cell.skipped == NEEDS_CUDA and "cluster.device=cuda" in cell.reason
    assert cell.recipe == "megatron_gpt_debug" and (cell.parameters is None or cell.parameters > 0)


@pytest.mark.slow  # imports torchtitan and builds its model on the meta device: about 10 s
def test_torchtitans_own_switch_is_a_cell_that_runs_with_its_own_model_size() -> None:
    pytest.importorskip("torchtitan")
    cell, cfg = plan_cell("titan", "stack_native", "dense", [], _compose)
    assert cfg is not None and cell.skipped is None and cfg.arms["deterministic"].stack_native
    assert cell.parameters and cell.parameters > 1_000_000  # torchtitan's Llama 3 debug model


# ------------------------------------------------------------------------------------------- a prepared folder
def _prepared(root: Path, cells: list[Cell]) -> Path:
    root.mkdir()
    StacksPlan("dense", 4, 2, "cpu", cells).write(root)
    return root


def test_a_matrix_where_no_cell_ran_is_no_evidence_and_lists_why(tmp_path: Path) -> None:
    root = _prepared(tmp_path / "none", [
        Cell("megatron", "stack_native", "megatron_gpt_debug", 362_000, NEEDS_CUDA, "Megatron-Core trains on CUDA"),
        Cell("titan", "stack_native", "titan_llama3_debug", None, "not installed", "pip install 'taxbench[titan]'")])
    published = publish(root, ReportConfig(html=True, wandb=False))
    assert published.exit_code == exit_codes.INCOMPLETE and not published.deterministic_ok
    markdown = (root / "report" / "report.md").read_text()
    assert "| megatron | megatron_gpt_debug | 362k | own switch | needs CUDA | — | — | — |" in markdown
    assert "titan, own switch: not installed: pip install 'taxbench[titan]'" in markdown
    assert json.loads((root / "summary.json").read_text())["verdict"].startswith("no cell ran here")


def test_a_cell_whose_experiment_is_missing_is_incomplete_and_skipped_cells_do_not_count(tmp_path: Path) -> None:
    root = _prepared(tmp_path / "lost", [
        Cell("taxbench", "deterministic", "dense_tiny", 135_808, failure="rank 1 died (SIGKILL)"),
        Cell("megatron", "deterministic", "megatron_gpt_debug", None, NEEDS_CUDA, "CUDA only")])
    summary = analyse_stacks(root)
    assert summary.exit_code == exit_codes.INCOMPLETE
    (lost, cuda) = summary.cells
    assert lost.outcome == "incomplete" and cuda.outcome == NEEDS_CUDA and cuda.exit_code == exit_codes.OK
    assert any("rank 1 died" in p for p in lost.problems) and any("not analysed" in p for p in lost.problems)
    (root / "stacks.json").write_text(json.dumps({"family": "dense", "steps": 4, "world_size": 2, "device": "cpu",
                                                  "cells": [{"stack": "taxbench", "policy": "fast"}]}))
    with pytest.raises(Exception, match="stacks.json: not a stacks record"):
        analyse_stacks(root)


def test_a_plan_reads_across_format_versions_it_knows_and_names_one_it_does_not(tmp_path: Path) -> None:
    root = _prepared(tmp_path / "plan", [
        Cell("megatron", "stack_native", "megatron_gpt_debug", None, NEEDS_CUDA, "Megatron-Core trains on CUDA")])
    plan = json.loads((root / "stacks.json").read_text())
    assert plan["format_version"] == 1
    expected = analyse_stacks(root).cells
    (root / "stacks.json").write_text(json.dumps({k: v for k, v in plan.items() if k != "format_version"}))
    assert analyse_stacks(root).cells == expected  # a plan written before the field was: version 1

    (root / "stacks.json").write_text(json.dumps({**plan, "format_version": 2}))
    result = run_taxbench("analyse", str(root), cwd=tmp_path)
    assert result.returncode == exit_codes.CONFIG_ERROR, result.stderr
    assert "stacks.json: a stacks record of format_version=2, expected 1" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------- the matrix, for real
def _stacks(out: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_taxbench("stacks", "experiment.steps=4", "report.wandb=false", f"experiment.out_dir={out}",
                        f"experiment.name={name}", *extra, cwd=out, timeout=1200)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    if not has_deepspeed():
        pytest.skip("needs taxbench[deepspeed]")
    out = tmp_path_factory.mktemp("stacks")
    return out / "matrix", _stacks(out, "matrix", "stacks=[taxbench, deepspeed, megatron]")


@pytest.mark.slow
def test_the_matrix_runs_each_installed_stack_under_both_policies(matrix: tuple[Path, subprocess.CompletedProcess[str]],
                                                                  ) -> None:
    root, result = matrix
    assert result.returncode == exit_codes.OK, result.stderr[-3000:] + result.stdout[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    cells = {cell["name"]: cell for cell in summary["cells"]}
    assert list(cells) == ["taxbench-stack_native", "taxbench-deterministic", "deepspeed-stack_native",
                           "deepspeed-deterministic", "megatron-stack_native", "megatron-deterministic"]
    for name in ("taxbench-stack_native", "taxbench-deterministic", "deepspeed-stack_native",
                 "deepspeed-deterministic"):
        cell = cells[name]
        assert cell["outcome"] == "passed" and cell["parameters"] > 0, cell
        assert cell["gates"] == {"repeatability": "identical", "restart_replay": "identical",
                                 "baseline_sanity": "identical"}
        assert cell["tax"]["pairs"] > 0 and (root / name / "report" / "report.html").is_file()
    assert cells["deepspeed-stack_native"]["recipe"] == "deepspeed_dense_debug"
    # one shape for the stacks that build their model from the recipe's fields: the same model size
    assert cells["deepspeed-deterministic"]["parameters"] == cells["taxbench-deterministic"]["parameters"] == 135_808
    assert "d_model=64" in summary["shape"]
    assert any("NCCL_ALGO" in line for line in cells["deepspeed-stack_native"]["audit"])
    assert cells["taxbench-stack_native"]["audit"] == [] and cells["taxbench-deterministic"]["audit"] is None
    assert [cells[n]["outcome"] for n in ("megatron-stack_native", "megatron-deterministic")] == [NEEDS_CUDA] * 2
    manifest = json.loads((root / "deepspeed-stack_native" / "deterministic-0" / "manifest.json").read_text())
    assert manifest["policy"]["stack_native"] is True
    assert "deepspeed_dense_debug" in result.stdout and "needs CUDA" in result.stdout
    report = (root / "report" / "report.md").read_text()
    assert "| [deepspeed](../deepspeed-stack_native/report/report.md) | deepspeed_dense_debug |" in report
    audit = "| deepspeed's own switch | deepspeed's switch leaves NCCL_ALGO unset; taxbench's policy sets Ring |"
    assert audit in report


@pytest.mark.slow
def test_taxbench_report_renders_the_matrix_again(matrix: tuple[Path, subprocess.CompletedProcess[str]],
                                                 tmp_path: Path) -> None:
    root, _ = matrix
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / "report" / "report.html").unlink()
    result = run_taxbench("report", str(copy), cwd=tmp_path, timeout=300)
    assert result.returncode == exit_codes.OK, result.stderr[-2000:]
    assert (copy / "report" / "report.html").is_file() and "deepspeed_dense_debug" in result.stdout
    stream = copy / "deepspeed-deterministic" / "deterministic-1" / "steps.rank1.jsonl"
    stream.write_text("".join(stream.read_text().splitlines(keepends=True)[:-1]))
    for mirror in copy.rglob("*.arrow"):
        mirror.unlink()
    summary = analyse_stacks(copy)
    assert summary.exit_code == exit_codes.INCOMPLETE
    assert [c.cell.name for c in summary.cells if c.exit_code != exit_codes.OK] == ["deepspeed-deterministic"]


@pytest.mark.slow
def test_the_wandb_run_holds_the_matrix_table(matrix: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    root, _ = matrix
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    run_dir = log_stacks(analyse_stacks(copy), ReportConfig(wandb=True, wandb_project="taxbench-test"))
    assert run_dir.parent == copy / "wandb" and run_dir.name.startswith("offline-run-")
    table = json.loads(next((run_dir / "files" / "media" / "table").glob("stacks_*.table.json")).read_text())
    rows = {row[0]: dict(zip(table["columns"], row, strict=True)) for row in table["data"]}
    assert rows["deepspeed-stack_native"]["repeatability"] == "identical"
    assert rows["megatron-deterministic"]["outcome"] == NEEDS_CUDA and rows["megatron-deterministic"]["tax"] is None
    assert isinstance(rows["taxbench-deterministic"]["tax"], float)


@pytest.mark.slow
def test_a_cell_whose_gate_differs_fails_the_matrix_and_outranks_missing_evidence(
        matrix: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    root, _ = matrix
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("*.arrow"))  # JSONL is the truth
    stream = copy / "taxbench-deterministic" / "deterministic-1" / "steps.rank1.jsonl"
    records = [json.loads(line) for line in stream.read_text().splitlines()]
    records[1]["params"] = "0" * 16  # step 2's parameters differ on rank 1, as a nondeterministic op would make them
    stream.write_text("".join(json.dumps(record) + "\n" for record in records))
    cut = copy / "deepspeed-deterministic" / "deterministic-1" / "steps.rank0.jsonl"
    cut.write_text("".join(cut.read_text().splitlines(keepends=True)[:-1]))
    summary = analyse_stacks(copy)
    assert summary.exit_code == exit_codes.NOT_DETERMINISTIC  # a proven difference outranks missing evidence
    outcomes = {c.cell.name: c.outcome for c in summary.cells}
    assert outcomes["taxbench-deterministic"] == "failed" and outcomes["deepspeed-deterministic"] == "incomplete"
    assert outcomes["taxbench-stack_native"] == "passed" and outcomes["megatron-deterministic"] == NEEDS_CUDA
    (failed,) = [c for c in summary.cells if c.cell.name == "taxbench-deterministic"]
    mismatch = failed.verdict("repeatability").first_mismatch
    assert (mismatch.step, mismatch.rank, mismatch.metric) == (2, 1, "params")
    assert summary.verdict()[1].startswith("not bitwise deterministic: taxbench-deterministic")


@pytest.mark.slow  # a CLI process that imports the stacks: about 10 s; no cell runs
def test_a_stack_whose_extra_is_missing_is_a_not_installed_cell_with_the_pip_line(tmp_path: Path) -> None:
    hidden = tmp_path / "no_deepspeed" / "deepspeed"  # an environment where `import deepspeed` fails
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named deepspeed')\n")
    result = run_taxbench("stacks", "stacks=[deepspeed]", "report.wandb=false", f"experiment.out_dir={tmp_path}",
                          "experiment.name=bare", cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(hidden.parent)})
    assert result.returncode == exit_codes.INCOMPLETE, result.stderr[-2000:]  # nothing ran: no evidence
    assert "not installed" in result.stdout and "DS_BUILD_OPS=0 pip install 'taxbench[deepspeed]'" in result.stdout
    assert not list((tmp_path / "bare").rglob("manifest.json"))
