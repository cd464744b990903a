#!/usr/bin/env bash
# GPU check for a machine with CUDA (e.g. a lent H200): install, run the CUDA tests, then short GPU experiments.
# Each step has its own time limit and the script goes on past a failed step, so one run reports every step; it
# exits 1 if any step failed. Logs go under ${OUT:-/tmp/taxbench-gpu}; step results in $OUT/steps.txt.
# GPU_STEPS="install megatron_gpt_policy ..." runs only the named steps (a short lease: the never-run ones first);
# GPU_STEPS=stacks is the install and every stack's pair under its own switch and taxbench's policy, plus fp8
# (estimated 6-10 minutes on one H200, close to a 10-minute device command: steps.txt keeps each finished step, so a
# cut run can go on with GPU_STEPS naming the rest; none of these steps has run on a GPU yet).
# GPU_CHECK_DRY=1 prints each step (name, limit, command) instead of running it, every stack taken as installed and
# GPU_CHECK_GPUS (default 1) as the GPU count; it needs no GPU (tests/test_gpu_scripts.py runs it).
# Offline machines: put wheels of the dependencies the machine lacks in .wheels/ (scripts/gpu_wheels.sh makes them).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/taxbench-gpu}
DRY=${GPU_CHECK_DRY:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=0
STACK_STEPS="install deepspeed_dense_policy deepspeed_dense_native deepspeed_moe_policy deepspeed_moe_native"
STACK_STEPS+=" titan_llama3_policy titan_llama3_native megatron_gpt_policy megatron_gpt_native"
STACK_STEPS+=" megatron_moe_policy megatron_moe_native fp8_policy fp8_native"
[ "${GPU_STEPS:-}" = stacks ] && GPU_STEPS=$STACK_STEPS

step() {  # step NAME LIMIT_S COMMAND...: run one step, log it, record rc and seconds (rc in $step_rc)
    local name=$1 limit=$2
    shift 2
    step_rc=0
    if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $name "* ]]; then return 0; fi
    if [ -n "$DRY" ]; then printf 'step %s %ss: %s\n' "$name" "$limit" "$*"; return 0; fi
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    step_rc=$?
    printf '%-22s rc=%-3s %4ss\n' "$name" "$step_rc" "$((SECONDS - start))" | tee -a "$OUT/steps.txt"
    [ "$step_rc" -eq 0 ] || { failed=1; tail -n 25 "$OUT/$name.log"; }
}

has() {  # has MODULE: whether the stack's import works here (always in the dry mode)
    [ -n "$DRY" ] || $PY -c "import $1" 2>"$OUT/import_$1.err"
}

skip() {  # skip MESSAGE: a step that cannot run on this machine, said in the step results
    echo "$1" | tee -a "$OUT/steps.txt"
}

if [ -n "$DRY" ]; then
    GPUS=${GPU_CHECK_GPUS:-1}
else
    $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())" \
        || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
fi
if [ -d .wheels ]; then
    # --no-deps: .wheels holds what each stack's import needs beyond the image, not its whole declared tree.
    step install 120 bash -c "$PY -m pip install -q --no-index --no-deps .wheels/*.whl && \
        $PY -m pip install -q --no-deps --no-build-isolation -e ."
else
    step install 120 "$PY" -m pip install -q -e ".[dev]"
fi

EXP=(cluster=inprocess cluster.device=cuda cluster.gpus=1 experiment.out_dir="$OUT/runs" report.wandb=false)
step pytest_gpu 200 "$PY" -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu.py tests/test_attribution.py
step moe_tiny_bf16 90 "$PY" -m taxbench "${EXP[@]}" +recipe=moe_tiny recipe.precision=bf16 experiment.name=moe_tiny_gpu
# The tax timed on one model, lanes switching policy per block (moe_1t's default mode).
step interleave_policy 90 "$PY" -m taxbench "${EXP[@]}" +recipe=moe_tiny experiment.interleave=policy \
    experiment.name=interleave_policy_gpu
# The calibrated instrument on GPU: a planted 5% tax on an A/A pair (spin kernel, CUDA event times).
step planted_5pct 150 "$PY" -m taxbench "${EXP[@]}" experiment.calibration=true experiment.planted_tax=0.05 \
    experiment.steps=240 experiment.name=planted_gpu
# The two NCCL policies against one baseline (docs/configuration.md): Megatron's Ring and torchtitan's pinned Tree
# all-reduce, one sweep point each. NCCL runs no collective on one rank, so this needs 2 GPUs; never run yet.
if [ "$GPUS" -ge 2 ]; then
    # NCCL_DEBUG_SUBSYS=ENV: NCCL logs each NCCL_* value it read ("NCCL_ALGO set by environment to ..."), per arm.
    step nccl_policies 300 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV "$PY" -m taxbench -m cluster.device=cuda cluster.gpus=2 experiment.out_dir="$OUT/runs" \
        report.wandb=false +recipe=moe_tiny 'mode@arms.deterministic=deterministic,deterministic_tree' \
        experiment.name=nccl_policies_gpu
    [ -n "$DRY" ] || [ ! -f "$OUT/nccl_policies.log" ] || grep -h "set by environment to" "$OUT/nccl_policies.log" | sed 's/.*NCCL INFO //' | sort | uniq -c
