"""Cross-entropy of a linear head without the [tokens, vocab] logits in memory.

The logits of a chunk of tokens are computed, reduced to their loss and dropped;
the backward computes them again, chunk by chunk. At the 130m model's 8 x 2048
tokens and 50k vocabulary that is 3.3 GB of f32 logits (and as much again for
their gradient) never held at once.

T tokens, M features, V classes, c tokens in a chunk. The GEMMs are torch's;
the per-chunk reduction (this package's ops) is a Triton kernel on the "triton"
backend, reading the logits once in the compute dtype, and PyTorch on the
"reference" one. The forward saves each token's logsumexp [T] (f32) so the
backward turns the recomputed logits into their gradient in one pass, in place.
`mambakit.ops.linear_cross_entropy` checks the inputs and picks the backend.
"""

from __future__ import annotations

import torch

from .._checks import state_dtype
from . import cross_entropy_bwd_triton, cross_entropy_fwd_triton
from .reference import cross_entropy_bwd_reference, cross_entropy_fwd_reference


class LinearCrossEntropy(torch.autograd.Function):
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
