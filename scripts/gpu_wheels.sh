#!/usr/bin/env bash
# Wheels that the lent GPU machine's image lacks, put here into .wheels/ (ignored by git) for scripts/gpu_check.sh to
# install offline with `pip install --no-index --no-deps .wheels/*.whl`. Carry .wheels with the device run.
# The image's packages are listed in scripts/gpu_image.txt (read here and by gpu_check.sh's first step): Python 3.12
# with a CUDA torch (so also triton, sympy, networkx, jinja2, filelock, fsspec), numpy, pandas, pyarrow, scipy, ...;
# no Hydra, no training stack. Every wheel is fetched without its dependencies: each stack gets exactly what its import
# needs beyond the image (read off `import torchtitan.trainer` / `import deepspeed` in a venv with the stack installed,
# versions as tested on CPU), not its whole declared tree (torchtitan declares wandb and more that its import never
# touches).
# TORCH_VERSION: the image's torch (major.minor), which picks the torchao release built against it; PYTHON_VERSION: the
# image's Python (major.minor); both default to gpu_image.txt's. GPU_WHEELS_DRY=1 prints the targets, fetches nothing.
# Total, measured 2026-12-05 with the defaults: 33 MiB in 54 wheels (32,812 KiB), under the device tool's 64 MiB
# carry limit, so one .wheels serves every step (no split needed).
set -euo pipefail
cd "$(dirname "$0")/.."
image_version() {  # image_version DISTRIBUTION: its major.minor in scripts/gpu_image.txt
    awk -v name="$1" '$1 == name { split($3, v, /[.+]/); print v[1] "." v[2] }' scripts/gpu_image.txt
}
TORCH_VERSION=${TORCH_VERSION:-$(image_version torch)}
PYTHON_VERSION=${PYTHON_VERSION:-$(image_version python)}
WHEELS=${WHEELS:-.wheels}
case "$TORCH_VERSION" in  # torchao for recipe.precision=fp8: each release is built against one torch
    2.9) torchao=0.15.0 ;;
    2.10) torchao=0.16.0 ;;
    2.11) torchao=0.17.0 ;;
    *) torchao=0.18.0 ;;
esac
if [ -n "${GPU_WHEELS_DRY:-}" ]; then
    echo "wheels for Python $PYTHON_VERSION, torch $TORCH_VERSION (torchao $torchao) into $WHEELS"
    exit 0
fi
mkdir -p "$WHEELS"

binary() {  # binary REQUIREMENT...: wheels built for the image's Python (a pure wheel where that is all there is)
    python3 -m pip download -q --no-deps --python-version "$PYTHON_VERSION" --only-binary=:all: -d "$WHEELS" "$@"
}

# taxbench itself: Hydra (pure python; antlr4 ships only an sdist).
python3 -m pip wheel -q --no-deps -w "$WHEELS" hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
# Megatron-Core (its only dependencies, numpy, packaging and torch, are in the image).
binary "megatron-core>=0.19,<0.20"
# torchtitan (taxbench[titan]'s pin) and its import: its dataloader imports datasets (and through it huggingface_hub,
# aiohttp, requests), its metrics torch.utils.tensorboard, its config tyro. Not triton: the image's CUDA torch brings
# the triton it was built with, and taxbench[titan]'s triton pin is for torch's CPU wheel.
binary torchtitan==0.3.0 spmd_types==0.2.3 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
    tokenizers==0.23.3 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 huggingface_hub==2.4.0 hf-xet==1.8.0 \
    httpx==0.29.0 httpx2==2.17.0 httpcore==1.0.9 httpcore2==2.17.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 \
    truststore==0.10.5 click==8.5.1 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 \
    charset-normalizer==3.5.3 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 \
    frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 tqdm==4.70.1 \
    tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1
# DeepSpeed: an sdist only; DS_BUILD_OPS=0 builds a pure-python wheel (its ops are JIT-built where used).
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$WHEELS" deepspeed==0.19.8
binary hjson==3.1.0 ninja==1.13.2 py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 msgpack==1.2.4 psutil==7.2.2 einops==0.8.2
binary "torchao==$torchao"
ls -s --block-size=K "$WHEELS"
du -sh "$WHEELS"
