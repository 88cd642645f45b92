"""Training on several processes with PyTorch's own engine: DDP or FSDP2, launched by torchrun.

    torchrun --nproc_per_node 2 -m mambakit train --distributed ddp ...

Every process (rank) runs the same Trainer. The process group comes from torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL with one GPU per
rank (cuda:LOCAL_RANK), gloo on CPUs. The data source yields the same global batch on every
rank and each rank keeps its own contiguous block of rows (`shard_rows`), so the ranks never
overlap and together train on exactly what one process would.

The model and the loss function are one module (`LossModule`), so the engine sees the whole
forward, whatever the loss calls on the model:

- ddp: `DistributedDataParallel`, gradients averaged over ranks in buckets during backward;
  on CUDA the whole step is captured in a CUDA graph, as on one process;
- fsdp: `fully_shard` on every block, then on the whole (FSDP2): parameters, gradients and
  optimizer state sharded over ranks, each block gathered for its forward and backward.

Precision is DESIGN.md section 4's in both: f32 master weights, autocast compute, f32
gradient reductions (FSDP2 gathers the f32 parameters; no mixed-precision policy casts them).
Checkpoints hold full tensors (`full_state`), so a run saved by N processes resumes on M.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..layers.init import no_decay_marks_kept

MODES = ("none", "ddp", "fsdp")
ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: the engine, its rank and the number of ranks."""

    mode: str = "none"
    rank: int = 0
    world: int = 1

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints, logs and writes checkpoints."""
        return self.rank == 0


def setup(mode: str, device: torch.device) -> tuple[Dist, torch.device]:
    """Join (or create, from torchrun's environment) the process group for `mode`; returns
    this rank's `Dist` and its device: cuda:LOCAL_RANK when `device` is CUDA, else the CPU."""
    if mode not in MODES:
        raise ValueError(f"TrainConfig.distributed must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return Dist(), device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        missing = [k for k in ENV if k not in os.environ]
        if missing:
            raise ValueError(
                f"TrainConfig.distributed={mode!r} needs a process group: launch with torchrun "
                f"(the environment lacks {', '.join(missing)}) or call "
                "torch.distributed.init_process_group first"
            )
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return Dist(mode, dist.get_rank(), dist.get_world_size()), device


class LossModule(nn.Module):
    """`loss_fn(model, batch, state)` as the forward of one module: DDP's and FSDP2's hooks
    run around the whole loss, whichever of the model's methods it calls."""

    def __init__(self, model: nn.Module, loss_fn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch, state):
        return self.loss_fn(self.model, batch, state)


def wrap(model: nn.Module, loss_fn, d: Dist, device: torch.device) -> nn.Module:
    """The module a step calls as `module(batch, state) -> (summed loss, state)`. FSDP2 shards
    `model` in place (its parameters become DTensors): build the optimizer after this."""
    module = LossModule(model, loss_fn)
    if d.mode == "ddp":
        if device.type != "cuda":
            return nn.parallel.DistributedDataParallel(module)
        # built on a side stream, as PyTorch's CUDA-graph notes ask. The Trainer warms up
        # and captures on another side stream, so autograd warns that DDP's stashed
        # gradient nodes sit on a different stream: measured harmless (one GPU, NCCL: the
        # captured DDP steps gave one process's losses bit for bit)
        warnings.filterwarnings("ignore", "The AccumulateGrad node's stream does not match")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ddp = nn.parallel.DistributedDataParallel(module, device_ids=[device.index])
        torch.cuda.current_stream().wait_stream(side)
        return ddp
    if d.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # a block's final state (conv state) is a view; nothing writes into it in place (the
        # model stacks the layers' states into new tensors), so FSDP2's warning is moot
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .*MambaBlock.* view tensor")
        layers = getattr(getattr(model, "backbone", None), "layers", None)
        with no_decay_marks_kept(model):  # sharding replaces the parameters
            for block in layers if layers is not None else []:
                fully_shard(block)
            fully_shard(module)
    return module


def shard_rows(batch: dict[str, torch.Tensor], d: Dist) -> dict[str, torch.Tensor]:
    """This rank's block of the global batch's rows (rank r: rows r b .. (r + 1) b - 1)."""
    if not d.active:
        return batch
    rows = next(iter(batch.values())).shape[0]
    if rows % d.world:
        raise ValueError(
            f"a global batch of {rows} rows does not split over {d.world} processes: the data "
            f"must yield batch_size x world_size rows ({d.world} x TrainConfig.batch_size)"
        )
    b = rows // d.world
    return {k: v[d.rank * b : (d.rank + 1) * b] for k, v in batch.items()}


def all_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """The sum of `t` over the ranks (`t` itself on one process)."""
    if d.active:
        t = t.clone()
        dist.all_reduce(t)
    return t


def any_rank(flag: bool, d: Dist, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (a host sync: call it at log steps, not every step)."""
    if not d.active:
        return flag
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t)


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()
