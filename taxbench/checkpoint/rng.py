"""The state of every random number generator the harness or a model may draw from: python, numpy, torch's CPU
generator and, once CUDA is initialized, every CUDA device's; captured and restored as one."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class RngSnapshot:
    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> RngSnapshot:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)

    @classmethod
    def seeded(cls, seed: int) -> RngSnapshot:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device
        return cls.capture()

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)

    def state_dict(self) -> dict[str, Any]:
        return {"python": self.python, "numpy": self.numpy, "torch_cpu": self.torch_cpu, "torch_cuda": self.torch_cuda}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RngSnapshot:
        # torch.load(map_location=<cuda>) moves every tensor to the GPU; RNG states must be CPU ByteTensors.
        cuda = state["torch_cuda"]
        return cls(state["python"], state["numpy"], state["torch_cpu"].cpu(),
                   None if cuda is None else [s.cpu() for s in cuda])
