"""The parallel shape (taxbench.config.shape): the one place dp, edp and the replica size are computed."""

from __future__ import annotations

import pytest

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
