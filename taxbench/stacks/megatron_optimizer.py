"""Megatron-Core's distributed optimizer as the step the trainer drives (taxbench.stacks.step.OwnedStep), CUDA only.

With recipe.model.stack.use_distributed_optimizer=true Megatron owns the optimizer step and its state: its DDP
reduce-scatters the fp32 gradient buffers over each parameter's data-parallel group (dp for dense parameters, the
expert-data-parallel group for experts), `get_megatron_optimizer` builds one DistributedOptimizer per group (chained),
each rank steps AdamW on its shard of the fp32 main parameters (the model's bf16 parameters, with
recipe.model.stack.params_dtype=bf16, are Megatron's Float16Module's) and all-gathers the updated parameters. The
gradient norm and clipping are the optimizer's own.

What a rank holds is what is fingerprinted: its shard of the main parameters, of their gradients and of AdamW's
moments (per rank, as DeepSpeed's ZeRO partitions are). The checkpoint is Megatron's own, in its legacy `torch` format
(megatron/training/checkpointing.py): per model-parallel rank `mp_rank_TT_PPP_EEE/model_optim_rng.pt` (the chunks'
`state_dict_for_save_checkpoint` and the optimizer's `state_dict`, written by expert-data-parallel rank 0) and
`distrib_optim.pt` beside it (`save_parameter_state`: the shards gathered on data-parallel rank 0), restored by
`load_parameter_state`; the harness's extras (data position, RNG streams, steps) go per rank beside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from taxbench.checkpoint.state import extras_path
from taxbench.config.schema import ConfigError, RecipeConfig
from taxbench.parallel.layout import Layout
from taxbench.rundir.records import write_atomically
from taxbench.stacks.step import Batch, numbered_partitions

TAG = "megatron"  # <checkpoint dir>/megatron/mp_rank_.../
MODEL_FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"
# torch's AdamW (Megatron's optimizer without Apex or Transformer Engine) counts steps per parameter, in its state;
# Megatron's parameter state saves the main parameters and the moments only (FusedAdam keeps the step in its param
# groups), so the step is saved beside them and set back after the restore.
ADAM_STEPS = "taxbench_adam_steps"


def require_cuda(device: torch.device) -> None:
    """Refuse the distributed optimizer off CUDA, in one line (its buffers, reduce-scatter and gathers are CUDA's)."""
    if device.type != "cuda":
        raise ConfigError(f"recipe.model.stack.use_distributed_optimizer=true needs a CUDA GPU (Megatron's "
                          f"DistributedOptimizer shards its state in CUDA buffers); this rank's device is "
                          f"{device.type}: run it on a GPU node, or set it to false")


def optimizer_config(recipe: RecipeConfig, params_dtype: torch.dtype) -> Any:
    """Megatron's OptimizerConfig for the recipe's AdamW (lr, betas, eps, weight decay, clipping) over fp32 main
    parameters, sharded (use_distributed_optimizer)."""
    from megatron.core.optimizer import OptimizerConfig

    opt = recipe.optimizer
    bf16 = params_dtype == torch.bfloat16
    return OptimizerConfig(optimizer="adam", lr=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.beta1,
                           adam_beta2=opt.beta2, adam_eps=opt.eps, clip_grad=opt.grad_clip, bf16=bf16,
                           params_dtype=params_dtype, use_distributed_optimizer=True)


def mp_rank_dir(layout: Layout) -> str:
    """Megatron's legacy per-model-parallel-rank folder name (tensor, pipeline and expert rank)."""
    return f"mp_rank_{layout.tp_rank:02d}_{layout.pp_rank:03d}_{layout.ep_rank:03d}"


def attach_gloo_groups(optimizer: Any, full: DeviceMesh) -> None:
    """Give each chained DistributedOptimizer a gloo group over its data-parallel ranks (dense: edp x ep, experts:
    edp), which its legacy checkpoint gathers and scatters on. A collective: every rank creates every group."""
    names = list(full.mesh_dim_names or ())
    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for dims in (("edp", "ep"), ("edp",)):
        keep = [names.index(dim) for dim in dims]
        rest = [i for i in range(len(names)) if i not in keep]
        size = math.prod(full.mesh.shape[i] for i in keep)
        ranks = full.mesh.permute(*rest, *keep).reshape(-1, size).tolist()
        group, _ = dist.new_subgroups_by_enumeration(ranks, backend="gloo")
        by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), group)
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(chained, "data_parallel_group_gloo"):
            chained.data_parallel_group_gloo = by_ranks[tuple(dist.get_process_group_ranks(
                chained.data_parallel_group))]


