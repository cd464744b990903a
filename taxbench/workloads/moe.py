"""Mixture-of-experts GPT in plain torch: top-k router, load-balancing aux loss, dispatch/combine, grouped experts.

Every hot spot whose fast implementation is nondeterministic has a fixed-order twin, chosen by
`PolicyConfig.deterministic_kernels`:

- router top-k: `torch.topk` (the index returned among tied scores is unspecified) vs a stable descending sort that
  breaks ties by the lower expert index;
- dispatch: a gather whose backward scatters with atomic adds - `x[index]` on CPU (backward index_put_(accumulate=
  True)), `index_select` on CUDA (backward index_add_: atomicAdd) - vs `index_select` (backward index_add_, serial on
  CPU and sort-based on CUDA under deterministic algorithms);
- combine: atomic adds of the weighted expert outputs onto the shared-expert output, as fast MoE kernels do, whose
  summation order changes run to run: `index_put_(accumulate=True)` on CPU (atomic float adds across threads with 2+
  threads and >= 32768 elements; CPU's index_add_ is serial) and `index_add_` (atomicAdd) on CUDA, where
  index_put_(accumulate=True) sorts its indices and is bitwise stable (seen on an H200, torch 2.11) - vs un-permuting
  the slots with a gather and summing each token's top-k contributions in a fixed order;
- aux loss: tokens per expert via `torch.histc` (Megatron's fast path; no deterministic CUDA kernel) vs an integer
  one-hot count, which is exact whatever the order.

With no shared expert and top_k=2 the combine adds two values onto zero, which is commutative, so the fast path is
then bitwise stable in practice; moe_tiny has a shared expert, as DeepSeek/Nemotron-style MoEs do.

Expert parallelism: `enable_expert_parallel` keeps this rank's slice of the experts and exchanges tokens with
differentiable all_to_all over the expert-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from taxbench.config.schema import ModelConfig
from taxbench.workloads.dense import GPT, MLP
from taxbench.workloads.replay import recomputing


def grouped_matmul(tokens: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """tokens [N, K] grouped by expert (counts[e] rows each, in expert order) times weight [E, K, M] -> [N, M]."""
    if tokens.is_cuda and _grouped_mm_usable(tokens):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        dtype = torch.get_autocast_dtype("cuda")
        return torch._grouped_mm(tokens.to(dtype), weight.to(dtype), offs=offsets)
    chunks = tokens.split(counts.tolist())
    return torch.cat([chunk @ weight[e].to(chunk.dtype) for e, chunk in enumerate(chunks)])


def _grouped_mm_usable(tokens: torch.Tensor) -> bool:
    """torch._grouped_mm: bf16 on Hopper or newer (under bf16 autocast, as the trainer runs bf16 recipes)."""
    return (
        hasattr(torch, "_grouped_mm")
        and torch.is_autocast_enabled("cuda")
        and torch.get_autocast_dtype("cuda") is torch.bfloat16
        and torch.cuda.get_device_capability(tokens.device) >= (9, 0)
    )


def atomic_combine(base: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """base + rows scattered onto `index` with each device's atomic adds (see the module docstring)."""
    if base.device.type == "cuda":
        return base.index_add(0, index, rows)
    return base.clone().index_put_((index,), rows, accumulate=True)


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the layer output whose backward also gives the aux loss its gradient (1 per micro-batch, as if it
    were added to the loss): under pipeline parallelism a stage's aux loss reaches its router without travelling to
    the last stage's loss (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


