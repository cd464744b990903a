"""The experiment folder is claimed by one launch at a time, and default names never collide."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import compose_config, compose_raw

from taxbench.config.schema import ConfigError, launch_stamp
from taxbench.rundir.experiment_folder import LOCK_FILE, claimed, experiment_root

HOLD_THE_FOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
from helpers import compose_config
from taxbench.rundir.experiment_folder import claimed, experiment_root
cfg = compose_config("experiment.name=busy", "experiment.out_dir={out}")
with claimed(cfg, experiment_root(cfg)):
    print("holding", flush=True)
    time.sleep(3600)  # until the fixture kills it, however long a loaded machine takes
"""


@pytest.fixture
def folder_held_elsewhere(tmp_path: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_FOLDER.format(tests=str(Path(__file__).parent), out=str(tmp_path))],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    yield holder
    holder.kill()
    holder.wait()


def test_second_launch_on_a_held_folder_is_refused_naming_the_holder(
    folder_held_elsewhere: subprocess.Popen, tmp_path: Path, taxbench_cli
) -> None:
    result = taxbench_cli("experiment.name=busy", f"experiment.out_dir={tmp_path}", "cluster=inprocess",
                          cwd=tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr
    assert f"is in use by the launch with pid {folder_held_elsewhere.pid} on host {socket.gethostname()}" in (
        result.stderr)
    assert "Traceback" not in result.stderr
    assert (tmp_path / "busy").is_dir(), "the holder's folder stays"


def test_continue_while_the_first_launch_still_runs_is_refused(folder_held_elsewhere: subprocess.Popen,
                                                                 tmp_path: Path) -> None:
    cfg = compose_config("experiment.name=busy", f"experiment.out_dir={tmp_path}",
                            "experiment.continue_existing=true")
    with pytest.raises(ConfigError, match="is in use by"), claimed(cfg, experiment_root(cfg)):
        pass


def test_lock_is_released_when_the_holder_dies(folder_held_elsewhere: subprocess.Popen, tmp_path: Path) -> None:
    folder_held_elsewhere.kill()
    folder_held_elsewhere.wait()
    cfg = compose_config("experiment.name=busy", f"experiment.out_dir={tmp_path}")
    with claimed(cfg, experiment_root(cfg)) as root:
        assert (root / LOCK_FILE).exists()


def test_refused_claim_removes_the_folder_it_created_and_keeps_results(tmp_path: Path) -> None:
    cfg = compose_config("experiment.name=fresh", f"experiment.out_dir={tmp_path}")
    with pytest.raises(RuntimeError), claimed(cfg, experiment_root(cfg)):
        raise RuntimeError("the launch failed before any run wrote anything")
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "old" / "deterministic-0").mkdir(parents=True)
    cfg = compose_config("experiment.name=old", f"experiment.out_dir={tmp_path}")
    with pytest.raises(ConfigError, match="already holds results"), claimed(cfg, experiment_root(cfg)):
        pass
    assert (tmp_path / "old" / "deterministic-0").is_dir()


def test_default_names_differ_between_launches_started_in_the_same_second() -> None:
    show_name = ("import sys; sys.path.insert(0, 'tests'); from helpers import compose_raw; "
                 "print(compose_raw().experiment.name)")
    started = time.time()
    launches = [subprocess.Popen([sys.executable, "-c", show_name], stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).parents[1]) for _ in range(2)]
    names = [p.communicate(timeout=120)[0].strip() for p in launches]
    assert all(name.startswith("dense_tiny-") for name in names), names
    assert names[0] != names[1], f"two launches within {time.time() - started:.1f}s got the same name"


def test_one_launch_uses_one_default_name_for_every_point() -> None:
    assert compose_raw().experiment.name == compose_raw().experiment.name == f"dense_tiny-{launch_stamp()}"