class DistributedOptimizerStep:
    """Megatron's schedule, then its DistributedOptimizer's step, as one owned step."""

    def __init__(self, schedule: Any, ddps: list[nn.Module], optimizer: Any, layout: Layout, groups: Any,
                 device: torch.device) -> None:
        self.schedule, self.ddps, self.optimizer = schedule, ddps, optimizer
        self.layout, self.groups, self.device = layout, groups, device
        self._grads: list[torch.Tensor] = []
        for inner in self._inner():
            inner.register_step_pre_hook(self._keep_grads)

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return self._inner()

    def _inner(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers over this rank's main-parameter shards (one per chained DistributedOptimizer)."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [opt.optimizer for opt in chained if getattr(opt, "optimizer", None) is not None]

    def _keep_grads(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._grads += [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def optimize(self, batches: list[Batch], optimizer_step: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if not optimizer_step:
            raise ConfigError("Megatron's distributed optimizer reduces and clips gradients inside its step; a step "
                              "without the optimizer step is not available with "
                              "recipe.model.stack.use_distributed_optimizer=true")
        self._grads = []
        self.optimizer.zero_grad()
        loss = self.schedule.run(batches)  # reduce-scatters the gradient buffers (finalize_model_grads)
        updated, grad_norm, _ = self.optimizer.step()
        if not updated:
            raise RuntimeError("Megatron's distributed optimizer skipped its step (a non-finite gradient)")
        norm = float("nan") if grad_norm is None else float(grad_norm)
        return loss, torch.tensor(norm, dtype=torch.float32, device=self.device)

    def _shards(self) -> list[torch.Tensor]:
        return [p for inner in self._inner() for g in inner.param_groups for p in g["params"]]

    def gradients(self) -> list[torch.Tensor]:
        return list(self._grads)

    def parameters(self) -> list[torch.Tensor]:
        return self._shards()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return numbered_partitions(self.parameters())

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.gradients(), self.parameters()

    def optimizer_tensors(self) -> Iterator[torch.Tensor]:
        for inner in self._inner():
            for group in inner.param_groups:
                for param in group["params"]:
                    for _, value in sorted(inner.state.get(param, {}).items()):
                        if isinstance(value, torch.Tensor):
                            yield value

    def _steps(self) -> list[torch.Tensor | None]:
        """Each torch optimizer's step count (one for all its parameters; None before its first step)."""
        steps: list[torch.Tensor | None] = []
        for inner in self._inner():
            held = [state["step"] for state in inner.state.values() if "step" in state]
            steps.append(held[0].detach().clone() if held else None)
        return steps

    def _folder(self, directory: Path) -> Path:
        return directory / TAG / mp_rank_dir(self.layout)

    def save(self, directory: Path, extras: dict[str, Any], rank: int) -> list[Path]:
        """Megatron's legacy checkpoint of this model-parallel rank (a collective) and this rank's extras; the files
        this rank wrote."""
        folder = self._folder(directory)
        folder.mkdir(parents=True, exist_ok=True)
        files = [extras_path(directory, rank)]
        writer = self.groups.expt_dp.rank() == 0
        if writer:
            state = {"checkpoint_version": 3.0, "optimizer": self.optimizer.state_dict(), ADAM_STEPS: self._steps(),
                     **{f"model{i}" if len(self.ddps) > 1 else "model": ddp.state_dict_for_save_checkpoint()
                        for i, ddp in enumerate(self.ddps)}}
            write_atomically(folder / MODEL_FILE, lambda handle: torch.save(state, handle))
            files.append(folder / MODEL_FILE)
        self.optimizer.save_parameter_state(str(folder / OPTIMIZER_FILE))  # written where a group's dp rank is 0
        if (folder / OPTIMIZER_FILE).is_file() and writer:
            files.append(folder / OPTIMIZER_FILE)
        write_atomically(extras_path(directory, rank), lambda handle: torch.save(extras, handle))
        if dist.is_initialized():
            dist.barrier()
        return files

    @torch.no_grad()  # the main parameters of fp32 weights are views of them: copied into in place
    def load(self, directory: Path, rank: int, map_location: torch.device) -> dict[str, Any]:
        folder = self._folder(directory)
        state = torch.load(folder / MODEL_FILE, map_location=map_location, weights_only=False)
        for i, ddp in enumerate(self.ddps):
            ddp.load_state_dict(state[f"model{i}" if len(self.ddps) > 1 else "model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        for inner in self._inner():  # Megatron's parameter state holds no per-parameter step (see ADAM_STEPS)
            for held in inner.state.values():
                held.pop("step", None)
        self.optimizer.load_parameter_state(str(folder / OPTIMIZER_FILE))  # a collective over each group
        for inner, step in zip(self._inner(), state[ADAM_STEPS], strict=True):
            for param in (p for g in inner.param_groups for p in g["params"]):
                if step is not None and param in inner.state:
                    inner.state[param]["step"] = step.clone()
        extras: dict[str, Any] = torch.load(extras_path(directory, rank), map_location=map_location,
                                            weights_only=False)
        return extras
