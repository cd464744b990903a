"""`taxbench verify EXPERIMENT|CERTIFICATE [...] [overrides]`: the command line of the bitwise rerun
(taxbench.commands.verify and the launchers, imported once the arguments are read: --help loads no torch).

A recipe's rerun starts its ranks on the launcher its config names; the rerun of a `taxbench run -- COMMAND`
experiment is one run of the user's command as its deterministic arm ran (taxbench.launchers.command.CommandRunner:
the recorded command, edits and working folder, the same probe fingerprinting every step)."""

from __future__ import annotations

import itertools
import shlex
import sys
from contextlib import ExitStack
from pathlib import Path

from taxbench import exit_codes
from taxbench.commands.input_errors import fail, one_line_input_errors
from taxbench.commands.overrides import compose
from taxbench.config.schema import Launcher, TaxbenchConfig
from taxbench.rundir.experiment_folder import claimed, experiment_root
from taxbench.rundir.provenance import capture_launch
from taxbench.rundir.read import RecordError
from taxbench.rundir.records import RunWriteError

USAGE = """\
usage: taxbench verify EXPERIMENT|CERTIFICATE [...] [overrides]
                       [verify.avoid_reference_nodes=true]

Reruns the reference's deterministic recipe once (its deterministic-0, from the
config in its manifest or certificate) and compares every step's fingerprints
bit for bit with the reference's, over the steps both have. A reference made by
`taxbench run -- COMMAND` reruns that command once, on this machine, with its
recorded edits, in its recorded folder. Only where and how
the rerun runs may be overridden (cluster launcher/profile, partition, account,
qos, time limit, threads_per_rank, nodes, setup, sbatch_args,
experiment.out_dir/name/steps); any other difference is refused naming the
keys. With verify.avoid_reference_nodes=true a Slurm rerun excludes the
reference's hostnames (sbatch --exclude). Writes verify.json beside the rerun.
Several references (before the overrides) are rerun one after another, or on
Slurm as one job array (one submission; their jobs must have one shape).

  python -m taxbench verify runs/ref
  taxbench certificate runs/ref -o ref.cert
  python -m taxbench verify ref.cert cluster=slurm_cpu
  python -m taxbench verify certs/a.cert certs/b.cert cluster=slurm_cpu

exit codes: 0 identical, 2 bad input (a damaged or edited certificate), 3 a
fingerprint differs (first step, rank and metric; the manifests' differences as
suspects; the localize command), 4 evidence missing, 1 the rerun failed (how to
continue); for several references the worst of theirs (3 before 4)
"""


