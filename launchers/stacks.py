"""`taxbench stacks`: the same model size on each training stack, under the stack's own switch and under taxbench's
full policy, one experiment per cell (taxbench.analysis.stacks_matrix reads them back as one table).

Every cell is planned before the first one runs: its recipe (the stack's recipe of the family asked for), its model's
parameter count (on the meta device), and whether it can run here. A cell that cannot is recorded with the reason
and never launched: "needs CUDA" (Megatron-Core on a CPU machine), "not installed" (the stack's extra, with the pip
line). Any other refusal is bad input for the whole matrix (one line, exit 2, nothing run). Each cell that runs is a
whole experiment, composed and checked as `python -m taxbench +recipe=<recipe> mode@arms.deterministic=<policy>`
would be, launched into <root>/<stack>-<policy>/; a cell whose ranks fail is recorded and the next one runs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console

from taxbench.config.schema import (
    ConfigError,
    Device,
    ModelKind,
    RecipeConfig,
    ReportConfig,
    TaxbenchConfig,
    load_config,
    world_size,
)
from taxbench.design import experiment_steps
from taxbench.launchers.local import RankFailed, start_ranks
from taxbench.launchers.outcome import Launched
from taxbench.parallel.gpu_hours import render_total
from taxbench.parallel.plan import cost_of
from taxbench.preflight import prepare
from taxbench.rundir.plans import NEEDS_CUDA, NOT_INSTALLED, STACK_NAMES, Cell, StacksPlan
from taxbench.rundir.plans import STACKS_PLAN_FILE as PLAN_FILE
from taxbench.stacks.deepspeed import require_deepspeed
from taxbench.stacks.megatron import require_megatron
from taxbench.stacks.registry import stack_for
from taxbench.stacks.titan import require_torchtitan

# Per family, the recipe of comparable size each stack has (conf/recipe/); the table says which ran, and its size.
RECIPES = {
    "dense": {"taxbench": "dense_tiny", "titan": "titan_llama3_debug", "megatron": "megatron_gpt_debug",
              "deepspeed": "deepspeed_dense_debug"},
    "moe": {"taxbench": "moe_tiny", "titan": "titan_moe_debug", "megatron": "megatron_moe_debug",
            "deepspeed": "deepspeed_moe_debug"},
}
STACKS = STACK_NAMES
assert all(tuple(recipes) == STACKS for recipes in RECIPES.values())
# The model and batch every stack that builds its model from the recipe's fields runs (taxbench, DeepSpeed,
# Megatron-Core), so that their rows are the same model size: dense_tiny's, and for moe a shape DeepSpeed's MoE layer
# takes (no shared experts). torchtitan's model is its flavor's (its registry ignores these fields): its row says how
# many parameters it has. A field the command line sets wins.
_DENSE = {"vocab_size": 256, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256}
SHAPES = {
    "dense": {**{f"recipe.model.{key}": value for key, value in _DENSE.items()}, "recipe.micro_batch_size": 4,
              "recipe.global_batch_size": 8},
    "moe": {**{f"recipe.model.{key}": value for key, value in _DENSE.items()}, "recipe.model.n_experts": 4,
            "recipe.model.top_k": 2, "recipe.model.moe_d_ff": 128, "recipe.model.n_shared_experts": 0,
            "recipe.micro_batch_size": 8, "recipe.global_batch_size": 16},
}
OWN_MODEL = ("titan",)  # stacks whose model is not built from the recipe's fields
POLICIES = ("stack_native", "deterministic")  # the deterministic arm's mode (conf/mode/), one cell each
# The matrix sets these per cell; the command line may not.
OWN_OVERRIDES = ("recipe", "mode@arms.deterministic")
# A planted tax or the A/A calibration pair makes each cell's deterministic arm other than the policy it is labelled
# with: the matrix would answer for no stack's switch.
NOT_IN_A_MATRIX = ("experiment.calibration", "experiment.planted_tax")
DEFAULT_STEPS = 8  # per run: a cheap matrix; set experiment.steps for a tax interval worth quoting
# Unless the command line sets them: a short warmup, no periodic checkpoint (the restart replay's own is taken), the
# two *-0 runs timed (two models in memory per rank, not four).
CELL_DEFAULTS = {"experiment.warmup_steps": "2", "experiment.checkpoint_every_s": "0", "experiment.interleave": "pair"}
# Whether the stack's extra is installed (each raises ConfigError with its pip line)
_REQUIRE: dict[str, Callable[[], object]] = {
    ModelKind.titan.value: require_torchtitan,
    ModelKind.deepspeed.value: require_deepspeed,
    ModelKind.megatron.value: functools.partial(require_megatron, cuda=False),
}


def parse_stack_list(value: str | None) -> list[str]:
    """`stacks=[taxbench, deepspeed]` (None: every stack), each named once."""
    if value is None:
        return list(STACKS)
    names = [word.strip() for word in value.strip().removeprefix("[").removesuffix("]").split(",") if word.strip()]
    unknown = [name for name in names if name not in STACKS]
    if unknown or not names or len(set(names)) != len(names):
        raise ConfigError(f"stacks={value!r}: name each stack once, from {', '.join(STACKS)}, e.g. "
                          "'stacks=[taxbench, deepspeed]'")
    return names


def check_family(family: str) -> str:
    if family not in RECIPES:
        raise ConfigError(f"family={family!r}: choose {' or '.join(RECIPES)} (which recipe each stack runs)")
    return family


def check_overrides(overrides: list[str]) -> None:
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if key in OWN_OVERRIDES:
            raise ConfigError(f"{override}: taxbench stacks chooses each cell's recipe and deterministic arm itself; "
                              "drop it (family=dense|moe picks the recipes, stacks=[...] the stacks)")
        if key in NOT_IN_A_MATRIX:
            raise ConfigError(f"{override}: a stacks matrix answers for each stack's own switch and taxbench's "
                              "policy; calibrate the instrument on one pair instead (python -m taxbench "
                              "experiment.calibration=true ...)")


def cell_overrides(overrides: list[str], given: set[str]) -> list[str]:
    """The command line's overrides with the cell defaults it does not set (the matrix's experiment.name is the
    folder's, not a cell's)."""
    defaults = {"experiment.steps": str(DEFAULT_STEPS), **CELL_DEFAULTS}
    own = [o for o in overrides if o.lstrip("+").partition("=")[0] != "experiment.name"]
    return own + [f"{key}={value}" for key, value in defaults.items() if key not in given]


def parameter_count(recipe: RecipeConfig) -> int:
    """The whole model's parameters, on the meta device: counted without expert parallelism (DeepSpeed's MoE layer
    holds only a rank's own experts)."""
    whole = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, ep=1))
    return sum(p.numel() for p in stack_for(recipe.model).meta_model(whole).parameters())


