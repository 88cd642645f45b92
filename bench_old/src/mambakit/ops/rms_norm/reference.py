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
        if x.dtype == torch.float64 or (residual is not None and residual.dtype == torch.float64)
        else torch.float32
    )
    r = x if x.dtype == f else x.to(f)  # dtype checks first: .to() costs ~2 us even as a no-op
    if residual is not None:
        r = r + residual
    # mean(r^2) + eps as one addcmul on the L2 norm: arithmetic with a Python float
    # (`ms + eps`) converts the scalar on every call and costs twice a plain op on CPU
    norm = torch.linalg.vector_norm(r, dim=-1, keepdim=True)
    ms = torch.addcmul(norm.new_full((1,), eps), norm, norm, value=1.0 / r.shape[-1])
    out = r * ms.rsqrt_() * (weight if weight.dtype == f else weight.to(f))
    want = out_dtype or x.dtype
    return (out if want == f else out.to(want)), r
