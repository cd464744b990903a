from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_taxbench(*args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None,
                 ) -> subprocess.CompletedProcess[str]:
    """Run the user's entry point, `python -m taxbench ...`, as a real subprocess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "taxbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


@pytest.fixture
def taxbench_cli():
    return run_taxbench
