"""The import layers hold: scripts/import_graph.py (import-linter's contract on the installed package shape, no
cycles, no function-local imports of taxbench modules outside the command line) passes, and fails on a violation."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "import_graph.py"


def _run(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(repo / "scripts" / "import_graph.py"), "--picture"],
                          capture_output=True, text=True, timeout=120)


def test_the_package_is_layered_without_cycles() -> None:
    result = _run(REPO)
    assert result.returncode == 0, result.stderr
    assert "no cycles, every contract kept" in result.stdout
    picture = {name.strip(): targets for name, targets in
               (line.split(" -> ") for line in result.stdout.splitlines() if " -> " in line)}
    # the mapped folders are in the picture: launchers and analysis, seen as the installed package holds them
    assert "taxbench.analysis" in picture["taxbench.launchers"].split(", ")
    assert not any(name.startswith("taxbench.analysis") or name.startswith("taxbench.launchers")
                   for name in picture["taxbench.schedule"].split(", "))


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    for name in ("taxbench", "analysis", "launchers", "conf", "scripts"):
        shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    return copy


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    target = copy / "taxbench" / "train" / "planted.py"
    target.write_text(target.read_text() + "\nfrom taxbench.launchers.local import RankFailed  # noqa: E402,F401\n")
    result = _run(copy)
    assert result.returncode == 1
    assert "taxbench.train is not allowed to import taxbench.launchers" in result.stderr


def test_a_function_local_import_is_named(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    target = copy / "taxbench" / "stats" / "warmup.py"
    target.write_text(target.read_text() + "\n\ndef _late() -> None:\n    from taxbench.config import schema  # noqa\n")
    result = _run(copy)
    assert result.returncode == 1
    assert "warmup.py:" in result.stderr and "function-local import of taxbench.config.schema" in result.stderr


def test_a_module_outside_every_layer_is_named(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    (copy / "taxbench" / "unplaced.py").write_text('"""Nowhere in the contract."""\n')
    result = _run(copy)
    assert result.returncode == 1
    assert "taxbench.unplaced: in no import-linter contract" in result.stderr


def test_the_run_folder_format_loads_no_torch() -> None:
    # rundir sits below parallel: the manifests' torch facts are gathered by the core and handed in.
    code = ("import importlib, pkgutil, sys\nimport taxbench.rundir as rundir\n"
            "for found in pkgutil.iter_modules(rundir.__path__):\n"
            "    importlib.import_module(f'taxbench.rundir.{found.name}')\n"
            "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_config_layer_loads_no_torch() -> None:
    # config/ validates and describes the policy; applying it to the process (torch's flags) is taxbench.runtime.
    code = ("import importlib, pkgutil, sys\nimport taxbench.config as config\n"
            "for found in pkgutil.iter_modules(config.__path__):\n"
            "    importlib.import_module(f'taxbench.config.{found.name}')\n"
            "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
