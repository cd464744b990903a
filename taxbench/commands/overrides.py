"""Hydra overrides as the subcommands that take them (layouts, stacks, scan, verify) read them: the config they
compose to, and the keys they set."""

from __future__ import annotations

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from omegaconf import DictConfig

from taxbench.config.schema import register_configs

register_configs()  # the structured configs Hydra composes against


def compose(overrides: list[str]) -> DictConfig:
    """The config an experiment with these overrides would get (Hydra's compose API: no run folder, no logging)."""
    with initialize_config_module(config_module="taxbench.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def override_key(override: str) -> str:
    """The key an override sets: `+recipe.x=1`, `~recipe.x` and `recipe.x=1` all set `recipe.x`."""
    return override.lstrip("+~").partition("=")[0]


def split_own_settings(argv: list[str], own: tuple[str, ...], lists: tuple[str, ...] = ()) -> tuple[dict[str, str],
                                                                                                      list[str]]:
    """A subcommand's own `key=value` settings (keys in `own`) and the Hydra overrides around them. A list-valued
    setting in `lists` given unquoted (`layouts=[a, b]` reaches us as "layouts=[a," and "b]") is joined again."""
    settings: dict[str, str] = {}
    overrides = []
    args = iter(argv)
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key in own:
            while key in lists and value.startswith("[") and "]" not in value:
                value += " " + next(args, "]")
            settings[key] = value
        else:
            overrides.append(arg)
    return settings, overrides
