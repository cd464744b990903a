"""A small training script with torch's loss scaler, as users write it: `python amp_train.py --steps 8`.

`--overflow-step N` makes step N's loss overflow, so the scaler finds inf gradients and skips that optimizer step.
`--save DIR --save-step N` saves model, optimizer, scaler and data states after step N; `--resume DIR` goes on from
there.
"""

import argparse
import os

import torch
import torch.nn as nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--overflow-step", type=int, default=0)
    parser.add_argument("--save", default=None)
    parser.add_argument("--save-step", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    data = torch.Generator().manual_seed(1)
    first = 1
    if args.resume:
        saved = torch.load(os.path.join(args.resume, "state.pt"))
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scaler.load_state_dict(saved["scaler"])
        data.set_state(saved["data"])
        first = saved["step"] + 1
    for step in range(first, args.steps + 1):
        x, y = torch.randn(32, 16, generator=data), torch.randn(32, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        if step == args.overflow_step:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if args.save and step == args.save_step:
            os.makedirs(args.save, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "data": data.get_state(), "step": step},
                       os.path.join(args.save, "state.pt"))
    print(f"scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
