"""`taxbench verify` and `taxbench certificate`: check a later rerun of a recipe bitwise against a stored run.

The gates compare runs inside one launch. verify answers the question across launches: rerun today, on other nodes or
after an upgrade, does the deterministic recipe still give the bits of the run we trust? The reference is an experiment
folder (its deterministic-0) or a certificate made from one (taxbench.rundir.certificate). The rerun is one run of the
deterministic arm (taxbench.schedule.rerun) with the reference's recorded config; only where and how it runs may be
overridden (RERUN_MAY_CHANGE). For an experiment of `taxbench run -- COMMAND` the rerun is one run of the user's
command as its deterministic arm ran it (the recorded command, edits and working folder, under the same probe: see
verify_cli), on this machine, as long as the command takes. Its fingerprints are compared with the reference's by
the gates' comparer (analysis.verdicts.compare_runs) over the steps both have. On a difference, what differs between
the two runs' manifests is listed as suspects (taxbench.rundir.certificate.essentials), with the `localize` command
that replays both.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from taxbench import exit_codes
from taxbench.analysis.command_experiment import UNOBSERVED, flag_problems
from taxbench.analysis.divergence import nonfinite_runs
from taxbench.analysis.experiment import expected_steps, interleaved_runs
from taxbench.analysis.verdicts import DIFFERS, IDENTICAL, Verdict, compare_runs
from taxbench.config.command import CommandError, validate_command
from taxbench.config.pairing import differences
from taxbench.config.schema import ConfigError, Launcher, TaxbenchConfig, launch_stamp, load_config, validate
from taxbench.design import run_steps
from taxbench.preflight import check_before_launch, check_out_dir
from taxbench.redaction import REDACTED, redact
from taxbench.rundir.certificate import (
    Certificate,
    essentials,
    hostnames,
    make_certificate,
    read_certificate,
    write_certificate,
)
from taxbench.rundir.experiment_folder import held_by
from taxbench.rundir.read import (
    RecordError,
    UnreadableRecords,
    check_run,
    config_problems,
    identity_problems,
    load_checked_run,
    load_run,
)
from taxbench.rundir.records import MANIFEST, write_text_atomically
from taxbench.rundir.run_manifest import Manifest, load_manifest
from taxbench.rundir.step_record import STEP
from taxbench.rundir.stop_file import STOP_FILE, read_stop
from taxbench.schedule.rerun import RERUN

SUMMARY_FILE = "verify.json"  # in the rerun's experiment folder
# Settings a rerun may change: where and how it runs, never what it computes. A key matches itself and its children.
RERUN_MAY_CHANGE = (
    "cluster.name", "cluster.launcher", "cluster.master_addr", "cluster.master_port", "cluster.nodes",
    "cluster.gpus_per_node", "cluster.threads_per_rank", "cluster.partition", "cluster.account", "cluster.qos",
    "cluster.constraint", "cluster.time_min", "cluster.setup", "cluster.sbatch_args", "cluster.submitit_dir",
    "cluster.dry_run", "cluster.peak_tflops", "cluster.planned_mfu",
    "experiment.name", "experiment.out_dir", "experiment.steps", "experiment.block_steps",
    "experiment.checkpoint_every_steps", "experiment.continue_existing", "report",
)
OWN_KEYS = ("verify.avoid_reference_nodes",)


class VerifyError(ConfigError):
    """verify cannot run as asked; the message names the settings and the fix."""


@dataclass(frozen=True)
class Reference:
    """What a rerun is checked against: a run folder's deterministic-0 or a certificate."""

    source: str  # as the user named it
    run_dir: Path | None  # the reference run folder, where it exists here (localize replays it)
    made_from: str  # the run folder the reference describes
    experiment: str
    config: dict[str, Any]
    steps: int
    world_size: int
    essentials: dict[str, Any]
    frame: pd.DataFrame
    problems: tuple[str, ...] = ()  # why a run folder's evidence is not its own or its length unknown
    certificate: bool = False

    @property
    def runs_a_command(self) -> bool:
        """Whether the reference is a run of `taxbench run -- COMMAND` (the user's command, not a recipe)."""
        return runs_a_command(self.config)

    def grid_problems(self, steps: int) -> list[str]:
        """What keeps the reference from holding steps 1..`steps` of every rank once (a certificate always does)."""
        if self.certificate or self.run_dir is None:
            return []
        return check_run(self.run_dir.name, self.run_dir, _up_to(self.frame, steps), steps, self.world_size)


