"""Activation recompute (recipe.activation_checkpointing): none, full and selective train bitwise alike (RNG replayed
in the recompute), keep module names, and keep fewer activations alive for the backward (full < selective < none)."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from taxbench.config.schema import ActivationCheckpointing, ConfigError, Device, ModelConfig
from taxbench.parallel import distributed
from taxbench.parallel import recompute as ac
from taxbench.parallel.recompute import apply_activation_checkpointing
from taxbench.workloads import build_model
from taxbench.workloads.replay import recomputing

MODES = list(ActivationCheckpointing)
DENSE = ModelConfig(kind="dense", vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=4, d_ff=64)
MOE = ModelConfig(kind="moe", vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64, n_experts=4,
                  top_k=2, moe_d_ff=32, n_shared_experts=1)


class DropoutBlock(nn.Module):
    """A block whose forward draws random numbers: recompute must replay the same dropout mask."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.dropout(F.gelu(self.up(x)), p=0.5, training=True))


class DropoutNet(nn.Module):
    """Tokens -> logits with its blocks in an nn.ModuleDict keyed "0", "1", ... (as pipeline stages may hold them)."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleDict({str(i): DropoutBlock(width) for i in range(layers)})
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "dropout":
        return DropoutNet()
    return build_model(DENSE if kind == "dense" else MOE, deterministic_kernels=True, seed=0)


def _train(kind: str, mode: ActivationCheckpointing, steps: int = 3, bf16: bool = False) -> dict[str, Any]:
    """Losses, last gradients, parameters and AdamW state after `steps` steps from a fixed init and data."""
    model = _model(kind)
    apply_activation_checkpointing(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the dropout stream, the same for every mode
    losses, grads = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 17), generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1))
        aux = getattr(model, "aux_loss", None)
        if callable(aux):
            loss = loss + aux()
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    state = [v for p in model.parameters() for _, v in sorted(optimizer.state[p].items())]
    return {"loss": losses, "grads": grads, "params": [p.detach() for p in model.parameters()], "adam": state}


def _assert_bitwise_equal(left: dict[str, Any], right: dict[str, Any], what: str) -> None:
    for key in left:
        assert len(left[key]) == len(right[key])
        for i, (a, b) in enumerate(zip(left[key], right[key], strict=True)):
            assert torch.equal(a, b), f"{what}: {key}[{i}] differs"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("kind", ["dense", "moe", "dropout"])
def test_recompute_trains_bitwise_like_no_recompute(kind: str, bf16: bool) -> None:
    reference = _train(kind, ActivationCheckpointing.none, bf16=bf16)
    for mode in (ActivationCheckpointing.full, ActivationCheckpointing.selective):
        _assert_bitwise_equal(reference, _train(kind, mode, bf16=bf16), f"{kind} {mode.value} vs none")


def test_dropout_test_would_catch_a_recompute_without_rng_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dropout model is a real probe: without the RNG stash the recomputed mask differs, and so do gradients."""
    reference = _train("dropout", ActivationCheckpointing.none, steps=1)

    def no_replay(*args: Any, **kwargs: Any) -> Any:
        return torch_checkpoint(*args, **{**kwargs, "preserve_rng_state": False})

    monkeypatch.setattr(ac, "checkpoint", no_replay)
    unreplayed = _train("dropout", ActivationCheckpointing.full, steps=1)
    assert torch.equal(reference["loss"][0], unreplayed["loss"][0])  # the forward is the same...
    assert not all(torch.equal(a, b) for a, b in zip(reference["grads"], unreplayed["grads"], strict=True))


@pytest.mark.parametrize("mode", [ActivationCheckpointing.full, ActivationCheckpointing.selective])
@pytest.mark.parametrize("kind", ["dense", "moe", "dropout"])
def test_module_and_parameter_names_are_unchanged(kind: str, mode: ActivationCheckpointing) -> None:
    plain, wrapped = _model(kind), _model(kind)
    apply_activation_checkpointing(wrapped, mode)
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in plain.named_modules()]
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(ac._is_wrapped(block) for block in ac.transformer_blocks(wrapped) or [])
    apply_activation_checkpointing(wrapped, ActivationCheckpointing.none)  # none undoes the wrap
    assert not any(ac._is_wrapped(block) for block in ac.transformer_blocks(wrapped) or [])
    assert "forward" not in wrapped.state_dict() and "forward" not in dict(wrapped.named_modules())


def test_a_deep_copy_recomputes_with_its_own_parameters() -> None:
    """Pipeline stages are deep copies of the model: each copy's blocks must checkpoint themselves, not the original."""
    original = _model("dense")
    apply_activation_checkpointing(original, ActivationCheckpointing.full)
    stage = copy.deepcopy(original)
    block = stage.blocks[1]
    assert block.forward.args[0] is block
    with torch.no_grad():
        for param in block.parameters():
            param.zero_()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    stage(tokens).sum().backward()
    assert all(p.grad is not None for p in stage.parameters())
    assert all(p.grad is None for p in original.parameters())
    assert not torch.equal(stage(tokens), original(tokens))


