"""Launchers of the cross-entropy kernels (kernels.py): `ce_fwd`, `ce_bwd_`, and their blocks.

c rows (tokens), V classes; logits [c, V] in any float dtype with stride 1 in V. The forward
runs one program per row; the backward one per (row, BLOCK_V columns), in place.
"""

from __future__ import annotations

import torch

from .._triton import cdiv, launch, next_power_of_2
from .kernels import _ce_bwd_kernel, _ce_fwd_kernel

IGNORE_INDEX = -100


def _config(V: int, device: torch.device, backward: bool) -> tuple[int, int]:
    """(BLOCK_V, num_warps). On the H200 at c 4096, V 50280, bf16 logits: forward
    2048 x 4 warps 0.147 ms (2.8 TB/s read), backward 2048 x 8 warps 0.30 ms (2.7 TB/s
    read + write); a device copy runs at 4.2 TB/s. Under the interpreter small
    blocks, so that tests cross several."""
    if device.type != "cuda":
        return min(64, next_power_of_2(max(V, 1))), 1
    BLOCK_V = min(2048, next_power_of_2(max(V, 1)))
    return BLOCK_V, max(1, min(8 if backward else 4, BLOCK_V // 256))


def ce_fwd(
    logits: torch.Tensor,  # [c, V], stride 1 in V
    targets: torch.Tensor,  # [c] int64, -100 ignored
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [c] f32, lse [c] f32); loss is 0 on ignored rows."""
    c, V = logits.shape
    assert V <= 1 or logits.stride(1) == 1, "logits need stride 1 in V"
    targets = targets.contiguous()
    loss = torch.empty((c,), device=logits.device, dtype=torch.float32)
    lse = torch.empty((c,), device=logits.device, dtype=torch.float32)
    if c == 0:
        return loss, lse
    BLOCK_V, num_warps = _config(V, logits.device, backward=False)
    launch(_ce_fwd_kernel, (c,),
        logits, targets, loss, lse, V, logits.stride(0),
        BLOCK_V=BLOCK_V, IGNORE=IGNORE_INDEX, num_warps=num_warps,
    )  # fmt: skip
    return loss, lse


def ce_bwd_(
    logits: torch.Tensor,  # [c, V], stride 1 in V; overwritten with dL/dlogits
    targets: torch.Tensor,  # [c] int64, -100 ignored
    lse: torch.Tensor,  # [c] f32 from ce_fwd on the same logits
    g: torch.Tensor,  # [] dL/d(summed loss)
) -> None:
    c, V = logits.shape
    assert V <= 1 or logits.stride(1) == 1, "logits need stride 1 in V"
    if c == 0:
        return
    BLOCK_V, num_warps = _config(V, logits.device, backward=True)
    launch(_ce_bwd_kernel, (c, cdiv(V, BLOCK_V)),
        logits, targets.contiguous(), lse.contiguous(), g.reshape(1), V, logits.stride(0),
        BLOCK_V=BLOCK_V, IGNORE=IGNORE_INDEX, num_warps=num_warps,
    )  # fmt: skip
