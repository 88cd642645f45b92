"""RMSNorm with a fused residual add, in plain PyTorch: the CPU path and the oracle.

    residual_out = x + residual            (f32, or f64 on the oracle path)
    out          = residual_out * rsqrt(mean(residual_out^2) + eps) * weight

`out` is cast to `out_dtype` (default: x.dtype); statistics are in f32.
"""

from __future__ import annotations

import torch


def rms_norm_reference(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,  # [..., D]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    f = (
        torch.float64
        if torch.float64 in (x.dtype, residual.dtype if residual is not None else None)
        else torch.float32
    )
    r = x.to(f) if residual is None else x.to(f) + residual.to(f)
    out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.to(f)
    return out.to(out_dtype or x.dtype), r
