"""What a planned experiment costs in device time, before anything runs: its runs and steps (taxbench.design), the
wall clock those steps take from the recipe's model FLOPs at an assumed MFU (cluster.planned_mfu), the GPU-hours, and
the share of them that is timed.

Model FLOPs per token are counted as PaLM's appendix B does: 6 N + 12 L s d, N the parameters a token passes through
(the routed experts' top_k share, not the embedding tables, whose lookup is no matmul), L layers, s the sequence
length, d the model width (attention's scores and weighted sum, forward and backward, without the causal half).
Activation recompute is not counted (MFU's usual definition), so the MFU assumed is the one a recompute recipe reaches
on that count. Not counted in the wall clock: startup, checkpoint commits, the restart of the resumed run, analysis.
"""

from __future__ import annotations

from dataclasses import dataclass

from taxbench.config.schema import ModelConfig, ModelKind, Precision, RecipeConfig, TaxbenchConfig
from taxbench.design import ExperimentSteps, experiment_steps

# Dense peak TFLOP/s per GPU (no sparsity) by precision: the vendors' datasheets (SXM parts). fp32 steps are held to
# the TF32 tensor-core peak, which is what fp32 matmuls reach with TF32 on (the baseline's setting).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp32": 494.0},
    "H100": {"bf16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "B200": {"bf16": 2250.0, "fp32": 1100.0},
}
PLANNED_GPU = "H100"  # the GPU a plan is costed on unless cluster.peak_tflops says otherwise


def peak_key(precision: Precision) -> str:
    """The peak a recipe's steps are held to: fp8 recipes to the dense bf16 peak (as torchtitan does: only their
    linears run in float8)."""
    return "bf16" if precision in (Precision.bf16, Precision.fp8) else "fp32"


def lookup_elements(model: ModelConfig) -> int:
    """Elements of the embedding tables a token reads by lookup (no FLOPs): the token table, and the learned position
    table where the model has one (Megatron's default is RoPE)."""
    learned = str(model.kind) != ModelKind.megatron.value or model.stack.get("position_embedding_type") == \
        "learned_absolute"
    return model.vocab_size * model.d_model + (model.seq_len * model.d_model if learned else 0)


def model_flops_per_token(model: ModelConfig, active_params: int) -> float:
    """PaLM's 6 N + 12 L s d (see the module docstring); `active_params` counts the embedding tables, taken out here."""
    return 6.0 * (active_params - lookup_elements(model)) + 12.0 * model.n_layers * model.seq_len * model.d_model


@dataclass(frozen=True)
class GpuHours:
    gpus: int
    steps: ExperimentSteps
    max_per_run: int  # the most steps a timed run may take (experiment.max_steps with a precision target)
    flops_per_step: float  # model FLOPs of one step of the whole job
    peak_flops: float  # per GPU
    peak_source: str
    mfu: float  # assumed (cluster.planned_mfu)

    @property
    def step_s(self) -> float:
        return self.flops_per_step / (self.gpus * self.peak_flops * self.mfu)

    @property
    def wall_s(self) -> float:
        return self.steps.total * self.step_s

    @property
    def gpu_hours(self) -> float:
        return self.wall_s * self.gpus / 3600.0

    @property
    def timed_share(self) -> float:
        return self.steps.timed / self.steps.total if self.steps.total else 0.0

    def at_most(self, cfg: TaxbenchConfig) -> GpuHours | None:
        """The same experiment at its cap, where a precision target may add rounds (None: it runs exactly its steps)."""
        if self.max_per_run <= self.steps.per_run:
            return None
        return GpuHours(self.gpus, experiment_steps(cfg, self.max_per_run), self.max_per_run, self.flops_per_step,
                        self.peak_flops, self.peak_source, self.mfu)


