"""Per-op attribution: real torch.profiler tables of a planted slowdown and of moe_tiny's two MoE paths, the
attribution arithmetic, and the op table file."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import compose_config

from taxbench.analysis.attribution import ATTRIBUTION_COLUMNS, attribute, mean_over_ranks
from taxbench.parallel.distributed import DistContext
from taxbench.rundir.op_table import OP_COLUMNS, OP_TABLE_SCHEMA_VERSION, OpTable
from taxbench.rundir.read import RecordError
from taxbench.train.op_profile import profile_ops, profile_steps
from taxbench.train.trainer import RunSpec, Trainer

CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def table(rows: list[tuple[str, float, float]], steps: int = 4, ranks: int = 1) -> OpTable:
    frame = pd.DataFrame([(op, "cpu", float(us), float(calls)) for op, us, calls in rows], columns=list(OP_COLUMNS))
    return OpTable(frame, steps, "cpu", ranks)


def planted_profiles(device: str, planted_numel: int) -> tuple[OpTable, OpTable]:
    """Profiles of 3 steps of a small MLP, the candidate's steps also running cumsum over `planted_numel` floats
    five times."""
    weight = torch.randn(64, 64, device=device)
    planted_input = torch.randn(planted_numel, device=device)

    def steps(n: int, planted: bool) -> None:
        for _ in range(n):
            hidden = torch.randn(32, 64, device=device)
            for _ in range(3):
                hidden = torch.tanh(hidden @ weight)
            if planted:
                for _ in range(5):
                    torch.cumsum(planted_input, 0)
        if device == "cuda":
            torch.cuda.synchronize()

    steps(1, planted=True)  # first calls allocate and dispatch once; keep them out of both profiles
    return (profile_ops(lambda: steps(3, planted=False), 3, device),
            profile_ops(lambda: steps(3, planted=True), 3, device))


def test_a_planted_op_is_attributed_in_real_cpu_profiles() -> None:
    """The candidate arm also runs cumsum over 4M floats five times a step: the profiles hold it in the candidate only,
    with its calls and time. Whether it tops the growth is a matter of wall-clock self times, which a loaded host's
    preemption moves by milliseconds (attribute's docstring); the ranking is tested on tables whose times are known
    (test_attribute_counts_one_sided_ops_and_applies_floor_top_and_step_delta)."""
    baseline, candidate = planted_profiles("cpu", 1 << 22)

    assert baseline.steps == candidate.steps == 3
    ranked = attribute(baseline, candidate, top=None, noise_floor_us=0.0)
    assert tuple(ranked.columns) == ATTRIBUTION_COLUMNS
    planted = ranked.set_index("op").loc["aten::cumsum"]
    assert (planted["calls_baseline"], planted["calls_candidate"]) == (0.0, 5.0)
    assert planted["baseline_us"] == 0.0 and planted["delta_us"] == planted["candidate_us"] > 0
    assert ranked[ranked["delta_us"] > 0]["share_of_tax"].sum() == pytest.approx(1.0)
    assert list(ranked["delta_us"]) == sorted(ranked["delta_us"], reverse=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)")
def test_planted_kernel_tops_the_cuda_attribution() -> None:
    """On CUDA the table's own rows are kernels with their device time: the planted scan kernel must top them."""
    baseline, candidate = planted_profiles("cuda", 1 << 26)

    assert baseline.device == candidate.device == "cuda"
    assert set(candidate.ops["device"]) == {"cpu", "cuda"}
    ranked = attribute(baseline, candidate)
    print(ranked.to_string())  # shown with pytest -s
    top = ranked.iloc[0]
    assert not top["op"].startswith("aten::"), "device rows are kernel names"
    assert top["calls_baseline"] == 0 and top["calls_candidate"] >= 5
    assert top["share_of_tax"] > 0.5, ranked


def test_moe_tiny_attribution_names_the_dispatch_and_combine_ops(tmp_path: Path) -> None:
    """moe_tiny with deterministic kernels on vs off: the ops the fixed-order paths swap in and out (top-k, dispatch
    gather, combine scatter-add, expert histogram) are what differs between the two profiles."""
    cfg = compose_config("cluster=inprocess", "+recipe=moe_tiny", "recipe.global_batch_size=8",
                            "experiment.name=t")
    trainers = {arm: Trainer(RunSpec.of(cfg, arm, "0", cfg.arms[arm], tmp_path / arm), CTX)
                for arm in ("baseline", "deterministic")}
    for trainer in trainers.values():
        trainer.run_block(1, 0)
    tables = {arm: profile_steps(trainer, 2, 1) for arm, trainer in trainers.items()}
    for trainer in trainers.values():
        assert trainer.step == 3, "the profiled block is an ordinary block of the run"
        trainer.close()

    assert all(t.device == "cpu" and t.steps == 2 for t in tables.values())
    ranked = attribute(tables["baseline"], tables["deterministic"], top=None, noise_floor_us=0.0).set_index("op")
    print(attribute(tables["baseline"], tables["deterministic"]).to_string())  # shown with pytest -s

    def calls(op: str) -> tuple[float, float]:
        return ranked.loc[op, "calls_baseline"], ranked.loc[op, "calls_candidate"]

    # Fast path only: router top-k, histogram of tokens per expert.
    for op in ("aten::topk", "aten::histc"):
        baseline_calls, candidate_calls = calls(op)
        assert baseline_calls > 0 and candidate_calls == 0, op
        assert ranked.loc[op, "delta_us"] < 0, op
    # Fixed-order path only: the backward of the index_select dispatch/combine accumulates with index_add_.
    baseline_calls, candidate_calls = calls("aten::index_add_")
    assert baseline_calls == 0 and candidate_calls > 0
    assert ranked.loc["aten::index_add_", "delta_us"] > 0
    # Dispatch x[index] and combine index_put_(accumulate=True) become index_select gathers.
    assert calls("aten::index")[0] > calls("aten::index")[1]
    assert calls("aten::_index_put_impl_")[0] > calls("aten::_index_put_impl_")[1]
    assert calls("aten::index_select")[1] > calls("aten::index_select")[0]


def test_attribute_counts_one_sided_ops_and_applies_floor_top_and_step_delta() -> None:
    baseline = table([("aten::mm", 1000.0, 10), ("aten::index_put_", 50.0, 2), ("aten::add", 3.0, 1)])
    candidate = table([("aten::mm", 1010.0, 10), ("aten::gather", 200.0, 2), ("aten::sum", 40.0, 2),
                       ("aten::add", 3.5, 1)])

    ranked = attribute(baseline, candidate, noise_floor_us=5.0, top=None)
    assert list(ranked["op"]) == ["aten::gather", "aten::sum", "aten::mm", "aten::index_put_"]  # add: under floor
    gather = ranked.iloc[0]
    assert (gather["baseline_us"], gather["candidate_us"], gather["delta_us"]) == (0.0, 200.0, 200.0)
    assert (gather["calls_baseline"], gather["calls_candidate"]) == (0.0, 2.0)
    assert ranked.iloc[-1]["delta_us"] == -50.0
    # Default denominator: every positive growth, the floored one included (200 + 40 + 10 + 0.5).
    assert gather["share_of_tax"] == pytest.approx(200.0 / 250.5)

    measured = attribute(baseline, candidate, step_delta_us=400.0, top=2, noise_floor_us=5.0)
    assert list(measured["op"]) == ["aten::gather", "aten::sum"]
    assert list(measured["share_of_tax"]) == pytest.approx([0.5, 0.1])
    # Default floor: 0.1% of the baseline's 1053 us per step drops only the 0.5 us growth.
    assert "aten::add" not in set(attribute(baseline, candidate, top=None)["op"])


def test_mean_over_ranks_counts_a_missing_op_as_zero() -> None:
    rank0 = table([("aten::mm", 100.0, 4), ("aten::all_reduce", 30.0, 1)])
    rank1 = table([("aten::mm", 300.0, 4)])
    mean = mean_over_ranks([rank0, rank1])
    assert mean.ranks == 2 and mean.steps == 4 and mean.device == "cpu"
    assert mean.on_device().to_dict("index") == {
        "aten::all_reduce": {"self_us_per_step": 15.0, "calls_per_step": 0.5},
        "aten::mm": {"self_us_per_step": 200.0, "calls_per_step": 4.0},
    }
    # An average of averages weighs each table by its ranks: (200 * 2 + 500) / 3.
    again = mean_over_ranks([mean, table([("aten::mm", 500.0, 4)])])
    assert again.ranks == 3 and again.on_device().loc["aten::mm", "self_us_per_step"] == pytest.approx(300.0)
    with pytest.raises(ValueError, match="share device and steps"):
        mean_over_ranks([rank0, table([("aten::mm", 1.0, 1)], steps=5)])


def test_op_table_round_trip_and_refusals(tmp_path: Path) -> None:
    original = table([("aten::mm", 123.25, 10), ("aten::gather", 0.5, 2)], steps=3, ranks=2)
    path = tmp_path / "ops.json"
    original.write(path)
    restored = OpTable.read(path)
    assert (restored.steps, restored.device, restored.ranks) == (3, "cpu", 2)
    pd.testing.assert_frame_equal(restored.ops, original.ops)

    stored = json.loads(path.read_text())
    assert stored["schema_version"] == OP_TABLE_SCHEMA_VERSION
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({**stored, "schema_version": OP_TABLE_SCHEMA_VERSION + 1}))
    with pytest.raises(RecordError, match=rf"{foreign}: op table schema_version={OP_TABLE_SCHEMA_VERSION + 1}"):
        OpTable.read(foreign)

    truncated = tmp_path / "truncated.json"
    truncated.write_text(path.read_text()[:40])
    with pytest.raises(RecordError, match=rf"{truncated}: not valid JSON"):
        OpTable.read(truncated)
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps({**stored, "ops": [{"op": "aten::mm", "device": "cpu"}]}))
    with pytest.raises(RecordError, match=rf"{damaged}: damaged op table"):
        OpTable.read(damaged)
    with pytest.raises(RecordError, match=rf"{tmp_path / 'missing.json'}: cannot be read"):
        OpTable.read(tmp_path / "missing.json")
