"""Where a run came from, recorded in every manifest under "provenance": the taxbench version, the git commit of the
taxbench source tree and whether it was dirty, the launch's command line and Hydra overrides, and a hash of the
resolved config as the manifest stores it.

The ranks run in other processes (spawned locally, or Slurm tasks) that never see the launcher's argv or Hydra
state, so the launcher captures both into the environment variable LAUNCH_ENV (JSON, redacted: secrets never reach
the environment or a file) just before it starts them, and the manifest writer reads it back. Spawned processes and
Slurm jobs (sbatch exports the submitting environment by default) inherit it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from taxbench import __version__
from taxbench.redaction import redact, redact_text

LAUNCH_ENV = "TAXBENCH_LAUNCH"
GIT_TIMEOUT_S = 5
PACKAGE_DIR = Path(__file__).resolve().parent


def launch_command(argv: Sequence[str] | None = None) -> str:
    """The launching command line as typed, redacted: `python -m taxbench ...` keeps the interpreter and its flags
    (sys.orig_argv); a console script (`taxbench ...`) is its own argv."""
    if argv is None:
        argv = sys.orig_argv if Path(sys.argv[0]).name == "__main__.py" else sys.argv
    return shlex.join(redact_text(word) for word in argv)


def hydra_overrides() -> list[str]:
    """This job's Hydra overrides (a multirun point's own), redacted; [] outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [redact_text(override) for override in HydraConfig.get().overrides.task]


def capture_launch() -> None:
    """Hand this launch's command line and overrides to the ranks it is about to start (see the module docstring)."""
    os.environ[LAUNCH_ENV] = json.dumps({"command": launch_command(), "overrides": hydra_overrides()})


def read_launch() -> dict[str, Any]:
    """What capture_launch handed down: command and overrides, None each when not launched by the taxbench CLI (or
    the variable is unreadable)."""
    try:
        launch = json.loads(os.environ.get(LAUNCH_ENV, "{}"))
    except json.JSONDecodeError:
        launch = {}
    if not isinstance(launch, dict):
        launch = {}
    return {"command": launch.get("command"), "overrides": launch.get("overrides")}


def taxbench_version() -> str:
    try:
        return metadata.version("taxbench")
    except metadata.PackageNotFoundError:
        return __version__


def _git(args: Sequence[str], where: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                             timeout=GIT_TIMEOUT_S, check=True, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


@cache
def git_state(where: Path = PACKAGE_DIR) -> dict[str, Any]:
    """{"commit": 40-hex, "dirty": bool} when `where` holds taxbench source tracked by a git checkout, else both
    None: no git, not a checkout, or an installed copy that merely sits inside someone else's repository (a venv in
    a project folder), whose commit would not be taxbench's."""
    unknown: dict[str, Any] = {"commit": None, "dirty": None}
    if _git(["ls-files", "--error-unmatch", "--", "__init__.py"], where) is None:
        return unknown
    commit = _git(["rev-parse", "HEAD"], where)
    status = _git(["status", "--porcelain"], where)  # untracked files count: a new module changes what runs
    if commit is None or status is None:
        return unknown
    return {"commit": commit.strip(), "dirty": bool(status.strip())}


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the config as the manifest stores it (redacted), in canonical JSON: recomputable from the file."""
    return hashlib.sha256(canonical_json(redact(config)).encode("utf-8")).hexdigest()


def manifest_provenance(config: dict[str, Any]) -> dict[str, Any]:
    """The manifest's "provenance" section for a run of resolved `config`."""
    return {"version": taxbench_version(), **git_state(), **read_launch(), "config_sha256": config_hash(config)}
