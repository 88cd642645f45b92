"""Mamba-2's gated RMSNorm in plain PyTorch: the CPU path and the oracle.

x, z [..., D]; weight [D]; statistics per group of G = group_size consecutive channels.
With s = silu(z):

    norm_before_gate=False:  h = x * s,  out = h * rsqrt(mean_G(h^2) + eps) * weight
    norm_before_gate=True:   h = x,      out = h * rsqrt(mean_G(h^2) + eps) * weight * s

Arithmetic in f32 (f64 when x or z is float64); `out` is cast to `out_dtype` (default:
x.dtype). Autograd differentiates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import state_dtype


def rms_norm_gated_reference(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor | None = None,  # [..., D]
    weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-5,
    group_size: int | None = None,  # G, divides D; None: D
    norm_before_gate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    f = state_dtype(x, z)
    D = x.shape[-1]
    G = group_size or D
    h = x if x.dtype == f else x.to(f)
    s = F.silu(z if z.dtype == f else z.to(f)) if z is not None else None
    if s is not None and not norm_before_gate:
        h = h * s
    hg = h.unflatten(-1, (D // G, G)) if G else h[..., None]  # [..., D / G, G]
    rstd = torch.rsqrt(hg.square().mean(-1, keepdim=True) + eps)
    out = (hg * rstd).flatten(-2)
    if weight is not None:
        out = out * (weight if weight.dtype == f else weight.to(f))
    if s is not None and norm_before_gate:
        out = out * s
    want = out_dtype or x.dtype
    return out if want == f else out.to(want)
