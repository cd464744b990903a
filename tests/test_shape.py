"""The parallel shape (taxbench.config.shape): the one place dp, edp and the replica size are computed; and the layout
rules beside it (taxbench.config.layout_rules)."""

from __future__ import annotations

import pytest
from helpers import compose_typed

from taxbench.config.layout_rules import EXPERT_MODEL_KINDS, layout_problems
from taxbench.config.schema import (
    ConfigError,
    DataParallel,
    ModelConfig,
    ModelKind,
    ParallelConfig,
    RecipeConfig,
    validate,
)
from taxbench.config.shape import ParallelShape


@pytest.mark.parametrize(("world", "tp", "pp", "ep", "dp", "edp", "fits"), [
    (8, 2, 2, 1, 2, 2, True),
    (2432, 1, 16, 8, 152, 19, True),  # the seed's moe_1t: pp=16, ep=8 on 2,432 GPUs
    (6, 4, 1, 1, 1, 1, False),  # no whole replica split: 6 is not a multiple of tp*pp=4
    (8, 1, 2, 3, 4, 1, False),  # ep=3 does not divide dp=4
])
def test_the_shape_of_a_layout_on_a_world(world: int, tp: int, pp: int, ep: int, dp: int, edp: int,
                                          fits: bool) -> None:
    shape = ParallelShape(world, tp, pp, ep)
    assert (shape.dp, shape.edp, shape.fits, shape.model_parallel) == (dp, edp, fits, tp * pp)
    assert shape.stage_world == world // pp


def test_micro_batches_need_an_even_split_of_the_global_batch() -> None:
    shape = ParallelShape(8, 2, 1, 1)  # dp = 4
    assert shape.micro_batches(global_batch=32, micro_batch=2) == 4
    assert shape.micro_batches(global_batch=30, micro_batch=2) is None
    assert ParallelShape(6, 4, 1, 1).micro_batches(global_batch=32, micro_batch=2) is None


def test_the_layout_rules_read_the_schemas_kinds_by_their_values() -> None:
    # layout_rules compares recipe.model.kind and recipe.parallel.data_parallel with the schema's enum values (it
    # cannot import the schema, which calls it): the values it names must exist there.
    kinds = {kind.value for kind in ModelKind}
    assert set(EXPERT_MODEL_KINDS) <= kinds and "custom" in kinds and "fsdp" in {dp.value for dp in DataParallel}


def test_the_layout_rules_name_every_problem_of_a_recipe_on_a_world() -> None:
    recipe = RecipeConfig(name="r", global_batch_size=8, micro_batch_size=2,
                          model=ModelConfig(kind=ModelKind.dense, n_layers=3),
                          parallel=ParallelConfig(tp=1, pp=2, ep=2, data_parallel=DataParallel.fsdp,
                                                  pp_schedule="ZBVZeroBubble", virtual_stages=2))
    problems = layout_problems(recipe, 4, "cluster.cpu_ranks")
    assert any("recipe.parallel.ep=2 needs an MoE model" in p for p in problems)
    assert any("data_parallel=fsdp leaves the last stage untrained" in p for p in problems)
    assert any("recipe.model.n_layers=3 is not divisible by pp * virtual_stages" in p for p in problems)
    fitting = RecipeConfig(name="r", global_batch_size=8, micro_batch_size=2, model=ModelConfig(n_layers=4),
                           parallel=ParallelConfig(pp=2))
    assert layout_problems(fitting, 4, "cluster.cpu_ranks") == []
    with pytest.raises(ConfigError, match="recipe.parallel.ep=2 needs an MoE model"):
        validate(compose_typed("cluster.cpu_ranks=4", "recipe.parallel.ep=2"))
