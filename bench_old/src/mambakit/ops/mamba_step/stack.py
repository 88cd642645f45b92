"""The decode step of a stack of Mamba-1 blocks on the reference backend, in as few PyTorch
calls as it takes: the reference body of `ops.mamba_stack_step`.

B batch, M = d_model, D = d_inner, N = d_state, K = d_conv, R = dt_rank. Each block
advances the residual stream r one timestep and its conv and SSM state in place
(the math of `ops/mamba_step/README.md`, which `mamba_layer_step_reference` spells
out op by op):

    xz    = rmsnorm(r) W_in^T (+ b_in)                  -> x_in, z
    u     = silu(conv over [conv state; x_in] + b_conv)  conv state shifted in place
    dt_r, B, C = u W_x^T
    delta = softplus(dt_r W_dt^T + dt_bias)
    h     = exp(delta A) h + (delta u) B^T                ssm state in place
    r'    = r + ((h C + D u) * silu(z)) W_out^T (+ b_out)

At batch 1 on a CPU this step is bound by the cost of each PyTorch call (1-3 us of
dispatch, allocation and bookkeeping, against less than that in arithmetic for all
but in_proj), so it is written for few calls:

- r carries one extra column, the constant sqrt(eps M), so that |r| is
  sqrt(sum r^2 + eps M) = sqrt(M) / rsqrt(mean(r^2) + eps): the norm is one
  `vector_norm` and one `addcdiv` on in_proj's output (its weight scaled by the norm
  weight and sqrt(M)); out_proj has a zero column there, so the constant stays.
- r and the per-channel vectors are rows [B, 1, X], as 3-d matmuls produce them:
  splits are views and no reshape sits between the ops; the state update reads
  delta and delta u as columns through `.mT` views, so its in-place ops run on the
  contiguous state.
- the conv bias is the last row of the [K, D] addend of the conv's product, absent
  biases are zeros where an op adds them anyway, GEMM weights are contiguous
  transposed copies (MKL runs a batch-1 GEMM on them up to twice as fast as on a
  transposed view): `BlockWeights`, derived from the blocks' `StepWeights` by
  `stack_weights` once per decode plan (`inference.plan`: until a parameter changes).
- the blocks run under inference mode, which drops the per-call autograd bookkeeping
  that no_grad keeps; the caller's next op (the final norm) is outside it, so what
  the step returns is a normal tensor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..cpu_jit import compile_stack
from . import StepWeights


class BlockWeights(NamedTuple):
    """One block's tensors as `block_step` reads them."""

    in_wT: torch.Tensor  # [M + 1, 2D]: (W_in * norm weight * sqrt(M))^T, a zero last row
    in_b: torch.Tensor  # [2D] (zeros without a bias)
    conv_wT: torch.Tensor  # [K, D]
    conv_b: torch.Tensor  # [K, D]: zeros, the conv bias in the last row
    x_wT: torch.Tensor  # [D, R + 2N]
    dt_w: torch.Tensor  # [D, R]
    dt_bias: torch.Tensor  # [D]
    A: torch.Tensor  # [D, N]: -exp(A_log)
    D: torch.Tensor  # [D]
    out_wT: torch.Tensor  # [D, M + 1]: W_out^T, a zero last column
    out_b: torch.Tensor | None  # [M + 1], 0 in the last column
    halves: tuple[int, int]  # (D, D): the split of in_proj's output
    sizes: tuple[int, int, int]  # (R, N, N): the split of x_proj's output


class DecodeWeights(NamedTuple):
    """Every block's weights (the mixer's `BlockWeights`: this module's, Mamba-2's or
    Mamba-3's) and the value of r's constant column."""

    blocks: list
    pad: float  # sqrt(eps M), r's constant column (every block's norm has this eps)
    # the step compiled on these weights (`cpu_jit.<mixer>.Packed`) where it runs them
    compiled: object | None = None


