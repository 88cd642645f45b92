"""The launcher of `argmax_rows`' kernel (kernels.py): one program per row, BLOCK logits a step."""

from __future__ import annotations

import torch

from .._triton import launch, next_power_of_2
from .kernels import _argmax_kernel

BLOCK = 8192  # logits per step of a program (8 warps: 32 per thread)


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64 argmax of each row of logits [B, V] (V >= 1, stride 1 along V)."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    Bsz, V = logits.shape
    out = torch.empty(Bsz, dtype=torch.int64, device=logits.device)
    if Bsz == 0:
        return out
    interp = not logits.is_cuda
    block = min(BLOCK, next_power_of_2(V)) if not interp else min(64, next_power_of_2(V))
    launch(_argmax_kernel, (Bsz,), logits, out, V, logits.stride(0), BLOCK=block,
           num_warps=8 if block >= 2048 else 4)  # fmt: skip
    return out
