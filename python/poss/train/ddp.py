"""Data parallelism under ``torchrun``: gloo on CPU, NCCL on GPU.

The multi-step objective backpropagates every step separately and, with PosS-1, each backward
touches a different specialist. ``DistributedDataParallel`` would need ``no_sync`` plus
``find_unused_parameters`` around that; instead gradients are averaged explicitly once per optimizer
step with one flattened all-reduce, which is what DDP's reducer does, in a single bucket.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> DistInfo:
    """Join the torchrun process group if the environment names one; a single process otherwise."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistInfo()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    return info


def broadcast_parameters(module: torch.nn.Module, info: DistInfo) -> None:
    """Start every rank from rank 0's weights."""
    if info.world > 1:
        for p in module.parameters():
            dist.broadcast(p.data, 0)


def average_gradients(params, info: DistInfo) -> None:
    """Replace each gradient by its mean over ranks (missing gradients count as zero)."""
    if info.world <= 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1).float() for p in params])
    dist.all_reduce(flat)
    flat /= info.world
    at = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[at:at + n].view_as(p.grad))
        at += n


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t


def shutdown(info: DistInfo) -> None:
    if info.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
