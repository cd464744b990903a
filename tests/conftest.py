from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from taxbench.cli import prepare  # importing the CLI registers the config schema
from taxbench.config import TaxbenchConfig, to_typed

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


def compose_config(*overrides: str) -> tuple[TaxbenchConfig, dict[str, Any]]:
    """What the CLI would launch: typed, validated and pair-checked (taxbench.cli.prepare), plus its container."""
    return prepare(compose_raw(*overrides))


@pytest.fixture
def taxbench_cli():
    return run_taxbench
