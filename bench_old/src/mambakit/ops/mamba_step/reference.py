"""One decode step of a Mamba block in plain PyTorch: the oracle of the fused kernels.

B batch, M = d_model, D = d_inner, N = d_state, R = dt_rank. The op chain the
unfused step runs, written out once:

    residual' = x + residual                        (f32)
    xz        = rmsnorm(residual') W_in^T (+ b)     [B, 2D] -> x_in, z
    u         = silu(conv update of x_in)           (state shifted in place)
    dt_low, B, C = split(u W_x^T, [R, N, N])
    delta     = dt_low W_dt^T                       (softplus(delta + dt_bias) in the update)
    y         = state update(u, delta, A, B, C, D) * silu(z)   (state in place)
    out       = y W_out^T (+ b)

Every intermediate the chain stores is in the compute dtype (the weights'),
the residual and the states in f32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..causal_conv1d.reference import causal_conv1d_update_reference
from ..rms_norm.reference import rms_norm_reference
from ..selective_scan.reference import selective_state_update_reference


def mamba_layer_step_reference(
    hidden: torch.Tensor,  # [B, M]
    residual: torch.Tensor | None,  # [B, M] f32, None at the first layer
    w,  # StepWeights
    conv_state: torch.Tensor,  # [B, K-1, D] f32, updated in place
    ssm_state: torch.Tensor,  # [B, D, N] f32, updated in place
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, M] in the compute dtype, residual' [B, M] f32)."""
    normed, res = rms_norm_reference(hidden, w.norm_w, w.eps, residual, w.in_w.dtype)
    xz = F.linear(normed, w.in_w, w.in_b)
    Dn, N = w.A.shape
    R = w.dt_w.shape[1]
    u = causal_conv1d_update_reference(conv_state, xz[:, :Dn], w.conv_w, w.conv_b, "silu")
    x_dbl = F.linear(u, w.x_w)
    delta = F.linear(x_dbl[:, :R], w.dt_w)
    y = selective_state_update_reference(
        ssm_state, u, delta, w.A, x_dbl[:, R : R + N], x_dbl[:, R + N :], w.D, xz[:, Dn:],
        w.dt_bias, True,
    )  # fmt: skip
    return F.linear(y, w.out_w, w.out_b), res


def norm_linear_reference(
    x: torch.Tensor,  # [B, K]
    weight: torch.Tensor,  # [Nout, K]
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,  # [B, K] f32
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-5,
) -> torch.Tensor:
    """rmsnorm(x + residual) W^T (+ bias) in the weight's dtype; x W^T (+ bias) without the norm."""
    if norm_weight is not None:
        x, _ = rms_norm_reference(x, norm_weight, eps, residual, weight.dtype)
    elif residual is not None:
        x = (x.float() + residual).to(weight.dtype)
    return F.linear(x if x.dtype == weight.dtype else x.to(weight.dtype), weight, bias)
