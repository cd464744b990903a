#!/usr/bin/env bash
# GPU check for a lent CUDA machine: the figures we have never had first, each step under its own time limit, the
# whole default set within one device command's budget.
#
# Steps, in order of value (a cut run has the most valuable ones):
#   1. wheels: install the carried wheels (.wheels, scripts/gpu_wheels.sh) and import the image's packages
#      (scripts/gpu_image.txt), taxbench and each stack in a few seconds (scripts/gpu_imports.py); the steps of a
#      stack that does not import are skipped with the reason, never run to their limit;
#   2. each installed stack's pair under taxbench's policy (*_policy) and under its own switch (*_native), with tax
#      and gates: Megatron's MoE (and its distributed optimizer), torchtitan, DeepSpeed (its MoE at ep=2 on 2+ GPUs);
#   3. moe_tiny's tax on the GPU;  4. fp8;  5. the NCCL policies, Ring vs Tree (2+ GPUs);
#   6. `taxbench run` over torchtitan's own trainer (skipped until `python -m taxbench run --help` documents it), and
#      over Megatron-LM's own pretrain_gpt.py (a tiny GPT on mock data, `--deterministic-mode` as the deterministic
#      arm's edit), only where MEGATRON_LM names a Megatron-LM checkout (the megatron-core wheel has no
#      pretrain_gpt.py and the GPU box reaches no network): neither has run on a GPU yet;
#   7. what has run on a GPU before (megatron_gpt, the CUDA tests, interleave=policy, the planted tax, the op scan).
# The plan is printed first, `planned device time: N s` (the steps' limits and the device check); the default set is
# what fits GPU_CHECK_BUDGET (default 600 s, one device command) in this order, every other step is listed as over
# the budget. GPU_STEPS="a b ..." plans only the named steps (any budget, said when over it).
# After every step $OUT/gpu_table.md is rewritten (the device, and per step its status, seconds, tax and gates:
# scripts/gpu_table.py); $OUT/steps.txt has one line per finished step and a rerun with the same OUT skips the steps
# that passed there (a cut run goes on). Exit 1 if any step failed.
# GPU_CHECK_DRY=1 prints the plan (every stack taken as installed, GPU_CHECK_GPUS GPUs, default 1) and writes nothing
# a real run reads; it needs no GPU (tests/test_gpu_scripts.py runs it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/taxbench-gpu}
DRY=${GPU_CHECK_DRY:-}
BUDGET=${GPU_CHECK_BUDGET:-600}
DEVICE_S=25  # the CUDA check and nvidia-smi before the first step, the table written after each step
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=0

if [ -n "$DRY" ]; then
    GPUS=${GPU_CHECK_GPUS:-1}
else
    mkdir -p "$OUT"
    $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.cuda.get_device_name(), \
'x', torch.cuda.device_count(), '- torch', torch.__version__, 'CUDA', torch.version.cuda)" >"$OUT/device.txt" \
        || { cat "$OUT/device.txt"; exit 1; }
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n1 \
        | sed 's/^/driver: /' >>"$OUT/device.txt"
    cat "$OUT/device.txt"
    GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
fi

# ------------------------------------------------------------------------------------------------------- the plan
names=() limits=() needs=() commands=() notes=()
planned=$DEVICE_S

passed_before() {  # passed_before NAME: whether $OUT/steps.txt records NAME with rc=0 (a real run resumes)
    [ -z "$DRY" ] && [ -f "$OUT/steps.txt" ] && grep -qE "^$1 +rc=0 " "$OUT/steps.txt"
}

plan() {  # plan NAME LIMIT_S NEEDS COMMAND...: a step in order of value; NEEDS is the stack it imports, or -
    local name=$1 limit=$2 need=$3
    shift 3
    if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $name "* ]]; then return 0; fi
    if passed_before "$name"; then notes+=("skip $name: passed in an earlier run ($OUT/steps.txt)"); return 0; fi
    if [ -z "${GPU_STEPS:-}" ] && [ $((planned + limit)) -gt "$BUDGET" ]; then
        notes+=("skip $name: over the ${BUDGET} s budget (${limit} s; GPU_STEPS=$name runs it)")
        return 0
    fi
    names+=("$name"); limits+=("$limit"); needs+=("$need"); commands+=("$(printf '%q ' "$@")")
    planned=$((planned + limit))
}

