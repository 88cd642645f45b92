"""The mixer's inner part as a chain of ops, each with its own autograd: the CPU path and
the fused node's oracle (run with backend="triton", the same kernels op by op)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mamba_inner_chain(
    xz: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    ssm_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    backend: str = "auto",
    states_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """`mamba_inner` as a chain of ops, each saving its own inputs (u and delta included).
    `states_at` [B, k]: also the conv and ssm states after those steps (`mamba_inner`)."""
    from .. import causal_conv1d, selective_scan  # the public ops (this package imports them)
    from ..causal_conv1d.reference import conv_states_at

    Dn, N = A.shape
    R = dt_proj_weight.shape[1]
    # split, not two slices: its backward is one cat, a slice's a zero-filled [B, T, 2D] each
    x_in, z = xz.split(Dn, dim=-1)
    u, conv_out = causal_conv1d(
        x_in,
        conv_weight,
        conv_bias,
        initial_state=conv_state,
        seq_idx=seq_idx,
        activation="silu",
        return_final_state=True,
        backend=backend,
    )
    dt_r, B, C = F.linear(u, x_proj_weight).split([R, N, N], dim=-1)
    delta = F.linear(dt_r, dt_proj_weight)
    out = selective_scan(
        u,
        delta,
        A,
        B,
        C,
        D=D,
        z=z,
        delta_bias=dt_bias,
        delta_softplus=True,
        initial_state=ssm_state,
        seq_idx=seq_idx,
        return_final_state=True,
        backend=backend,
        states_at=states_at,
    )
    if states_at is None:
        return out[0], conv_out, out[1]
    y, ssm_out, ssm_at = out
    conv_at = conv_states_at(x_in, states_at, conv_weight.shape[1], conv_state, seq_idx)
    return y, conv_out, ssm_out, conv_at, ssm_at
