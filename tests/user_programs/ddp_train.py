"""A small DDP training script written the way users write them (it knows nothing of taxbench).

    torchrun --nproc-per-node 2 ddp_train.py --steps 12 [--save DIR --save-step 6] [--resume DIR]
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--save", default=None)
    parser.add_argument("--save-step", type=int, default=6)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--forget-rng", action="store_true", help="resume without restoring the RNG state")
    parser.add_argument("--scatter-add", action="store_true", help="an embedding-style update with index_put_")
    parser.add_argument("--urandom-step", type=int, default=0, help="mix os.urandom into the weights at this step")
    parser.add_argument("--no-optimizer", action="store_true")
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(64, 32))
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def forward(self, idx: torch.Tensor, scatter_add: bool) -> torch.Tensor:
        if scatter_add:  # rows gathered many times over: their gradient's index_put (accumulate) races on 2 threads
            rows = self.table[idx.repeat(128)].view(128, len(idx), -1).mean(0)
        else:
            rows = self.table[idx]
        return self.body(rows).squeeze(-1)


def single_process_defaults() -> None:
    """Started as plain `python ddp_train.py`: a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main() -> None:
    args = parse()
    single_process_defaults()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        state = torch.load(os.path.join(args.resume, f"rank{rank}.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if not args.forget_rng:
            torch.set_rng_state(state["rng"])
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(start * args.accumulate):
        torch.randint(0, 64, (512,), generator=data), torch.randn(512, generator=data)
    for step in range(start + 1, args.steps + 1):
        for _ in range(args.accumulate):
            idx = torch.randint(0, 64, (512,), generator=data)
            target = torch.randn(512, generator=data)
            loss = nn.functional.mse_loss(model(idx, args.scatter_add), target) / args.accumulate
            loss.backward()
        if not args.no_optimizer:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.urandom_step == step:
            with torch.no_grad():
                noise = int.from_bytes(os.urandom(2), "little") / 65536
                model.module.table[0, 0] += noise
        if args.save and step == args.save_step:
            os.makedirs(args.save, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "rng": torch.get_rng_state()}, os.path.join(args.save, f"rank{rank}.pt"))
    dist.barrier()
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
