"""`taxbench scan [overrides] [scan.*=...]`: the command line of the op repeat scan (taxbench.commands.scan, which
runs torch: imported once the arguments are read, so that --help loads no torch)."""

from __future__ import annotations

from pathlib import Path

from taxbench import exit_codes
from taxbench.commands.input_errors import fail, one_line_input_errors
from taxbench.commands.overrides import compose
from taxbench.config.schema import ConfigError, load_config

USAGE = """\
usage: taxbench scan [hydra overrides] [scan.repeats=K]
                     [scan.optimizer_step=false] [scan.out=FILE]

Runs one training step of the recipe under each policy (baseline,
deterministic) on one rank in this process, replays every ATen op K times
(default 3) on cloned inputs with the same RNG state, and lists per policy the
ops whose outputs differed (op, module, how many of K, input shapes, dtype) and
the ops without a deterministic implementation. Writes scan.json (default
<experiment.out_dir>/scan-<experiment.name>/).

  python -m taxbench scan +recipe=moe_tiny cluster.threads_per_rank=2

exit codes: 0 the deterministic policy has no such op, 2 bad input, 3 it has
one, 4 no op replayed (no evidence)
"""
OWN_KEYS = ("scan.repeats", "scan.optimizer_step", "scan.out")


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return exit_codes.OK
    from taxbench.commands.scan import DEFAULT_REPEATS, ScanSettings, check_scan, exit_code, render, run_scan
    from taxbench.preflight import check_before_launch

    own = {}
    overrides = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.startswith("scan."):
            if key not in OWN_KEYS:
                fail(f"unknown scan setting {key!r}; scan takes scan.repeats, scan.optimizer_step and scan.out")
            own[key] = value
        else:
            overrides.append(arg)
    with one_line_input_errors():
        try:
            repeats = int(own.get("scan.repeats", DEFAULT_REPEATS))
        except ValueError:
            raise ConfigError(f"scan.repeats={own['scan.repeats']!r} is not an integer") from None
        step = own.get("scan.optimizer_step", "true").lower()
        if step not in ("true", "false"):
            raise ConfigError(f"scan.optimizer_step={own['scan.optimizer_step']!r}; use true or false")
        out = own.get("scan.out")
        settings = ScanSettings(repeats, step == "true", Path(out) if out else None)
        cfg = load_config(compose(overrides))
        check_scan(cfg, settings)
        check_before_launch(cfg)
        scans, out_file = run_scan(cfg, settings)
    print(render(scans, out_file))
    return exit_code(scans)
