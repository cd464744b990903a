"""Pair validation: the two arms may differ only in the determinism policy.

Each arm's full run configuration is its copy of the recipe and cluster with that arm's `arm_overrides` applied;
any difference between the two is refused with the list of differing keys.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from taxbench.config.schema import ARM_NAMES, ClusterConfig, ConfigError, RecipeConfig, TaxbenchConfig

COMPARED_SECTIONS = ("recipe", "cluster")
# Settings that may change when an interrupted experiment is continued: they do not affect what the runs compute.
CONTINUE_MAY_CHANGE = ("experiment.continue_existing", "report.")


def arm_run_config(cfg: TaxbenchConfig, arm: str) -> dict[str, Any]:
    overrides = cfg.arm_overrides.get(arm, {})
    unknown = sorted(set(overrides) - set(COMPARED_SECTIONS))
    if unknown:
        raise ConfigError(
            f"arm_overrides.{arm} has unknown sections {unknown}; only {list(COMPARED_SECTIONS)} can be overridden "
            f"per arm (the policy is chosen with mode@arms.{arm}=<mode>)"
        )
    schemas = {"recipe": RecipeConfig, "cluster": ClusterConfig}
    resolved: dict[str, Any] = {}
    for section in COMPARED_SECTIONS:
        base = OmegaConf.merge(OmegaConf.structured(schemas[section]), OmegaConf.structured(getattr(cfg, section)))
        try:
            merged = OmegaConf.merge(base, overrides.get(section, {}))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"arm_overrides.{arm}.{section}: {exc}") from exc
        resolved[section] = OmegaConf.to_container(merged, resolve=True, enum_to_str=True)
    return resolved


def differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every leaf where two nested dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(a) | set(b)):
            out += differences(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if a == b else [(prefix, a, b)]


def experiment_differences(stored: Any, current: Any) -> list[tuple[str, Any, Any]]:
    """differences() between two configs of one experiment (a run's and the experiment's, or a continue's), less
    the settings a continue may change."""
    return [d for d in differences(stored, current) if not d[0].startswith(CONTINUE_MAY_CHANGE)]


def pair_differences(cfg: TaxbenchConfig) -> list[tuple[str, Any, Any]]:
    """(key, baseline value, deterministic value) for everything but the policy that differs between the arms."""
    baseline, deterministic = (arm_run_config(cfg, arm) for arm in ARM_NAMES)
    return differences(baseline, deterministic)


def validate_pair(cfg: TaxbenchConfig) -> None:
    unknown_arms = sorted(set(cfg.arm_overrides) - set(ARM_NAMES))
    if unknown_arms:
        raise ConfigError(f"arm_overrides names unknown arms {unknown_arms}; arms are {list(ARM_NAMES)}")
    # A calibration (A/A) pair runs the baseline policy on both arms (see config.schema.load_config).
    opposite = not cfg.arms["baseline"].deterministic and cfg.arms["deterministic"].deterministic
    if not cfg.experiment.calibration and not opposite:
        raise ConfigError(
            f"the baseline arm must be nondeterministic and the deterministic arm deterministic; got "
            f"arms.baseline.deterministic={cfg.arms['baseline'].deterministic}, "
            f"arms.deterministic.deterministic={cfg.arms['deterministic'].deterministic}"
        )
    differences = pair_differences(cfg)
    if differences:
        lines = "\n".join(f"  {key}: baseline={a!r} deterministic={b!r}" for key, a, b in differences)
        raise ConfigError(
            "refusing the pair: the arms may differ only in the determinism policy, but these differ:\n"
            f"{lines}\nremove the arm_overrides that cause them"
        )
