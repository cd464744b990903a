"""The GPU check's first step (scripts/gpu_check.sh): after the carried wheels are installed, import the image's
packages (scripts/gpu_image.txt), taxbench and each stack, in one process and a few seconds, and say what is missing.

    python scripts/gpu_imports.py OUT/imports.txt

Writes one line per stack to the file, `<stack> ok` or `<stack> missing <why>`, which gpu_check.sh reads to skip the
steps of a missing stack with the reason instead of running them to their time limit. Exit 1 when taxbench itself
does not import (no step can run), else 0.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

IMAGE = Path(__file__).with_name("gpu_image.txt")
# What taxbench needs beyond the image, and each stack's import as its steps use it.
TAXBENCH = ("hydra", "omegaconf", "taxbench", "taxbench.analysis", "taxbench.launchers")
STACKS = {"deepspeed": "deepspeed", "titan": "torchtitan.trainer", "megatron": "megatron.core", "fp8": "torchao.float8"}


def image_modules(path: Path = IMAGE) -> list[str]:
    """The image's import names (python itself has none)."""
    names = []
    for line in path.read_text().splitlines():
        fields = line.split()
        if fields and not line.startswith("#") and fields[1] != "-":
            names.append(fields[1])
    return names


def try_import(name: str) -> str | None:
    """None when `name` imports, else why not (one line)."""
    try:
        importlib.import_module(name)
    except Exception as exc:  # an import that fails for any reason is a missing stack here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def main(out: Path) -> int:
    start = time.perf_counter()
    missing = {name: why for name in image_modules() if (why := try_import(name)) is not None}
    for name, why in missing.items():
        print(f"image: {name} missing ({why}): scripts/gpu_image.txt is out of date, or the image changed")
    broken = {name: why for name in TAXBENCH if (why := try_import(name)) is not None}
    for name, why in broken.items():
        print(f"taxbench: {name} does not import ({why}); build the wheels (scripts/gpu_wheels.sh), carry .wheels")
    lines = []
    for stack, module in STACKS.items():
        why = try_import(module)
        lines.append(f"{stack} ok" if why is None else f"{stack} missing {module}: {why}")
        print(f"stack {lines[-1]}")
    out.write_text("".join(f"{line}\n" for line in lines))
    print(f"imports checked in {time.perf_counter() - start:.1f} s")
    return 1 if broken else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/gpu_imports.py OUT/imports.txt")
    sys.exit(main(Path(sys.argv[1])))
