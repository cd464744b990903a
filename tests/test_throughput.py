"""Training metrics: model FLOPs counted once per recipe, the peak they are held to, and the per-arm metrics a run's
summary holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import compose_typed, run_schedule, tiny_config

from taxbench.config.schema import Device, Precision
from taxbench.train.flops import flops_per_step, peak_flops


def test_dense_flops_are_about_six_per_parameter_and_token() -> None:
    recipe = compose_typed("experiment.name=x").recipe
    flops, how = flops_per_step(recipe)
    model = recipe.model
    per_layer = 4 * model.d_model**2 + 2 * model.d_model * model.d_ff
    matmul_params = model.n_layers * per_layer + model.vocab_size * model.d_model  # blocks and the output head
    tokens = recipe.global_batch_size * model.seq_len
    assert how == "FlopCounterMode on the meta device"
    # 6 N T for the matmuls, plus attention's scores and values (which grow with seq_len, not with parameters)
    assert 6 * matmul_params * tokens <= flops <= 1.5 * 6 * matmul_params * tokens


def test_a_moe_without_meta_kernels_is_counted_on_a_host_copy() -> None:
    flops, how = flops_per_step(compose_typed("+recipe=moe_tiny", "experiment.name=x").recipe)
    assert how == "FlopCounterMode on a host copy" and flops is not None and flops > 0


def test_peak_flops_come_from_the_override_the_table_or_nowhere_on_cpu() -> None:
    cluster = compose_typed("experiment.name=x").cluster
    assert peak_flops(cluster, Precision.bf16, None) == (None, "MFU does not apply on CPU")
    cluster.device = Device.cuda
    assert peak_flops(cluster, Precision.bf16, "NVIDIA H100 80GB HBM3") == (989e12, "H100 bf16 datasheet peak")
    assert peak_flops(cluster, Precision.fp32, "NVIDIA H200")[0] == 494e12
    assert peak_flops(cluster, Precision.bf16, "Some GPU")[0] is None
    cluster.peak_tflops = 100
    assert peak_flops(cluster, Precision.bf16, "Some GPU") == (100e12, "cluster.peak_tflops")


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from taxbench.analysis.summary import analyse

    root = tmp_path_factory.mktemp("throughput")
    run_schedule(tiny_config("experiment.block_steps=1", "experiment.steps=12"), root)
    analyse(root)
    return root


def test_a_run_records_its_work_and_its_summary_holds_tokens_per_second(experiment: Path) -> None:
    manifest = json.loads((experiment / "deterministic-0" / "manifest.json").read_text())
    throughput = manifest["throughput"]
    assert throughput["tokens_per_step"] == 4 * 16 and throughput["flops_per_step"] > 0
    assert throughput["peak_flops_per_device"] is None  # CPU: no MFU
    summary = json.loads((experiment / "summary.json").read_text())
    for arm in ("baseline", "deterministic"):
        metrics = summary["throughput"][arm]
        step = summary["tax"][f"{arm}_median_s"]
        assert metrics["tokens_per_s"] == pytest.approx(64 / step)
        assert metrics["tflops_per_device"] == pytest.approx(throughput["flops_per_step"] / step / 1e12)
        assert metrics["mfu"] is None and metrics["peak_memory_bytes"] > 0 and 0 < metrics["data_share"] < 1
    assert summary["cost"]["tokens_per_s_lost"] == pytest.approx(
        summary["throughput"]["baseline"]["tokens_per_s"] - summary["throughput"]["deterministic"]["tokens_per_s"])


def test_megatrons_gpt_is_counted_as_the_dense_gpt_of_the_same_shape() -> None:
    megatron = compose_typed("+recipe=megatron_gpt_debug", "experiment.name=x").recipe
    flops, how = flops_per_step(megatron)
    model = megatron.model
    dense = compose_typed("experiment.name=x", f"recipe.model.vocab_size={model.vocab_size}",
                          f"recipe.model.seq_len={model.seq_len}",
                          f"recipe.micro_batch_size={megatron.micro_batch_size}",
                          f"recipe.global_batch_size={megatron.global_batch_size}").recipe
    assert how == "FlopCounterMode on the meta device, taxbench's dense GPT of the same shape"
    assert flops == flops_per_step(dense)[0]
    # GPTModel's matmuls by hand (qkv and projection, a GELU MLP, attention scores and values over the whole sequence,
    # the output head): 3 (forward, backward) x 2 x tokens x (layers x (4h^2 + 2hf + 2sh) + hV)
    h, f, s, v, layers = model.d_model, model.d_ff, model.seq_len, model.vocab_size, model.n_layers
    tokens = megatron.global_batch_size * s
    assert flops == 6 * tokens * (layers * (4 * h * h + 2 * h * f + 2 * s * h) + h * v)