not_here() {  # not_here NAME WHY: a step this machine cannot run, said in the plan
    if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $1 "* ]]; then return 0; fi
    notes+=("skip $1: $2")
}

EXP=(cluster=inprocess cluster.device=cuda cluster.gpus=1 experiment.out_dir="$OUT/runs" report.wandb=false)
EXP2=(cluster=local cluster.device=cuda cluster.gpus=2 experiment.out_dir="$OUT/runs" report.wandb=false)
# Short pairs: 24 steps per run, 6-step blocks, restart replay from step 12.
SHORT=(experiment.steps=24 experiment.block_steps=6 experiment.warmup_steps=4 experiment.resume_step=12)
NATIVE=mode@arms.deterministic=stack_native
TB=("$PY" -m taxbench)

# 1. the wheels, checked before anything else spends the budget
if [ -d .wheels ] || [ -n "$DRY" ]; then  # the dry plan is the device run's, which carries .wheels
    # --no-deps: .wheels holds what each stack's import needs beyond the image, not its whole declared tree.
    # Its exit code is the imports' (1: taxbench does not import); a failed install shows as what is missing.
    plan wheels 60 - bash -c "($PY -m pip install -q --no-index --no-deps .wheels/*.whl && \
$PY -m pip install -q --no-deps --no-build-isolation -e .); $PY scripts/gpu_imports.py $OUT/imports.txt"
else
    plan wheels 120 - bash -c "$PY -m pip install -q -e '.[dev]'; $PY scripts/gpu_imports.py $OUT/imports.txt"
fi
# 2. every installed stack's pair, under taxbench's policy and under its own switch: never run on a GPU yet
MOE=(+recipe=megatron_moe_debug)
plan megatron_moe_policy 55 megatron "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${MOE[@]}" experiment.name=megatron_moe_policy
plan megatron_moe_native 55 megatron "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${MOE[@]}" "$NATIVE" \
    experiment.name=megatron_moe_native
# Megatron's DistributedOptimizer with bf16 parameters (the seed's recipe as NVIDIA runs it): its own step, state
# and checkpoint; the restart gate checks its save and restore.
plan megatron_moe_distopt 55 megatron "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${MOE[@]}" \
    +recipe.model.stack.use_distributed_optimizer=true +recipe.model.stack.params_dtype=bf16 \
    experiment.name=megatron_moe_distopt
# torchtitan with its FlexAttention (compiled on first use: a longer limit)
TITAN=(+recipe=titan_llama3_debug recipe.model.stack.attn_backend=flex)
plan titan_llama3_policy 70 titan "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${TITAN[@]}" experiment.name=titan_llama3_policy
plan titan_llama3_native 70 titan "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${TITAN[@]}" "$NATIVE" \
    experiment.name=titan_llama3_native
# DeepSpeed ZeRO-3, dense: one rank is a world of one (its partitions are whole)
DS=(+recipe=deepspeed_dense_debug)
plan deepspeed_dense_policy 45 deepspeed "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${DS[@]}" \
    experiment.name=deepspeed_dense_policy
plan deepspeed_dense_native 45 deepspeed "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${DS[@]}" "$NATIVE" \
    experiment.name=deepspeed_dense_native
if [ "$GPUS" -ge 2 ]; then  # ZeRO-2 with DeepSpeed's MoE layer at ep=2: two ranks
    DSMOE=(+recipe=deepspeed_moe_debug)
    plan deepspeed_moe_policy 70 deepspeed "${TB[@]}" "${EXP2[@]}" "${SHORT[@]}" "${DSMOE[@]}" \
        experiment.name=deepspeed_moe_policy
    plan deepspeed_moe_native 70 deepspeed "${TB[@]}" "${EXP2[@]}" "${SHORT[@]}" "${DSMOE[@]}" "$NATIVE" \
        experiment.name=deepspeed_moe_native
