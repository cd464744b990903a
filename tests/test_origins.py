"""Origins across ranks: the diff orders origin candidates causally, never by rank number.

A candidate (inputs agree, outputs differ) that communicates is a receiver while a peer of its group holds a candidate
no later than the peer's own record of the same communication; only a candidate no peer explains is named. The slow
tests plant a bit flip in one expert on rank 1 of an ep=2 MoE, whose output only rank 0's tokens see: rank 0's MoE
layer differs with agreeing inputs (it received the values through the all-to-all), and the origin is still rank 1's
expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import compose_typed, has_deepspeed, localize_planted_fault
from torch import nn

from taxbench.tracing.capture import communicating_modules
from taxbench.tracing.diff import (
    ORIGIN,
    ROLE_ORIGIN,
    ROLE_RECEIVER,
    UNRESOLVED,
    diff_traces,
    render,
)
from taxbench.tracing.trace_io import TRACE_SCHEMA_VERSION, TraceWriter, UnreadableTrace, read_trace, trace_file

needs_deepspeed = pytest.mark.skipif(not has_deepspeed(), reason="needs taxbench[deepspeed]")
EP = [0, 1]
MOE_COMM = {"collectives": ["all_to_all"], "group": EP}


def _rec(rank: int, seq: int, kind: str, scope: str, ins: str, outs: str, comm: dict | None = None,
         name: str | None = None) -> dict:
    side = lambda digest: [{"shape": [4], "dtype": "float32", "digest": digest}]  # noqa: E731
    name = name or scope
    record = {"schema_version": TRACE_SCHEMA_VERSION, "seq": seq, "rank": rank, "step": 5, "kind": kind,
              "name": name, "id": f"{name}:0", "scope": scope, "in": side(ins), "out": side(outs)}
    return record | ({"comm": comm} if comm is not None else {})


def _expert_case(planted_on: int) -> tuple[dict, dict]:
    """Both ranks run an MoE layer (all-to-all over ranks 0 and 1) holding one expert; in B the expert on
    `planted_on` computed different values, which only the other rank's tokens carried back."""
    receiving = 1 - planted_on

    def trace(expert_out: str, layer_out: dict[int, str]) -> dict:
        return {rank: [_rec(rank, 0, "module", "layer.moe.expert", "e1", expert_out if rank == planted_on else "e2"),
                       _rec(rank, 1, "module", "layer.moe", "m1", layer_out[rank], MOE_COMM),
                       _rec(rank, 2, "module", "layer.out", layer_out[rank], layer_out[rank] + "0")]
                for rank in EP}

    a = trace("e2", {0: "m2", 1: "m2"})
    b = trace("f2", {planted_on: "m2", receiving: "f9"})
    return a, b


@pytest.mark.parametrize("planted_on", [0, 1])
def test_the_rank_that_received_the_difference_is_no_origin(planted_on: int) -> None:
    report = diff_traces(*_expert_case(planted_on))
    assert report.verdict == ORIGIN
    assert report.primary is not None
    assert (report.primary.rank, report.primary.scope) == (planted_on, "layer.moe.expert")
    roles = {(f.rank, f.scope): f.role for f in report.candidates}
    assert roles == {(planted_on, "layer.moe.expert"): ROLE_ORIGIN, (1 - planted_on, "layer.moe"): ROLE_RECEIVER}
    receiver = next(f for f in report.candidates if f.role == ROLE_RECEIVER)
    assert receiver.explained_by == [f"rank {planted_on} module layer.moe.expert:0"]
    receiving_rank = report.ranks[1 - planted_on]
    assert receiving_rank.first_origin is None and receiving_rank.downstream == 2  # the layer and what follows
    text = render(report)
    assert f"first: step 5 rank {planted_on}: origin module layer.moe.expert:0" in text
    assert f"receiver: step 5 rank {1 - planted_on}: receiver module layer.moe:0" in text
    assert json.loads(json.dumps(report.to_dict()))["candidates"][0]["role"] in (ROLE_ORIGIN, ROLE_RECEIVER)


def test_without_the_communication_marker_the_lower_rank_would_be_named() -> None:
    """The rule depends on the record saying it communicates: the same records without `comm` give two origins and
    the lower rank first, which is how rank 0 was blamed before."""
    a, b = _expert_case(planted_on=1)
    for trace in (a, b):
        for record in trace[0] + trace[1]:
            record.pop("comm", None)
    report = diff_traces(a, b)
    assert report.primary is not None and report.primary.rank == 0
    assert {f.role for f in report.candidates} == {ROLE_ORIGIN}


