"""Cross-entropy of one chunk of logits as torch.library custom ops over the Triton kernels.

c rows (tokens), V classes. These are the non-GEMM half of
`mambakit.ops.linear_cross_entropy` (linear.py), which computes each chunk's logits,
reduces them here and, when a backward will follow, turns them into their gradient in
place at once. Triton is imported inside the op bodies only, so CPU
users can import this package without it. No autograd is registered: the loss's
own autograd.Function calls the forward and backward explicitly.

`mambakit::cross_entropy_fwd` returns (loss [c], lse [c]) in f32;
`mambakit::cross_entropy_bwd_` overwrites the logits with g * (softmax - onehot).
"""

from __future__ import annotations

import torch

from .._dispatch import Op
from .reference import IGNORE_INDEX, cross_entropy_bwd_reference, cross_entropy_fwd_reference

__all__ = [
    "IGNORE_INDEX",
    "cross_entropy_fwd_reference",
    "cross_entropy_bwd_reference",
    "cross_entropy_fwd_triton",
    "cross_entropy_bwd_triton",
]


@torch.library.custom_op("mambakit::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .launch import ce_fwd

    return ce_fwd(logits, targets)


@_ce_fwd_op.register_fake
def _(logits, targets):
    c = logits.shape[0]
    return logits.new_empty((c,), dtype=torch.float32), logits.new_empty((c,), dtype=torch.float32)


@torch.library.custom_op("mambakit::cross_entropy_bwd_", mutates_args=("logits",))
def _ce_bwd_op(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor
) -> None:
    from .launch import ce_bwd_

    ce_bwd_(logits, targets, lse, g)


@_ce_bwd_op.register_fake
def _(logits, targets, lse, g):
    return None


# the handles the package's callers use (eager calls skip the dispatcher: ops/_dispatch.py)
ce_fwd_op = Op(_ce_fwd_op)
ce_bwd_op = Op(_ce_bwd_op)


def cross_entropy_fwd_triton(
    logits: torch.Tensor,  # [c, V], stride 1 in V, any float dtype but f64
    targets: torch.Tensor,  # [c] int64, -100 ignored
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [c] f32, lse [c] f32); loss is 0 on ignored rows, NaN for a target outside [0, V)."""
    return ce_fwd_op(logits, targets)


def cross_entropy_bwd_triton(
    logits: torch.Tensor,  # [c, V], stride 1 in V: overwritten
    targets: torch.Tensor,  # [c] int64, -100 ignored
    lse: torch.Tensor,  # [c] f32 from cross_entropy_fwd_triton on the same logits
    g: torch.Tensor,  # [] dL/d(summed loss)
) -> torch.Tensor:
    """dL/dlogits [c, V] in the logits' dtype, written over `logits` (which it returns)."""
    ce_bwd_op(logits, targets, lse, g)
    return logits
