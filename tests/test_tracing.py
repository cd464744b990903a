"""The tracing ladder: capture, trace files, diff rules, and localize on injected faults at known places."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import compose_raw, compose_typed, run_taxbench
from omegaconf import DictConfig

from taxbench.commands.localize import NAMED, localize
from taxbench.config.schema import TaxbenchConfig
from taxbench.parallel.distributed import DistContext
from taxbench.preflight import prepare
from taxbench.tracing.capture import CaptureScope
from taxbench.tracing.diff import (
    CONTROL_FLOW,
    IDENTICAL,
    INCOMPLETE,
    NOTHING_COMPARED,
    ORIGIN,
    OUTSIDE,
    VIA_VIEW,
    diff_runs,
    diff_traces,
    render,
)
from taxbench.tracing.trace_io import TRACE_SCHEMA_VERSION, TraceError, TraceWriter, read_trace, trace_file
from taxbench.train.trainer import RunSpec, Trainer

FAULT_MM = ["experiment.fault.kind=nondeterministic_op", "experiment.fault.module=blocks.1.ffn",
            "experiment.fault.op=aten.mm.default"]


# Small enough that a rung-3 capture of a step takes a fraction of a second.
TINY = ["recipe.model.seq_len=16", "recipe.model.d_model=32", "recipe.model.d_ff=64", "recipe.model.vocab_size=64"]


def _raw(overrides: list[str]) -> DictConfig:
    return compose_raw("experiment.name=trace-test", *TINY, *overrides)


def _cfg(overrides: list[str]) -> TaxbenchConfig:
    # one micro-batch per step on one rank
    return compose_typed("experiment.name=trace-test", *TINY, "recipe.global_batch_size=4", *overrides)


def _run_in_process(cfg: TaxbenchConfig, run_dir: Path, steps: int, faulty: bool) -> Path:
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    fault = cfg.experiment.fault if faulty else None
    trainer = Trainer(RunSpec.of(cfg, "deterministic", "x", cfg.arms["deterministic"], run_dir, fault), ctx)
    trainer.run_block(steps, 0)
    trainer.close()
    return run_dir


def _pair(tmp_path: Path, trace: list[str], fault: list[str] | None = None, steps: int = 2) -> tuple[Path, Path]:
    overrides = ["experiment.trace.enabled=true", "experiment.trace.steps=[2]", *trace]
    if fault:
        overrides += ["experiment.fault.enabled=true", "experiment.fault.step=2", *fault]
    cfg = _cfg(overrides)
    return (_run_in_process(cfg, tmp_path / "a", steps, faulty=False),
            _run_in_process(cfg, tmp_path / "b", steps, faulty=fault is not None))


# ---- capture + diff on real single-rank runs -----------------------------------------------------------------------

def test_nondeterministic_op_is_named_with_layer_and_rank(tmp_path: Path) -> None:
    run_a, run_b = _pair(tmp_path, ["experiment.trace.rung=3"], FAULT_MM)
    report = diff_runs(run_a, run_b)
    assert report.verdict == ORIGIN
    origin = report.primary
    assert origin is not None
    assert (origin.kind, origin.name, origin.id, origin.scope, origin.rank, origin.step) == (
        "op", "aten.mm.default", "aten.mm.default:0", "blocks.1.ffn.up", 0, 2)
    assert origin.in_shapes == [[64, 32], [32, 64]] and origin.out_shapes == [[64, 64]]  # [batch*seq, d] @ [d, d_ff]
    # rung 2 alone names the innermost module whose output first differs
    run_c, run_d = _pair(tmp_path / "rung2", ["experiment.trace.rung=2"], FAULT_MM)
    module = diff_runs(run_c, run_d).primary
    assert module is not None and (module.kind, module.scope) == ("module", "blocks.1.ffn.up")


def test_clean_pair_has_no_origin_and_records_align(tmp_path: Path) -> None:
    run_a, run_b = _pair(tmp_path, ["experiment.trace.rung=3"])
    report = diff_runs(run_a, run_b)
    assert report.verdict == IDENTICAL and report.primary is None
    records = read_trace(run_a)[0]
    kinds = {r["kind"] for r in records}
    assert {"op", "module", "optimizer"} <= kinds
    assert not any(r["name"].startswith("aten.empty") for r in records)
    ids = [(r["kind"], r["scope"], r["id"]) for r in records]
    assert len(ids) == len(set(ids)), "ids must be unique per (kind, scope) within a step"
    assert all(r["step"] == 2 for r in records)


def test_a_parameter_flipped_after_the_optimizer_step_is_named_at_rung_1(tmp_path: Path) -> None:
    # The fault corrupts a parameter after the optimizer step, inside the traced step: each parameter's record at the
    # step's end (its input: the parameter as the optimizer step left it) names it. At step 3 the parameters are
    # inputs that already differ.
    overrides = ["experiment.trace.enabled=true", "experiment.trace.rung=1", "experiment.trace.steps=[2,3]",
                 "experiment.fault.enabled=true", "experiment.fault.step=2"]
    cfg = _cfg(overrides)
    run_a = _run_in_process(cfg, tmp_path / "a", 3, faulty=False)
    run_b = _run_in_process(cfg, tmp_path / "b", 3, faulty=True)
    report = diff_runs(run_a, run_b, steps=[2])
    assert report.verdict == ORIGIN and report.primary is not None
    assert (report.primary.kind, report.primary.name, report.primary.step) == ("parameter", "embed.weight", 2)
    assert diff_runs(run_a, run_b, steps=[3]).verdict == OUTSIDE
    # a clean pair's parameter records agree
    clean = _run_in_process(cfg, tmp_path / "c", 3, faulty=False)
    assert diff_runs(run_a, clean).verdict == IDENTICAL
    assert {r["kind"] for r in read_trace(run_a)[0]} >= {"optimizer", "parameter"}


def test_scope_filters_op_filter_and_max_numel(tmp_path: Path) -> None:
    run_a, _ = _pair(tmp_path, ["experiment.trace.rung=3", "experiment.trace.modules=[blocks.1.ffn]",
                                "experiment.trace.ops=[aten.mm*]", "experiment.trace.max_numel=2000"])
    records = read_trace(run_a)[0]
    ops = [r for r in records if r["kind"] == "op"]
    assert ops and all(r["name"] == "aten.mm.default" for r in ops)
    assert all(r["scope"].removesuffix("/backward").startswith("blocks.1.ffn") for r in ops)
    modules = {r["scope"] for r in records if r["kind"] == "module"}
    assert modules == {"blocks.1.ffn", "blocks.1.ffn.up", "blocks.1.ffn.down"}
    sides = [s for r in ops for s in r["in"] + r["out"]]
    big = [s for s in sides if s["shape"][0] * s["shape"][1] > 2000]
    assert big and all(s["digest"] is None for s in big)
    assert all(s["digest"] is not None for s in sides if s not in big)


def test_capture_scope_matching() -> None:
    scope = CaptureScope(rung=3, steps=(2,), ranks=(1,), modules=("blocks.*.ffn",), ops=("aten.index_put_*",))
    assert scope.wants_step(2) and not scope.wants_step(3)
    assert scope.wants_rank(1) and not scope.wants_rank(0)
    assert scope.wants_module("blocks.3.ffn.up") and scope.wants_module("blocks.3.ffn/backward")
    assert not scope.wants_module("blocks.3.attn") and not scope.wants_module("")
    assert scope.wants_op("aten.index_put_.default") and not scope.wants_op("aten.index_add_.default")
    with pytest.raises(ValueError, match="rung=4"):
        CaptureScope(rung=4)


def test_control_flow_divergence_is_reported_as_such(tmp_path: Path) -> None:
    run_a, run_b = _pair(tmp_path, ["experiment.trace.rung=3", "experiment.trace.modules=[blocks.1.ffn]"])
    trace_a, trace_b = read_trace(run_a), read_trace(run_b)
    dropped = next(r for r in trace_b[0] if r["name"] == "aten.gelu.default")
    trace_b[0].remove(dropped)
    report = diff_traces(trace_a, trace_b)
    assert report.verdict == CONTROL_FLOW
    assert report.primary is not None and report.primary.rule == "missing_in_b"
    assert (report.primary.id, report.primary.scope) == (dropped["id"], dropped["scope"])


# ---- diff rules on hand-made records ------------------------------------------------------------------------------

def _rec(rank: int, seq: int, kind: str, name: str, scope: str, ins: list[str], outs: list[str], n: int = 0) -> dict:
    side = lambda digests: [{"shape": [4], "dtype": "float32", "digest": d} for d in digests]  # noqa: E731
    return {"schema_version": TRACE_SCHEMA_VERSION, "seq": seq, "rank": rank, "step": 5, "kind": kind, "name": name,
            "id": f"{name}:{n}", "scope": scope, "in": side(ins), "out": side(outs)}


def test_rules_origin_downstream_view_and_collective_peer() -> None:
    a = {0: [_rec(0, 0, "op", "aten.view.default", "m", ["01"], ["02"]),
             _rec(0, 1, "op", "aten.mm.default", "m", ["02"], ["03"]),
             _rec(0, 2, "collective", "c10d.allreduce", "ddp.bucket0", ["04"], ["05"])],
         1: [_rec(1, 0, "collective", "c10d.allreduce", "ddp.bucket0", ["14"], ["05"])]}
    b = {0: [_rec(0, 0, "op", "aten.view.default", "m", ["01"], ["f2"]),
             _rec(0, 1, "op", "aten.mm.default", "m", ["f2"], ["f3"]),
             _rec(0, 2, "collective", "c10d.allreduce", "ddp.bucket0", ["f4"], ["f5"])],
         1: [_rec(1, 0, "collective", "c10d.allreduce", "ddp.bucket0", ["14"], ["f5"])]}
    report = diff_traces(a, b)
    assert report.verdict == ORIGIN
    rank0, rank1 = report.ranks
    assert rank0.first_origin is not None and rank0.first_origin.rule == VIA_VIEW  # one hop: its producer is the origin
    assert rank0.downstream == 2
    # rank 1's own input agrees, but rank 0's input to the same all-reduce differs: a receiver, not an origin
    assert rank1.first_origin is None and rank1.downstream == 1
    # only the collective on rank 1 perturbed: it is the origin there
    b[1][0]["out"][0]["digest"] = "f5"
    b[0] = [dict(r) for r in a[0]]
    b[0][2] = {**a[0][2], "out": [{"shape": [4], "dtype": "float32", "digest": "05"}]}
    report = diff_traces(a, b)
    assert report.primary is not None and (report.primary.kind, report.primary.rank) == ("collective", 1)


def _at(record: dict, step: int) -> dict:
    return {**record, "step": step}


def test_diff_without_positive_evidence_is_never_identical() -> None:
    both = {rank: [_at(_rec(rank, 0, "op", "aten.mm.default", "m", ["01"], ["02"]), step) for step in (5, 6)]
            for rank in (0, 1)}
    assert diff_traces(both, both).verdict == IDENTICAL
    # a requested step that neither run traced: nothing compared, no evidence
    report = diff_traces(both, both, steps=[9])
    assert report.verdict == NOTHING_COMPARED and report.compared == 0
    assert "nothing compared" in render(report) and "step 9 is traced in neither run" in render(report)
    # rank 1's trace is missing in B: what was compared agrees, but that is not "identical"
    report = diff_traces(both, {0: both[0]}, "A", "B")
    assert report.verdict == INCOMPLETE and "rank 1 is traced in A only" in render(report)
    assert render(report).splitlines()[1].startswith("verdict: incomplete")
    # rank 0's trace in B is shorter (stops before step 6)
    report = diff_traces(both, {0: both[0][:1], 1: both[1]}, "A", "B")
    assert report.verdict == INCOMPLETE
    assert report.notes == ["rank 0: step 6 traced in A only (B's trace is shorter or lacks them); not compared"]
    # a difference found in what both hold keeps its verdict, and the headline says the traces were incomplete
    changed = {0: [_at(_rec(0, 0, "op", "aten.mm.default", "m", ["01"], ["f2"]), 5)]}
    report = diff_traces(both, changed, "A", "B")
    assert report.verdict == ORIGIN
    assert "(traces incomplete: rank 1 is traced in A only; not compared, and 1 more)" in render(report).splitlines()[1]


@pytest.mark.slow  # over 10 s: a real multi-process or CLI run (the fast tier stays under 8 min)
def test_cli_diff_exit_codes_identical_nothing_compared_and_missing_rank(tmp_path: Path) -> None:
    records = [_at(_rec(0, i, "op", "aten.add.Tensor", "", ["01"], ["02"], n=i), 2) for i in range(3)]
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    _write(run_a, records)
    _write(run_b, records)
    same = run_taxbench("diff", str(run_a), str(run_b), cwd=tmp_path, timeout=120)
    assert same.returncode == 0 and "verdict: identical" in same.stdout, same.stderr
    untraced = run_taxbench("diff", str(run_a), str(run_b), "--step", "7", cwd=tmp_path, timeout=120)
    assert untraced.returncode == 4 and "verdict: nothing compared" in untraced.stdout, untraced.stderr
    writer = TraceWriter(trace_file(run_a, 1))  # rank 1 traced in A only
    writer.write_batch([{k: v for k, v in {**r, "rank": 1}.items() if k != "schema_version"} for r in records])
    writer.close()
    missing = run_taxbench("diff", str(run_a), str(run_b), "--json", cwd=tmp_path, timeout=120)
    assert missing.returncode == 4, missing.stderr
    report = json.loads(missing.stdout)
    assert report["verdict"] == "incomplete" and any("rank 1 is traced in" in n for n in report["notes"])


# ---- trace files --------------------------------------------------------------------------------------------------

def _write(run_dir: Path, records: list[dict]) -> Path:
    writer = TraceWriter(trace_file(run_dir, 0))
    writer.write_batch({k: v for k, v in r.items() if k != "schema_version"} for r in records)
    writer.close()
    return trace_file(run_dir, 0)


def test_trace_files_round_trip_and_bad_files_give_clear_errors(tmp_path: Path) -> None:
    records = [_rec(0, i, "op", "aten.add.Tensor", "", ["01"], ["02"], n=i) for i in range(3)]
    path = _write(tmp_path / "ok", records)
    assert read_trace(tmp_path / "ok")[0] == records

    with pytest.raises(TraceError, match="no trace.rank"):
        read_trace(tmp_path / "empty")
    torn = _write(tmp_path / "torn", records)
    torn.write_text(path.read_text()[:-20])
    with pytest.raises(TraceError, match=r"trace.rank0.jsonl:3: the last trace record is torn"):
        read_trace(tmp_path / "torn")
    corrupt = _write(tmp_path / "corrupt", records)
    lines = corrupt.read_text().splitlines()
    corrupt.write_text("\n".join([lines[0], "{garbage", lines[2]]) + "\n")
    with pytest.raises(TraceError, match=r":2: not a JSON record"):
        read_trace(tmp_path / "corrupt")
    other = _write(tmp_path / "other", records)
    other.write_text(other.read_text().replace(f'"schema_version":{TRACE_SCHEMA_VERSION}', '"schema_version":99'))
    with pytest.raises(TraceError, match=f"schema_version=99, this taxbench reads {TRACE_SCHEMA_VERSION}"):
        read_trace(tmp_path / "other")
    lacking = _write(tmp_path / "lacking", [{k: v for k, v in records[0].items() if k != "scope"}])
    assert lacking.exists()
    with pytest.raises(TraceError, match=r"lacks \['scope'\]"):
        read_trace(tmp_path / "lacking")


@pytest.mark.slow  # over 10 s: a real multi-process or CLI run (the fast tier stays under 8 min)
def test_cli_diff_prints_origin_json_and_rejects_corrupt_traces(tmp_path: Path) -> None:
    run_a, run_b = _pair(tmp_path, ["experiment.trace.rung=3", "experiment.trace.modules=[blocks.1.ffn]"], FAULT_MM)
    done = run_taxbench("diff", str(run_a), str(run_b), "--json", cwd=tmp_path, timeout=120)
    assert done.returncode == 3, done.stderr
    primary = json.loads(done.stdout)["primary"]
    assert (primary["name"], primary["scope"], primary["rank"]) == ("aten.mm.default", "blocks.1.ffn.up", 0)
    text = run_taxbench("diff", str(run_a), str(run_b), cwd=tmp_path, timeout=120)
    assert "origin op aten.mm.default:0 in blocks.1.ffn.up" in text.stdout
    trace = trace_file(run_b, 0)
    trace.write_text(trace.read_text()[:-5])
    bad = run_taxbench("diff", str(run_a), str(run_b), cwd=tmp_path, timeout=120)
    assert bad.returncode == 4 and "taxbench: error:" in bad.stderr and "Traceback" not in bad.stderr  # unreadable


def test_fault_and_trace_config_are_validated() -> None:
    from taxbench.config.schema import ConfigError, validate

    cfg = _cfg(["cluster.cpu_ranks=1", "experiment.fault.enabled=true", "experiment.fault.kind=nondeterministic_op"])
    with pytest.raises(ConfigError, match="needs experiment.fault.module"):
        validate(cfg)
    cfg = _cfg(["cluster.cpu_ranks=1", "experiment.trace.enabled=true", "experiment.trace.rung=5"])
    with pytest.raises(ConfigError, match="experiment.trace.rung=5"):
        validate(cfg)


# ---- localize end to end: two gloo ranks, the experiment schedule, replays --------------------------------------

def _experiment(tmp_path: Path, fault: list[str]) -> Path:
    from taxbench.launchers.local import launch_local

    raw = _raw(["recipe.micro_batch_size=2", "recipe.global_batch_size=4", "experiment.steps=4",
                "experiment.block_steps=2", "experiment.resume_step=2",
                "experiment.warmup_steps=0", "cluster.cpu_ranks=2", f"experiment.out_dir={tmp_path}",
                "experiment.fault.enabled=true", "experiment.fault.step=2", "experiment.fault.rank=1", *fault])
    cfg = prepare(raw)
    root = tmp_path / cfg.experiment.name
    root.mkdir(parents=True)
    launch_local(cfg, root)
    return root


@pytest.mark.slow
def test_localize_names_a_perturbed_collective_on_its_rank(tmp_path: Path) -> None:
    # No gradient clipping: its rescale can round a one-ulp flip away (it did on this CPU, not on another), and the
    # step would then be bitwise identical after all.
    root = _experiment(tmp_path, ["experiment.fault.kind=perturb_collective", "recipe.optimizer.grad_clip=0"])
    result = localize(root / "deterministic-0", root / "deterministic-1", tmp_path / "work")
    assert result.first_mismatch is not None and result.first_mismatch["step"] == 2
    assert result.verdict == NAMED
    assert result.origin is not None
    assert (result.origin.kind, result.origin.name, result.origin.rank) == ("collective", "c10d.allreduce", 1)
    assert [step.rung for step in result.path] == [1]


@pytest.mark.slow
def test_localize_names_a_flipped_parameter_at_rung_1(tmp_path: Path) -> None:
    root = _experiment(tmp_path, ["experiment.fault.kind=flip_param_bit"])
    result = localize(root / "deterministic-0", root / "deterministic-1", tmp_path / "work")
    assert result.verdict == NAMED and [step.rung for step in result.path] == [1]
    assert result.origin is not None
    assert (result.origin.kind, result.origin.name, result.origin.rank, result.origin.step) == (
        "parameter", "embed.weight", 1, 2)


@pytest.mark.slow
def test_localize_walks_the_ladder_to_a_nondeterministic_op(tmp_path: Path) -> None:
    root = _experiment(tmp_path, FAULT_MM)
    result = localize(root / "deterministic-0", root / "deterministic-1", tmp_path / "work")
    assert result.verdict == NAMED
    assert [(s.rung, s.modules) for s in result.path] == [(1, []), (2, []), (3, ["blocks.1.ffn.up"])]
    assert result.path[0].verdict == OUTSIDE  # rung 1: every boundary is a downstream receiver
    origin = result.origin
    assert origin is not None
    assert (origin.kind, origin.name, origin.scope, origin.rank, origin.step) == (
        "op", "aten.mm.default", "blocks.1.ffn.up", 1, 2)
    # a clean pair of the same experiment has nothing to localize
    clean = localize(root / "deterministic-0", root / "deterministic-resumed", tmp_path / "work-clean")
    assert clean.verdict == "no_divergence" and clean.path == []


def test_replays_start_from_the_latest_complete_checkpoint_before_the_step(tmp_path: Path) -> None:
    from taxbench.checkpoint.store import RunCheckpoints, commit, finish
    from taxbench.commands.localize import RecordedRun

    class Saver:
        def save_checkpoint(self, directory: Path) -> list[Path]:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "__0_0.distcp").write_bytes(b"state")
            return [directory / "__0_0.distcp"]

    run = tmp_path / "deterministic-1"
    checkpoints = RunCheckpoints(run, rank=0)
    for step in (6, 12):
        commit(step, [(checkpoints, Saver())])
    spec = RecordedRun(run, run.name, "deterministic", "1", {}, world_size=1)
    assert [spec.checkpoint_before(s) for s in (5, 7, 12, 13)] == [0, 6, 6, 12]
    finish([checkpoints])  # a finished run keeps no checkpoints: replays start from seeded init
    assert spec.checkpoint_before(13) == 0


@pytest.mark.slow
def test_localize_names_an_op_inside_the_second_pipeline_stage(tmp_path: Path) -> None:
    """pp=2 on two ranks, a nondeterministic op in block 1 (stage 1, rank 1): rung 1 sees the stage send different
    gradients back, rung 2 and 3 narrow it to the module and op on that rank. Seed 1: whether a one-ulp difference in
    the forward survives into the gradient sent back depends on the values (with the layout-invariant initial values
    of seed 0 it rounds away there, rung 1 finds nothing and rungs 2-3 still name the op; seeds 1 and 2 keep it)."""
    root = _experiment(tmp_path, [*FAULT_MM, "recipe.parallel.pp=2", "recipe.seed=1"])
    result = localize(root / "deterministic-0", root / "deterministic-1", tmp_path / "work")
    assert result.verdict == NAMED, [(s.rung, s.verdict) for s in result.path]
    first = result.path[0].finding
    assert first is not None and (first.kind, first.name, first.rank) == ("pipeline", "pipeline.send_grad", 1)
    origin = result.origin
    assert origin is not None
    assert (origin.kind, origin.name, origin.scope, origin.rank, origin.step) == (
        "op", "aten.mm.default", "blocks.1.ffn.up", 1, 2)


@pytest.mark.slow
def test_localize_names_a_perturbed_pipeline_boundary_at_rung_1(tmp_path: Path) -> None:
    """A bit flipped in the activation stage 1 received (the sender's copy intact) is named at rung 1 as the
    receive on that stage's boundary, not as a computation of either stage."""
    root = _experiment(tmp_path, ["experiment.fault.kind=perturb_collective", "recipe.parallel.pp=2"])
    result = localize(root / "deterministic-0", root / "deterministic-1", tmp_path / "work")
    assert result.verdict == NAMED and [s.rung for s in result.path] == [1]
    origin = result.origin
    assert origin is not None
    assert (origin.kind, origin.name, origin.scope, origin.rank, origin.step) == (
        "pipeline", "pipeline.recv", "pipeline/stage1", 1, 2)