else
    not_here deepspeed_moe_policy "fewer than 2 GPUs (its ep=2 needs 2 ranks); deepspeed_moe_native neither"
fi
# 3. moe_tiny's tax on the GPU (taxbench's own stack, bf16)
plan moe_tiny_bf16 40 - "${TB[@]}" "${EXP[@]}" +recipe=moe_tiny recipe.precision=bf16 experiment.name=moe_tiny_bf16
# 4. fp8 (torchao's float8 linears, compute capability 8.9+) on taxbench's dense GPT, widened to float8's shapes
FP8=(recipe.precision=fp8 recipe.model.d_model=128 recipe.model.d_ff=512)
plan fp8_policy 40 fp8 "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${FP8[@]}" experiment.name=fp8_policy
plan fp8_native 40 fp8 "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" "${FP8[@]}" "$NATIVE" experiment.name=fp8_native
# 5. the two NCCL policies against one baseline: Megatron's Ring and torchtitan's pinned Tree, one sweep point each
# (NCCL_DEBUG_SUBSYS=ENV logs each NCCL_* value it read, per arm). NCCL runs no collective on one rank.
if [ "$GPUS" -ge 2 ]; then
    plan nccl_policies 150 - env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV "${TB[@]}" -m cluster.device=cuda \
        cluster.gpus=2 experiment.out_dir="$OUT/runs" report.wandb=false +recipe=moe_tiny \
        'mode@arms.deterministic=deterministic,deterministic_tree' experiment.name=nccl_policies
else
    not_here nccl_policies "fewer than 2 GPUs (one rank runs no NCCL collective)"
fi
# 6. torchtitan's own trainer, unchanged, as each run of a pair (`taxbench run [overrides] -- COMMAND`)
run_available() {  # whether `python -m taxbench run --help` documents the subcommand (not the general help)
    "$PY" -m taxbench run --help 2>/dev/null | head -n 3 | grep -q "taxbench run"
}
# Before the wheels step a real run may not import taxbench yet: then the step is planned and checked after it.
if run_available || { [ -z "$DRY" ] && ! "$PY" -c "import taxbench.cli" 2>/dev/null; }; then
    plan titan_run 90 run:titan "${TB[@]}" run cluster.device=cuda cluster.gpus=1 experiment.out_dir="$OUT/runs" \
        report.wandb=false experiment.name=titan_run -- "$PY" -m torch.distributed.run --nproc-per-node 1 \
        -m torchtitan.train --module llama3 --config llama3_debugmodel --training.steps 24 \
        --training.disable_cuda_graphs
else
    not_here titan_run "taxbench run not available"
fi
# Megatron-LM's own entry point, as its determinism check runs it: a 2-layer GPT, mock data, 24 iterations, no eval.
MEGATRON_LM=${MEGATRON_LM:-}
if [ -n "$MEGATRON_LM" ] && { [ -n "$DRY" ] || [ -f "$MEGATRON_LM/pretrain_gpt.py" ]; }; then
    plan megatron_run 120 run:megatron env PYTHONPATH="$MEGATRON_LM" "${TB[@]}" run cluster.device=cuda \
        cluster.gpus=1 experiment.out_dir="$OUT/runs" report.wandb=false experiment.name=megatron_run \
        'run.deterministic.args=[--deterministic-mode]' -- "$PY" -m torch.distributed.run --nproc-per-node 1 \
        "$MEGATRON_LM/pretrain_gpt.py" --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 \
        --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 2 --train-iters 24 --lr 1e-4 \
        --lr-decay-style constant --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --bf16 \
        --eval-iters 0 --eval-interval 1000 --log-interval 1 --no-gradient-accumulation-fusion --seed 1234