def gpu_hours(cfg: TaxbenchConfig, active_params: int, max_per_run: int,
              steps: ExperimentSteps | None = None) -> GpuHours:
    """The experiment as configured on cluster.gpus GPUs (`active_params`: the plan's count, embeddings included;
    `steps`: other runs of its recipe than the experiment's, e.g. `taxbench layouts`' repeats)."""
    recipe: RecipeConfig = cfg.recipe
    key = peak_key(recipe.precision)
    if cfg.cluster.peak_tflops > 0:
        peak, source = cfg.cluster.peak_tflops * 1e12, "cluster.peak_tflops"
    else:
        peak, source = PEAK_TFLOPS[PLANNED_GPU][key] * 1e12, f"{PLANNED_GPU} {key} datasheet peak"
    tokens = recipe.global_batch_size * recipe.model.seq_len
    flops = model_flops_per_token(recipe.model, active_params) * tokens
    return GpuHours(cfg.cluster.gpus, steps or experiment_steps(cfg), max_per_run, flops, peak, source,
                    cfg.cluster.planned_mfu)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def render_gpu_hours(hours: GpuHours, cfg: TaxbenchConfig) -> list[str]:
    """The plan's cost lines: runs and steps, wall clock and GPU-hours, the timed share, and what they assume."""
    s = hours.steps
    lines = [
        f"cost: {s.runs} runs, {s.total:,} steps in all ({s.timed_runs} timed runs x {s.per_run} steps in the "
        f"interleaved rounds, {s.gate_runs} runs after them x {s.gate_steps}"
        + (f", {s.profile_runs} profile runs x {s.profile_steps}" if s.profile_runs else "") + ")",
        f"  {hours.flops_per_step:.3g} model FLOPs per step -> {hours.step_s:.2f} s per step on {hours.gpus} GPUs, "
        f"{_duration(hours.wall_s)} of steps, {hours.gpu_hours:,.0f} GPU-hours",
        f"  timed: {s.timed:,} of {s.total:,} steps ({hours.timed_share:.0%} of the GPU-hours), {s.in_tax:,} of them "
        f"after warmup in the tax",
    ]
    most = hours.at_most(cfg)
    if most is not None:
        lines.append(f"  experiment.target_half_width={cfg.experiment.target_half_width} may add rounds up to "
                     f"{most.max_per_run} steps per timed run: at most {most.steps.total:,} steps, "
                     f"{_duration(most.wall_s)}, {most.gpu_hours:,.0f} GPU-hours")
    lines.append(f"  assumes: MFU {hours.mfu:.0%} (cluster.planned_mfu, an assumption: set it to what this recipe "
                 f"reaches on your cluster) of the {hours.peak_source}, {hours.peak_flops / 1e12:.0f} TFLOP/s per GPU; "
                 "6N + 12 L s d model FLOPs per token (no recompute); startup, checkpoints, restarts not counted")
    return lines


def render_total(what: str, steps: list[ExperimentSteps], hours: list[GpuHours | None], on_gpu: bool) -> str:
    """One line for several launches (`taxbench stacks`' cells, `taxbench layouts`' layouts): their runs and steps,
    the timed share, and on GPUs their GPU-hours at the assumed MFU (None: a model the planner does not count)."""
    runs, total, timed = sum(s.runs for s in steps), sum(s.total for s in steps), sum(s.timed for s in steps)
    line = f"{what}: {runs} runs, {total:,} steps in all, {timed:,} timed ({timed / total if total else 0:.0%})"
    if not on_gpu:
        return line + "; GPU-hours do not apply on CPU"
    counted = [h for h in hours if h is not None]
    if not counted:
        return line + "; GPU-hours: no model here is counted by the planner"
    mfu = counted[0].mfu
    missing = len(hours) - len(counted)
    return (line + f"; {sum(h.gpu_hours for h in counted):.3g} GPU-hours of steps at an assumed MFU of {mfu:.0%} "
            f"(cluster.planned_mfu)" + (f", {missing} not counted" if missing else ""))
