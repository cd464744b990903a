"""`taxbench stacks [overrides] ['stacks=[S1, S2, ...]']`: each training stack under its own switch and under
taxbench's policy, one table (taxbench.launchers.stacks, imported once the arguments are read: --help loads no
torch)."""

from __future__ import annotations

from taxbench import exit_codes
from taxbench.commands.input_errors import one_line_input_errors
from taxbench.commands.overrides import compose, override_key, split_own_settings
from taxbench.config.schema import ConfigError, Launcher, load_config, world_size
from taxbench.rundir.experiment_folder import claimed, experiment_root
from taxbench.rundir.provenance import capture_launch
from taxbench.rundir.read import RecordError

USAGE = """\
usage: taxbench stacks [hydra overrides] ['stacks=[S1, S2, ...]']
                       [family=dense|moe]

Runs the same model size on each training stack named (default: taxbench,
titan, megatron, deepspeed), each under its own determinism switch
(mode@arms.deterministic=stack_native) and under taxbench's full policy
(mode@arms.deterministic=deterministic): one experiment per cell, then one
table of tax +/- interval and the three gate verdicts per stack and policy.
family picks each stack's recipe (dense: dense_tiny, titan_llama3_debug,
megatron_gpt_debug, deepspeed_dense_debug; moe: moe_tiny, titan_moe_debug,
megatron_moe_debug, deepspeed_moe_debug); the stacks that build their model
from the recipe's fields (all but torchtitan) get one model and batch shape
(dense_tiny's, with 4 experts for moe; a recipe.* override wins), and the
table gives each row's parameter count. A cell that cannot run here is listed,
not failed: "needs CUDA" (Megatron-Core), "not installed" (with the pip line).
experiment.steps sets the steps per run (default 8); the other overrides apply
to every cell. taxbench report <folder> renders the matrix again.

  python -m taxbench stacks 'stacks=[taxbench, deepspeed]' experiment.steps=30

exit codes: 0 every cell that ran passed, 2 bad input (checked for every cell
before any runs), 3 a strict gate differs in a cell, 4 evidence missing (or no
cell ran)
"""
OWN_KEYS = ("stacks", "family")


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return exit_codes.OK
    from taxbench.launchers.outcome import publish_launch
    from taxbench.launchers.stacks import (
        DEFAULT_STEPS,
        check_family,
        check_overrides,
        parse_stack_list,
        plan_stacks,
        run_stacks,
        shape_text,
    )
    from taxbench.rundir.plans import StacksPlan

    own, overrides = split_own_settings(argv, OWN_KEYS, lists=("stacks",))
    given = {override_key(o) for o in overrides}
    with one_line_input_errors(RecordError):
        stacks = parse_stack_list(own.get("stacks"))
        family = check_family(own.get("family", "dense"))
        check_overrides(overrides)
        cfg = load_config(compose(overrides))
        if cfg.cluster.launcher is not Launcher.local:
            raise ConfigError(f"taxbench stacks launches the cells on this machine; cluster={cfg.cluster.name} is not "
                              "supported yet, use cluster=local")
        cells, configs = plan_stacks(stacks, family, overrides, given, compose)
        if "experiment.name" not in given:
            cfg.experiment.name = f"stacks-{family}-{cfg.experiment.name.removeprefix(cfg.recipe.name + '-')}"
        steps = next((c.experiment.steps for c in configs.values()), DEFAULT_STEPS)
        plan = StacksPlan(family, steps, world_size(cfg.cluster), cfg.cluster.device.value, cells,
                          shape_text(family))
        with claimed(cfg, experiment_root(cfg)) as root:
            capture_launch()
            return publish_launch(run_stacks(plan, configs, root, cfg.report))
    return exit_codes.CONFIG_ERROR