@pytest.mark.parametrize("mode", [ActivationCheckpointing.full, ActivationCheckpointing.selective])
def test_pipeline_stages_split_after_applying_train_like_the_whole_model(mode: ActivationCheckpointing) -> None:
    """Applied once before taxbench.parallel.pipeline.split_model: each stage recomputes its own blocks, bitwise as
    none."""
    from taxbench.config.schema import ParallelConfig, RecipeConfig
    from taxbench.parallel.pipeline import split_model, stage_split

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    whole = _model("moe")
    F.cross_entropy(whole(tokens).reshape(-1, 64), tokens.reshape(-1)).backward()
    model = _model("moe")
    apply_activation_checkpointing(model, mode)
    split = stage_split(RecipeConfig(name="t", model=MOE, parallel=ParallelConfig(pp=2)), pp_rank=0)
    first, last = (split_model(model, split, stage) for stage in (0, 1))
    assert first.blocks[0].forward.args[0] is first.blocks[0] and last.blocks[1].forward.args[0] is last.blocks[1]
    hidden = first(tokens)
    F.cross_entropy(last(hidden).reshape(-1, 64), tokens.reshape(-1)).backward()
    for name, param in whole.named_parameters():
        owner = first if name.startswith(("embed", "pos", "blocks.0")) else last
        assert torch.equal(owner.get_parameter(name).grad, param.grad), name


def test_forward_hooks_inside_a_block_stay_balanced_through_the_recompute() -> None:
    """Tracing and fault injection push on a module's pre-hook and pop on its post-hook; the recompute runs to the
    block's end (no early stop), so every module entered in the backward is also left."""
    model = _model("moe")
    apply_activation_checkpointing(model, ActivationCheckpointing.full)
    calls = {"pre": 0, "post": 0}
    ffn = model.get_submodule("blocks.1.ffn")
    ffn.register_forward_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    ffn.register_forward_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(tokens).sum() + model.aux_loss()
    assert calls == {"pre": 1, "post": 1}
    loss.backward()
    assert calls == {"pre": 2, "post": 2}  # the recompute ran the whole ffn again


def test_a_model_without_blocks_is_refused_with_the_key_and_the_fix() -> None:
    model = NoBlocks()
    apply_activation_checkpointing(model, ActivationCheckpointing.none)  # nothing to do, nothing to refuse
    for mode in ("full", "selective"):
        with pytest.raises(ConfigError, match=f"recipe.activation_checkpointing={mode} .*NoBlocks.*no `blocks`"):
            apply_activation_checkpointing(model, mode)
    with pytest.raises(ConfigError, match="recipe.activation_checkpointing='sometimes' is unknown"):
        apply_activation_checkpointing(_model("dense"), "sometimes")


def test_applies_to_a_meta_device_model() -> None:
    """The preflight and the plan build models on the meta device; applying touches no tensor."""
    with torch.device("meta"):
        model = build_model(MOE, deterministic_kernels=True)
    apply_activation_checkpointing(model, ActivationCheckpointing.selective)
    assert all(ac._is_wrapped(block) for block in model.blocks)
    assert ac.activation_checkpointing_problem(model, "full") is None
    with torch.device("meta"):  # the dense GPT also runs on meta (the MoE's routing is data-dependent)
        dense = build_model(DENSE, deterministic_kernels=True)
    apply_activation_checkpointing(dense, ActivationCheckpointing.full)
    logits = dense(torch.zeros(2, DENSE.seq_len, dtype=torch.long, device="meta"))
    assert logits.shape == (2, DENSE.seq_len, DENSE.vocab_size) and logits.is_meta


def test_pipeline_placeholders_are_skipped() -> None:
    """A pipeline stage replaces the blocks it does not own with nn.Identity: nothing there to recompute."""
    model = _model("dense")
    model.blocks[0] = nn.Identity()
    apply_activation_checkpointing(model, ActivationCheckpointing.full)
    assert "forward" not in model.blocks[0].__dict__
    assert ac._is_wrapped(model.blocks[1]) and ac._is_wrapped(model.blocks[2])


# -- memory: bytes the forward leaves alive for the backward --------------------------------------------------------

