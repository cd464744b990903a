"""A run's manifest.json as a typed model: its one reader (`load_manifest`) and its one writer (`Manifest.write`).

The manifest is versioned with the step records (records.SCHEMA_VERSION): the reader refuses any other version, as it
always has. Its fields hold what the file holds, as stored: a manifest is evidence, and what a damaged or edited one
lacks or mistypes is a finding of the analysis (taxbench.rundir.read.identity_problems, config_problems), not a
reason to refuse reading it. What the analysis cannot go on without is asked for through the properties below
(`world_size`, `device`, `run_config`, ...), which raise `UnreadableRecords` naming the manifest and the field it
lacks (exit 4). No module outside taxbench/rundir/ names a manifest field by a string.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taxbench.redaction import redact
from taxbench.rundir.evidence import experiment_of
from taxbench.rundir.json_object import RecordError, UnreadableRecords, read_json_object
from taxbench.rundir.records import MANIFEST, SCHEMA_VERSION, write_manifest_text

# The fields every manifest taxbench writes holds (null where a run has nothing to say), in the order it writes them.
WRITTEN = ("experiment", "run", "arm", "replica", "config", "policy", "policy_applied", "stack_switch",
           "stack_native_audit", "layout", "stack", "timing", "throughput", "attempts", "provenance")
# Fields only some runs hold: a knob arm's knob, a profile run's profile, a `taxbench run -- COMMAND` run's command.
OPTIONAL = ("knob", "profile", "command")


@dataclass(frozen=True)
class Manifest:
    """<experiment>/<run>/manifest.json. Each field holds the file's value as stored (None where it is absent)."""

    experiment: Any = None  # the experiment folder's name
    run: Any = None  # <arm>-<replica>
    arm: Any = None
    replica: Any = None
    config: Any = None  # the experiment's config as composed (taxbench.config.schema), redacted
    policy: Any = None  # the arm's determinism policy, as configured
    policy_applied: Any = None  # the switches as set while the arm's policy was active (device among them)
    stack_switch: Any = None  # the training stack's own determinism switch for the arm
    stack_native_audit: Any = None  # a stack-native arm: what taxbench's full policy would add or change
    layout: Any = None  # rank 0's view: world_size, dp/tp/ep sizes, mesh, backend, grad_accum, pipeline
    stack: Any = None  # the software/hardware stack (taxbench.parallel.stack_facts)
    timing: Any = None  # thread counts, gc, block steps, interleave, shared model
    throughput: Any = None  # model FLOPs per token (taxbench.train.flops)
    attempts: Any = None  # every start of the run's processes
    provenance: Any = None  # code, Hydra overrides, config_sha256 (taxbench.rundir.provenance)
    knob: Any = None
    profile: Any = None
    command: Any = None
    # Fields a newer writer added that this model does not name: kept, so a read and a write lose nothing.
    others: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None  # where it was read from (None: not read from a file); the errors name it
    # The JSON object as read (None: built, not read): what a field lacks is judged on it, not on the model's Nones.
    stored: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------------------------------- the one writer
    def as_json(self) -> dict[str, Any]:
        """The manifest's content as written (without schema_version, which the writer adds)."""
        content = {name: getattr(self, name) for name in WRITTEN}
        content.update({name: getattr(self, name) for name in OPTIONAL if getattr(self, name) is not None})
        return {**content, **self.others}

    def write(self, run_dir: Path) -> None:
        """Write <run_dir>/manifest.json (redacted, atomically; taxbench.rundir.records.RunWriteError on failure)."""
        write_manifest_text(run_dir, json.dumps({"schema_version": SCHEMA_VERSION, **redact(self.as_json())},
                                                indent=2, default=str))

    @classmethod
    def of(cls, content: dict[str, Any], path: Path | None = None) -> Manifest:
        """The model of a manifest's JSON object (schema_version already checked)."""
        named = {f.name for f in dataclasses.fields(cls)} - {"others", "path", "stored"}
        known = {key: value for key, value in content.items() if key in named}
        others = {key: value for key, value in content.items() if key not in named and key != "schema_version"}
        return cls(**known, others=others, path=path, stored=content)

    # ---------------------------------------------------------------- what the analysis cannot go on without
    def _content(self) -> dict[str, Any]:
        return self.stored if self.stored is not None else self.as_json()

    def _required(self, *parts: str) -> Any:
        node: Any = self._content()
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                raise UnreadableRecords(f"{self.path}: lacks {'.'.join(parts)}; the manifest is damaged or from "
                                        "another tool")
            node = node[part]
        return node

    @property
    def world_size(self) -> int:
        return int(self._required("layout", "world_size"))

    @property
    def device(self) -> Any:
        """The device the run trained on, as its applied policy records it ("cpu", "cuda")."""
        return self._required("policy_applied", "device")

    @property
    def run_config(self) -> Any:
        """The experiment's config (a required field, unlike `config`, which may be absent in a damaged manifest)."""
        return self._required("config")

    @property
    def experiment_config(self) -> Any:
        """config.experiment: steps, blocks, warmup, checkpoints, ..."""
        return self._required("config", "experiment")

    @property
    def recipe(self) -> Any:
        return self._required("config", "recipe")

    @property
    def command_argv(self) -> Any:
        """config.run.command: the user's command line of a `taxbench run -- COMMAND` experiment."""
        return self._required("config", "run", "command")

    @property
    def cluster(self) -> Any:
        return self._required("config", "cluster")

    # --------------------------------------------------------------------------- what may be absent or odd
    @property
    def config_or_empty(self) -> dict[str, Any]:
        return self.config if isinstance(self.config, dict) else {}

    @property
    def is_command_run(self) -> bool:
        """Whether the config is a `taxbench run -- COMMAND` experiment's (config.run.command set)."""
        config = self.config or {}
        return isinstance(config, dict) and bool((config.get("run") or {}).get("command"))

    @property
    def config_sha256(self) -> Any:
        return (self.provenance or {}).get("config_sha256")

    @property
    def overrides(self) -> list[Any]:
        """The Hydra overrides the experiment was composed with (provenance), [] where none are recorded."""
        return (self.provenance or {}).get("overrides") or []

    @property
    def layout_or_empty(self) -> dict[str, Any]:
        return self.layout if isinstance(self.layout, dict) else {}

    @property
    def data_parallel(self) -> int:
        """layout.dp, 1 where the layout does not record it."""
        return int(self.layout_or_empty.get("dp", 1))

    @property
    def recipe_parallel(self) -> dict[str, Any]:
        """config.recipe.parallel as recorded, {} where absent."""
        return (self.config_or_empty.get("recipe") or {}).get("parallel") or {}

    @property
    def stack_native(self) -> bool:
        """Whether the arm's policy is the training stack's own switch."""
        return bool((self.policy or {}).get("stack_native"))

    @property
    def fingerprint_every(self) -> int:
        """A `taxbench run -- COMMAND` run: every how many steps its probe fingerprinted (1 where not recorded)."""
        return int(((self.command or {}).get("probe") or {}).get("fingerprint_every", 1))

    @property
    def resumed_from(self) -> int:
        """A `taxbench run -- COMMAND` run restarted by its own resume: the step its probe saw it resume from (0:
        none recorded)."""
        return int(((self.command or {}).get("probe") or {}).get("resumed_from") or 0)

    @property
    def attempt_list(self) -> list[dict[str, Any]]:
        return self.attempts if isinstance(self.attempts, list) else []

    def section(self, dotted: str) -> Any:
        """A section of the manifest for presenting it ("policy", "config.recipe"), None where absent."""
        node: Any = self._content()
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node


def load_manifest(run_dir: Path) -> Manifest:
    """<run_dir>/manifest.json: RecordError when it is missing or of another schema version (exit 2),
    UnreadableRecords when it is not a JSON object or cannot be read (exit 4)."""
    path = run_dir / MANIFEST
    if not path.exists() and not path.is_symlink():
        raise RecordError(f"{path}: missing manifest; the run never started (or this is not a taxbench run folder)")
    content = read_json_object(path, "manifest", experiment_of(run_dir))
    if content.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version={content.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    return Manifest.of(content, path)