def runs_a_command(config: dict[str, Any]) -> bool:
    return bool((config.get("run") or {}).get("command"))


def _run_dir_of(path: Path) -> Path:
    """An experiment folder's deterministic-0, or the run folder itself."""
    if (path / MANIFEST).exists():
        return path
    if (path / RERUN.name).is_dir():
        return path / RERUN.name
    raise RecordError(f"{path}: neither an experiment folder with {RERUN.name}/ nor a run folder with {MANIFEST}; "
                      "name the experiment (runs/<experiment>) or a certificate file")


def load_reference(path: Path) -> Reference:
    """The reference named on the command line: a certificate file, or an experiment (or run) folder."""
    if path.is_file():
        return _from_certificate(read_certificate(path))
    if not path.exists():
        raise RecordError(f"{path}: no such experiment folder or certificate")
    run_dir = _run_dir_of(path)
    _refuse_a_running_experiment(run_dir)
    manifest = load_manifest(run_dir)
    config = manifest.config
    if f"{manifest.arm}-{manifest.replica}" != RERUN.name:
        raise RecordError(f"{run_dir / MANIFEST}: not the manifest of a {RERUN.name} run; verify checks against an "
                          "experiment's deterministic-0")
    if not isinstance(config, dict):
        raise UnreadableRecords(f"{run_dir / MANIFEST}: holds no config; the manifest is damaged")
    problems = config_problems(run_dir, manifest, config)
    if runs_a_command(config):
        return _command_reference(path, run_dir, manifest, config, problems)
    try:
        experiment = config["experiment"]
        rounds_steps, _, stop_problems = expected_steps(run_dir.parent, experiment)
        # deterministic-0 is timed in the rounds, or (experiment.interleave=policy) a gate-only run of its own length
        timed = {ref.name for ref in interleaved_runs(experiment)}
        steps = run_steps(RERUN.name, timed, rounds_steps, experiment)
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableRecords(f"{run_dir / MANIFEST}: its config lacks or garbles {exc}; the manifest is damaged "
                                "(verify needs the manifest an experiment wrote)") from None
    frame = load_run(run_dir, empty_ok=True)
    problems += stop_problems + identity_problems(run_dir, manifest, frame)
    world = manifest.world_size
    return Reference(str(path), run_dir, str(run_dir), str(manifest.experiment), config, steps, world,
                     essentials(manifest), frame, tuple(problems))


def _command_reference(path: Path, run_dir: Path, manifest: Manifest, config: dict[str, Any],
                       problems: list[str]) -> Reference:
    """The deterministic-0 of a `taxbench run -- COMMAND` experiment: as long as the command took (stop.json, which
    every run of the experiment is checked against), its records with the live flags (a command that turned the
    policy off is no evidence: analysis.command_experiment.flag_problems)."""
    frame = load_run(run_dir, empty_ok=True)
    stop = read_stop(run_dir.parent)
    if stop is None:
        problems = [*problems, f"{run_dir.parent / STOP_FILE}: missing or damaged: the experiment's runs never all "
                               "ended, so the command's length is unknown; continue the experiment "
                               "(experiment.continue_existing=true)"]
    steps = stop.steps if stop is not None else int(frame[STEP].max()) if not frame.empty else 0
    problems += identity_problems(run_dir, manifest, frame) + flag_problems(RERUN.name, manifest, frame)
    return Reference(str(path), run_dir, str(run_dir), str(manifest.experiment), config, steps, manifest.world_size,
                     essentials(manifest), _observed(frame), tuple(problems))


class ReferenceRunning(RecordError):
    """The reference's experiment is still held by a live launch (exit 2: name a finished one, or wait)."""


def _refuse_a_running_experiment(run_dir: Path) -> None:
    """ReferenceRunning when a live launch holds the reference's experiment: its deterministic-0 is not finished, and
    reading it would leave mirrors in a folder that launch writes (verify starts no launch before this probe, so it
    holds no lock the probe could drop: taxbench.rundir.experiment_folder.held_by)."""
    for folder in (run_dir.parent, run_dir):
        holder = held_by(folder)
        if holder is not None:
            raise ReferenceRunning(f"{folder} is running: {holder.describe()} still writes to it; a reference is "
                                   "a finished experiment's deterministic-0: wait for that launch to end")


