"""Cross-entropy of a linear head without the [tokens, vocab] logits in memory.

The logits of a chunk of tokens are computed, reduced to their loss and dropped.
At the 130m model's 8 x 2048 tokens and 50k vocabulary that is 3.3 GB of f32
logits (and as much again for their gradient) never held at once.

When a gradient will be asked for (grad mode on and hidden or weight requiring
it), the forward also turns each chunk's logits into their gradient for a unit
upstream gradient, in place, and multiplies it out at once: dL/dhidden [T, M]
and dL/dweight [V, M], both f32, are kept for the backward, which only scales
them by the upstream gradient. The logits are then computed once, not again in
the backward (one of the head's three [T, M] x [M, V] GEMMs: 1.8 ms of the 130m
training step's profile on an H100, 82f6b59). Without a gradient the forward
computes the loss alone.

T tokens, M features, V classes, c tokens in a chunk. The GEMMs are torch's;
the per-chunk reduction (this package's ops) is a Triton kernel on the "triton"
backend, reading the logits once in the compute dtype, and PyTorch on the
"reference" one. `mambakit.ops.linear_cross_entropy` checks the inputs and picks
the backend.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._checks import state_dtype
from . import cross_entropy_bwd_triton, cross_entropy_fwd_triton
from .reference import cross_entropy_bwd_reference, cross_entropy_fwd_reference


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, backend, with_grad):
        # hidden [T, M] in the compute dtype; weight [V, M]; targets [T] (-100: ignored);
        # with_grad: a backward will follow (the caller knows: grad mode is off in here)
        fwd = cross_entropy_fwd_triton if backend == "triton" else cross_entropy_fwd_reference
        bwd = cross_entropy_bwd_triton if backend == "triton" else cross_entropy_bwd_reference
        acc = state_dtype(hidden)
        w = weight.to(hidden.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        need_h = with_grad and ctx.needs_input_grad[0]
        need_w = with_grad and ctx.needs_input_grad[1]
        g_hidden = hidden.new_empty(hidden.shape, dtype=acc) if need_h else None
        g_weight = None
        unit = torch.ones((), dtype=acc, device=hidden.device)
        # on CUDA the products of bf16 / f16 operands accumulate and land in f32 inside the
        # GEMM (cuBLAS's f32 output): no rounding of dL/dhidden or per-chunk [V, M] parts
        f32_out = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], chunk):
                h = hidden[i : i + chunk]
                rows = slice(i, i + chunk)
                logits = h @ w.t()  # [c, V]
                loss, lse = fwd(logits, targets[rows])
                total = total + loss.sum()
                if not (need_h or need_w):
                    continue
                p = bwd(logits, targets[rows], lse, unit)  # d(summed loss)/dlogits [c, V]
                if need_h:
                    if f32_out:
                        g_hidden[rows] = torch.mm(p, w, out_dtype=acc)
                    else:
                        g_hidden[rows] = p @ w
                if need_w:
                    if f32_out:
                        g_weight = (
                            torch.mm(p.t(), h, out_dtype=acc)
                            if g_weight is None
                            else torch.addmm(g_weight, p.t(), h, out_dtype=acc)
                        )
                    else:
                        part = (p.t() @ h).to(acc)
                        g_weight = part if g_weight is None else g_weight.add_(part)
        if need_w and g_weight is None:  # no tokens
            g_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        ctx.save_for_backward(g_hidden, g_weight)  # (None where not asked for)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        g_hidden, g_weight = ctx.saved_tensors
        # new tensors, not in place: a retained graph may run this backward again
        dh = None if g_hidden is None else (g_hidden * g).to(ctx.dtypes[0])
        dw = None if g_weight is None else (g_weight * g).to(ctx.dtypes[1])
        return dh, dw, None, None, None, None
