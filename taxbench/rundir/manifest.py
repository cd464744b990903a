"""A run's manifest.json: assembled from its config, policy and the facts its training process gathered.

The facts that need torch (the policy as applied, the layout, the software/hardware stack, the thread counts) are
gathered where torch is (taxbench.schedule.experiment, taxbench.parallel.stack_facts) and handed in as `RunFacts`; the
assembly and the on-disk format live here, free of torch, beside the readers of the run folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from taxbench.config.schema import PolicyConfig, TaxbenchConfig
from taxbench.design import KNOBS_BY_NAME, PROFILE_REPLICA, RunRef, knob_of
from taxbench.rundir import provenance
from taxbench.rundir.records import MANIFEST
from taxbench.rundir.run_manifest import Manifest, load_manifest


@dataclass(frozen=True)
class RunFacts:
    """What only the run's training process knows, as rank 0 sees it."""

    policy_applied: dict[str, Any]  # the determinism switches as they are set while the arm's policy is active
    stack_switch: dict[str, Any]  # the training stack's own determinism switch for this arm
    stack_native_audit: list[str] | None  # a stack-native arm: what taxbench's full policy would add or change
    layout: dict[str, Any]  # world, dp/tp/ep sizes, mesh, backend, grad_accum, pipeline
    stack: dict[str, Any]  # software/hardware stack, every rank's hostname and GPU (taxbench.parallel.stack_facts)
    threads: dict[str, int]  # torch_threads, interop_threads: what shapes step-time noise, as this process has it
    shared_model: list[str] | None  # the runs that train one model, switching policy per block (interleave=policy)
    throughput: dict[str, Any] | None  # model FLOPs per token (taxbench.train.flops)


def write_run_manifest(root: Path, ref: RunRef, cfg: TaxbenchConfig, arm_policy: PolicyConfig, facts: RunFacts,
                       attempt_id: str, command: dict[str, Any] | None = None) -> None:
    """Write <root>/<run>/manifest.json for run `ref` of experiment `root`, this start of its processes
    (`attempt_id`) added to the attempts an earlier start recorded. `command`: a run of `taxbench run -- COMMAND`,
    the exact command line, its edits and what the probe saw."""
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    Manifest(
        experiment=root.name,
        run=ref.name,
        arm=ref.arm,
        replica=ref.replica,
        config=config,
        policy=OmegaConf.to_container(OmegaConf.structured(arm_policy)),
        policy_applied=facts.policy_applied,
        stack_switch=facts.stack_switch,
        stack_native_audit=facts.stack_native_audit,
        # Rank 0's view; fingerprints stay per rank in steps.rank<R>.jsonl.
        layout=facts.layout,
        stack=facts.stack,
        timing={
            **facts.threads,
            "manual_gc": cfg.experiment.manual_gc,
            "block_steps": cfg.experiment.block_steps,
            "interleave": cfg.experiment.interleave,
            "shared_model": facts.shared_model,
        },
        throughput=facts.throughput,
        attempts=attempts(root / ref.name, attempt_id, facts.stack["hostnames"]),
        provenance=provenance.manifest_provenance(config),
        **ablation_entry(cfg, ref),
        command=command,
    ).write(root / ref.name)


def attempts(run_dir: Path, attempt_id: str, hostnames: list[str]) -> list[dict[str, Any]]:
    """Every start of this run's processes (a requeue or continue adds one), with where it ran."""
    found = []
    if (run_dir / MANIFEST).exists():
        found = list(load_manifest(run_dir).attempt_list)
    if not found or found[-1]["id"] != attempt_id:
        found.append({
            "id": attempt_id,
            "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "hostnames": hostnames,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            # A task of a job array (verify of several references): <array job>_<task>, as slurm_job.json names it.
            "slurm_array_job": (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
                                if os.environ.get("SLURM_ARRAY_JOB_ID") else None),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"),
        })
    return found


def ablation_entry(cfg: TaxbenchConfig, ref: RunRef) -> dict[str, Any]:
    """Which knob a knob arm switches, and which arm a profile run profiles (nothing for the pair's runs)."""
    found = knob_of(ref.arm)
    entry: dict[str, Any] = {}
    if found is not None:
        direction, name = found
        entry["knob"] = {"direction": direction, "name": name, "fields": list(KNOBS_BY_NAME[name].fields)}
    if ref.replica == PROFILE_REPLICA:
        entry["profile"] = {"warmup_steps": cfg.experiment.warmup_steps,
                            "profiled_steps": cfg.experiment.profile_steps}
    return entry
