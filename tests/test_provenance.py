"""Provenance in every manifest: version, git commit and dirty flag, command line, Hydra overrides, config hash."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from taxbench.design import ALL_RUNS
from taxbench.redaction import REDACTED
from taxbench.rundir import provenance

REPO = Path(__file__).resolve().parents[1]
TINY = ("cluster=inprocess", "experiment.steps=12", "experiment.block_steps=6", "experiment.warmup_steps=2",
        "experiment.resume_step=6", "report.wandb=false")
SECRET = "abc123secret"
SECRET_SETUP = f"cluster.setup=['export MY_TOKEN={SECRET}']"


def _sha256_of_canonical_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def _head_commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_git_state_of_this_checkout_names_its_commit() -> None:
    state = provenance.git_state.__wrapped__(provenance.PACKAGE_DIR)
    assert state["commit"] == _head_commit()
    assert isinstance(state["dirty"], bool)


def test_git_state_is_null_without_git(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to be found
    assert provenance.git_state.__wrapped__(provenance.PACKAGE_DIR) == {"commit": None, "dirty": None}


def test_git_state_is_null_outside_a_checkout(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    assert provenance.git_state.__wrapped__(tmp_path) == {"commit": None, "dirty": None}


def test_git_state_is_null_for_a_copy_inside_another_repository(tmp_path: Path) -> None:
    """An installed taxbench in a venv inside a user's project repo: that repo's commit is not taxbench's."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "project"], check=True)
    package = tmp_path / ".venv" / "taxbench"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert provenance.git_state.__wrapped__(package) == {"commit": None, "dirty": None}


def test_launch_command_is_redacted() -> None:
    command = provenance.launch_command(["python", "-m", "taxbench", "+recipe=moe_tiny", SECRET_SETUP])
    assert SECRET not in command and REDACTED in command
    assert command.startswith("python -m taxbench +recipe=moe_tiny ")


def test_launch_round_trips_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(provenance.LAUNCH_ENV, raising=False)
    assert provenance.read_launch() == {"command": None, "overrides": None}
    monkeypatch.setattr(sys, "argv", ["/somewhere/taxbench/__main__.py", "+recipe=moe_tiny", SECRET_SETUP])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "taxbench", "+recipe=moe_tiny", SECRET_SETUP])
    provenance.capture_launch()
    assert SECRET not in provenance.os.environ[provenance.LAUNCH_ENV]
    launch = provenance.read_launch()
    assert launch["command"] == provenance.launch_command(sys.orig_argv)
    assert launch["overrides"] == []  # no Hydra app in this process


@pytest.mark.parametrize("value", ["not json", "[1, 2]"])
def test_unreadable_launch_variable_reads_as_unknown(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(provenance.LAUNCH_ENV, value)
    assert provenance.read_launch() == {"command": None, "overrides": None}


def test_config_hash_is_of_the_config_as_stored() -> None:
    config = {"cluster": {"setup": [f"export MY_TOKEN={SECRET}"]}, "b": 1.5, "a": [1, 2]}
    stored = {"cluster": {"setup": [f"export MY_TOKEN={REDACTED}"]}, "a": [1, 2], "b": 1.5}
    assert provenance.config_hash(config) == _sha256_of_canonical_json(stored)


def test_version_is_the_installed_distribution() -> None:
    assert provenance.taxbench_version() == metadata.version("taxbench")


@pytest.mark.slow
def test_cli_run_records_provenance_and_keeps_secrets_out(tmp_path: Path, taxbench_cli) -> None:
    args = (*TINY, "experiment.name=prov", f"experiment.out_dir={tmp_path}", SECRET_SETUP)
    result = taxbench_cli(*args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    root = tmp_path / "prov"
    leaked = [p for p in root.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaked

    for ref in ALL_RUNS:
        manifest = json.loads((root / ref.name / "manifest.json").read_text())
        prov = manifest["provenance"]
        assert prov["version"] == metadata.version("taxbench")
        assert prov["commit"] == _head_commit() and isinstance(prov["dirty"], bool)
        assert prov["command"].startswith(f"{sys.executable} -m taxbench cluster=inprocess ")
        assert REDACTED in prov["command"] and SECRET not in prov["command"]
        assert prov["overrides"] == [*args[:-1], f"cluster.setup=['export MY_TOKEN={REDACTED}']"]
        assert re.fullmatch(r"[0-9a-f]{64}", prov["config_sha256"])
        assert prov["config_sha256"] == _sha256_of_canonical_json(manifest["config"])

    report = (root / "report" / "report.md").read_text()
    assert "provenance.commit" in report and "provenance.config_sha256" in report

    # Provenance differs on a continue (its command line does), but only the config decides whether it may.
    again = taxbench_cli(*args, "experiment.continue_existing=true", cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr
