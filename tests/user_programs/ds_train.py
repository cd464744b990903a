"""A small DeepSpeed training script as users write it: `deepspeed ds_train.py --deepspeed_config ds_config.json`."""

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this machine has no GPU

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1, bias=False))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    data = torch.Generator().manual_seed(100 + engine.global_rank)
    for _ in range(args.steps):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 1, generator=data)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()