class _StorageCensus(TorchDispatchMode):
    """Weak references to the storage of every tensor an op produces (params and inputs are not op outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                known = self.storages.get(storage.data_ptr())
                if known is None or known() is None:  # the allocator reuses a freed storage's address
                    self.storages[storage.data_ptr()] = weakref.ref(storage)
        return result

    def live_bytes(self) -> int:
        alive = (ref() for ref in self.storages.values())
        return sum(storage.nbytes() for storage in alive if storage is not None)


def _activation_bytes(mode: ActivationCheckpointing) -> int:
    """Bytes of the storages a forward + loss leaves alive for the backward (saved tensors, the selective cache).

    Saved-tensor hooks alone would miss what selective checkpointing keeps (its cache holds matmul outputs outside
    autograd's saved tensors), so this counts live storages instead: deterministic, a byte count and not a timing.
    """
    model = _model("dense")
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, DENSE.vocab_size, (4, DENSE.seq_len + 1), generator=torch.Generator().manual_seed(1))
    census = _StorageCensus()
    with census:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, DENSE.vocab_size), tokens[:, 1:].reshape(-1))
    del logits
    alive = census.live_bytes()
    loss.backward()  # the graph was whole: the backward still runs
    return alive


def test_recompute_keeps_fewer_activations_full_least() -> None:
    none, full, selective = (_activation_bytes(mode) for mode in MODES)
    assert full < selective < none, (full, selective, none)
    # full keeps one [batch, seq, d_model] input per block where none keeps each block's whole working set
    per_block_input = 4 * DENSE.seq_len * DENSE.d_model * 4
    assert none - full > DENSE.n_layers * 4 * per_block_input


# -- on gloo: expert parallel and FSDP2 ----------------------------------------------------------------------------

def _ep_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    distributed.init(rank, world, rank, Device.cpu, "127.0.0.1", port)
    try:
        results = {}
        for mode in MODES:
            model = _model("moe")
            for layer in model.moe_layers():
                layer.enable_expert_parallel(torch.distributed.group.WORLD)
            apply_activation_checkpointing(model, mode)
            tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
            loss = F.cross_entropy(model(tokens).reshape(-1, 64), tokens.reshape(-1)) + model.aux_loss()
            loss.backward()
            results[mode.value] = [loss.detach()] + [p.grad for p in model.parameters()]
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        distributed.shutdown()


@pytest.fixture(autouse=True)
def _deterministic_cpu() -> Iterator[None]:
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(saved)


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    distributed.init(rank, world, rank, Device.cpu, "127.0.0.1", port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = {}
        for mode in MODES:
            model = _model("dense")
            apply_activation_checkpointing(model, mode)  # before sharding, as the trainer applies it
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(3):
                tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(100 * step + rank))
                loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
            results[mode.value] = losses + [p.full_tensor() for p in model.parameters()]
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        distributed.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("worker", [_ep_worker, _fsdp_worker], ids=["expert-parallel", "fsdp2"])
def test_recompute_is_bitwise_on_gloo(worker: Any, tmp_path: Path) -> None:
    """Expert parallel: the recompute reruns the token exchange on every rank. FSDP2 (blocks sharded after the wrap):
    the recompute runs on the gathered parameters; three AdamW steps end with the parameters of none."""
    mp.start_processes(worker, args=(2, distributed.free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for mode in ("full", "selective"):
            for i, (a, b) in enumerate(zip(results["none"], results[mode], strict=True)):
                assert torch.equal(a, b), f"rank {rank}: {mode} tensor {i} differs from none"


class CountingBlock(nn.Module):
    """A block with a once-per-forward side effect, guarded by recomputing() as the MoE aux-loss sum must be."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.forwards = 0
        self.seen_recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if recomputing():
            self.seen_recompute = True
        else:
            self.forwards += 1
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("mode", [ActivationCheckpointing.full, ActivationCheckpointing.selective])
def test_recomputing_tells_a_forward_it_is_being_replayed(mode: ActivationCheckpointing) -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList([CountingBlock(8), CountingBlock(8)])
    apply_activation_checkpointing(model, mode)
    x = torch.randn(2, 8, requires_grad=True)
    for _ in range(2):
        y = x
        for block in model.blocks:
            y = block(y)
        assert not recomputing()
        y.sum().backward()
    assert [(b.forwards, b.seen_recompute) for b in model.blocks] == [(2, True), (2, True)]
    assert not recomputing()


@pytest.mark.parametrize("mode", [ActivationCheckpointing.full, ActivationCheckpointing.selective])
def test_pipeline_aux_loss_is_counted_once_under_recompute(mode: ActivationCheckpointing) -> None:
    """Pipeline stages sum each micro-batch's aux loss inside the MoE forward; a recompute must not add it again (and
    selective recompute refuses a replay that runs ops the forward did not)."""
    sums, grads = {}, {}
    for each in (ActivationCheckpointing.none, mode):
        model = _model("moe")
        for layer in model.moe_layers():
            layer.aux_loss_in_backward = True
        apply_activation_checkpointing(model, each)
        for micro_batch in range(3):
            tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(micro_batch))
            model(tokens).sum().backward()
        sums[each] = [layer.aux_loss_sum for layer in model.moe_layers()]
        grads[each] = [p.grad for p in model.parameters()]
    none = ActivationCheckpointing.none
    assert all(torch.equal(a, b) for a, b in zip(sums[none], sums[mode], strict=True)), (sums[none], sums[mode])
    assert all(torch.equal(a, b) for a, b in zip(grads[none], grads[mode], strict=True))
