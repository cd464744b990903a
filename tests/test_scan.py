"""`taxbench scan`: every ATen op of a step replayed on identical inputs (taxbench.tracing.op_scan,
taxbench.commands.scan)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from helpers import run_taxbench, run_taxbench_in_terminal

from taxbench import exit_codes
from taxbench.commands.scan import exit_code, render
from taxbench.tracing.capture import ModuleScope
from taxbench.tracing.op_scan import NondeterministicOp, OpRepeatScan, PolicyScan, clone_inputs, signature


def _scan(fn, repeats: int = 3, deterministic: bool = False):  # type: ignore[no-untyped-def]
    mode = OpRepeatScan("test", deterministic, repeats, ModuleScope())
    with mode:
        out = fn()
    return out, mode.finish()


@torch.library.custom_op("taxbench_test::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    """An op that gives other bytes on every call, drawing from the OS rather than torch's RNG (which the scan
    restores before each replay)."""
    noise = torch.frombuffer(bytearray(os.urandom(4 * x.numel())), dtype=torch.int32).reshape(x.shape)
    return x + noise.to(x.dtype)


def test_an_op_that_differs_on_identical_inputs_is_found() -> None:
    x = torch.ones(3, 4)
    out, scan = _scan(lambda: noisy(x) * 2, repeats=3)
    assert [op.op for op in scan.nondeterministic] == ["taxbench_test.noisy.default"]
    assert scan.nondeterministic[0].shapes == [[3, 4]] and scan.nondeterministic[0].most_differed == 3
    assert out.shape == (3, 4)


def _index_put_race(base: torch.Tensor, index: torch.Tensor, values: torch.Tensor, tries: int) -> bool:
    first = base.clone().index_put_((index,), values, accumulate=True)
    return any(not torch.equal(first, base.clone().index_put_((index,), values, accumulate=True))
               for _ in range(tries))


def test_atomic_index_put_accumulate_on_two_threads_is_found() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # As in the MoE combine: both threads' halves sweep the same rows in the same order, so their atomic adds
        # race on the same rows (random indices rarely collide in time: measured 0 of 50 differing here).
        generator = torch.Generator().manual_seed(0)
        base = torch.randn(512, 64, generator=generator)
        index = torch.arange(512).repeat(2)
        values = torch.randn(1024, 64, generator=generator)
        if not _index_put_race(base, index, values, tries=60):  # a race needs both threads running at once
            pytest.skip("index_put_(accumulate=True) gave the same bytes 60 times here: the two threads did not "
                        "race (one core busy elsewhere?); test_an_op_that_differs_on_identical_inputs_is_found "
                        "covers the scan's detection")
        for _ in range(5):
            out, scan = _scan(lambda: base.clone().index_put_((index,), values, accumulate=True), repeats=20)
            if scan.nondeterministic:
                break
    finally:
        torch.set_num_threads(threads)
    assert [op.op for op in scan.nondeterministic] == ["aten.index_put_.default"]
    assert scan.nondeterministic[0].shapes == [[512, 64], [1024], [1024, 64]]
    assert scan.nondeterministic[0].most_differed >= 1
    assert out.shape == (512, 64)


def test_in_place_ops_are_replayed_on_clones_and_the_real_call_continues() -> None:
    torch.manual_seed(0)
    x = torch.zeros(4)
    view = x[1:3]
    reference = torch.zeros(4)
    reference[1:3].add_(1).mul_(torch.rand(2))
    torch.manual_seed(0)
    _, scan = _scan(lambda: view.add_(1).mul_(torch.rand(2)))
    assert torch.equal(x, reference)  # mutated once, with the RNG draw it would have had without the scan
    assert scan.clean and scan.ops_replayed == 3


def test_fused_attentions_rng_bookkeeping_is_not_compared_but_its_numbers_are() -> None:
    # CUDA's efficient attention returns its philox seed and offset, uninitialized without dropout (on an H200 every
    # replay of the deterministic policy's attention "differed" through them alone).
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    output, log_sumexp = torch.ones(2, 3), torch.zeros(2)

    def produced(seed: int, offset: int, out: torch.Tensor = output) -> tuple[object, ...]:
        return signature(op, (out, log_sumexp, torch.tensor(seed), torch.tensor(offset)), (), {})

    assert produced(1, 2) == produced(7, 9)
    assert produced(1, 2) != produced(1, 2, out=output + 1)


def test_clones_keep_aliasing_between_arguments() -> None:
    storage = torch.arange(6.0)
    a, b = storage[:4], storage[2:]
    (ca, cb), _ = clone_inputs((a, b), {})
    ca[2] = -1.0
    assert cb[0] == -1.0 and storage[2] == 2.0


def test_ops_without_a_deterministic_implementation_are_listed() -> None:
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)  # strict, as the deterministic policy sets it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the scan keeps torch's alert to itself
            out, scan = _scan(lambda: torch.zeros(4).put_(torch.tensor([0, 1]), torch.ones(2)), deterministic=True)
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    assert [entry.op for entry in scan.no_deterministic_implementation] == ["aten.put_.default"]
    assert "put_ does not have a deterministic implementation" in scan.no_deterministic_implementation[0].message
    assert scan.no_deterministic_implementation[0].calls == 1  # the step's call, not its replays
    assert scan.nondeterministic == [] and not scan.clean
    assert out.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert not torch.is_deterministic_algorithms_warn_only_enabled()


def test_moe_tiny_baseline_index_put_is_named_by_module_and_deterministic_is_clean(tmp_path: Path) -> None:
    out = tmp_path / "scan.json"
    code, shown = run_taxbench_in_terminal("scan", "+recipe=moe_tiny", "cluster.threads_per_rank=2",
                                           f"scan.out={out}", cwd=tmp_path)
    assert code == 0, shown
    assert "ops/s" in shown  # the live progress bar
    scan = json.loads(out.read_text())
    baseline, deterministic = scan["policies"]
    assert (baseline["policy"], deterministic["policy"]) == ("baseline", "deterministic")
    found = {(op["op"], op["scope"]) for op in baseline["nondeterministic"]}
    # Each layer's combine is a race of its own (19 of 20 calls differed over 5 scans here): one named is the finding.
    assert found & {("aten.index_put_.default", "blocks.0.ffn"), ("aten.index_put_.default", "blocks.1.ffn")}, found
    assert deterministic["nondeterministic"] == [] and deterministic["no_deterministic_implementation"] == []
    assert deterministic["ops_replayed"] > 1000 and scan["exit_code"] == 0 and scan["threads"] == 2


@pytest.mark.slow
def test_a_planted_nondeterministic_op_fails_the_deterministic_policy(tmp_path: Path) -> None:
    out = tmp_path / "scan.json"
    result = run_taxbench("scan", "+recipe=dense_tiny", "scan.repeats=2", "scan.optimizer_step=false",
                          f"scan.out={out}", "experiment.fault.enabled=true",
                          "experiment.fault.kind=nondeterministic_op", "experiment.fault.module=blocks.1.ffn.up",
                          "experiment.fault.op=aten.mm.default", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    deterministic = json.loads(out.read_text())["policies"][1]
    assert [(op["op"], op["scope"]) for op in deterministic["nondeterministic"]] == [
        ("aten.mm.default", "blocks.1.ffn.up")]
    assert "NONDETERMINISTIC OPS" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["scan.repeats=0"], "scan.repeats=0 must be >= 1"),
    (["scan.bogus=1"], "unknown scan setting 'scan.bogus'"),
    (["+recipe=no_such_recipe"], "no_such_recipe"),
    (["+recipe=moe_1t"], "needs tp*pp"),
    (["+recipe=moe_1t_proxy", "recipe.parallel.pp=1"], "scan it with recipe.parallel.ep=1"),
    (["scan.out=/proc/no/scan.json"], "choose another scan.out"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_taxbench("scan", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_policy_that_replayed_nothing_is_no_evidence() -> None:
    baseline = PolicyScan("baseline", deterministic=False, repeats=3, ops_seen=10, ops_replayed=10)
    nothing = PolicyScan("deterministic", deterministic=True, repeats=3, ops_seen=10, ops_replayed=0,
                         not_replayed={"aten.mm.default": 10})
    assert not nothing.clean and exit_code([baseline, nothing]) == exit_codes.INCOMPLETE
    replayed = PolicyScan("deterministic", deterministic=True, repeats=3, ops_seen=10, ops_replayed=10)
    assert replayed.clean and exit_code([baseline, replayed]) == exit_codes.OK
    replayed.nondeterministic.append(NondeterministicOp("aten.mm.default", "blocks.0", [[2, 2]], ["float32"], 3))
    assert exit_code([baseline, replayed]) == exit_codes.NOT_DETERMINISTIC


def test_the_scan_table_fits_80_columns_with_long_op_module_and_shape_names(tmp_path: Path) -> None:
    op = NondeterministicOp("aten._scaled_dot_product_efficient_attention.default", "blocks.11.attention.inner",
                            [[8, 16, 2048, 128]] * 4, ["torch.bfloat16"], repeats=3, calls=24, calls_differed=24,
                            most_differed=3)
    scan = PolicyScan("deterministic", deterministic=True, repeats=3, ops_seen=5000, ops_replayed=4000,
                      nondeterministic=[op])
    shown = render([scan], tmp_path / "scan.json")
    assert max(len(line) for line in shown.splitlines()[:-1]) <= 80, shown  # the path is never broken
    assert "8x16x2048x128" in shown and "blocks.11.attention.inner" in shown and "3/3 replays, 24/24 calls" in shown
