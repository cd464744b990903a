#!/usr/bin/env bash
# GPU check for a machine with CUDA (e.g. a lent H200): install, run the CUDA tests, then short GPU experiments.
# Each step has its own time limit and the script goes on past a failed step, so one run reports every step; it
# exits 1 if any step failed. Logs go under ${OUT:-/tmp/taxbench-gpu}; step results in $OUT/steps.txt.
# GPU_STEPS="install megatron_tests ..." runs only the named steps (a short lease: the never-run ones first).
# Offline machines: put wheels of the dependencies the machine lacks in .wheels/ (scripts/gpu_wheels.sh makes them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/taxbench-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=0

step() {  # step NAME LIMIT_S COMMAND...: run one step, log it, record rc and seconds
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $name "* ]]; then return 0; fi
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$OUT/steps.txt"
    [ "$rc" -eq 0 ] || { failed=1; tail -n 25 "$OUT/$name.log"; }
}

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())" \
    || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ -d .wheels ]; then
    step install 120 bash -c "$PY -m pip install -q --no-index --find-links .wheels .wheels/*.whl && \
        $PY -m pip install -q --no-deps --no-build-isolation -e ."
else
    step install 120 $PY -m pip install -q -e ".[dev]"
fi

EXP=(cluster=inprocess cluster.device=cuda cluster.gpus=1 experiment.out_dir="$OUT/runs" report.wandb=false)
step pytest_gpu 200 $PY -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu.py tests/test_attribution.py
step moe_tiny_bf16 90 $PY -m taxbench "${EXP[@]}" +recipe=moe_tiny recipe.precision=bf16 experiment.name=moe_tiny_gpu
# The tax timed on one model, lanes switching policy per block (moe_1t's default mode).
step interleave_policy 90 $PY -m taxbench "${EXP[@]}" +recipe=moe_tiny experiment.interleave=policy \
    experiment.name=interleave_policy_gpu
# The calibrated instrument on GPU: a planted 5% tax on an A/A pair (spin kernel, CUDA event times).
step planted_5pct 150 $PY -m taxbench "${EXP[@]}" experiment.calibration=true experiment.planted_tax=0.05 \
    experiment.steps=240 experiment.name=planted_gpu
# The two NCCL policies against one baseline (docs/configuration.md): Megatron's Ring and torchtitan's pinned Tree
# all-reduce, one sweep point each. NCCL runs no collective on one rank, so this needs 2 GPUs; never run yet.
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    # NCCL_DEBUG_SUBSYS=ENV: NCCL logs each NCCL_* value it read ("NCCL_ALGO set by environment to ..."), per arm.
    step nccl_policies 300 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ENV $PY -m taxbench -m cluster.device=cuda cluster.gpus=2 experiment.out_dir="$OUT/runs" \
        report.wandb=false +recipe=moe_tiny 'mode@arms.deterministic=deterministic,deterministic_tree' \
        experiment.name=nccl_policies_gpu
    grep -h "set by environment to" "$OUT/nccl_policies.log" | sed 's/.*NCCL INFO //' | sort | uniq -c
else
    echo "fewer than 2 GPUs: nccl_policies not run (one rank runs no NCCL collective)" | tee -a "$OUT/steps.txt"
fi
# The op repeat scan on CUDA: the baseline's atomic MoE ops (index_add_ in combine and dispatch backward) named, the
# deterministic policy clean (exit 0).
step scan_moe_tiny 120 $PY -m taxbench scan +recipe=moe_tiny cluster.device=cuda cluster.gpus=1 \
    scan.out="$OUT/scan_moe_tiny.json"
# Foreign stacks (issue 21). torchtitan with its FlexAttention, when installed (offline: add taxbench[titan]'s wheels,
# torchtitan 0.3.0 and what its import needs, to .wheels/); Megatron-Core's GPTModel pair (scripts/gpu_wheels.sh puts
# megatron-core in .wheels/): its tests (the host contract and the gpu end-to-end) and the recipe itself.
if $PY -c "import torchtitan.trainer" 2>/dev/null; then
    step titan_llama3_flex 300 $PY -m taxbench "${EXP[@]}" +recipe=titan_llama3_debug \
        recipe.model.stack.attn_backend=flex experiment.name=titan_gpu
else
    echo "torchtitan not installed: titan_llama3_debug not run" | tee -a "$OUT/steps.txt"
fi
if $PY -c "import megatron.core" 2>/dev/null; then
    step megatron_tests 200 $PY -m pytest -v -p no:cacheprovider tests/test_megatron.py
    step megatron_gpt 150 $PY -m taxbench "${EXP[@]}" +recipe=megatron_gpt_debug experiment.name=megatron_gpu
    # Megatron's MoE layers (top-2 of 4, allgather dispatcher, sequential experts) on one GPU: never run on a GPU yet.
    step megatron_moe_debug 200 $PY -m taxbench "${EXP[@]}" +recipe=megatron_moe_debug experiment.name=megatron_moe_gpu
else
    echo "megatron-core not installed: megatron_gpt_debug and megatron_moe_debug not run" | tee -a "$OUT/steps.txt"
fi
grep -h -E "tax|deterministic:|planted" "$OUT"/moe_tiny_bf16.log "$OUT"/interleave_policy.log "$OUT"/planted_5pct.log \
    "$OUT"/nccl_policies.log "$OUT"/megatron_gpt.log "$OUT"/megatron_moe_debug.log 2>/dev/null | head -40
exit $failed
