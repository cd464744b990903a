#!/usr/bin/env bash
# Wheels that the lent GPU machine's image lacks (it has torch, numpy, pandas, pyarrow, scipy, rich, matplotlib,
# xxhash, pytest, but no Hydra nor Megatron-Core), put here into .wheels/ (ignored by git) for scripts/gpu_check.sh to
# install offline. Carry .wheels with the device run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip wheel -q --no-deps -w .wheels hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
# Megatron-Core for the GPU image's Python 3.12 (its only dependencies, numpy, packaging and torch, are there).
python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: -d .wheels "megatron-core>=0.19,<0.20"
ls .wheels
