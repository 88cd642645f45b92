"""Cross-entropy of a linear head without the [tokens, vocab] logits in memory.

The logits of a chunk of tokens are computed, reduced to their loss and dropped;
the backward computes them again, chunk by chunk. At the 130m model's 8 x 2048
tokens and 50k vocabulary that is 3.3 GB of f32 logits (and as much again for
their gradient) never held at once.

T tokens, M features, V classes, c tokens in a chunk. The GEMMs are torch's;
the per-chunk reduction (`mambakit.ops.cross_entropy`) is a Triton kernel on
CUDA, reading the logits once in the compute dtype, and PyTorch on the CPU and
for f64. The forward saves each token's logsumexp [T] (f32) so the backward
turns the recomputed logits into their gradient in one pass, in place.
"""

from __future__ import annotations

import torch

from ..ops import resolve_backend
from ..ops._checks import state_dtype
from ..ops.cross_entropy import (
    cross_entropy_bwd_reference,
    cross_entropy_bwd_triton,
    cross_entropy_fwd_reference,
    cross_entropy_fwd_triton,
)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, backend):
        # hidden [T, M] in the compute dtype; weight [V, M]; targets [T] (-100: ignored)
        fwd = cross_entropy_fwd_triton if backend == "triton" else cross_entropy_fwd_reference
        acc = state_dtype(hidden)
        w = weight.to(hidden.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        lse = hidden.new_empty(hidden.shape[0], dtype=acc)  # [T]
        # autocast off: the backward's GEMM must give bit-identical logits
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], chunk):
                logits = hidden[i : i + chunk] @ w.t()  # [c, V]
                loss, lse[i : i + chunk] = fwd(logits, targets[i : i + chunk])
                total = total + loss.sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        ctx.backend = backend
        return total

    @staticmethod
    def backward(ctx, g):
        hidden, weight, targets, lse = ctx.saved_tensors
        bwd = cross_entropy_bwd_triton if ctx.backend == "triton" else cross_entropy_bwd_reference
        acc = state_dtype(hidden)
        w = weight.to(hidden.dtype)
        g_hidden = torch.empty_like(hidden)
        # on CUDA the weight gradient accumulates in f32 inside the GEMM (cuBLAS's f32
        # output of bf16 / f16 inputs): no per-chunk [V, M] rounding, cast or add
        f32_out = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
        g_weight = None
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[i : i + ctx.chunk]
                rows = slice(i, i + ctx.chunk)
                p = bwd(h @ w.t(), targets[rows], lse[rows], g)  # dL/dlogits [c, V]
                g_hidden[rows] = p @ w
                if f32_out:
                    g_weight = (
                        torch.mm(p.t(), h, out_dtype=acc)
                        if g_weight is None
                        else torch.addmm(g_weight, p.t(), h, out_dtype=acc)
                    )
                else:
                    part = (p.t() @ h).to(acc)
                    g_weight = part if g_weight is None else g_weight.add_(part)
        if g_weight is None:  # no tokens
            g_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        return g_hidden, g_weight.to(weight.dtype), None, None, None


def next_token_targets(tokens: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
    """The targets of tokens[:, :-1]: tokens[:, 1:] (int64), -100 where the next token
    opens another document (docs [B, T]: document ids, non-decreasing along T). The one
    place the document-boundary rule is written: training rows and `forward(labels=)`."""
    targets = tokens[:, 1:].long()  # a copy when tokens are int32, a view otherwise
    if docs is None:
        return targets
    return targets.masked_fill(docs[:, 1:] != docs[:, :-1], -100)


def linear_cross_entropy(
    hidden: torch.Tensor,  # [..., M]
    weight: torch.Tensor,  # [V, M]
    targets: torch.Tensor,  # [...] int, -100 ignored
    chunk: int = 4096,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` against `targets` (f32, f64 for f64).

    `backend` as for every mambakit op: "auto" runs the Triton reduction on CUDA
    (f32 / bf16 / f16 hidden), PyTorch otherwise; MAMBAKIT_BACKEND overrides it."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets must have shape {list(hidden.shape[:-1])}, got {list(targets.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}], got {list(weight.shape)}")
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).long(),
        chunk,
        resolve_backend(backend, hidden),
    )