else
    skip "fewer than 2 GPUs: nccl_policies not run (one rank runs no NCCL collective)"
fi
# The op repeat scan on CUDA: the baseline's atomic MoE ops (index_add_ in combine and dispatch backward) named, the
# deterministic policy clean (exit 0).
step scan_moe_tiny 120 "$PY" -m taxbench scan +recipe=moe_tiny cluster.device=cuda cluster.gpus=1 \
    scan.out="$OUT/scan_moe_tiny.json"
# Every stack's pair (issue 32), each under taxbench's policy (*_policy) and under the stack's own switch alone
# (*_native: mode@arms.deterministic=stack_native; the run prints the audit of what taxbench's policy would add).
# Short runs: 24 steps, restart replay from step 12. None of these steps has run on a GPU yet.
SHORT=(experiment.steps=24 experiment.block_steps=6 experiment.warmup_steps=4 experiment.resume_step=12)
NATIVE=mode@arms.deterministic=stack_native
if has deepspeed; then
    # ZeRO-3, dense: one rank is a world of one (its partitions are whole).
    step deepspeed_dense_policy 180 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" +recipe=deepspeed_dense_debug \
        experiment.name=deepspeed_dense_gpu
    step deepspeed_dense_native 180 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" +recipe=deepspeed_dense_debug \
        "$NATIVE" experiment.name=deepspeed_dense_native_gpu
    # ZeRO-2 with DeepSpeed's MoE layer at ep=2: two ranks, so two GPUs.
    if [ "$GPUS" -ge 2 ]; then
        EXP2=(cluster=local cluster.device=cuda cluster.gpus=2 experiment.out_dir="$OUT/runs" report.wandb=false)
        step deepspeed_moe_policy 150 "$PY" -m taxbench "${EXP2[@]}" "${SHORT[@]}" +recipe=deepspeed_moe_debug \
            experiment.name=deepspeed_moe_gpu
        step deepspeed_moe_native 150 "$PY" -m taxbench "${EXP2[@]}" "${SHORT[@]}" +recipe=deepspeed_moe_debug \
            "$NATIVE" experiment.name=deepspeed_moe_native_gpu
    else
        skip "fewer than 2 GPUs: deepspeed_moe_policy and deepspeed_moe_native not run (its ep=2 needs 2 ranks)"
    fi
else
    skip "deepspeed not installed: deepspeed_dense_* and deepspeed_moe_* not run ($(tail -n1 "$OUT/import_deepspeed.err"))"
fi
# torchtitan with its FlexAttention, under its own switch (debug.deterministic) and under taxbench's policy.
if has torchtitan.trainer; then
    TITAN=(+recipe=titan_llama3_debug recipe.model.stack.attn_backend=flex)
    step titan_llama3_policy 180 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" "${TITAN[@]}" experiment.name=titan_gpu
    step titan_llama3_native 180 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" "${TITAN[@]}" "$NATIVE" \
        experiment.name=titan_native_gpu
else
    skip "torchtitan not installed: titan_llama3_* not run ($(tail -n1 "$OUT/import_torchtitan.trainer.err"))"
fi
# Megatron-Core's GPTModel pair and its MoE layers (top-2 of 4, allgather dispatcher, sequential experts) on one GPU;
# its tests: the host contract and the gpu end-to-end.
if has megatron.core; then
    step megatron_tests 200 "$PY" -m pytest -v -p no:cacheprovider tests/test_megatron.py
    step megatron_gpt_policy 150 "$PY" -m taxbench "${EXP[@]}" +recipe=megatron_gpt_debug experiment.name=megatron_gpu
    step megatron_gpt_native 120 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" +recipe=megatron_gpt_debug \
        "$NATIVE" experiment.name=megatron_native_gpu
    step megatron_moe_policy 150 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" +recipe=megatron_moe_debug \
        experiment.name=megatron_moe_gpu
    step megatron_moe_native 150 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" +recipe=megatron_moe_debug \
        "$NATIVE" experiment.name=megatron_moe_native_gpu
else
    skip "megatron-core not installed: megatron_* not run ($(tail -n1 "$OUT/import_megatron.core.err"))"
fi
# fp8 (recipe.precision=fp8: torchao's float8 linears, compute capability 8.9+) on taxbench's own dense GPT, widened
# so that the linears take float8's shapes; under taxbench's policy and under its own stack's switch.
if has torchao; then
    FP8=(recipe.precision=fp8 recipe.model.d_model=128 recipe.model.d_ff=512)
    step fp8_policy 120 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" "${FP8[@]}" experiment.name=fp8_gpu
    step fp8_native 120 "$PY" -m taxbench "${EXP[@]}" "${SHORT[@]}" "${FP8[@]}" "$NATIVE" \
        experiment.name=fp8_native_gpu
else
    skip "torchao not installed: fp8_policy and fp8_native not run ($(tail -n1 "$OUT/import_torchao.err"))"
fi
[ -n "$DRY" ] && exit 0
grep -h -E "tax|deterministic:|planted|audit" "$OUT"/moe_tiny_bf16.log "$OUT"/interleave_policy.log \
    "$OUT"/planted_5pct.log "$OUT"/nccl_policies.log "$OUT"/*_policy.log "$OUT"/*_native.log 2>/dev/null | head -80
exit $failed
