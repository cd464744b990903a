"""A determinism certificate: the portable reference that `taxbench verify` checks a later rerun against.

It holds what a rerun needs and what it is compared with, and nothing else: the reference run's config (to rerun its
recipe, or the user's command with its edits and working folder for a `taxbench run` experiment), the essentials of
its manifest (the software/hardware stack, applied policy, thread counts, provenance, a command's edited command line:
what a difference is traced back to) and every step's per-rank fingerprints of the deterministic run, as one JSON
file small enough to commit (~5 MiB per 1,000 steps x 64 ranks: five fingerprints of 8-16 hex digits per step and
rank).

Tamper-evident the way a manifest's config is: `content_sha256` is the sha256 of the rest of the file in canonical
JSON, and its config must hash to its `config_sha256`. A certificate edited by hand (a fingerprint, the config) or
damaged is refused when read; like the manifest's hash, this catches edits and accidents, not a forger who recomputes
the hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from taxbench.rundir.json_object import RecordError, UnreadableRecords, read_json_object
from taxbench.rundir.provenance import canonical_json, config_hash
from taxbench.rundir.records import METRICS, SCHEMA_VERSION, write_text_atomically
from taxbench.rundir.run_manifest import Manifest
from taxbench.rundir.step_stream import STEP_FIELDS

FORMAT = "taxbench.certificate"
FORMAT_VERSION = 1
HASH_KEY = "content_sha256"

# The manifest's sections (and keys within them) that say where and on what a run executed: a rerun that differs
# from its reference is traced back to what differs here. Per-rank detail is summed up by stack.hostnames.
ESSENTIAL_SECTIONS: dict[str, tuple[str, ...] | None] = {
    "stack": None,  # torch, CUDA, cuDNN, NCCL, driver, GPU model, hostnames, CPU threads, Python, stack packages
    "policy_applied": None,  # the determinism switches and environment variables as the process had them
    "stack_switch": None,  # a training stack's own determinism switch (torchtitan, Megatron-Core, ...)
    "timing": ("torch_threads", "interop_threads"),
    "provenance": ("version", "commit", "dirty"),
    "layout": ("world_size", "backend", "dp", "tp", "pp", "ep", "data_parallel", "grad_accum"),
}
_LEFT_OUT = {"stack": ("ranks",)}


class CertificateError(RecordError):
    """A file that is no certificate this taxbench reads (another format or schema version: exit 2, point at another
    file or use the taxbench that wrote it); the message says which."""


class DamagedCertificate(UnreadableRecords, CertificateError):
    """A certificate whose evidence is damaged: unreadable, edited without resealing, its grid of fingerprints
    incomplete (exit 4, as every piece of damaged evidence: docs/records-and-trust.md)."""


def essentials(manifest: Manifest) -> dict[str, Any]:
    """What a manifest says about where and how its run executed (ESSENTIAL_SECTIONS), plus its cluster config and
    the model's stack: the same shape from a run folder and from a certificate, so that two can be diffed."""
    out: dict[str, Any] = {}
    for section, keys in ESSENTIAL_SECTIONS.items():
        value = manifest.section(section)
        if not isinstance(value, dict):
            out[section] = value
            continue
        kept = keys if keys is not None else [k for k in value if k not in _LEFT_OUT.get(section, ())]
        out[section] = {key: value.get(key) for key in kept}
    config = manifest.config or {}
    out["cluster"] = config.get("cluster")
    out["model_kind"] = ((config.get("recipe") or {}).get("model") or {}).get("kind")
    command = manifest.command
    if isinstance(command, dict):  # a run of `taxbench run -- COMMAND` (recipe runs have no such section)
        out["command"] = command_essentials(command)
    return out


RUN_FOLDER = "<run folder>"


def command_essentials(command: dict[str, Any]) -> dict[str, Any]:
    """What describes a run of the user's command, as its manifest recorded it (redacted when it was written): the
    edited command line, where it ran, the edits (arguments, environment, config keys) and the optimizers the probe
    saw. The run's own folder (where an edited config copy lives) reads as RUN_FOLDER, so a rerun elsewhere differs
    from its reference only where the command does."""
    config_copy = command.get("config_copy")
    folder = str(Path(config_copy).parent) if isinstance(config_copy, str) and config_copy else None

    def portable(value: Any) -> Any:
        return value.replace(folder, RUN_FOLDER) if folder and isinstance(value, str) else value

    argv = command.get("argv")
    return {
        "argv": [portable(word) for word in argv] if isinstance(argv, list) else argv,
        "cwd": command.get("cwd"),
        "config_copy": portable(config_copy),
        "edits": command.get("edits"),
        "env": command.get("env"),
        "optimizers": (command.get("probe") or {}).get("optimizers"),
    }


def hostnames(essential: dict[str, Any]) -> list[str]:
    stack = essential.get("stack") or {}
    return sorted(stack.get("hostnames") or [])