def decode_layers(
    h: torch.Tensor,  # [B, M], the embedded input
    weights: DecodeWeights,
    conv: torch.Tensor,  # [L, B, K-1, D], updated in place
    ssm: torch.Tensor,  # [L, B, D, N], updated in place
) -> torch.Tensor:
    """The residual stream [B, M] after every block (before the final norm), as an
    inference tensor: the caller's next op makes a normal one."""
    if weights.compiled is not None and h.shape[0] <= weights.compiled.rows_max:
        return weights.compiled(h, conv, ssm)
    Bsz, M = h.shape
    with torch.inference_mode():
        r = F.pad(h, (0, 1), value=weights.pad).view(Bsz, 1, M + 1)
        for w, conv_state, ssm_state in zip(weights.blocks, conv.unbind(0), ssm.unbind(0)):
            block_step(r, w, conv_state, ssm_state)
        return r.view(Bsz, M + 1).narrow(1, 0, M)


def block_step(
    r: torch.Tensor,  # [B, 1, M + 1], the residual stream and the constant column, in place
    w: BlockWeights,
    conv_state: torch.Tensor,  # [B, K-1, D], updated in place
    ssm_state: torch.Tensor,  # [B, D, N], updated in place
) -> None:
    """r += mixer(rmsnorm(r)) for one timestep; the states advance in place."""
    norm = torch.linalg.vector_norm(r, dim=-1, keepdim=True)  # [B, 1, 1]
    xz = torch.addcdiv(w.in_b, torch.matmul(r, w.in_wT), norm)  # [B, 1, 2D]
    x_in, z = xz.split_with_sizes(w.halves, 2)  # [B, 1, D] each
    window = torch.cat((conv_state, x_in), 1)  # [B, K, D]
    conv_state.copy_(window.narrow(1, 1, conv_state.shape[1]))
    u = F.silu(torch.addcmul(w.conv_b, window, w.conv_wT).sum(1, keepdim=True))  # [B, 1, D]
    dt_r, B, C = torch.matmul(u, w.x_wT).split_with_sizes(w.sizes, 2)  # [B, 1, R | N | N]
    delta = F.softplus(F.linear(dt_r, w.dt_w, w.dt_bias))  # [B, 1, D]
    ssm_state.mul_(torch.mul(delta.mT, w.A).exp_())
    ssm_state.addcmul_(delta.mul_(u).mT, B)  # + (delta u) B^T
    y = torch.baddbmm(u.mul_(w.D), C, ssm_state.mT)  # C h^T + D u: [B, 1, D]
    r.add_(torch.matmul(y.mul_(F.silu(z)), w.out_wT))
    if w.out_b is not None:
        r.add_(w.out_b)


def _derive(w: StepWeights) -> BlockWeights:
    """A block's `BlockWeights` from its `StepWeights` (without autograd)."""
    D2, M = w.in_w.shape
    in_wT = w.in_w.new_zeros(M + 1, D2)
    in_wT[:M] = (w.in_w * (w.norm_w * math.sqrt(M))).t()
    out_wT = w.out_w.new_zeros(w.out_w.shape[1], M + 1)
    out_wT[:, :M] = w.out_w.t()
    conv_wT = w.conv_w.t().contiguous()
    bias_rows = torch.zeros_like(conv_wT)
    if w.conv_b is not None:
        bias_rows[-1] = w.conv_b
    N = w.A.shape[1]
    return BlockWeights(
        in_wT=in_wT,
        in_b=w.in_b if w.in_b is not None else w.in_w.new_zeros(D2),
        conv_wT=conv_wT,
        conv_b=bias_rows,
        x_wT=w.x_w.t().contiguous(),
        dt_w=w.dt_w,
        dt_bias=w.dt_bias,
        A=w.A,
        D=w.D,
        out_wT=out_wT,
        out_b=None if w.out_b is None else F.pad(w.out_b, (0, 1)),
        halves=(D2 // 2, D2 // 2),
        sizes=(w.dt_w.shape[1], N, N),
    )


def stack_weights(layers: list[StepWeights]) -> DecodeWeights | None:
    """Every block's `BlockWeights`, or None when the blocks' norms differ in eps (the
    constant column of r holds one)."""
    eps = {w.eps for w in layers}
    if len(eps) != 1:
        return None
    with torch.no_grad():
        blocks = [_derive(w) for w in layers]
    pad = math.sqrt(eps.pop() * layers[0].norm_w.shape[0])
    return DecodeWeights(blocks, pad, compile_stack("mamba1", blocks, pad))
