"""`taxbench layouts`: layout names, the ulp distance, the layout-invariant weights digest, and the command end to end
with real rank processes (dense_tiny on 2 gloo ranks as dp2 and pp2, a few steps): a clean run, a planted fault that
makes each layout non-repeatable (exit 3), records cut short (exit 4) and bad layouts (exit 2, one line)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from taxbench import exit_codes
from taxbench.analysis.layouts import analyse_layouts, float32_bits, ulp_distance
from taxbench.analysis.wandb_log import log_layouts
from taxbench.config.layout_names import check_layout, parse_layout_list, parse_layout_name
from taxbench.config.schema import ConfigError, DataParallel, ModelConfig, RecipeConfig, ReportConfig
from taxbench.parallel.logical_digest import combine, shard_sum, shard_sums
from taxbench.rundir.read import RecordError
from taxbench.workloads import build_model
from taxbench.workloads.init import GlobalView, initialize

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------------------ ulps
def test_ulp_distance_counts_the_floats_between_two_bit_patterns() -> None:
    one = float32_bits(1.0)
    above = float32_bits(float(np.nextafter(np.float32(1.0), np.float32(2.0))))
    assert ulp_distance(one, one) == 0
    assert ulp_distance(one, above) == ulp_distance(above, one) == 1
    assert ulp_distance(one, float32_bits(1.0 + 2 ** -20)) == 8  # float32 spacing at 1.0 is 2**-23
    assert ulp_distance(float32_bits(0.0), float32_bits(-0.0)) == 0
    tiny = 1  # the smallest positive subnormal's bits; its negative lies two steps away, across both zeros
    assert ulp_distance(tiny, tiny | 1 << 31) == 2
    assert ulp_distance(float32_bits(float("nan")), one) is None
    doubles = np.array([1.0, np.nextafter(1.0, 2.0)], dtype=np.float64).view(np.uint64)
    assert ulp_distance(int(doubles[0]), int(doubles[1]), width=64) == 1


# ---------------------------------------------------------------------------------------------------- layout names
def test_a_layout_name_states_the_whole_layout() -> None:
    layout = parse_layout_name("pp2.dp2.ep2")
    assert (layout.pp, layout.tp, layout.dp, layout.ep, layout.data_parallel) == (2, 1, 2, 2, None)
    assert parse_layout_name("tp2.fsdp").data_parallel is DataParallel.fsdp
    assert [lay.name for lay in parse_layout_list("[pp1.dp4, 'pp2.dp2']")] == ["pp1.dp4", "pp2.dp2"]
    for bad, words in (("pp2.xx3", "'xx3' is not a factor"), ("pp2.pp2", "gives pp twice"), ("pp0", "at least"),
                       ("", "empty layout")):
        with pytest.raises(ConfigError, match=words):
            parse_layout_name(bad)
    with pytest.raises(ConfigError, match="more than once"):
        parse_layout_list("[dp2, dp2]")
    with pytest.raises(ConfigError, match="at least two"):
        parse_layout_list("[dp2]")


def test_a_layout_that_does_not_fit_says_how_to_fix_it() -> None:
    recipe = RecipeConfig(name="t", model=ModelConfig(kind="moe", n_layers=2, n_experts=4, top_k=2, moe_d_ff=32),
                          micro_batch_size=2, global_batch_size=8)
    with pytest.raises(ConfigError, match=r"needs pp\*tp\*dp = 2\*1\*4 = 8 ranks, but the world size is 4 "
                                          r"\(cluster.cpu_ranks\); write dp2"):
        check_layout(parse_layout_name("pp2.dp4"), recipe, 4, "cluster.cpu_ranks")
    with pytest.raises(ConfigError, match="layout dp4.ep3: .*not divisible by recipe.parallel.ep=3"):
        check_layout(parse_layout_name("dp4.ep3"), recipe, 4, "cluster.cpu_ranks")
    fitted = check_layout(parse_layout_name("pp2.ep2"), recipe, 4, "cluster.cpu_ranks")
    assert (fitted.parallel.pp, fitted.parallel.ep, fitted.parallel.tp) == (2, 2, 1)


# ------------------------------------------------------------------------------------------- layout-invariant digest
def _split_rows(tensor: torch.Tensor, parts: int) -> list[tuple[torch.Tensor, GlobalView]]:
    shape = tuple(tensor.shape)
    chunks = torch.arange(shape[0]).chunk(parts)
    return [(tensor[rows], GlobalView(shape, (rows, *(torch.arange(n) for n in shape[1:])))) for rows in chunks]


def _split_columns(tensor: torch.Tensor) -> list[tuple[torch.Tensor, GlobalView]]:
    shape = tuple(tensor.shape)
    halves = torch.arange(shape[1]).chunk(2)
    return [(tensor[:, cols], GlobalView(shape, (torch.arange(shape[0]), cols))) for cols in halves]


def test_the_weights_digest_is_the_same_for_any_split_and_replicas_count_once() -> None:
    model = initialize(build_model(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_ff=32, vocab_size=32,
                                               seq_len=8), deterministic_kernels=True), seed=3)
    params = {name: p.detach() for name, p in model.named_parameters()}
    whole = combine([[shard_sum(n, p, GlobalView.whole(p)) for n, p in params.items()]])
    assert whole.model is not None and not whole.problems and whole.elements == sum(p.numel() for p in params.values())
    rank0, rank1 = [], []
    for name, p in params.items():  # matrices split by columns (tensor parallel), the rest by rows (FSDP2)
        pieces = _split_columns(p) if p.dim() == 2 else _split_rows(p, 2)
        for rank, (local, view) in zip((rank0, rank1), pieces, strict=True):
            rank.append(shard_sum(name, local.contiguous(), view))
    split = combine([rank0, rank1, list(rank0)])  # rank 2 is a data-parallel replica of rank 0
    assert split.model == whole.model and split.parameters == whole.parameters

    name = next(n for n, p in params.items() if p.dim() == 2)
    flipped = params[name].clone()
    flipped.view(-1)[5:6].view(torch.int32).bitwise_xor_(1)
    changed = combine([[shard_sum(n, flipped if n == name else p, GlobalView.whole(p)) for n, p in params.items()]])
    assert changed.model != whole.model and changed.parameters[name] != whole.parameters[name]

    missing = combine([rank0])  # half of every parameter held by nobody: never a digest
    assert missing.model is None and any("elements of its" in p for p in missing.problems)
    local, view = _split_columns(flipped)[0]
    replica = [shard_sum(name, local.contiguous(), view) if s.name == name else s for s in rank0]
    disagreeing = combine([rank0, rank1, replica])
    assert disagreeing.model is None and any("replicas disagree" in p for p in disagreeing.problems)


def test_the_weights_digest_covers_persistent_buffers_by_name_and_replicas_must_agree_on_them() -> None:
    model = initialize(build_model(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_ff=32, vocab_size=32,
                                               seq_len=8), deterministic_kernels=True), seed=3)
    router = model.get_submodule("blocks.0")  # a router's load-balancing bias, and a scratch count never saved
    router.register_buffer("expert_bias", torch.linspace(-1, 1, 4))
    router.register_buffer("tokens_per_expert", torch.arange(4.0), persistent=False)
    rank0 = shard_sums([model])
    whole = combine([rank0])
    assert whole.model is not None and set(whole.buffers) == {"blocks.0.expert_bias"}
    assert not set(whole.buffers) & set(whole.parameters)
    assert whole.elements == sum(p.numel() for p in model.parameters()) + 4
    replicated = combine([rank0, shard_sums([model])])  # a data-parallel replica: counted once
    assert (replicated.model, replicated.buffers) == (whole.model, whole.buffers)

    router.tokens_per_expert.add_(1)  # not in the state dict: no part of the weights
    assert combine([shard_sums([model])]).model == whole.model
    router.expert_bias[2] += 0.5
    moved = combine([shard_sums([model])])
    assert moved.model is not None and moved.model != whole.model and moved.parameters == whole.parameters
    disagreeing = combine([rank0, shard_sums([model])])  # a replica whose bias drifted from rank 0's
    assert disagreeing.model is None
    assert any(p.startswith("blocks.0.expert_bias: ") and "replicas disagree" in p for p in disagreeing.problems)


# --------------------------------------------------------------------------------------------- the command, for real
def _taxbench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "taxbench", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _layouts(out: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return _taxbench("layouts", "layouts=[dp2, pp2]", "experiment.steps=3", "report.wandb=false",
                     f"experiment.out_dir={out}", f"experiment.name={name}", *extra)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("layouts")
    return out / "clean", _layouts(out, "clean")


@pytest.mark.slow
def test_two_layouts_compare_with_identical_step0_weights(clean_run: tuple[Path, subprocess.CompletedProcess[str]],
                                                          ) -> None:
    root, result = clean_run
    assert result.returncode == exit_codes.OK, result.stderr + result.stdout
    # what the launch costs, said before it starts
    assert "plan: 2 layouts: 4 runs, 12 steps in all, 0 timed (0%); GPU-hours do not apply on CPU" in result.stderr
    summary = json.loads((root / "summary.json").read_text())
    assert summary["initial_weights_identical"] is True
    assert "identical step-0 weights: yes" in result.stdout
    assert [layout["repeatable"]["outcome"] for layout in summary["layouts"]] == ["identical", "identical"]
    (pair,) = summary["pairs"]
    assert (pair["reference"], pair["candidate"]) == ("dp2", "pp2")
    assert [row["step"] for row in pair["per_step"]] == [1, 2, 3]
    assert all(isinstance(row["loss_ulp"], int) for row in pair["per_step"])
    first = pair["first_difference"]
    if first is not None:  # where the reduction order differs, the first step and metric are named
        assert first["step"] >= 1 and first["metric"] in ("loss", "grad_norm", "weights")
    report = (root / "report" / "report.html").read_text()
    assert "Cross-layout validation" in report and "dp2 vs pp2" in report


@pytest.mark.slow
def test_records_cut_short_are_incomplete_evidence(clean_run: tuple[Path, subprocess.CompletedProcess[str]],
                                                   tmp_path: Path) -> None:
    root, _ = clean_run
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("*.arrow"))
    stream = copy / "pp2" / "deterministic-1" / "steps.rank1.jsonl"
    lines = stream.read_text().splitlines(keepends=True)
    stream.write_text("".join(lines[:-1]))
    (copy / "dp2" / "deterministic-0" / "logical_weights.json").unlink()
    summary = analyse_layouts(copy).summary
    assert summary.exit_code == exit_codes.INCOMPLETE
    assert summary.initial_weights_identical is None
    assert any("steps.rank" in p or "step 3 missing" in p for p in summary.problems)
    assert any("logical_weights.json: missing" in p for p in summary.problems)


@pytest.mark.slow
def test_a_run_copied_from_another_layout_is_named(clean_run: tuple[Path, subprocess.CompletedProcess[str]],
                                                   tmp_path: Path) -> None:
    root, _ = clean_run
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "pp2" / "deterministic-0")
    shutil.copytree(copy / "dp2" / "deterministic-0", copy / "pp2" / "deterministic-0")
    summary = analyse_layouts(copy).summary
    # the foreign run also differs from pp2's own second run: a proven difference outranks the missing evidence
    assert summary.exit_code == exit_codes.NOT_DETERMINISTIC
    assert any("describes a layout with pp=1, not pp2" in p for p in summary.problems), summary.problems


@pytest.mark.slow
def test_a_weights_digest_copied_from_another_run_or_a_plan_of_one_layout_is_no_evidence(
        clean_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    root, _ = clean_run
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    shutil.copy(copy / "dp2" / "deterministic-0" / "logical_weights.json",
                copy / "dp2" / "deterministic-1" / "logical_weights.json")
    summary = analyse_layouts(copy).summary
    assert summary.exit_code == exit_codes.INCOMPLETE
    assert any("digests of run 'deterministic-0'" in p and "not of deterministic-1" in p for p in summary.problems)
    plan = json.loads((copy / "layouts.json").read_text())
    (copy / "layouts.json").write_text(json.dumps({**plan, "layouts": ["dp2"]}))
    with pytest.raises(RecordError, match="not two or more distinct layouts"):
        analyse_layouts(copy)


@pytest.mark.slow
def test_the_wandb_run_holds_the_layout_tables(clean_run: tuple[Path, subprocess.CompletedProcess[str]],
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    root, _ = clean_run
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    run_dir = log_layouts(analyse_layouts(copy), ReportConfig(wandb=True, wandb_project="taxbench-test"))
    assert run_dir.parent == copy / "wandb" and run_dir.name.startswith("offline-run-")
    tables = run_dir / "files" / "media" / "table"
    pairs = json.loads(next(tables.glob("layout_pairs_*.table.json")).read_text())
    assert pairs["columns"][:2] == ["reference", "candidate"] and [row[:2] for row in pairs["data"]] == [["dp2", "pp2"]]
    ulps = json.loads(next(tables.glob("layout_ulps_*.table.json")).read_text())
    assert [row[0] for row in ulps["data"]] == [1, 2, 3]
    layouts = json.loads(next(tables.glob("layouts_*.table.json")).read_text())
    assert [row[0] for row in layouts["data"]] == ["dp2", "pp2"]


@pytest.mark.slow
def test_a_planted_fault_makes_each_layout_non_repeatable(tmp_path: Path) -> None:
    result = _layouts(tmp_path, "faulted", "experiment.fault.enabled=true", "experiment.fault.step=2",
                      "experiment.fault.rank=1")
    assert result.returncode == exit_codes.NOT_DETERMINISTIC, result.stderr + result.stdout
    summary = json.loads((tmp_path / "faulted" / "summary.json").read_text())
    assert summary["not_repeatable"] == ["dp2", "pp2"]
    for layout in summary["layouts"]:
        mismatch = layout["repeatable"]["first_mismatch"]
        assert mismatch["step"] == 2 and mismatch["rank"] == 1
    assert "not repeatable on its own: dp2, pp2" in result.stdout


@pytest.mark.parametrize(("args", "words"), [
    (["layouts=[dp2, pp2.qq2]"], "layout 'pp2.qq2': 'qq2' is not a factor"),
    (["layouts=[dp2,", "dp4]"], "layout dp4 needs pp*tp*dp = 1*1*4 = 4 ranks, but the world size is 2"),  # unquoted
    (["layouts=[dp2, dp2.ep2]"], "layout dp2.ep2: recipe.parallel.ep=2 needs an MoE model"),
    (["layouts=[dp2, tp2]", "recipe.model.kind=custom",
      "++recipe.model.factory={_target_: torch.nn.Embedding, num_embeddings: 256, embedding_dim: 256}"],
     "layout tp2: recipe.parallel.tp=2 shards taxbench's attention and MLP blocks"),  # before dp2 runs
    (["layouts=[dp2, pp2]", "policy=fast"], "policy='fast' is not an arm; choose one of ['baseline', 'deterministic']"),
])
def test_a_bad_layout_is_one_line_exit_2(args: list[str], words: str, tmp_path: Path) -> None:
    result = _taxbench("layouts", *args, f"experiment.out_dir={tmp_path}", timeout=120)
    assert result.returncode == exit_codes.CONFIG_ERROR
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not any(tmp_path.iterdir())  # refused before any folder is made
