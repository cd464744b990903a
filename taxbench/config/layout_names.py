"""Parallel layouts named as `taxbench layouts` takes them: `pp2.dp2.ep2`, `tp2.dp2`, `pp1.dp4`.

A name is dot-separated factors: pp<N> (pipeline stages), tp<N> (tensor parallel), dp<N> (data parallel, the world
size divided by tp*pp), ep<N> (expert parallel, carved out of dp), v<N> (virtual pipeline stages per rank), and ddp or
fsdp (how data parallelism shards). A factor left out is 1, dp is worked out from the world size, and the recipe
keeps its pipeline schedule and, unless the name says ddp or fsdp, its data-parallel kind. So a name states the whole
layout: `pp2.dp2` on the moe_1t_proxy recipe (ep=2) runs without expert parallelism.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from taxbench.config.layout_rules import layout_problems
from taxbench.config.schema import ConfigError, DataParallel, ParallelConfig, RecipeConfig
from taxbench.config.shape import ParallelShape

_FACTOR = re.compile(r"(pp|tp|dp|ep|v)(\d+)")
FACTOR_HELP = "pp<N>, tp<N>, dp<N>, ep<N>, v<N> (virtual stages) and ddp or fsdp, joined by dots, e.g. pp2.dp2.ep2"


@dataclass(frozen=True)
class LayoutName:
    name: str
    pp: int = 1
    tp: int = 1
    ep: int = 1
    dp: int | None = None  # None: the world size / (tp * pp)
    virtual_stages: int = 1
    data_parallel: DataParallel | None = None  # None: the recipe's

    def parallel(self, recipe: RecipeConfig) -> ParallelConfig:
        """The recipe's parallel settings with this layout's factors."""
        kind = self.data_parallel or recipe.parallel.data_parallel
        return dataclasses.replace(recipe.parallel, pp=self.pp, tp=self.tp, ep=self.ep,
                                   virtual_stages=self.virtual_stages, data_parallel=kind)


def parse_layout_name(text: str) -> LayoutName:
    """A layout name's factors; ConfigError naming the bad part and the accepted forms."""
    name = text.strip()
    if not name:
        raise ConfigError(f"an empty layout name; give each layout as {FACTOR_HELP}")
    factors: dict[str, int] = {}
    kind: DataParallel | None = None
    for part in name.split("."):
        if part in DataParallel.__members__:
            if kind is not None:
                raise ConfigError(f"layout {name!r} names the data-parallel kind twice; give one of ddp or fsdp")
            kind = DataParallel(part)
            continue
        match = _FACTOR.fullmatch(part)
        if match is None:
            raise ConfigError(f"layout {name!r}: {part!r} is not a factor; a layout is {FACTOR_HELP}")
        key, value = match.group(1), int(match.group(2))
        if key in factors:
            raise ConfigError(f"layout {name!r} gives {key} twice; give each factor once")
        if value < 1:
            raise ConfigError(f"layout {name!r}: {part} must be at least {key}1")
        factors[key] = value
    return LayoutName(name, pp=factors.get("pp", 1), tp=factors.get("tp", 1), ep=factors.get("ep", 1),
                      dp=factors.get("dp"), virtual_stages=factors.get("v", 1), data_parallel=kind)


def check_layout(layout: LayoutName, recipe: RecipeConfig, world: int, world_key: str) -> RecipeConfig:
    """The recipe under this layout on `world` ranks; ConfigError with the fix when it does not fit them or the
    model."""
    shape = ParallelShape(world, layout.tp, layout.pp, layout.ep)
    model_parallel = shape.model_parallel
    if layout.dp is not None and model_parallel * layout.dp != world:
        fitting = shape.dp if shape.fits_world else None
        fix = (f"write dp{fitting} (or leave dp out)" if fitting else
               f"choose pp*tp dividing {world}")
        raise ConfigError(f"layout {layout.name} needs pp*tp*dp = {layout.pp}*{layout.tp}*{layout.dp} = "
                          f"{model_parallel * layout.dp} ranks, but the world size is {world} ({world_key}); {fix}, "
                          f"or set {world_key}={model_parallel * layout.dp} for every layout")
    recipe = dataclasses.replace(recipe, parallel=layout.parallel(recipe))
    problems = layout_problems(recipe, world, world_key)
    if problems:
        raise ConfigError(f"layout {layout.name}: " + "; ".join(problems))
    return recipe


def parse_layout_list(text: str) -> list[LayoutName]:
    """`[pp1.dp4, pp2.dp2]` (Hydra's list syntax, brackets optional) as layout names, each once, at least two."""
    inner = text.strip()
    if inner.startswith("[") and inner.endswith("]"):
        inner = inner[1:-1]
    names = [part.strip().strip("'\"") for part in inner.split(",") if part.strip()]
    layouts = [parse_layout_name(name) for name in names]
    seen = [layout.name for layout in layouts]
    repeated = sorted({name for name in seen if seen.count(name) > 1})
    if repeated:
        raise ConfigError(f"layouts lists {', '.join(repeated)} more than once; each layout runs twice already "
                          "(its repeatability)")
    if len(layouts) < 2:
        raise ConfigError(f"layouts={text!r} names {len(layouts)} layout(s); compare at least two, e.g. "
                          "'layouts=[pp1.dp4, pp2.dp2]'")
    return layouts
