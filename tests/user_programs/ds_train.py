"""A small DeepSpeed training script as users write it: `deepspeed ds_train.py --deepspeed_config ds_config.json`.

`--overflow-step N` makes step N's loss overflow: under fp16 (`"fp16": {"enabled": true}` in the JSON) DeepSpeed's
loss scaler then skips that optimizer step. DeepSpeed refuses fp16 on a CPU without mkldnn fp16 (this machine), though
its fp16 path runs there: `--cpu-fp16` lifts that check.
"""

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this machine has no GPU

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--overflow-step", type=int, default=0)
    parser.add_argument("--cpu-fp16", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.cpu_fp16:
        type(get_accelerator()).is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    width = args.width
    model = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, 1, bias=False))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    dtype = torch.float16 if engine.fp16_enabled() else torch.float32
    data = torch.Generator().manual_seed(100 + engine.global_rank)
    for step in range(1, args.steps + 1):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 1, generator=data)
        loss = nn.functional.mse_loss(engine(x.to(dtype)), y.to(dtype))
        if step == args.overflow_step:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()
