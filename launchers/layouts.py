"""`taxbench layouts`: run one recipe under each layout named, two whole runs of one policy per layout, then compare.

Every layout is checked before the first one starts (a bad name, or a layout that does not fit the world size or the
model, is one line and exit 2). Each layout then runs as its own launch of the world's rank processes
(taxbench.launchers.local.start_ranks) into <root>/<layout>/, through the experiment's trainer, manifests and step
records (taxbench.schedule.repeats). A layout whose ranks fail is recorded and the next one runs; the analysis then
counts its evidence as missing.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

from rich.console import Console

from taxbench.analysis.experiment import recipe_label
from taxbench.analysis.layouts import SUMMARY_FILE
from taxbench.config.layout_names import LayoutName, check_layout
from taxbench.config.schema import ConfigError, Device, ReportConfig, TaxbenchConfig, world_size, world_size_key
from taxbench.design import ExperimentSteps
from taxbench.launchers.local import RankFailed, start_ranks
from taxbench.launchers.outcome import Launched
from taxbench.launchers.worker import run_repeats_rank
from taxbench.parallel.gpu_hours import render_total
from taxbench.parallel.plan import cost_of
from taxbench.preflight import check_before_launch
from taxbench.rundir.plans import LAYOUTS_PLAN_FILE as PLAN_FILE
from taxbench.rundir.plans import LaunchRecord, LayoutsPlan
from taxbench.schedule.repeats import REPLICAS

DEFAULT_STEPS = 8  # per run: 4 layouts x 2 runs of the moe_1t proxy take a few minutes on 2 cores


def repeat_settings(cfg: TaxbenchConfig, steps: int | None) -> TaxbenchConfig:
    """The experiment settings of a layout's two runs: `steps` each (None: DEFAULT_STEPS) in one block, no checkpoints
    and nothing timed against anything (warmup, resume and stopping settings do not apply)."""
    steps = DEFAULT_STEPS if steps is None else steps
    if steps < 2:
        raise ConfigError(f"experiment.steps={steps}: taxbench layouts compares at least 2 steps per run")
    exp = dataclasses.replace(cfg.experiment, steps=steps, block_steps=steps, warmup_steps=0, resume_step=1,
                              checkpoint_every_steps=0, checkpoint_every_s=0.0, gate_steps=0,
                              target_half_width=0.0, max_steps=0, ablation=False,
                              interleave="pair")
    return dataclasses.replace(cfg, experiment=exp)


def layout_configs(cfg: TaxbenchConfig, layouts: list[LayoutName]) -> dict[str, TaxbenchConfig]:
    """Each layout's config, every one checked as an experiment's would be; ConfigError for the first that fails."""
    world, key = world_size(cfg.cluster), world_size_key(cfg.cluster)
    configs = {}
    for layout in layouts:
        recipe = check_layout(layout, cfg.recipe, world, key)
        configs[layout.name] = dataclasses.replace(cfg, recipe=recipe)
        try:
            check_before_launch(configs[layout.name])
        except ConfigError as exc:
            raise ConfigError(f"layout {layout.name}: {exc}") from exc
    return configs


def check_arm(cfg: TaxbenchConfig, arm: str) -> None:
    if arm not in cfg.arms:
        raise ConfigError(f"policy={arm!r} is not an arm; choose one of {sorted(cfg.arms)} (the policy each arm "
                          "runs is set with mode@arms.<arm>=<mode>)")


def run_layouts(configs: dict[str, TaxbenchConfig], arm: str, root: Path, settings: ReportConfig,
                console: Console | None = None) -> Launched:
    """Run every layout's two runs into <root>/<layout>/, recording each launch in <root>/layouts.json; the whole
    launch, to publish with `settings`."""
    console = console or Console(stderr=True)
    if (root / PLAN_FILE).exists() or (root / SUMMARY_FILE).exists():
        raise ConfigError(f"{root} already holds layout results; pick another experiment.name instead of "
                          "overwriting them")
    first = next(iter(configs.values()))
    steps, world = first.experiment.steps, world_size(first.cluster)
    plan = LayoutsPlan(recipe_label(dataclasses.asdict(first.recipe)), arm, steps, world, list(configs))
    plan.write(root)
    # Each layout: its runs whole, one after the other, none timed against the other (a verdict on the weights).
    repeats = ExperimentSteps(0, steps, len(REPLICAS), steps, 0, 0, 0)
    on_gpu = first.cluster.device is Device.cuda
    costs = [cost_of(cfg, repeats) if on_gpu else None for cfg in configs.values()]
    total = render_total(f"plan: {len(configs)} layouts", [repeats] * len(configs), costs, on_gpu)
    console.print(total, soft_wrap=True)
    for index, (name, cfg) in enumerate(configs.items(), start=1):
        console.print(f"layout {index}/{len(configs)} {name}: {len(REPLICAS)} runs x {steps} steps of {arm} on "
                      f"{world} ranks")
        folder = root / name
        folder.mkdir()
        started = time.perf_counter()
        record = LaunchRecord()
        try:
            start_ranks(cfg, folder, functools.partial(run_repeats_rank, arm=arm))
        except RankFailed as exc:
            record.failure = str(exc)
            console.print(f"[red]layout {name} failed:[/red] {exc}", soft_wrap=True)
        record.seconds = time.perf_counter() - started
        plan.launches[name] = record
        plan.write(root)
    return Launched(root, settings)