def test_a_peer_candidate_after_the_meeting_point_explains_nothing() -> None:
    """Rank 1's candidate comes after its own record of the MoE layer: it cannot have been sent through it."""
    a = {0: [_rec(0, 0, "module", "layer.moe", "m1", "m2", MOE_COMM)],
         1: [_rec(1, 0, "module", "layer.moe", "m1", "m2", MOE_COMM), _rec(1, 1, "module", "head", "h1", "h2")]}
    b = {0: [_rec(0, 0, "module", "layer.moe", "m1", "f2", MOE_COMM)],
         1: [_rec(1, 0, "module", "layer.moe", "m1", "m2", MOE_COMM), _rec(1, 1, "module", "head", "h1", "f3")]}
    report = diff_traces(a, b)
    assert report.verdict == ORIGIN
    assert {(f.rank, f.role) for f in report.candidates} == {(0, ROLE_ORIGIN), (1, ROLE_ORIGIN)}
    assert report.primary is not None and (report.primary.rank, report.primary.scope) == (0, "layer.moe")


def test_a_peer_outside_the_group_explains_nothing() -> None:
    pair_comm = {"collectives": ["all_to_all"], "group": [0, 1]}
    a = {0: [_rec(0, 1, "module", "layer.moe", "m1", "m2", pair_comm)], 1: [],
         2: [_rec(2, 0, "module", "layer.moe.expert", "e1", "e2")]}
    b = {0: [_rec(0, 1, "module", "layer.moe", "m1", "f2", pair_comm)], 1: [],
         2: [_rec(2, 0, "module", "layer.moe.expert", "e1", "f2")]}
    report = diff_traces(a, b)
    assert {(f.rank, f.role) for f in report.candidates} == {(0, ROLE_ORIGIN), (2, ROLE_ORIGIN)}
    # with the group unknown, every traced rank is a peer: rank 2's earlier candidate explains rank 0's
    for trace in (a, b):
        trace[0][0]["comm"] = {"collectives": ["all_to_all"], "group": None}
    report = diff_traces(a, b)
    assert {(f.rank, f.role) for f in report.candidates} == {(0, ROLE_RECEIVER), (2, ROLE_ORIGIN)}
    assert report.primary is not None and report.primary.rank == 2


def test_candidates_that_explain_each_other_remain_with_the_rung_that_resolves_them() -> None:
    """Both ranks' MoE layers differ with agreeing inputs and nothing inside them is traced: either may have made
    the difference and sent it, so none is named; rung 3 inside the innermost such module resolves it."""
    def trace(outs: tuple[str, str]) -> dict:
        return {rank: [_rec(rank, 0, "module", "layer.moe", "m1", outs[rank], MOE_COMM),
                       _rec(rank, 1, "module", "layer", "l1", outs[rank] + "0", MOE_COMM)] for rank in EP}

    report = diff_traces(trace(("m2", "m2")), trace(("f2", "f3")))
    assert report.verdict == UNRESOLVED and report.primary is None
    assert {f.role for f in report.candidates} == {ROLE_RECEIVER} and len(report.candidates) == 4
    assert report.resolve.startswith("rung 3 inside ['layer.moe']")
    text = render(report)
    assert "verdict: candidates remain" in text and "rung 3 inside ['layer.moe']" in text
    assert text.count("  receiver: ") == 4


def test_a_traced_collective_whose_inputs_agree_everywhere_is_itself_the_origin() -> None:
    """An all-reduce whose traced inputs agree on every rank and whose outputs differ on both: the peers' own records
    of it explain nothing (their inputs agree too), so the collective is named, on the lower rank first."""
    comm = {"collectives": ["all_reduce"], "group": EP}
    a = {r: [_rec(r, 0, "collective", "ddp.bucket0", "g1", "s1", comm, name="c10d.allreduce")] for r in EP}
    b = {r: [_rec(r, 0, "collective", "ddp.bucket0", "g1", f"f{r}", comm, name="c10d.allreduce")] for r in EP}
    report = diff_traces(a, b)
    assert report.verdict == ORIGIN and {f.role for f in report.candidates} == {ROLE_ORIGIN}
    # a peer's op candidate before its all-reduce can explain a receiving rank's result
    a[1].insert(0, _rec(1, -1, "op", "m", "x1", "y1", name="aten.mm.default"))
    b[1].insert(0, _rec(1, -1, "op", "m", "x1", "y2", name="aten.mm.default"))
    b[1][1]["out"][0]["digest"] = "s1"  # rank 1's own all-reduce result agrees
    report = diff_traces(a, b)
    assert {(f.rank, f.kind, f.role) for f in report.candidates} == {(0, "collective", ROLE_RECEIVER),
                                                                     (1, "op", ROLE_ORIGIN)}
    assert report.primary is not None and (report.primary.rank, report.primary.kind) == (1, "op")


def test_declared_collectives_mark_the_module_and_every_module_around_it() -> None:
    class Layer(nn.Module):
        def __init__(self, group: list[int] | None) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)
            self.group = group

        def collectives_within(self) -> dict[str, tuple[str, list[int] | None]]:
            return {"inner": ("all_to_all", self.group)}

    model = nn.Sequential(Layer([0, 1]), Layer([2, 3]), nn.Linear(2, 2))
    comm = communicating_modules(model.named_modules())
    assert comm["0.inner"] == {"collectives": ["all_to_all"], "group": [0, 1]}
    assert comm["0"] == comm["0.inner"] and "2" not in comm
    assert comm[""] == {"collectives": ["all_to_all"], "group": [0, 1, 2, 3]}  # the model encloses both
    model[1].group = None  # a group that cannot be named: any rank may be a peer
    assert communicating_modules(model.named_modules())[""]["group"] is None


