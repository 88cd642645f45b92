"""Mamba-2's gated RMSNorm, one row and one group at a time in float64: the oracle.

M rows (the flattened leading dims), D features in groups of G = group_size. For every
row r and group k (channels j in [k G, (k + 1) G)), with s = z / (1 + exp(-z)):

    h_r[j]   = x_r[j] * s_r[j]   (norm_before_gate=False)   or   x_r[j]   (True)
    out_r[j] = h_r[j] / sqrt(sum_{j in group k} h_r[j]^2 / G + eps) * weight[j]
               (* s_r[j] when norm_before_gate)

No fused reductions and no custom backward (autograd differentiates the loop): slow, and
independent of both the reference (reference.py) and the kernels, which the tests check
against it.
"""

from __future__ import annotations

import torch


def rms_norm_gated_naive(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor | None = None,  # [..., D]
    weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """out [..., D] in float64 (the op rounds it to out_dtype; the oracle keeps it exact)."""
    f = torch.float64
    Dn = x.shape[-1]
    G = group_size or Dn
    xs = x.to(f).reshape(-1, Dn)  # [M, D]
    zs = z.to(f).reshape(-1, Dn) if z is not None else None
    w = weight.to(f) if weight is not None else torch.ones(Dn, dtype=f, device=x.device)
    rows = []
    for r in range(xs.shape[0]):
        gate = zs[r] / (1 + torch.exp(-zs[r])) if zs is not None else torch.ones_like(xs[r])
        pieces = []
        for k in range(0, Dn, G):
            h = xs[r, k : k + G] if norm_before_gate else xs[r, k : k + G] * gate[k : k + G]
            mean_sq = (h * h).sum() / G
            o = h / torch.sqrt(mean_sq + eps) * w[k : k + G]
            pieces.append(o * gate[k : k + G] if norm_before_gate else o)
        rows.append(torch.cat(pieces) if pieces else xs[r].clone())
    out = torch.stack(rows) if rows else xs.clone()
    return out.reshape(x.shape)
