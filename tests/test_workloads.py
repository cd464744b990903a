"""MoE and dense workloads: fast paths really nondeterministic on CPU with 2 threads, fixed-order paths not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import compose_typed
from torch import nn

from taxbench.config.schema import ConfigError, ModelConfig
from taxbench.workloads import build_model
from taxbench.workloads.moe import MoEFeedForward

# moe_tiny's model, with one micro-batch of 8 x 64 tokens: 8*64 tokens x top-2 x 64 = 65536 combined elements,
# above the 32768 at which CPU index_put_(accumulate=True) switches to multi-threaded atomic adds.
MOE_TINY = ModelConfig(kind="moe", vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4, d_ff=256,
                       n_experts=8, top_k=2, moe_d_ff=128, n_shared_experts=1)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two intra-op threads and torch's deterministic algorithms off, as in a baseline rank on CPU."""
    saved_threads, saved_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(False)
    yield
    torch.set_num_threads(saved_threads)
    torch.use_deterministic_algorithms(saved_deterministic)


def _train_step_bytes(cfg: ModelConfig, deterministic_kernels: bool) -> torch.Tensor:
    """Logits and every gradient of one forward/backward from a fixed init and batch."""
    model = build_model(cfg, deterministic_kernels, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens.reshape(-1)) + model.aux_loss()
    loss.backward()
    return torch.cat([logits.detach().flatten()] + [p.grad.flatten() for p in model.parameters()])


def test_moe_fast_path_differs_run_to_run_and_deterministic_path_does_not(two_threads: None) -> None:
    fast = [_train_step_bytes(MOE_TINY, deterministic_kernels=False) for _ in range(6)]
    deterministic = [_train_step_bytes(MOE_TINY, deterministic_kernels=True) for _ in range(6)]
    assert any(not torch.equal(fast[0], other) for other in fast[1:]), "fast MoE path was bitwise stable 6 times"
    assert all(torch.equal(deterministic[0], other) for other in deterministic[1:])
    # Same model, different summation order: the two paths agree to rounding.
    torch.testing.assert_close(fast[0], deterministic[0], rtol=1e-4, atol=1e-5)


def test_deterministic_router_breaks_ties_by_lower_expert_index() -> None:
    layer = MoEFeedForward(MOE_TINY, deterministic_kernels=True)
    probs = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25], [0.4, 0.1, 0.1, 0.4]])
    layer.top_k = 2
    top_p, top_e = layer.select_experts(probs)
    assert top_e.tolist() == [[1, 2], [0, 1], [0, 3]]
    torch.testing.assert_close(top_p, torch.tensor([[0.3, 0.3], [0.25, 0.25], [0.4, 0.4]]))


def test_aux_loss_is_the_same_on_both_paths() -> None:
    torch.manual_seed(0)
    fast = MoEFeedForward(MOE_TINY, deterministic_kernels=False)
    deterministic = MoEFeedForward(MOE_TINY, deterministic_kernels=True)
    deterministic.load_state_dict(fast.state_dict())
    x = torch.randn(4, 16, MOE_TINY.d_model)
    fast(x), deterministic(x)
    assert fast.last_aux_loss is not None and deterministic.last_aux_loss is not None
    torch.testing.assert_close(fast.last_aux_loss, deterministic.last_aux_loss)
    assert fast.last_aux_loss.item() > 0


def test_moe_rejects_top_k_above_experts() -> None:
    cfg = ModelConfig(kind="moe", n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="top_k"):
        build_model(cfg, deterministic_kernels=True)


def build_tiny_lstm_lm(vocab_size: int, width: int) -> nn.Module:
    """A user model for the `_target_` test: tokens [batch, seq] -> logits [batch, seq, vocab]."""

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab_size, width)
            self.rnn = nn.LSTM(width, width, batch_first=True)
            self.head = nn.Linear(width, vocab_size)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(self.embed(tokens))[0])

    return TinyLM()


def test_custom_model_through_hydra_target() -> None:
    cfg = ModelConfig(kind="custom", factory={"_target_": f"{__name__}.build_tiny_lstm_lm", "vocab_size": 32,
                                              "width": 8})
    model = build_model(cfg, deterministic_kernels=True)
    assert model(torch.randint(0, 32, (2, 5))).shape == (2, 5, 32)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ({}, "needs recipe.model.factory with a _target_"),
        ({"_target_": "no_such_pkg.build"}, "could not be instantiated"),
        ({"_target_": "builtins.dict"}, "not an nn.Module"),
    ],
)
def test_custom_model_errors_name_the_fix(factory: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model(ModelConfig(kind="custom", factory=factory), deterministic_kernels=True)


def test_unknown_kind_lists_choices() -> None:
    with pytest.raises(ConfigError, match="custom"):
        build_model(ModelConfig(kind="bogus"), deterministic_kernels=True)


def test_custom_model_from_the_command_line_with_interpolated_sizes() -> None:
    factory = f"{{_target_: {__name__}.build_tiny_lstm_lm, vocab_size: '${{recipe.model.vocab_size}}', width: 8}}"
    cfg = compose_typed("recipe.model.kind=custom", f"++recipe.model.factory={factory}")
    model = build_model(cfg.recipe.model, deterministic_kernels=True)
    assert model(torch.randint(0, 256, (1, 4))).shape == (1, 4, 256)