def test_trace_files_keep_comm_and_refuse_a_malformed_one(tmp_path: Path) -> None:
    record = _rec(0, 0, "module", "layer.moe", "m1", "m2", MOE_COMM)
    writer = TraceWriter(trace_file(tmp_path / "run", 0))
    writer.write_batch([{k: v for k, v in record.items() if k != "schema_version"}])
    writer.close()
    assert read_trace(tmp_path / "run")[0][0]["comm"] == MOE_COMM
    path = trace_file(tmp_path / "run", 0)
    path.write_text(path.read_text().replace('"group":[0,1]', '"group":"all"'))
    with pytest.raises(UnreadableTrace, match="field 'comm' must be"):
        read_trace(tmp_path / "run")


# ---- end to end: a real ep=2 MoE on two gloo ranks, localized by replay ------------------------------------------

# Bit 22 (float32's highest mantissa bit): the lowest bit of one expert output is rounded away in DeepSpeed's
# combine, and the step records then agree bit for bit.
PLANT = ("experiment.fault.kind=nondeterministic_op", "experiment.fault.op=aten.mm.default", "experiment.fault.bit=22")


@needs_deepspeed
@pytest.mark.slow
def test_localize_names_the_expert_on_rank_1_of_deepspeeds_moe(tmp_path: Path) -> None:
    """deepspeed_moe_debug at ep=2: expert 1 of rank 1's MOELayer computes a different value for a token of rank 0.
    Rank 0's MOELayer differs with agreeing inputs: a receiver; the origin is rank 1's expert, then its op."""
    from taxbench.commands.localize import NAMED, render

    expert = "blocks.0.ffn.moe.deepspeed_moe.experts.deepspeed_experts.1"
    result = localize_planted_fault(tmp_path, "deepspeed_moe_debug", *PLANT, f"experiment.fault.module={expert}")
    assert result.verdict == NAMED, render(result)
    module_rung = next(step for step in result.path if step.rung == 2)
    assert module_rung.finding is not None and module_rung.finding.rank == 1
    assert module_rung.finding.scope.startswith(expert)
    roles = {(c.rank, c.scope): c.role for c in module_rung.candidates}
    assert roles[(0, "blocks.0.ffn.moe.deepspeed_moe")] == ROLE_RECEIVER
    origin = result.origin
    assert origin is not None
    assert (origin.kind, origin.name, origin.rank, origin.step) == ("op", "aten.mm.default", 1, 2)
    assert origin.scope.startswith(expert)
    text = render(result)
    assert "verdict: origin named" in text and "receiver: step 2 rank 0: receiver module" in text


@pytest.mark.slow
def test_localize_names_the_expert_on_the_higher_rank_of_taxbenchs_moe(tmp_path: Path) -> None:
    """moe_tiny at ep=2 (taxbench's own dispatch): rank 1's experts compute a different value for a token of rank 0."""
    from taxbench.commands.localize import NAMED, render

    result = localize_planted_fault(tmp_path, "moe_tiny", *PLANT, "experiment.fault.module=blocks.0.ffn.experts",
                                    "recipe.parallel.ep=2", "cluster.cpu_ranks=2", "recipe.model.seq_len=32")
    assert result.verdict == NAMED, render(result)
    module_rung = next(step for step in result.path if step.rung == 2)
    roles = {(c.rank, c.scope): c.role for c in module_rung.candidates}
    assert roles[(0, "blocks.0.ffn")] == ROLE_RECEIVER and roles[(1, "blocks.0.ffn.experts")] == ROLE_ORIGIN
    origin = result.origin
    assert origin is not None
    assert (origin.kind, origin.name, origin.scope, origin.rank, origin.step) == (
        "op", "aten.mm.default", "blocks.0.ffn.experts", 1, 2)


def test_a_fault_flips_the_bit_it_is_given() -> None:
    import torch

    from taxbench.config.schema import ConfigError, validate
    from taxbench.tracing.faults import flip_bit

    values = torch.tensor([1.0, 2.0])
    flip_bit(values, 22)  # float32's highest mantissa bit: 1.0 -> 1.5
    flip_bit(values[1:], 31)  # the sign bit, on a view's first element
    assert values.tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="experiment.fault.bit=16 is beyond the 16-bit torch.bfloat16"):
        flip_bit(torch.ones(2, dtype=torch.bfloat16), 16)
    with pytest.raises(ConfigError, match=r"experiment.fault.bit=32 must be in \[0, 31\]"):
        validate(compose_typed("experiment.name=bit", "experiment.fault.enabled=true", "experiment.fault.bit=32"))
