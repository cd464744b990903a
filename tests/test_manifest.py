"""A run's manifest as taxbench.rundir.manifest assembles it from the config and the facts the training process
gathered (no torch here: the facts are handed in)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import tiny_config

from taxbench.design import KNOBS, PROFILE_REPLICA, TIMED, RunRef
from taxbench.rundir.manifest import RunFacts, write_run_manifest
from taxbench.rundir.run_manifest import load_manifest

FACTS = RunFacts(
    policy_applied={"deterministic_algorithms": True}, stack_switch={"stack": "taxbench"}, stack_native_audit=None,
    layout={"world_size": 1, "backend": "gloo"}, stack={"hostname": "h", "hostnames": ["h"], "ranks": []},
    threads={"torch_threads": 1, "interop_threads": 1}, shared_model=None, throughput={"flops_per_token": 1},
)


def test_the_manifest_holds_the_config_the_facts_and_one_attempt_per_start(tmp_path: Path) -> None:
    cfg = tiny_config(name="m")
    ref = TIMED["deterministic"]
    root = tmp_path / "m"
    write_run_manifest(root, ref, cfg, cfg.arms["deterministic"], FACTS, "first")
    manifest = load_manifest(root / ref.name)
    assert (manifest.experiment, manifest.run, manifest.arm, manifest.replica) == \
        ("m", ref.name, "deterministic", "0")
    assert manifest.experiment_config["steps"] == 12 and manifest.policy["deterministic"] is True
    assert manifest.layout == FACTS.layout and manifest.stack == FACTS.stack
    assert manifest.timing == {"torch_threads": 1, "interop_threads": 1, "manual_gc": cfg.experiment.manual_gc,
                                  "block_steps": 3, "interleave": cfg.experiment.interleave, "shared_model": None}
    assert manifest.knob is None and manifest.profile is None
    assert manifest.config_sha256
    assert "knob" not in json.loads((root / ref.name / "manifest.json").read_text())

    write_run_manifest(root, ref, cfg, cfg.arms["deterministic"], FACTS, "first")  # the same start: one attempt
    write_run_manifest(root, ref, cfg, cfg.arms["deterministic"], FACTS, "second")  # a requeue: a second one
    attempts = json.loads((root / ref.name / "manifest.json").read_text())["attempts"]
    assert [a["id"] for a in attempts] == ["first", "second"] and attempts[1]["hostnames"] == ["h"]


def test_a_knob_arm_and_a_profile_run_say_what_they_are(tmp_path: Path) -> None:
    cfg = tiny_config(name="k")
    knob = KNOBS[0]
    ref = RunRef(f"with_{knob.name}", PROFILE_REPLICA)
    write_run_manifest(tmp_path / "k", ref, cfg, cfg.arms["deterministic"], FACTS, "a")
    manifest = load_manifest(tmp_path / "k" / ref.name)
    assert manifest.knob == {"direction": "with", "name": knob.name, "fields": list(knob.fields)}
    assert manifest.profile == {"warmup_steps": 2, "profiled_steps": cfg.experiment.profile_steps}
