from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from taxbench.config.schema import TaxbenchConfig, register_configs, to_typed
from taxbench.preflight import prepare

register_configs()  # the schema Hydra composes against (the CLI registers it when imported)
REPO = Path(__file__).resolve().parents[1]


def run_taxbench(*args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None,
                 ) -> subprocess.CompletedProcess[str]:
    """Run the user's entry point, `python -m taxbench ...`, as a real subprocess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "taxbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def compose_raw(*overrides: str) -> DictConfig:
    """The Hydra config that `python -m taxbench <overrides>` composes, without running anything."""
    with initialize_config_module(config_module="taxbench.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def compose_typed(*overrides: str) -> TaxbenchConfig:
    """Typed but not validated: for configs validate() refuses on purpose (a plan for more GPUs than local ranks)."""
    return to_typed(OmegaConf.to_container(compose_raw(*overrides), resolve=True))


def compose_config(*overrides: str) -> TaxbenchConfig:
    """What the CLI would launch: typed, validated and pair-checked (taxbench.preflight.prepare)."""
    return prepare(compose_raw(*overrides))


@pytest.fixture
def taxbench_cli():
    return run_taxbench


def run_taxbench_in_terminal(*args: str, cwd: Path, timeout: float = 600, columns: int = 100) -> tuple[int, str]:
    """`python -m taxbench ...` with stdin, stdout and stderr on a pseudo-terminal, as a person runs it: rich then
    draws live progress bars (a piped run never takes that branch). Returns the exit code and everything shown."""
    import pty
    import select
    import time

    controller, terminal = pty.openpty()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERM": "xterm-256color", "COLUMNS": str(columns)}
    process = subprocess.Popen([sys.executable, "-m", "taxbench", *args], cwd=cwd, stdin=terminal, stdout=terminal,
                               stderr=terminal, env=env, close_fds=True)
    os.close(terminal)
    shown, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # EIO: every holder of the terminal has exited
                    break
                if not chunk:
                    break
                shown += chunk
            elif process.poll() is not None:
                break
        else:
            process.kill()
            raise TimeoutError(f"taxbench {' '.join(args)} still running after {timeout}s")
        return process.wait(timeout=30), shown.decode("utf-8", errors="replace")
    finally:
        os.close(controller)