def main(argv: list[str]) -> int:
    """Rerun stored deterministic runs and compare them bitwise."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return exit_codes.OK
    sources = list(itertools.takewhile(lambda arg: "=" not in arg and not arg.startswith(("+", "~")), argv))
    if not sources:
        fail("taxbench verify needs a reference: an experiment folder (runs/<experiment>) or a certificate file "
             "(taxbench verify --help)")
    from taxbench.commands.launch import launch, launch_slurm_batch
    from taxbench.commands.verify import (
        OWN_KEYS,
        conclude,
        load_reference,
        overview,
        plan_rerun,
        render,
        settings_of,
    )
    from taxbench.launchers.command import CommandFailed, NoEvidence
    from taxbench.launchers.local import RankFailed, continue_command
    from taxbench.launchers.outcome import LaunchFailed
    from taxbench.launchers.worker import run_rerun_rank

    rest = argv[len(sources):]
    misplaced = [arg for arg in rest if "=" not in arg]
    if misplaced:
        fail(f"{misplaced[0]!r} follows the overrides; name every reference first: taxbench verify REF [REF ...] "
             "[overrides]")
    own = {arg.partition("=")[0]: arg.partition("=")[2] for arg in rest if arg.startswith("verify.")}
    unknown = sorted(set(own) - set(OWN_KEYS))
    if unknown:
        fail(f"unknown verify setting {unknown[0]!r}; verify takes {', '.join(OWN_KEYS)}")
    overrides = [arg for arg in rest if not arg.startswith("verify.")]
    if len(sources) > 1 and any(arg.lstrip("+~").startswith("experiment.name=") for arg in overrides):
        fail(f"experiment.name names one rerun, but {len(sources)} references are verified; drop it (each rerun is "
             "named verify-<experiment>-<date>-<time>-<n>)")
    with one_line_input_errors(RecordError, RunWriteError):
        references = [load_reference(Path(source)) for source in sources]
        settings = settings_of(own)
        several = len(references) > 1
        cfgs = [plan_rerun(reference, compose(overrides), overrides, settings, f"-{index}" if several else "")
                for index, reference in enumerate(references, 1)]
        with ExitStack() as held:
            roots = [held.enter_context(claimed(cfg, experiment_root(cfg))) for cfg in cfgs]
            capture_launch()
            runs = list(zip(cfgs, roots, strict=True))
            failed_codes: dict[int, int] = {}  # a failure other than the rerun's (exit 1): no evidence, exit 4
            if several and all(cfg.cluster.launcher is Launcher.slurm for cfg in cfgs):
                failures = launch_slurm_batch(runs, run_rerun_rank)
            else:
                failures = {}
                for index, (cfg, root) in enumerate(runs):
                    alone = [sys.argv[0], "verify", sources[index], *rest]
                    try:
                        if references[index].runs_a_command:
                            _rerun_command(cfg, root, alone)
                        else:
                            launch(cfg, root, run_rerun_rank)
                    except NoEvidence as exc:
                        if not several:
                            fail(str(exc), exit_codes.INCOMPLETE)
                        failures[index], failed_codes[index] = str(exc), exit_codes.INCOMPLETE
                    except CommandFailed as exc:  # its message says how to verify again
                        if not several:
                            fail(str(exc), exit_codes.FAILED)
                        failures[index] = str(exc)
                    except (RankFailed, LaunchFailed) as exc:
                        if not several:
                            fail(str(exc), exit_codes.FAILED)
                        # The other references still get their verdicts; this one continues on its own.
                        what = exc.what if isinstance(exc, RankFailed) else str(exc)
                        again = continue_command(alone, cfg.experiment.name)
                        failures[index] = f"{what}; continue this rerun with: {shlex.join(again)}"
            results = [conclude(reference, root) for index, (reference, root) in enumerate(zip(references, roots,
                                                                                                   strict=True))
                       if index not in failures]
        text = "\n\n".join(render(result) for result in results)
        if several:
            text += "\n\n" + overview(results, [sources[index] for index in failures])
        for message in failures.values():
            print(f"taxbench: error: {message}", file=sys.stderr)
        codes = [result.exit_code for result in results] + [failed_codes.get(index, exit_codes.FAILED)
                                                             for index in failures]
        print(text)
        return exit_codes.combined(codes)
    return exit_codes.CONFIG_ERROR


def _rerun_command(cfg: TaxbenchConfig, root: Path, verify_argv: list[str]) -> None:
    """One run of the user's command as the reference's deterministic-0 ran: its recorded command, edits and folder,
    under the probe with taxbench's policy (or the stack's switch alone, as recorded), every step fingerprinted.
    CommandFailed (exit 1) names its output and the verify that runs it again: a failed run of a command keeps
    nothing to continue from, so verify starts a fresh rerun (the continue keys are dropped); NoEvidence (exit 4)
    when it recorded nothing."""
    from taxbench.design import TIMED
    from taxbench.launchers.command import CommandRunner, PlannedRun
    from taxbench.launchers.local import continue_command

    fresh = continue_command(verify_argv, cfg.experiment.name)[:-2]  # without experiment.name and continue_existing
    runner = CommandRunner(cfg, root, [], again=shlex.join(fresh))
    runner.run_one(PlannedRun(TIMED["deterministic"], 0, gated=True), 1, 1)
