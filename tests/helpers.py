"""Helpers the tests share: running the CLI as a person does, composing configs, tiny in-process experiments.

Imported as `from helpers import ...` (tests/ is on sys.path under pytest); conftest.py keeps the fixtures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from taxbench.config.schema import TaxbenchConfig, load_config, register_configs
from taxbench.launchers.worker import rank_process
from taxbench.parallel.distributed import DistContext, free_port
from taxbench.preflight import prepare
from taxbench.progress import IDLE, StepProgress
from taxbench.rundir.records import METRICS, steps_file
from taxbench.schedule.experiment import Experiment

register_configs()  # the schema Hydra composes against (the CLI registers it when imported)
REPO = Path(__file__).resolve().parents[1]


def has_deepspeed() -> bool:
    """Whether taxbench[deepspeed] is installed (its import, as a deepspeed recipe needs it)."""
    from taxbench.config.schema import ConfigError
    from taxbench.stacks.deepspeed import require_deepspeed

    try:
        require_deepspeed()
    except ConfigError:
        return False
    return True


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
    return load_config(compose_raw(*overrides))


def compose_config(*overrides: str) -> TaxbenchConfig:
    """What the CLI would launch: typed, validated and pair-checked (taxbench.preflight.prepare)."""
    return prepare(compose_raw(*overrides))


# ---- a tiny experiment run in this process, crashed and continued ------------------------------------------------
def tiny_config(*extra: str, name: str = "ckpt") -> TaxbenchConfig:
    """A 12-step in-process experiment of a tiny model in 3-step blocks, checkpointed every 3 steps."""
    return compose_config("cluster=inprocess", "recipe.global_batch_size=4", "recipe.model.d_model=32",
                          "recipe.model.n_heads=2", "recipe.model.seq_len=16", "recipe.model.d_ff=64",
                          f"experiment.name={name}", "experiment.steps=12", "experiment.block_steps=3",
                          "experiment.warmup_steps=2", "experiment.resume_step=6",
                          "experiment.checkpoint_every_steps=3", *extra)


class Crash(Exception):
    pass


def crash_after(steps: int) -> Callable[[], None]:
    """A progress callback that raises Crash at the `steps`-th step the schedule takes."""
    done = [0]

    def on_step() -> None:
        done[0] += 1
        if done[0] == steps:
            raise Crash

    return on_step


@contextmanager
def one_rank(cfg: TaxbenchConfig) -> Iterator[DistContext]:
    """The only rank of `cfg`, in this process; the environment its policies set is put back afterwards."""
    saved = dict(os.environ)
    try:
        with rank_process([cfg], 0, 1, 0, "127.0.0.1", free_port()) as ctx:
            yield ctx
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_schedule(cfg: TaxbenchConfig, root: Path, on_step: Callable[[], None] | None = None) -> None:
    """The experiment's whole schedule on one in-process rank."""
    with one_rank(cfg) as ctx:
        Experiment(cfg, ctx, root, IDLE if on_step is None else StepProgress(on_step)).run()


def step_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in steps_file(run_dir, 0).read_text().splitlines()]


def fingerprints(run_dir: Path) -> list[tuple]:
    """Rank 0's (step, trajectory_step, *METRICS) per record (trajectory_step: None outside a shared model)."""
    return [(r["step"], r.get("trajectory_step"), *(r[m] for m in METRICS)) for r in step_records(run_dir)]


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


def localize_planted_op(tmp_path: Path, recipe: str, module: str) -> Any:
    """A 4-step, 2-rank experiment of `recipe` whose deterministic-1 has aten.mm's first output inside `module`
    perturbed at step 2 on rank 1, launched for real, then localized (deterministic-0 vs deterministic-1)."""
    return localize_planted_fault(tmp_path, recipe, "experiment.fault.kind=nondeterministic_op",
                                  f"experiment.fault.module={module}", "experiment.fault.op=aten.mm.default")


def localize_planted_fault(tmp_path: Path, recipe: str, *fault: str) -> Any:
    """A 4-step, 2-rank experiment of `recipe` whose deterministic-1 gets the `fault` settings at step 2 on rank 1,
    launched for real, then localized (deterministic-0 vs deterministic-1)."""
    from taxbench.commands.localize import localize
    from taxbench.launchers.local import launch_local

    cfg = prepare(compose_raw(
        f"+recipe={recipe}", "experiment.steps=4", "experiment.block_steps=2", "experiment.resume_step=2",
        "experiment.warmup_steps=0", f"experiment.out_dir={tmp_path}", "experiment.fault.enabled=true",
        "experiment.fault.step=2", "experiment.fault.rank=1", *fault))
    root = tmp_path / cfg.experiment.name
    root.mkdir(parents=True)
    launch_local(cfg, root)
    return localize(root / "deterministic-0", root / "deterministic-1", tmp_path / "work")
