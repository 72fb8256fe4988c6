"""The torchrun process group as training sees it: rank, world size, sums across ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
        return t


def init_distributed(device: torch.device) -> Dist:
    """Join the torchrun process group when launched by it (gloo on CPU, NCCL on GPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size())
