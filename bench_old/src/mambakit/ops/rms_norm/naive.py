"""RMSNorm with a fused residual add, one row at a time in float64: the oracle.

M rows (the flattened leading dims), D features. For every row r:

    residual_out_r = x_r + residual_r
    out_r          = residual_out_r / sqrt(sum_j residual_out_r[j]^2 / D + eps) * weight

No fused reductions and no custom backward (autograd differentiates the loop):
slow, and independent of both the reference (reference.py) and the kernels,
which the tests check against it.
"""

from __future__ import annotations

import torch


def rms_norm_naive(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,  # [..., D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out), both [..., D] float64 (the op rounds `out` to out_dtype and
    keeps residual_out in f32; the oracle keeps both exact)."""
    f = torch.float64
    Dn = x.shape[-1]
    rows_in = x.to(f).reshape(-1, Dn)  # [M, D]
    if residual is not None:
        rows_in = rows_in + residual.to(f).reshape(-1, Dn)
    w = weight.to(f)
    outs = []
    for r in rows_in:
        mean_sq = (r * r).sum() / Dn
        outs.append(r / torch.sqrt(mean_sq + eps) * w)
    out = torch.stack(outs) if outs else rows_in.clone()
    return out.reshape(x.shape), rows_in.reshape(x.shape)
