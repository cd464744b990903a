"""A small DeepSpeed training script as users write it: `deepspeed ds_train.py --deepspeed_config ds_config.json`.

`--overflow-step N` makes step N's loss overflow: under fp16 (`"fp16": {"enabled": true}` in the JSON) DeepSpeed's
loss scaler then skips that optimizer step. DeepSpeed refuses fp16 on a CPU without mkldnn fp16 (this machine), though
its fp16 path runs there: `--cpu-fp16` lifts that check.

`--save DIR --save-step N` saves DeepSpeed's checkpoint after step N (`engine.save_checkpoint`, the step in its
client state); `--resume DIR` loads it (`engine.load_checkpoint`) and goes on from the next step. Each step's batch is
drawn from a generator seeded by the step and rank, so a resumed run reads what the uninterrupted one read.
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
    parser.add_argument("--save", default=None)
    parser.add_argument("--save-step", type=int, default=0)
    parser.add_argument("--resume", default=None)
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
    first = 1
    if args.resume:
        _, client_state = engine.load_checkpoint(args.resume)
        first = client_state["step"] + 1
    for step in range(first, args.steps + 1):
        data = torch.Generator().manual_seed(1000 * step + engine.global_rank)
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 1, generator=data)
        loss = nn.functional.mse_loss(engine(x.to(dtype)), y.to(dtype))
        if step == args.overflow_step:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        if args.save and step == args.save_step:
            engine.save_checkpoint(args.save, client_state={"step": step})


if __name__ == "__main__":
    main()