else
    not_here megatron_run "no Megatron-LM checkout (MEGATRON_LM=<a folder with pretrain_gpt.py>, carried to the box)"
fi
# 7. what an H200 ran on 2026-12-04 (docs/stacks.md "On a GPU"): again where the budget allows
plan megatron_gpt_policy 60 megatron "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" +recipe=megatron_gpt_debug \
    experiment.name=megatron_gpt_policy
plan megatron_gpt_native 60 megatron "${TB[@]}" "${EXP[@]}" "${SHORT[@]}" +recipe=megatron_gpt_debug "$NATIVE" \
    experiment.name=megatron_gpt_native
plan interleave_policy 90 - "${TB[@]}" "${EXP[@]}" +recipe=moe_tiny experiment.interleave=policy \
    experiment.name=interleave_policy
plan planted_5pct 150 - "${TB[@]}" "${EXP[@]}" experiment.calibration=true experiment.planted_tax=0.05 \
    experiment.steps=240 experiment.name=planted_5pct
plan pytest_gpu 200 - "$PY" -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu.py tests/test_attribution.py
plan scan_moe_tiny 120 - "${TB[@]}" scan +recipe=moe_tiny cluster.device=cuda cluster.gpus=1 \
    scan.out="$OUT/scan_moe_tiny.json"
plan megatron_tests 200 megatron "$PY" -m pytest -v -p no:cacheprovider tests/test_megatron.py

echo "planned device time: $planned s (${#names[@]} steps' limits, ${DEVICE_S} s for the device check and tables;" \
    "budget $BUDGET s, $GPUS GPU(s))"
[ "$planned" -le "$BUDGET" ] || echo "over the budget: GPU_STEPS names more than $BUDGET s of limits"
for i in "${!names[@]}"; do
    printf 'step %s %ss: %s\n' "${names[$i]}" "${limits[$i]}" "${commands[$i]}"
done
printf '%s\n' "${notes[@]}"
[ -n "$DRY" ] && exit 0

# ----------------------------------------------------------------------------------------------------- the steps
record() {  # record LINE: one finished (or skipped) step in steps.txt, and the table rewritten
    echo "$1" | tee -a "$OUT/steps.txt"
    "$PY" scripts/gpu_table.py "$OUT" || true
}
for note in "${notes[@]}"; do
    [[ $note == *"passed in an earlier run"* ]] || echo "$note" >>"$OUT/steps.txt"
done
"$PY" scripts/gpu_table.py "$OUT" || true
taxbench_ok=1
for i in "${!names[@]}"; do
    name=${names[$i]} limit=${limits[$i]} need=${needs[$i]}
    if [ "$taxbench_ok" = 0 ]; then record "skip $name: taxbench does not import (see wheels.log)"; continue; fi
    if [[ $need == run:* ]]; then  # `taxbench run` over a stack's own command
        run_available || { record "skip $name: taxbench run not available"; continue; }
        need=${need#run:}
    fi
    if [ "$need" != - ] && [ -f "$OUT/imports.txt" ] && ! grep -q "^$need ok" "$OUT/imports.txt"; then
        record "skip $name: stack $(grep "^$need " "$OUT/imports.txt" || echo "$need not checked")"
        continue
    fi
    start=$SECONDS
    eval "timeout $limit ${commands[$i]}" >"$OUT/$name.log" 2>&1
    rc=$?
    record "$(printf '%-22s rc=%-3s %4ss limit=%ss' "$name" "$rc" "$((SECONDS - start))" "$limit")"
    if [ "$rc" -ne 0 ]; then
        failed=1
        tail -n 25 "$OUT/$name.log"
        [ "$name" = wheels ] && taxbench_ok=0
    fi
    [ "$name" = nccl_policies ] && grep -h "set by environment to" "$OUT/nccl_policies.log" 2>/dev/null | sed 's/.*NCCL INFO //' \
        | sort | uniq -c
done
cat "$OUT/gpu_table.md"
exit $failed
