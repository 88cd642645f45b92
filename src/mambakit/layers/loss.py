"""Cross-entropy of a linear head without the [tokens, vocab] logits in memory.

The logits of a chunk of tokens are computed, reduced to their loss and dropped;
the backward computes them again, chunk by chunk. At the 130m model's 8 x 2048
tokens and 50k vocabulary that is 3.3 GB of f32 logits (and as much again for
their gradient) never held at once.
"""

from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        # hidden [T, M] in the compute dtype; weight [V, M]; targets [T] (-100: ignored)
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        w = weight.to(hidden.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], chunk):
                logits = (hidden[i : i + chunk] @ w.t()).to(acc)  # [c, V]
                tgt = targets[i : i + chunk]
                valid = tgt != -100
                picked = logits.gather(1, tgt.clamp(min=0).unsqueeze(1)).squeeze(1)
                total = total + ((torch.logsumexp(logits, -1) - picked) * valid).sum()
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, g):
        hidden, weight, targets = ctx.saved_tensors
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        w = weight.to(hidden.dtype)
        g_hidden = torch.empty_like(hidden)
        g_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        rows = torch.arange(min(ctx.chunk, hidden.shape[0]), device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[i : i + ctx.chunk]
                tgt = targets[i : i + ctx.chunk]
                valid = (tgt != -100).to(acc)
                p = torch.softmax((h @ w.t()).to(acc), -1)  # dL/dlogits = softmax - onehot
                p[rows[: h.shape[0]], tgt.clamp(min=0)] -= 1.0
                p = (p * (valid * g).unsqueeze(1)).to(hidden.dtype)
                g_hidden[i : i + ctx.chunk] = p @ w
                g_weight += (p.t() @ h).to(acc)
        return g_hidden, g_weight.to(weight.dtype), None, None


def linear_cross_entropy(
    hidden: torch.Tensor,  # [..., M]
    weight: torch.Tensor,  # [V, M]
    targets: torch.Tensor,  # [...] int, -100 ignored
    chunk: int = 4096,
) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` against `targets` (f32, f64 for f64)."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets must have shape {list(hidden.shape[:-1])}, got {list(targets.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}], got {list(weight.shape)}")
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(), chunk
    )