@dataclass(frozen=True)
class Certificate:
    path: Path
    experiment: str
    made_from: str  # the run folder it was made from, as given then
    steps: int
    world_size: int
    config: dict[str, Any]
    essentials: dict[str, Any]
    fingerprints: dict[str, dict[str, list[str]]]  # rank -> metric -> one value per step 1..steps

    def frame(self) -> pd.DataFrame:
        """The fingerprints as a step-record frame (rank-major, the types load_run gives), for the gates' comparer."""
        ranks = sorted(int(rank) for rank in self.fingerprints)
        columns: dict[str, Any] = {
            "rank": pa.array([rank for rank in ranks for _ in range(self.steps)], STEP_FIELDS["rank"]),
            "step": pa.array([step for _ in ranks for step in range(1, self.steps + 1)], STEP_FIELDS["step"]),
        }
        for metric in METRICS:
            values = [value for rank in ranks for value in self.fingerprints[str(rank)][metric]]
            columns[metric] = pa.array(values, STEP_FIELDS[metric])
        return pa.table(columns).to_pandas(split_blocks=True)


def make_certificate(manifest: Manifest, frame: pd.DataFrame, steps: int, made_from: str) -> dict[str, Any]:
    """The certificate of a complete run (every rank of its world, every step 1..steps once: the caller checked)."""
    world = manifest.world_size
    ordered = frame.sort_values(["rank", "step"], kind="stable")
    fingerprints = {
        str(rank): {metric: [str(v) for v in group[metric].tolist()] for metric in METRICS}
        for rank, group in ordered.groupby("rank", sort=True)
    }
    body = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "schema_version": SCHEMA_VERSION,
        "experiment": manifest.experiment,
        "run": manifest.run,
        "made_from": made_from,
        "steps": steps,
        "world_size": world,
        "config": manifest.run_config,
        "config_sha256": config_hash(manifest.run_config),
        "essentials": essentials(manifest),
        "metrics": list(METRICS),
        "fingerprints": fingerprints,
    }
    return {**body, HASH_KEY: _content_hash(body)}


def _content_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def write_certificate(path: Path, certificate: dict[str, Any]) -> None:
    """One line of JSON per top-level key (a diff of two certificates shows which part changed)."""
    lines = [f"  {json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}" for key, value in certificate.items()]
    write_text_atomically(path, "{\n" + ",\n".join(lines) + "\n}\n")


def read_certificate(path: Path) -> Certificate:
    """The certificate at `path`, checked: its format, its content hash, its config hash and its grid of fingerprints
    (CertificateError naming the path and what is wrong)."""
    try:
        stored = read_json_object(path, "certificate")
    except RecordError as exc:
        raise DamagedCertificate(str(exc)) from exc
    if stored.get("format") != FORMAT or stored.get("format_version") != FORMAT_VERSION:
        raise CertificateError(f"{path}: not a taxbench certificate of format {FORMAT_VERSION} (format="
                               f"{stored.get('format')!r}, format_version={stored.get('format_version')!r}); make one "
                               "with `taxbench certificate runs/<experiment> -o FILE`")
    if stored.get("schema_version") != SCHEMA_VERSION:
        raise CertificateError(f"{path}: schema_version={stored.get('schema_version')!r}, this taxbench reads "
                               f"{SCHEMA_VERSION}; its fingerprints are not comparable with this version's runs")
    body = {key: value for key, value in stored.items() if key != HASH_KEY}
    if stored.get(HASH_KEY) != _content_hash(body):
        raise DamagedCertificate(f"{path}: {HASH_KEY} does not match the certificate's content: it was edited or "
                                 "damaged after it was made; make it again from the reference run")
    if stored.get("config_sha256") != config_hash(stored.get("config")):
        raise DamagedCertificate(f"{path}: its config does not hash to its config_sha256; the certificate is "
                                 "damaged")
    return _parsed(path, stored)


def _parsed(path: Path, stored: dict[str, Any]) -> Certificate:
    try:
        steps, world = int(stored["steps"]), int(stored["world_size"])
        fingerprints = stored["fingerprints"]
        complete = (stored["metrics"] == list(METRICS) and sorted(fingerprints) == sorted(map(str, range(world)))
                    and all(len(fingerprints[str(r)][m]) == steps for r in range(world) for m in METRICS))
        if not complete or steps < 1:
            raise ValueError("its fingerprints do not cover every step and rank once")
        return Certificate(path, str(stored["experiment"]), str(stored["made_from"]), steps, world,
                           stored["config"], stored["essentials"], fingerprints)
    except (KeyError, TypeError, ValueError) as exc:
        raise DamagedCertificate(f"{path}: not a usable certificate ({type(exc).__name__}: {exc}); make it again "
                                 "from the reference run") from exc