class GroupedExperts(nn.Module):
    """The routed experts' weights, [E, d_model, d_ff] and [E, d_ff, d_model] for this rank's E experts, applied to
    tokens grouped by expert. A module of its own, so that FSDP2 can shard it over the expert-data-parallel ranks
    while the rest of the layer shards over all data-parallel ranks (as torchtitan does)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_up = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.global_rows: tuple[int, int] | None = None  # (first expert, all experts) once a slice is kept

    def keep(self, experts: slice) -> None:
        """Keep only `experts` (expert parallelism: this rank's slice)."""
        self.global_rows = (experts.start, self.w_up.shape[0])
        self.w_up = nn.Parameter(self.w_up.detach()[experts].clone())
        self.w_down = nn.Parameter(self.w_down.detach()[experts].clone())

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(grouped_matmul(tokens, self.w_up, counts))
        return grouped_matmul(hidden, self.w_down, counts).to(tokens.dtype)


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, deterministic_kernels: bool) -> None:
        super().__init__()
        if cfg.n_experts < 1 or not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(
                f"MoE needs recipe.model.n_experts >= 1 and 1 <= top_k <= n_experts; got n_experts={cfg.n_experts}, "
                f"top_k={cfg.top_k}"
            )
        d_ff = cfg.moe_d_ff or cfg.d_ff
        self.n_experts, self.top_k, self.aux_loss_coef = cfg.n_experts, cfg.top_k, cfg.aux_loss_coef
        self.deterministic_kernels = deterministic_kernels
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, d_ff)
        self.shared = MLP(cfg.d_model, d_ff * cfg.n_shared_experts) if cfg.n_shared_experts > 0 else None
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size, self.ep_rank = 1, 0
        self.last_aux_loss: torch.Tensor | None = None
        # Pipeline stages: the aux loss flows through the backward of the layer output (see _AuxLossGradient), and
        # its value is summed over the step's micro-batches for the record.
        self.aux_loss_in_backward = False
        self.aux_loss_sum: torch.Tensor | None = None

    @property
    def local_experts(self) -> int:
        return self.experts.w_up.shape[0]

    @property
    def w_up(self) -> nn.Parameter:
        return self.experts.w_up

    @property
    def w_down(self) -> nn.Parameter:
        return self.experts.w_down

    def enable_expert_parallel(self, group: dist.ProcessGroup) -> None:
        """Keep experts [ep_rank * E/ep, (ep_rank+1) * E/ep) and exchange tokens over `group`."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.n_experts % size:
            raise ValueError(f"n_experts={self.n_experts} is not divisible by the expert-parallel size {size}")
        per_rank = self.n_experts // size
        keep = slice(rank * per_rank, (rank + 1) * per_rank)
        self.experts.keep(keep)
        self.ep_group, self.ep_size, self.ep_rank = group, size, rank

    def collectives_within(self) -> dict[str, tuple[str, list[int] | None]]:
        """For the tracing ladder (taxbench.tracing.capture.communicating_modules): under expert parallelism this
        layer's forward exchanges tokens with all-to-all over the expert-parallel group."""
        if self.ep_group is None:
            return {}
        return {"": ("all_to_all", sorted(dist.get_process_group_ranks(self.ep_group)))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n_tokens, k = tokens.shape[0], self.top_k
        probs = self.router(tokens).float().softmax(dim=-1)
        top_p, top_e = self.select_experts(probs)
        gates = (top_p / top_p.sum(dim=-1, keepdim=True)).to(tokens.dtype)
        slot_expert = top_e.reshape(-1)  # slot t*k + j: token t's j-th choice
        if self.deterministic_kernels:
            order = torch.sort(slot_expert, stable=True).indices
        else:
            order = torch.argsort(slot_expert)
        slot_token = torch.arange(n_tokens, device=x.device).repeat_interleave(k)
        dispatch_index = slot_token[order]
        if self.deterministic_kernels or tokens.device.type == "cuda":
            dispatched = tokens.index_select(0, dispatch_index)
        else:
            dispatched = tokens[dispatch_index]
        counts = torch.bincount(slot_expert, minlength=self.n_experts)
        expert_out = self._experts(dispatched, counts)
        weighted = expert_out * gates.reshape(-1)[order].unsqueeze(1)

        if self.shared is not None:
            base = self.shared(tokens).to(weighted.dtype)
        else:
            base = weighted.new_zeros(n_tokens, weighted.shape[1])
        if self.deterministic_kernels:
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            per_slot = weighted.index_select(0, inverse).view(n_tokens, k, -1)
            out = base + per_slot.sum(dim=1)
        else:
            out = atomic_combine(base, dispatch_index, weighted)
        aux_loss = self._aux_loss(probs, slot_expert)
        if not recomputing():  # activation recompute replays this forward in the backward: record the aux loss once
            self.last_aux_loss = aux_loss
            if self.aux_loss_in_backward:
                detached = aux_loss.detach()
                self.aux_loss_sum = detached if self.aux_loss_sum is None else self.aux_loss_sum + detached
        if not self.aux_loss_in_backward:
            return out.view(shape)
        return _AuxLossGradient.apply(out.view(shape), aux_loss)

    def select_experts(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (probabilities, expert ids) per token; the fixed-order path breaks ties by the lower expert id."""
        if self.deterministic_kernels:
            sorted_probs, sorted_experts = probs.sort(dim=-1, descending=True, stable=True)
            return sorted_probs[:, : self.top_k], sorted_experts[:, : self.top_k]
        return probs.topk(self.top_k, dim=-1)

    def _experts(self, dispatched: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self._local_experts(dispatched, counts)
        return self._exchange_and_run(dispatched, counts)

    def _local_experts(self, dispatched: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(dispatched, counts)

    def _exchange_and_run(self, dispatched: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each token to the rank owning its expert, run the local experts, and send the results back."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        group, size, local = self.ep_group, self.ep_size, self.local_experts
        send_counts = counts.view(size, local)  # [destination rank, its local expert]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)  # [source rank, my local expert]
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        received = all_to_all_single_autograd(dispatched, recv_splits, send_splits, group)
        # Received rows are grouped by source rank, then local expert; regroup by local expert (a fixed permutation).
        row_expert = torch.arange(local, device=counts.device).repeat(size).repeat_interleave(recv_counts.reshape(-1))
        regroup = torch.sort(row_expert, stable=True).indices
        restore = torch.empty_like(regroup)
        restore[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        local_out = self._local_experts(received.index_select(0, regroup), recv_counts.sum(dim=0))
        back = local_out.index_select(0, restore)
        return all_to_all_single_autograd(back, send_splits, recv_splits, group)

    def _aux_loss(self, probs: torch.Tensor, slot_expert: torch.Tensor) -> torch.Tensor:
        """Switch-style load balancing: coef * E * sum_e (fraction of slots routed to e) * (mean router prob of e)."""
        if self.deterministic_kernels:
            per_expert = F.one_hot(slot_expert, self.n_experts).sum(dim=0).to(probs.dtype)
        else:
            per_expert = torch.histc(slot_expert.to(probs.dtype), bins=self.n_experts, min=0, max=self.n_experts)
        fraction = per_expert / slot_expert.numel()
        return self.aux_loss_coef * self.n_experts * (fraction * probs.mean(dim=0)).sum()


class MoEGPT(GPT):
    """GPT whose feed-forward blocks are MoE layers; `aux_loss()` sums their load-balancing losses."""

    def __init__(self, cfg: ModelConfig, deterministic_kernels: bool) -> None:
        super().__init__(cfg, ffn_factory=lambda: MoEFeedForward(cfg, deterministic_kernels))

    def moe_layers(self) -> list[MoEFeedForward]:
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def aux_loss(self) -> torch.Tensor | None:
        losses = [layer.last_aux_loss for layer in self.moe_layers() if layer.last_aux_loss is not None]
        if not losses:
            return None
        total = losses[0]
        for loss in losses[1:]:  # fixed order, whatever the policy
            total = total + loss
        return total


def build_moe(cfg: ModelConfig, deterministic_kernels: bool) -> nn.Module:
    return MoEGPT(cfg, deterministic_kernels)
