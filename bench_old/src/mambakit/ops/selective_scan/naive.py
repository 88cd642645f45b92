"""The selective scan as the recurrence reads, one step at a time in float64: the oracle.

B batch, T time, D = d_inner, N = d_state. No chunking, no fused terms, no custom
backward (autograd differentiates the loop): slow, and independent of both the
reference (reference.py) and the kernels, which the tests check against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_scan_naive(
    u: torch.Tensor,  # [B, T, D]
    delta: torch.Tensor,  # [B, T, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [B, T, N]
    C: torch.Tensor,  # [B, T, N]
    D: torch.Tensor | None = None,  # [D]
    z: torch.Tensor | None = None,  # [B, T, D]
    delta_bias: torch.Tensor | None = None,  # [D]
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,  # [B, D, N]
    seq_idx: torch.Tensor | None = None,  # [B, T]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, T, D], h_T [B, D, N]), both float64:

    dt_t = softplus(delta_t + delta_bias)     (or without softplus / bias)
    h_t  = exp(dt_t A) h_{t-1} + dt_t u_t B_t  (h_{t-1} = 0 where a document starts)
    y_t  = (C_t . h_t + D u_t) * silu(z_t)
    """
    f = torch.float64
    u, delta, B, C = u.to(f), delta.to(f), B.to(f), C.to(f)
    dt = delta + delta_bias.to(f) if delta_bias is not None else delta
    dt = F.softplus(dt) if delta_softplus else dt
    Bsz, T, Dn = u.shape
    h = initial_state.to(f) if initial_state is not None else u.new_zeros(Bsz, Dn, A.shape[1])
    ys = []
    for t in range(T):
        a = torch.exp(dt[:, t, :, None] * A.to(f))
        if seq_idx is not None and t > 0:
            a = a * (seq_idx[:, t] == seq_idx[:, t - 1]).to(f)[:, None, None]
        h = a * h + (dt[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + u * D.to(f)
    if z is not None:
        y = y * F.silu(z.to(f))
    return y, h
