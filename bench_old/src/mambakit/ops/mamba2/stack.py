"""The decode step of a stack of Mamba-2 blocks on the reference backend, in as few PyTorch
calls as it takes: the reference body of `ops.mamba2.mamba2_stack_step`.

B batch, M = d_model, H heads of P values (d_ssm = H P), G groups of the N-wide B/C rows
(head h reads group h // (H / G)), K = d_conv, conv_dim = d_ssm + 2 G N. Each block
advances the residual stream r one timestep and its conv and SSM states in place, the
math of `mamba2_step_fused_reference` (step.py gives it) between the norm and out_proj:

    zxbcdt  = rmsnorm(r) W_in^T (+ b_in)              -> z0, x0, z, xBC, dt
    x, B, C = silu(conv over [conv state; xBC] + b_conv)   conv state shifted in place
    delta   = clamp(softplus(dt + dt_bias), dt_limit)
    h       = exp(delta A) h + delta x B^T              ssm state in place
    y       = gated RMSNorm(h C + D x, z)   (or (h C + D x) silu(z) without the norm)
    r'      = r + [silu(z0) x0, y] W_out^T (+ b_out)

At batch 1 on a CPU this step is bound by the cost of each PyTorch call, so it is
written for few calls, as `ops/mamba_step/stack.py` is (the constant column of r that
folds the norm's eps, the conv bias as the last row of the conv's addend, contiguous
transposed weights, rows [B, 1, X] so splits are views, inference mode), and:

- dt_bias sits in in_proj's bias row; the heads are read in groups ([B, G, H/G, P, N]
  views of the state), so the group's B and C rows broadcast over its heads;
- the gated norm is one `F.rms_norm` per group (the same rsqrt(mean(v^2) + eps) v), its
  weight folded into out_proj's columns; the gated MLP's part, when there is one, is a
  second `addmm_` into r rather than a concatenation.

With numba, up to `rows_max` rows of float32 or float64 (`cpu_jit.rows_max`), `cpu_jit.mamba2` runs
this math on the same weights as one compiled call for the whole stack
(`DecodeWeights.compiled`); this body runs the rest.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...state import Mamba2State
from ..cpu_jit import compile_stack
from ..mamba_step.stack import DecodeWeights


class BlockWeights(NamedTuple):
    """One block's tensors as `block_step` reads them."""

    in_wT: torch.Tensor  # [M + 1, W]: (W_in * norm weight * sqrt(M))^T, a zero last row
    in_b: torch.Tensor  # [W]: in_proj's bias (or zeros), dt_bias added to the dt columns
    conv_wT: torch.Tensor  # [K, conv_dim]
    conv_b: torch.Tensor  # [K, conv_dim]: zeros, the conv bias in the last row
    A: torch.Tensor  # [G, H/G, 1, 1]
    D: torch.Tensor  # [G, H/G, 1 or P, 1]
    out_wT: torch.Tensor  # [d_ssm, M + 1]: W_out^T (times the gated norm's weight)
    mlp_wT: torch.Tensor | None  # [d_mlp, M + 1]: the gated MLP's columns of W_out^T
    out_b: torch.Tensor | None  # [M + 1], 0 in the last column
    dt_limit: tuple[float, float] | None  # None: (0, inf), no clamp
    gnorm: tuple[int, float, bool] | None  # (d_ssm / G, eps, norm_before_gate); None: gate
    split: tuple[int, int, int, int, int]  # (d_mlp, d_mlp, d_ssm, conv_dim, H): zxbcdt
    xbc_split: tuple[int, int, int]  # (d_ssm, G N, G N)
    dims: tuple[int, int, int, int]  # (G, H, P, N)


def decode_layers(
    h: torch.Tensor,  # [B, M], the embedded input
    weights: DecodeWeights,
    states: list[Mamba2State],  # every block's, advanced in place
) -> torch.Tensor:
    """The residual stream [B, M] after every block (before the final norm), as an
    inference tensor: the caller's next op makes a normal one."""
    if weights.compiled is not None and h.shape[0] <= weights.compiled.rows_max:
        return weights.compiled(h, states)
    Bsz, M = h.shape
    with torch.inference_mode():
        r = F.pad(h, (0, 1), value=weights.pad)
        rows = r.view(Bsz, 1, M + 1)
        for w, (conv_state, ssm_state) in zip(weights.blocks, states):
            block_step(r, rows, w, conv_state, ssm_state)
        return r.narrow(1, 0, M)


