"""Cross-entropy of one chunk of logits, in plain PyTorch: the CPU / f64 path and the oracle.

c rows (tokens of the chunk), V classes. Per row, with x the row's logits and
t its target (-100: ignored):

    lse  = log(sum_v exp(x_v))
    loss = lse - x_t                       (0 for an ignored row)
    dL/dx_v = g * (exp(x_v - lse) - [v == t])   (0 for an ignored row)

Reductions run in f32 (f64 when the logits are f64); the gradient is returned
in the logits' dtype.
"""

from __future__ import annotations

import torch

from .._checks import state_dtype

IGNORE_INDEX = -100


def _acc(logits: torch.Tensor) -> torch.dtype:
    return state_dtype(logits)


def cross_entropy_fwd_reference(
    logits: torch.Tensor,  # [c, V]
    targets: torch.Tensor,  # [c] int64, -100 ignored
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [c], lse [c]), both f32 (f64 for f64 logits); loss is 0 on ignored rows."""
    x = logits.to(_acc(logits))
    lse = torch.logsumexp(x, -1)
    picked = x.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return (lse - picked) * (targets != IGNORE_INDEX), lse


def cross_entropy_bwd_reference(
    logits: torch.Tensor,  # [c, V]
    targets: torch.Tensor,  # [c] int64, -100 ignored
    lse: torch.Tensor,  # [c] from the forward
    g: torch.Tensor,  # [] dL/d(summed loss)
) -> torch.Tensor:
    """dL/dlogits [c, V] in the logits' dtype: g * (softmax - onehot(target)), 0 rows ignored."""
    acc = _acc(logits)
    p = torch.exp(logits.to(acc) - lse.unsqueeze(1))  # softmax, from the forward's lse
    rows = torch.arange(logits.shape[0], device=logits.device)
    p[rows, targets.clamp(min=0)] -= 1.0
    scale = (targets != IGNORE_INDEX).to(acc) * g.to(acc)
    return (p * scale.unsqueeze(1)).to(logits.dtype)