def _from_certificate(cert: Certificate) -> Reference:
    made_from = Path(cert.made_from)
    here = made_from if (made_from / MANIFEST).exists() else None
    return Reference(str(cert.path), here, cert.made_from, cert.experiment, cert.config, cert.steps, cert.world_size,
                     cert.essentials, cert.frame(), certificate=True)


# --------------------------------------------------------------------------------------------------- the rerun
@dataclass(frozen=True)
class VerifySettings:
    avoid_reference_nodes: bool = False


def settings_of(own: dict[str, str]) -> VerifySettings:
    value = own.get("verify.avoid_reference_nodes", "false").lower()
    if value not in ("true", "false"):
        raise VerifyError(f"verify.avoid_reference_nodes={value!r}; use true or false")
    return VerifySettings(avoid_reference_nodes=value == "true")


def _override_path(override: str) -> str | None:
    """The config path an override sets (`cluster=slurm` sets the node cluster, `mode@arms.x=m` the node arms.x),
    None for Hydra's own settings."""
    key = override.lstrip("+~").partition("=")[0]
    if key.startswith("hydra.") or key == "hydra":
        return None
    return key.partition("@")[2] or key


def _lookup(node: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise VerifyError(f"{path} is not a config key the rerun can take (`python -m taxbench --cfg job` prints "
                              "every valid key)")
        node = node[part]
    return copy.deepcopy(node)


def _assign(node: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _may_change(key: str, config: dict[str, Any]) -> bool:
    """Whether a rerun may differ from its reference in `key`: where and how it runs, or the world-size key of the
    other device (cluster.gpus on CPU ranks: the device itself may not change)."""
    unused = "cluster.gpus" if config["cluster"]["device"] == "cpu" else "cluster.cpu_ranks"
    return key == unused or any(key == allowed or key.startswith(allowed + ".") for allowed in RERUN_MAY_CHANGE)


def rerun_config(reference: Reference, composed: DictConfig, overrides: list[str], settings: VerifySettings,
                 suffix: str = "") -> dict[str, Any]:
    """The reference's config with what the overrides set (a group choice such as cluster=slurm sets its whole node)
    and the rerun's own name (`suffix` tells apart the reruns of one command) and length; VerifyError naming every
    setting the overrides change that is not where or how the run executes."""
    given = OmegaConf.to_container(composed, resolve=True, enum_to_str=True)
    stored = reference.config
    rerun = copy.deepcopy(stored)
    paths = [p for p in map(_override_path, overrides) if p is not None]
    for path in sorted(paths, key=lambda p: p.count(".")):  # a group's node first, then keys inside it
        _assign(rerun, path, _lookup(given, path))
    if "experiment.name" not in paths:
        rerun["experiment"]["name"] = f"verify-{reference.experiment}-{launch_stamp()}{suffix}"
    if "experiment.steps" not in paths and not reference.runs_a_command:  # a command takes the steps it takes
        rerun["experiment"]["steps"] = reference.steps
    if settings.avoid_reference_nodes:
        _exclude_reference_nodes(rerun, reference)
    refused = [(key, a, b) for key, a, b in differences(stored, rerun) if not _may_change(key, stored)]
    if refused:
        shown = "; ".join(f"{key}: {redact(a)!r} in the reference, {redact(b)!r} here" for key, a, b in refused)
        raise VerifyError(f"verify reruns the reference's recipe as recorded; only where and how it runs may change "
                          f"(cluster launcher, partition, time limit, threads, out_dir, ...), but these differ: "
                          f"{shown}; drop those overrides")
    redacted = [key for key, value in _leaves(rerun.get("cluster", {}), "cluster") if REDACTED in str(value)]
    if redacted:
        raise VerifyError(f"{', '.join(redacted)} of the reference held a secret, recorded as {REDACTED}; give the "
                          f"rerun its own, e.g. {redacted[0]}=[...] or cluster=<profile>")
    # The experiment's other runs' settings (warmup, the resumed replica, a precision target) do not apply to the
    # rerun's one whole run; neutral values keep a shorter rerun valid.
    rerun["experiment"].update(warmup_steps=0, resume_step=1, target_half_width=0.0, max_steps=0)
    return rerun


def _leaves(node: Any, path: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf under `node` (list items by index)."""
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in _leaves(value, f"{path}.{key}")]
    if isinstance(node, list):
        return [leaf for i, value in enumerate(node) for leaf in _leaves(value, f"{path}[{i}]")]
    return [(path, node)]


def _exclude_reference_nodes(rerun: dict[str, Any], reference: Reference) -> None:
    """sbatch --exclude the reference's hosts, so the rerun really runs on other nodes."""
    if rerun["cluster"]["launcher"] != Launcher.slurm.value:
        raise VerifyError(f"verify.avoid_reference_nodes=true excludes the reference's nodes from a Slurm job, but "
                          f"the rerun runs on cluster={rerun['cluster']['name']}; add cluster=slurm (or drop it)")
    hosts = _reference_hosts(reference)
    if not hosts:
        raise VerifyError(f"verify.avoid_reference_nodes=true: {reference.source} records no hostnames to exclude")
    args = rerun["cluster"].setdefault("sbatch_args", {})
    already = [h for h in str(args.get("exclude") or "").split(",") if h]
    args["exclude"] = ",".join(dict.fromkeys([*already, *hosts]))


def _reference_hosts(reference: Reference) -> list[str]:
    return hostnames(reference.essentials)


def plan_rerun(reference: Reference, composed: DictConfig, overrides: list[str], settings: VerifySettings,
               suffix: str = "") -> TaxbenchConfig:
    """The rerun's typed config, checked as an experiment's would be before anything launches."""
    rerun = rerun_config(reference, composed, overrides, settings, suffix)
    if reference.runs_a_command:
        return _plan_command_rerun(rerun, overrides)
    cfg = load_config(rerun)
    if cfg.cluster.dry_run:  # no rerun, no records: a verdict of exit 0 would have no evidence behind it
        raise VerifyError("verify compares a rerun's records, and cluster.dry_run=true runs nothing; drop it (a job "
                          "script alone: python -m taxbench ... cluster=slurm cluster.dry_run=true)")
    if cfg.cluster.launcher is Launcher.torchrun:
        raise VerifyError("verify starts its rerun itself; cluster=torchrun is started by someone else: use "
                          "cluster=local, cluster=inprocess or cluster=slurm")
    if cfg.experiment.steps < 2:
        raise VerifyError(f"experiment.steps={cfg.experiment.steps}: verify reruns at least 2 steps")
    check_before_launch(cfg)
    return cfg


def _plan_command_rerun(rerun: dict[str, Any], overrides: list[str]) -> TaxbenchConfig:
    """The typed config of the rerun of a user's command, checked as `taxbench run` checks its own before anything
    runs: on this machine, in the recorded working folder, with every edit still applicable (a config file the
    edits name must still be there)."""
    if "experiment.steps" in (_override_path(override) for override in overrides):
        raise VerifyError("experiment.steps: the rerun of a command takes the steps the command takes, as its "
                          "reference did; drop it")
    cluster = rerun["cluster"]
    if cluster["launcher"] != Launcher.local.value:
        raise VerifyError(f"verify reruns a command on this machine, as `taxbench run` runs it; cluster="
                          f"{cluster['name']} is not supported for a command yet: run verify inside your allocation "
                          "(salloc, then the default cluster=local)")
    _fill_secrets_from_environment(rerun)
    cfg = load_config(rerun)
    cwd = Path(cfg.run.cwd or ".")
    if not cwd.is_dir():
        raise VerifyError(f"run.cwd={cfg.run.cwd!r}: the reference's command ran in this folder, which is not here; "
                          "verify reruns the command where it ran (check out the project at that path)")
    try:
        validate(cfg)
        validate_command(cfg.run)
    except CommandError as exc:
        raise VerifyError(f"the reference's command cannot run here: {exc}") from None
    check_out_dir(Path(cfg.experiment.out_dir))
    return cfg


def _fill_secrets_from_environment(rerun: dict[str, Any]) -> None:
    """A secret in what the deterministic arm runs was recorded as REDACTED, never its value: an environment edit
    takes the value this process has under the same name; a secret anywhere else cannot be rerun (VerifyError)."""
    run = rerun["run"]
    edits = run["deterministic"]
    for name, value in edits["env"].items():
        if value == REDACTED:
            if not os.environ.get(name):
                raise VerifyError(f"run.deterministic.env.{name} of the reference held a secret, recorded as "
                                  f"{REDACTED}; export {name} in the environment verify runs in, and its rerun "
                                  "takes it from there")
            edits["env"][name] = os.environ[name]
    unrunnable = [key for key, value in _leaves({k: run[k] for k in ("command", "cwd")}, "run")
                  + _leaves({k: v for k, v in edits.items() if k != "env"}, "run.deterministic")
                  if REDACTED in str(value)]
    if unrunnable:
        raise VerifyError(f"{', '.join(unrunnable)} of the reference held a secret, recorded as {REDACTED}, so its "
                          "command cannot be rerun as it ran; give the command its secret through an environment "
                          "variable (run.deterministic.env) instead of its arguments, and make the reference again")


# ------------------------------------------------------------------------------------------------- the verdict
@dataclass
class VerifyResult:
    reference: Reference
    rerun_dir: Path
    verdict: Verdict
    compared_steps: int
    rerun_steps: int
    suspects: list[tuple[str, Any, Any]] = field(default_factory=list)
    rerun_hosts: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return {IDENTICAL: exit_codes.OK, DIFFERS: exit_codes.NOT_DETERMINISTIC}.get(self.verdict.outcome,
                                                                                     exit_codes.INCOMPLETE)

    def localize_command(self) -> str | None:
        if self.verdict.outcome != DIFFERS:
            return None
        return shlex.join(["python", "-m", "taxbench", "localize", self.reference.made_from, str(self.rerun_dir)])

    def to_dict(self) -> dict[str, Any]:
        ref = self.reference
        return {
            "reference": {"source": ref.source, "run": ref.made_from, "experiment": ref.experiment,
                          "steps": ref.steps, "hostnames": _reference_hosts(ref), "problems": list(ref.problems)},
            "rerun": {"run": str(self.rerun_dir), "steps": self.rerun_steps, "hostnames": self.rerun_hosts},
            "compared_steps": self.compared_steps,
            "outcome": self.verdict.outcome,
            "verdict": self.verdict.to_dict(),
            "suspects": [{"key": key, "reference": redact(a), "rerun": redact(b)} for key, a, b in self.suspects],
            "localize": self.localize_command(),
            "exit_code": self.exit_code,
        }


def conclude(reference: Reference, root: Path) -> VerifyResult:
    """Compare the rerun in experiment folder `root` with the reference over the steps both have; write verify.json."""
    run_dir = root / RERUN.name
    manifest = load_manifest(run_dir)
    config = manifest.run_config
    if runs_a_command(config):
        steps, problems = _command_rerun_steps(reference, run_dir)
        frame, found = load_checked_run(run_dir, manifest, steps, config)
        problems += found + flag_problems(RERUN.name, manifest, frame)
        frame = _observed(frame)
    else:
        steps = int(config["experiment"]["steps"])
        frame, problems = load_checked_run(run_dir, manifest, steps, config)
    common = min(steps, reference.steps)
    ref_problems = [*reference.problems, *reference.grid_problems(common)]  # gaps within the common steps only
    # Bits that agree with a run that trained on NaN or Inf are NaN or Inf too: no verdict either way (exit 4).
    problems = [*problems, *(f"{finding.describe()}: trained on non-finite values, no verdict"
                             for finding in nonfinite_runs({"rerun": _up_to(frame, common)}))]
    verdict = compare_runs("verify", reference.source, _up_to(reference.frame, common), str(run_dir),
                           _up_to(frame, common), 0, tuple(ref_problems + problems))
    rerun_essentials = essentials(manifest)
    result = VerifyResult(reference, run_dir, verdict, common, steps,
                          differences(reference.essentials, rerun_essentials), hostnames(rerun_essentials))
    write_text_atomically(root / SUMMARY_FILE, json.dumps(result.to_dict(), indent=2, default=str))
    return result


def _command_rerun_steps(reference: Reference, run_dir: Path) -> tuple[int, list[str]]:
    """The steps the rerun of a command took (its records say: the command decides), and a problem where that is
    not the reference's length: the same command, edits and folder ran another length, so the comparison over the
    steps both have is no verdict on its own (a fingerprint that differs there still is)."""
    recorded = load_run(run_dir, empty_ok=True, fields={"step", "rank"})
    steps = int(recorded["step"].max()) if not recorded.empty else 0
    if steps == reference.steps:
        return steps, []
    return steps, [f"{run_dir}: the command took {steps} steps in the rerun and {reference.steps} in the reference; "
                   "the same command, edits and folder ran another length"]


def _observed(frame: pd.DataFrame) -> pd.DataFrame:
    """A command run's records less what the probe never observes (the command's own gradient norm: no non-finite
    finding for a value never recorded) and the live flags (checked already by flag_problems)."""
    return frame.drop(columns=["flags", *UNOBSERVED], errors="ignore")


def _up_to(frame: pd.DataFrame, step: int) -> pd.DataFrame:
    keep = frame["step"].to_numpy() <= step
    return frame if keep.all() else frame[keep].reset_index(drop=True)


def render(result: VerifyResult) -> str:
    ref, verdict = result.reference, result.verdict
    world = ref.world_size
    lines = [f"verify {ref.source} ({RERUN.name} of experiment {ref.experiment}, {ref.steps} steps x {world} ranks) "
             f"against the rerun {result.rerun_dir}"]
    if result.rerun_steps != ref.steps:
        lines.append(f"the reference has {ref.steps} steps and the rerun {result.rerun_steps}: compared the "
                     f"{result.compared_steps} steps both have (1-{result.compared_steps})")
    lines.append(f"hostnames: reference {', '.join(_reference_hosts(ref)) or 'unknown'}; rerun "
                 f"{', '.join(result.rerun_hosts) or 'unknown'}")
    if verdict.outcome == IDENTICAL:
        lines.append(f"identical: every fingerprint of {verdict.compared_steps} steps x {world} ranks agrees bit for "
                     "bit")
    elif verdict.outcome == DIFFERS:
        first = verdict.first_mismatch
        assert first is not None
        lines.append(f"differs: first at step {first.step}, rank {first.rank}, metric {first.metric} "
                     f"(reference {first.expected}, rerun {first.actual})")
    else:
        lines.append(f"incomplete: no verdict over {verdict.compared_steps} compared steps; evidence is missing:")
    lines += [f"  {problem}" for problem in verdict.problems]
    if verdict.outcome != IDENTICAL:
        if result.suspects:
            lines.append("suspects (what differs between the reference's manifest and the rerun's):")
            lines += [f"  {key}: {redact(a)!r} -> {redact(b)!r}" for key, a, b in result.suspects]
        else:
            lines.append("suspects: none; the two manifests agree on stack, policy, threads and provenance")
    command = result.localize_command()
    if command:
        where = "" if ref.run_dir is not None else " (needs the reference run folder, which is not here)"
        lines.append(f"localize the first difference{where}: {command}")
    lines.append(f"summary: {result.rerun_dir.parent / SUMMARY_FILE}")
    return "\n".join(lines)


def overview(results: list[VerifyResult], failed: list[str]) -> str:
    """One line per reference of a verify of several: what was compared and the outcome; `failed`: the references
    whose rerun ended without results (no verdict)."""
    lines = [f"verified {len(results) + len(failed)} references:"]
    for result in results:
        verdict = result.verdict
        if verdict.outcome == DIFFERS and verdict.first_mismatch is not None:
            first = verdict.first_mismatch
            outcome = f"differs at step {first.step}, rank {first.rank}, {first.metric}"
        else:
            outcome = verdict.outcome
        lines.append(f"  {result.reference.source}: {outcome} ({result.compared_steps} steps compared; "
                     f"{result.rerun_dir.parent / SUMMARY_FILE})")
    lines += [f"  {source}: the rerun failed (no verdict; the error below)" for source in failed]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ certificates
def certificate_command(experiment: Path, out: Path) -> int:
    """Write the certificate of an experiment's deterministic-0; exit 4 (nothing written) when the run is incomplete."""
    reference = load_reference(experiment)
    if reference.certificate or reference.run_dir is None:
        raise RecordError(f"{experiment}: a certificate is made from an experiment folder, not from a certificate")
    frame = _up_to(reference.frame, reference.steps)
    problems = [*reference.problems, *reference.grid_problems(reference.steps),
                *(f"{finding.describe()}: trained on non-finite values"
                  for finding in nonfinite_runs({RERUN.name: frame}))]
    if problems:
        print(f"taxbench: error: {reference.run_dir} is incomplete, so no certificate was written:")
        for problem in problems:
            print(f"  {problem}")
        return exit_codes.INCOMPLETE
    manifest = load_manifest(reference.run_dir)
    certificate = make_certificate(manifest, frame, reference.steps, str(reference.run_dir))
    write_certificate(out, certificate)
    print(f"taxbench: certificate of {reference.run_dir} ({reference.steps} steps x {reference.world_size} ranks, "
          f"{out.stat().st_size / 1024:.1f} KiB): {out}")
    return exit_codes.OK
