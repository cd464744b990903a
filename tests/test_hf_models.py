"""Hugging Face causal LMs as custom models (`recipe.model.kind=custom`): transformers' forward calls `.item()` on
its masks, which the meta device cannot answer, so preflight checks their logits on a small host copy instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import compose_config
from torch import nn

from taxbench.train.flops import flops_per_step

HERE = Path(__file__).resolve().parent  # the factory's module and its `helpers` import
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}


class LogitsOnly(nn.Module):
    """A causal LM as taxbench needs it: tokens [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits


def tiny_causal_lm(arch: str, vocab_size: int) -> nn.Module:
    if arch == "llama":
        return LogitsOnly(transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab_size, **SIZES)))
    config = transformers.MixtralConfig(vocab_size=vocab_size, num_local_experts=4, num_experts_per_tok=2, **SIZES)
    return LogitsOnly(transformers.MixtralForCausalLM(config))


def factory(arch: str) -> str:
    return (f"++recipe.model.factory={{_target_: {__name__}.tiny_causal_lm, arch: {arch}, "
            "vocab_size: '${recipe.model.vocab_size}'}")


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_hugging_face_causal_lm_passes_preflight_and_its_flops_are_counted(arch: str) -> None:
    cfg = compose_config("recipe.model.kind=custom", factory(arch))
    flops, how = flops_per_step(cfg.recipe)
    assert how == "FlopCounterMode on a host copy" and flops is not None and flops > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_hugging_face_causal_lm_runs_an_experiment_and_passes_the_gates(tmp_path: Path, taxbench_cli,
                                                                         arch: str) -> None:
    result = taxbench_cli("recipe.model.kind=custom", factory(arch), "cluster=inprocess", "experiment.steps=6",
                          "experiment.warmup_steps=1", "experiment.resume_step=3",
                          "experiment.checkpoint_every_steps=3", "report.wandb=false",
                          f"experiment.out_dir={tmp_path}", "experiment.name=hf", cwd=tmp_path, timeout=300,
                          env={"PYTHONPATH": str(HERE)})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summary["outcome"] == "passed"
    assert {v["gate"]: v["outcome"] for v in summary["verdicts"]} == {
        "repeatability": "identical", "restart_replay": "identical", "baseline_sanity": "identical"}
