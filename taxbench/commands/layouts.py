"""`taxbench layouts [overrides] 'layouts=[L1, L2, ...]'`: one recipe under several parallel layouts
(taxbench.launchers.layouts, imported once the arguments are read: --help loads no torch)."""

from __future__ import annotations

from taxbench import exit_codes
from taxbench.commands.input_errors import fail, one_line_input_errors
from taxbench.commands.overrides import compose, override_key, split_own_settings
from taxbench.config.layout_names import parse_layout_list
from taxbench.config.schema import ConfigError, Launcher, load_config
from taxbench.rundir.experiment_folder import claimed, experiment_root
from taxbench.rundir.provenance import capture_launch
from taxbench.rundir.read import RecordError

USAGE = """\
usage: taxbench layouts [hydra overrides] 'layouts=[L1, L2, ...]'
                        [policy=deterministic|baseline]

Runs the recipe under each layout, two runs of one arm's policy per layout
(default: the deterministic arm), and compares them: whether each layout is
repeatable on its own, the step-0 and final weights by a layout-invariant
digest, and per step the loss and gradient norm with their distance in float32
ulps. A layout is dot-joined factors: pp<N>, tp<N>, dp<N>, ep<N>, v<N> (virtual
stages), ddp or fsdp; a factor left out is 1, dp follows from the world size
(cluster.cpu_ranks). experiment.steps sets the steps per run (default 8).

  python -m taxbench layouts +recipe=moe_1t_proxy \\
      'layouts=[pp1.dp4, pp2.dp2, pp2.dp2.ep2, tp2.dp2]'

exit codes: 0 every layout repeatable, 2 bad input (checked for every layout
before any runs), 3 a layout not repeatable, 4 evidence missing
"""
OWN_KEYS = ("layouts", "policy")


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return exit_codes.OK
    from taxbench.launchers.layouts import check_arm, layout_configs, repeat_settings, run_layouts
    from taxbench.launchers.outcome import publish_launch

    own, overrides = split_own_settings(argv, OWN_KEYS, lists=("layouts",))
    if "layouts" not in own:
        fail("taxbench layouts needs the layouts to compare, e.g. 'layouts=[pp1.dp4, pp2.dp2]' (see taxbench "
             "layouts --help)")
    policy = own.get("policy", "deterministic")
    given = {override_key(o) for o in overrides}
    with one_line_input_errors(RecordError):
        layouts = parse_layout_list(own["layouts"])
        cfg = load_config(compose(overrides))
        if cfg.cluster.launcher is not Launcher.local:
            raise ConfigError(f"taxbench layouts launches the layouts on this machine; cluster={cfg.cluster.name} "
                              "is not supported yet, use cluster=local")
        check_arm(cfg, policy)
        cfg = repeat_settings(cfg, cfg.experiment.steps if "experiment.steps" in given else None)
        if "experiment.name" not in given:
            cfg.experiment.name = f"layouts-{cfg.experiment.name}"
        configs = layout_configs(cfg, layouts)
        with claimed(cfg, experiment_root(cfg)) as root:
            capture_launch()
            return publish_launch(run_layouts(configs, policy, root, cfg.report))
    return exit_codes.CONFIG_ERROR
