"""The Triton kernel of `argmax_rows`: one program per row walks the vocabulary in blocks.

Each of the BLOCK lanes of a program keeps the largest value it has seen and its first index
(a strict comparison keeps the earlier of equal values); at the end the row's answer is the
smallest index among the lanes holding the largest value, so ties resolve to the first
index, as torch.argmax does. NaN counts as larger than any number, also as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import launch, next_power_of_2

BLOCK = 8192  # logits per step of a program (8 warps: 32 per thread)


@triton.jit
def _argmax_kernel(p_x, p_out, V, s_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    idx = tl.zeros([BLOCK], tl.int32)
    for v0 in tl.range(0, V, BLOCK, num_stages=3):
        v = v0 + offs
        x = tl.load(p_x + row * s_x + v, mask=v < V, other=float("-inf")).to(tl.float32)
        better = (x > best) | ((x != x) & (best == best))  # a NaN beats any number
        best = tl.where(better, x, best)
        idx = tl.where(better, v, idx)
    nan = best != best
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    hit = tl.where(has_nan, nan, best == top)
    tl.store(p_out + row, tl.min(tl.where(hit, idx, 0x7FFFFFFF), axis=0).to(tl.int64))


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
