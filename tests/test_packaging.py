"""The built wheel (non-editable install) carries conf/, launchers/ and analysis/ and runs from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO, run_taxbench

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True, capture_output=True, text=True, timeout=300)
    (built,) = out.glob("taxbench-*.whl")
    return built


def test_wheel_contains_config_tree_and_top_level_packages(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("taxbench/conf/config.yaml", "taxbench/conf/recipe/dense_tiny.yaml",
                     "taxbench/conf/mode/deterministic.yaml", "taxbench/conf/cluster/local.yaml",
                     "taxbench/launchers/local.py", "taxbench/analysis/summary.py"):
        assert expected in names


def test_installed_wheel_composes_the_config_outside_the_repo(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import taxbench, taxbench.conf; print(taxbench.conf.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site))
    job = run_taxbench("+recipe=dense_tiny", "--cfg", "job", cwd=tmp_path, env=env, timeout=120)
    assert job.returncode == 0, job.stderr
    assert "name: dense_tiny" in job.stdout and "cublas_workspace_config: :4096:8" in job.stdout


def test_the_readme_installs_cpu_torch_before_the_quick_start_installs_taxbench() -> None:
    """Run top to bottom on a CPU-only Linux machine, the Quick start must not pull the multi-GB CUDA build first."""
    quick_start = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in quick_start.splitlines() if line.startswith("pip install")]
    assert commands[0].startswith("pip install torch==") and "--index-url https://download.pytorch.org/whl/cpu" in \
        commands[0]
    assert commands[1].startswith('pip install -e ".[dev]"')