def shape_overrides(family: str, given: set[str]) -> list[str]:
    return [f"{key}={value}" for key, value in SHAPES[family].items() if key not in given]


def shape_text(family: str) -> str:
    """The shape as the table's header says it."""
    return ", ".join(f"{key.removeprefix('recipe.').removeprefix('model.')}={value}"
                     for key, value in SHAPES[family].items())


def plan_cell(stack: str, policy: str, family: str, overrides: list[str],
              compose: Callable[[list[str]], DictConfig], shape: list[str] | None = None,
              ) -> tuple[Cell, TaxbenchConfig | None]:
    """The cell and the config it runs (None: it does not run here, and the cell says why); `shape` overrides the
    model and batch of a stack that builds its model from the recipe's fields."""
    recipe = RECIPES[family][stack]
    cell = Cell(stack, policy, recipe, None)
    shape = [] if shape is None or stack in OWN_MODEL else shape
    raw = compose([f"+recipe={recipe}", f"mode@arms.deterministic={policy}", *shape, *overrides,
                   f"experiment.name={cell.name}"])
    typed = load_config(raw)
    kind = str(typed.recipe.model.kind)
    if kind == ModelKind.megatron.value and typed.cluster.device is not Device.cuda:
        cell.skipped, cell.reason = NEEDS_CUDA, ("Megatron-Core trains on CUDA only (its schedule, gradient buffers "
                                                 "and norms); on a GPU node: cluster.device=cuda cluster.gpus=N")
    require = _REQUIRE.get(kind)
    with warnings.catch_warnings():  # a stack's import-time notices (Megatron's Apex, deprecations): not the cell's
        warnings.simplefilter("ignore")
        try:
            if require is not None:
                require()
        except ConfigError as exc:  # the stack's extra is missing: its message holds the pip line
            if cell.skipped is None:
                cell.skipped, cell.reason = NOT_INSTALLED, str(exc)
        else:
            try:
                cell.parameters = parameter_count(typed.recipe)
            except ConfigError as exc:  # the recipe as the overrides leave it is refused by the stack: bad input
                raise ConfigError(f"{stack} ({recipe}, mode@arms.deterministic={policy}): {exc}") from exc
    if cell.skipped is not None:
        return cell, None
    try:
        return cell, prepare(raw)
    except ConfigError as exc:
        raise ConfigError(f"{stack} ({recipe}, mode@arms.deterministic={policy}): {exc}") from exc


def plan_stacks(stacks: list[str], family: str, overrides: list[str], given: set[str],
                compose: Callable[[list[str]], DictConfig]) -> tuple[list[Cell], dict[str, TaxbenchConfig]]:
    """Every cell, checked before any runs; the configs of those that run, by cell name."""
    per_cell = cell_overrides(overrides, given)
    shape = shape_overrides(family, given)
    cells, configs = [], {}
    for stack in stacks:
        for policy in POLICIES:
            cell, cfg = plan_cell(stack, policy, family, per_cell, compose, shape)
            cells.append(cell)
            if cfg is not None:
                configs[cell.name] = cfg
    return cells, configs


def run_stacks(plan: StacksPlan, configs: dict[str, TaxbenchConfig], root: Path, settings: ReportConfig,
               console: Console | None = None) -> Launched:
    """Run each runnable cell's experiment into <root>/<cell>/, recording each launch in <root>/stacks.json; the
    matrix folder to publish with `settings`."""
    console = console or Console(stderr=True)
    if (root / PLAN_FILE).exists():
        raise ConfigError(f"{root} already holds a stacks matrix; pick another experiment.name instead of "
                          "overwriting it")
    plan.write(root)
    runnable = [cell for cell in plan.cells if cell.name in configs]
    on_gpu = plan.device == Device.cuda.value
    costs = [cost_of(configs[cell.name], params=cell.parameters) if on_gpu else None for cell in runnable]
    console.print(render_total(f"plan: {len(runnable)} cells", [experiment_steps(configs[cell.name])
                                                               for cell in runnable], costs, on_gpu), soft_wrap=True)
    for index, cell in enumerate(runnable, start=1):
        cfg = configs[cell.name]
        console.print(f"cell {index}/{len(configs)} {cell.name}: {cell.recipe}, {cfg.experiment.steps} steps per run "
                      f"on {world_size(cfg.cluster)} ranks")
        folder = root / cell.name
        folder.mkdir()
        started = time.perf_counter()
        try:
            start_ranks(cfg, folder)
        except RankFailed as exc:
            cell.failure = str(exc)
            console.print(f"[red]cell {cell.name} failed:[/red] {exc}", soft_wrap=True)
        cell.seconds = time.perf_counter() - started
        plan.write(root)
    return Launched(root, settings)