def block_step(
    r: torch.Tensor,  # [B, M + 1], the residual stream and the constant column, in place
    rows: torch.Tensor,  # [B, 1, M + 1], a view of r
    w: BlockWeights,
    conv_state: torch.Tensor,  # [B, K-1, conv_dim], updated in place
    ssm_state: torch.Tensor,  # [B, H, P, N], updated in place
) -> None:
    """r += mixer(rmsnorm(r)) for one timestep; the states advance in place."""
    G, H, P, N = w.dims
    Bsz = r.shape[0]
    norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True)  # [B, 1, 1]
    zxbcdt = torch.addcdiv(w.in_b, torch.matmul(rows, w.in_wT), norm)  # [B, 1, W]
    z0, x0, z, xBC, dt = zxbcdt.split_with_sizes(w.split, 2)
    window = torch.cat((conv_state, xBC), 1)  # [B, K, conv_dim]
    conv_state.copy_(window.narrow(1, 1, conv_state.shape[1]))
    xBC = F.silu(torch.addcmul(w.conv_b, window, w.conv_wT).sum(1, keepdim=True))
    x, B, C = xBC.split_with_sizes(w.xbc_split, 2)
    x = x.view(Bsz, G, H // G, P, 1)
    delta = F.softplus(dt).view(Bsz, G, H // G, 1, 1)
    if w.dt_limit is not None:
        delta = delta.clamp(*w.dt_limit)
    ssm = ssm_state.view(Bsz, G, H // G, P, N)
    ssm.mul_(torch.mul(delta, w.A).exp_())
    ssm.addcmul_(delta.mul(x), B.view(Bsz, G, 1, 1, N))  # + delta x B^T
    y = torch.matmul(ssm, C.view(Bsz, G, 1, N, 1)).addcmul_(x, w.D)  # h C + D x: [.., P, 1]
    if w.gnorm is None:
        y = y.view(Bsz, -1).mul_(F.silu(z.view(Bsz, -1)))
    else:
        gs, eps, before = w.gnorm
        gate = F.silu(z.view(Bsz, G, gs))
        v = y.view(Bsz, G, gs)
        y = F.rms_norm(v if before else v.mul_(gate), (gs,), eps=eps)
        if before:
            y.mul_(gate)
        y = y.view(Bsz, -1)
    r.addmm_(y, w.out_wT)
    if w.mlp_wT is not None:
        r.addmm_(F.silu(z0.view(Bsz, -1)).mul_(x0.view(Bsz, -1)), w.mlp_wT)
    if w.out_b is not None:
        r.add_(w.out_b)


def _derive(w) -> BlockWeights:
    """A block's `BlockWeights` from its `Mamba2StepWeights` (without autograd)."""
    d_mlp, d_ssm, G, N, H, P = w.sizes
    W, M = w.in_w.shape
    new = w.in_w.new_zeros
    in_wT = new(M + 1, W)
    in_wT[:M] = (w.in_w * (w.norm_w * math.sqrt(M))).t()
    in_b = new(W) if w.in_b is None else w.in_b.clone()
    in_b[W - H :] += w.dt_bias
    out_wT = torch.cat([w.out_w.t(), new(w.out_w.shape[1], 1)], 1)  # [d_mlp + d_ssm, M + 1]
    if w.gnorm_w is not None:
        out_wT[d_mlp:] *= w.gnorm_w[:, None]
    conv_wT = w.conv_w.t().contiguous()
    conv_b = torch.zeros_like(conv_wT)
    if w.conv_b is not None:
        conv_b[-1] = w.conv_b
    D = w.D.view(G, H // G, -1, 1) if w.D.dim() == 2 else w.D.view(G, H // G, 1, 1)
    lo, hi = (float(v) for v in w.dt_limit)
    return BlockWeights(
        in_wT=in_wT,
        in_b=in_b,
        conv_wT=conv_wT,
        conv_b=conv_b,
        A=w.A.view(G, H // G, 1, 1).to(w.in_w.dtype),
        D=D.to(w.in_w.dtype),
        out_wT=out_wT[d_mlp:].contiguous(),
        mlp_wT=out_wT[:d_mlp].contiguous() if d_mlp else None,
        out_b=None if w.out_b is None else F.pad(w.out_b, (0, 1)),
        dt_limit=None if (lo, hi) == (0.0, math.inf) else (lo, hi),
        gnorm=None if w.gnorm_w is None else (d_ssm // G, w.gnorm_eps, w.norm_before_gate),
        split=(d_mlp, d_mlp, d_ssm, d_ssm + 2 * G * N, H),
        xbc_split=(d_ssm, G * N, G * N),
        dims=(G, H, P, N),
    )


def stack_weights(layers: list) -> DecodeWeights | None:
    """Every block's `BlockWeights` from the blocks' `Mamba2StepWeights`, or None when the
    blocks' norms differ in eps (the constant column of r holds one)."""
    eps = {w.eps for w in layers}
    if len(eps) != 1:
        return None
    with torch.no_grad():
        blocks = [_derive(w) for w in layers]
    pad = math.sqrt(eps.pop() * layers[0].norm_w.shape[0])
    return DecodeWeights(blocks, pad, compile_stack("mamba2", blocks, pad))
