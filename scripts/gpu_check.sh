#!/usr/bin/env bash
# GPU check for a machine with CUDA (e.g. a lent H200): install, run the CUDA tests, then a timed default pair.
# Meant to fit in a few minutes; writes logs under ${OUT:-/tmp/taxbench-gpu}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/taxbench-gpu}
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())"
python -m pip install -q -e ".[dev]" 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python -m pytest -m gpu -v -s tests/test_gpu.py tests/test_attribution.py 2>&1 | tee "$OUT/pytest_gpu.log"
python -m taxbench cluster=inprocess cluster.device=cuda cluster.gpus=1 +recipe=moe_tiny recipe.precision=bf16 \
    experiment.out_dir="$OUT/runs" experiment.name=moe_tiny_gpu report.wandb=false 2>&1 | tee "$OUT/moe_tiny_gpu.log"
# The calibrated instrument on GPU: a planted 5% tax on an A/A pair (spin kernel, CUDA event times).
python -m taxbench cluster=inprocess cluster.device=cuda cluster.gpus=1 experiment.calibration=true \
    experiment.planted_tax=0.05 experiment.steps=240 experiment.out_dir="$OUT/runs" experiment.name=planted_gpu \
    report.wandb=false 2>&1 | tee "$OUT/planted_gpu.log"
