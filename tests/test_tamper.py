"""Evidence must belong to its run: records or a manifest copied from another run into a run's folder are incomplete
evidence (exit 4, naming the file), never a pass. One real experiment whose deterministic-1 had a bit flipped at step
8 (the repeatability gate fails on it), then one test per way of forging it into a pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import compose_config, run_schedule, tiny_config

from analysis.summary import analyse
from taxbench import exit_codes
from taxbench.rundir.provenance import config_hash


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = compose_config("cluster=inprocess", "recipe.global_batch_size=4", "recipe.model.d_model=32",
                         "recipe.model.n_heads=2", "recipe.model.seq_len=16", "recipe.model.d_ff=64",
                         "experiment.name=tamper", "experiment.steps=12", "experiment.block_steps=3",
                         "experiment.warmup_steps=2", "experiment.resume_step=6", "experiment.fault.enabled=true",
                         "experiment.fault.step=8", "experiment.fault.rank=0")
    root = tmp_path_factory.mktemp("tamper") / "experiment"
    root.mkdir()
    run_schedule(cfg, root)
    return root


def copy_of(faulted: Path, tmp_path: Path) -> Path:
    root = tmp_path / faulted.name
    shutil.copytree(faulted, root)
    return root


def copy_streams(root: Path, source: str, target: str, mirrors: bool) -> None:
    for path in (root / target).glob("steps.rank*"):
        path.unlink()
    for path in (root / source).glob("steps.rank*.jsonl" if not mirrors else "steps.rank*"):
        shutil.copy(path, root / target / path.name)


def test_the_untouched_experiment_fails_its_repeatability_gate(faulted: Path) -> None:
    summary = analyse(faulted)
    assert summary.exit_code == exit_codes.NOT_DETERMINISTIC and not summary.problems, summary.problems


@pytest.mark.parametrize("mirrors", [False, True], ids=["jsonl", "with_mirrors"])
def test_a1_the_reference_runs_streams_copied_over_the_candidates_are_not_its_evidence(
        faulted: Path, tmp_path: Path, mirrors: bool) -> None:
    root = copy_of(faulted, tmp_path)
    copy_streams(root, "deterministic-0", "deterministic-1", mirrors)
    summary = analyse(root)
    assert summary.exit_code == exit_codes.INCOMPLETE and not summary.deterministic_ok
    assert any(line.startswith(f"{root / 'deterministic-1' / 'steps.rank0.jsonl'}: 12 records of run "
                               "deterministic-0, not deterministic-1") for line in summary.problems), summary.problems


def test_a3_the_baselines_streams_copied_into_a_deterministic_run_are_not_its_evidence(
        faulted: Path, tmp_path: Path) -> None:
    root = copy_of(faulted, tmp_path)
    copy_streams(root, "baseline-0", "deterministic-1", mirrors=True)
    summary = analyse(root)
    assert summary.exit_code == exit_codes.INCOMPLETE
    assert any("records of run baseline-0, not deterministic-1" in line for line in summary.problems)


def test_a_manifest_copied_from_another_run_is_named(faulted: Path, tmp_path: Path) -> None:
    root = copy_of(faulted, tmp_path)
    shutil.rmtree(root / "deterministic-1")
    shutil.copytree(root / "deterministic-0", root / "deterministic-1")  # the whole folder, manifest and all
    summary = analyse(root)
    assert summary.exit_code == exit_codes.INCOMPLETE
    assert f"{root / 'deterministic-1' / 'manifest.json'}: describes run deterministic-0" in "\n".join(
        summary.problems)


def rewrite_manifest(path: Path, change, rehash: bool) -> None:
    manifest = json.loads(path.read_text())
    change(manifest["config"])
    if rehash:  # a forger who knows the hash is a plain sha256 of the redacted config
        manifest["provenance"]["config_sha256"] = config_hash(manifest["config"])
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("rehash", [False, True], ids=["config_edited", "config_rehashed"])
def test_d4_records_cut_back_before_the_fault_with_the_stop_record_edited_are_incomplete(
        faulted: Path, tmp_path: Path, rehash: bool) -> None:
    root = copy_of(faulted, tmp_path)
    for stream in root.glob("*/steps.rank*.jsonl"):  # every run cut back to steps <= 7 (the fault fired at 8)
        kept = [line for line in stream.read_text().splitlines() if json.loads(line)["step"] <= 7]
        stream.write_text("".join(f"{line}\n" for line in kept))
    stop = json.loads((root / "stop.json").read_text())
    (root / "stop.json").write_text(json.dumps({**stop, "steps": 7}))
    for path in root.glob("*/manifest.json"):  # and every manifest's experiment.steps
        rewrite_manifest(path, lambda config: config["experiment"].update(steps=7), rehash)
    summary = analyse(root)
    assert summary.exit_code == exit_codes.INCOMPLETE and not summary.deterministic_ok
    edited = f"{root / 'deterministic-1' / 'manifest.json'}: config_sha256 "
    assert any(line.startswith(edited) for line in summary.problems) is not rehash, summary.problems
    assert any(line.startswith(f"{root / 'deterministic-1'}: ") and "records hold steps 1-7 only" in line
               for line in summary.problems), summary.problems


def test_a_run_of_another_config_is_not_the_experiments_evidence(faulted: Path, tmp_path: Path) -> None:
    root = copy_of(faulted, tmp_path)
    rewrite_manifest(root / "baseline-1" / "manifest.json",
                     lambda config: config["recipe"].update(seed=config["recipe"]["seed"] + 1), rehash=True)
    summary = analyse(root)
    assert summary.exit_code == exit_codes.NOT_DETERMINISTIC  # the repeatability gate still shows the fault
    assert any(line.startswith(f"{root / 'baseline-1' / 'manifest.json'}: config differs from the experiment's: "
                               "recipe.seed") for line in summary.problems), summary.problems


@pytest.mark.parametrize("stop", ["missing", "other_steps"])
def test_a_stop_record_missing_or_disagreeing_with_the_config_is_incomplete(
        faulted: Path, tmp_path: Path, stop: str) -> None:
    root = copy_of(faulted, tmp_path)
    stop_file = root / "stop.json"
    if stop == "missing":
        stop_file.unlink()
    else:
        stop_file.write_text(json.dumps({**json.loads(stop_file.read_text()), "steps": 9}))
    summary = analyse(root)
    assert summary.exit_code in (exit_codes.INCOMPLETE, exit_codes.NOT_DETERMINISTIC)
    assert any(line.startswith(f"{stop_file}: ") for line in summary.problems), summary.problems


def test_a_fault_under_a_gate_that_still_agrees_is_called_out_and_not_a_pass(faulted: Path, tmp_path: Path) -> None:
    """The forgery the identity check cannot see (another run's records rewritten to name this run): the fault's
    own record still says it fired, so a gate finding the runs identical is a self-test that tested nothing."""
    root = copy_of(faulted, tmp_path)
    copy_streams(root, "deterministic-0", "deterministic-1", mirrors=False)
    for stream in (root / "deterministic-1").glob("steps.rank*.jsonl"):
        records = [{**json.loads(line), "replica": "1"} for line in stream.read_text().splitlines()]
        stream.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    summary = analyse(root)
    assert summary.fault_fired is False and summary.exit_code == exit_codes.INCOMPLETE
    assert any("the fault fired, yet repeatability found the runs identical" in line for line in summary.faults)


@pytest.fixture(scope="module")
def ablated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ablation experiment: knob arms beside the pair, each with the policy the design gives it."""
    root = tmp_path_factory.mktemp("ablated") / "experiment"
    root.mkdir()
    run_schedule(tiny_config("experiment.ablation=true", "experiment.profile_steps=1", "experiment.warmup_steps=0",
                             "experiment.steps=6", "experiment.resume_step=3", name="ablated"), root)
    return root


@pytest.mark.parametrize("run", ["deterministic-1", "with_deterministic_kernels-0", "without_deterministic_kernels-1"])
def test_a_manifest_whose_policy_was_edited_is_named_for_every_kind_of_arm(ablated: Path, tmp_path: Path,
                                                                          run: str) -> None:
    root = copy_of(ablated, tmp_path)
    assert not [line for line in analyse(root).problems if ": policy is not" in line]
    path = root / run / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["policy"]["deterministic_kernels"] = not manifest["policy"]["deterministic_kernels"]
    path.write_text(json.dumps(manifest))
    summary = analyse(root)
    assert summary.exit_code == exit_codes.INCOMPLETE
    assert any(line.startswith(f"{path}: policy is not ") and ": deterministic_kernels " in line
               for line in summary.problems), summary.problems
