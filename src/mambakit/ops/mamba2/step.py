"""One Mamba-2 decode step from in_proj's rows to what out_proj reads, the state in place.

B batch, H heads of P values (d_ssm = H P), G groups of the N-wide B/C rows (head h reads
group h // (H / G)), K = d_conv, conv_dim = d_ssm + 2 G N. A row of zxbcdt (in_proj's
output) is [z0, x0 (d_mlp each), z (d_ssm), xBC (conv_dim), dt (H)]. Per row:

    xBC     = silu(conv_b + sum_k conv_w[:, k] window[k])   window: conv state, then xBC
    x, B, C = split(xBC)                                    x [H, P], B and C [G, N]
    delta   = clamp(softplus(dt + dt_bias), dt_limit)       [H], f32
    h       = exp(delta A) h + delta x B^T                  [H, P, N], f32, in place
    y       = h C + D x                                     D: [H], [H, P] or None
    out     = gated RMSNorm of y over G groups of d_ssm / G channels (the heads of a group):
              v = y silu(z), v rstd(v) w   or (norm_before_gate)  y rstd(y) w silu(z);
              without a norm (norm_w None): y silu(z)
    result  = [silu(z0) x0, out]                            [B, d_mlp + d_ssm]

Values are rounded to zxbcdt's dtype where the sequence path stores them: the conv's
output (x, B, C) and y before the norm (mamba_ssm's step does the same: its state update
returns y in x's dtype, and the gated norm reads that); the gate without a norm acts on
the f32 y. State, statistics and arithmetic are f32 (f64 in the reference for f64 state).

`mamba2_step_fused_reference` is that in PyTorch (the CPU path and the oracle of the
kernels); `mamba2_step_triton` runs it in two launches (step_kernels.py):

1. `_ssm_kernel`, one program per (row, head, block of P rows): the conv of its x channels
   (shifting their state: one program owns them), the conv of its group's B and C
   channels (reading their state only), SiLU, delta, its [BLOCK_P, N] rows of the state
   in place, y (or y silu(z) without a norm) into the output.
2. `_norm_kernel`, one program per (row, group): shifts the conv state of the group's B
   and C channels, normalises and gates the group's y, and writes silu(z0) x0 for its
   share of the d_mlp channels.

Why two: the norm of a group needs every head of it, and the heads' states are too large
for one program to hold (130m-mamba2: one group of 24 heads of 64 x 128 f32 values, 768 KB
a row; one program per (row, group) would give one SM per row at batch 1). No grid-wide
sync or atomics (DESIGN section 5) leaves the launch boundary as the barrier. The same
boundary orders the B/C conv state: every program of a group reads it in kernel 1, so
only kernel 2 may shift it. Kernel 2 sums the squares itself rather than reading
per-head partial sums from kernel 1: it loads the group's y and z anyway, so the sum
costs no memory traffic and the step needs no scratch buffer.

Neither kernel is autotuned (both write the state in place: an autotuner's trial runs
would advance it), neither syncs with the host, and the only allocation is the output,
so a step can be captured in a CUDA graph; the state tensors keep their addresses. On
sm_90+ both launch with programmatic dependent launch: they load their weights while the
kernel before them finishes.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from .._checks import check_tensor, state_dtype
from .._triton import launch, next_power_of_2, opt, pdl_args
from .step_kernels import _norm_kernel, _ssm_kernel

Sizes = tuple[int, int, int, int, int, int]  # (d_mlp, d_ssm, G, N, H, P)


@dataclasses.dataclass(frozen=True)
class Mamba2StepConfig:
    """Launch parameters of the two step kernels, given by hand (never autotuned: the
    kernels update the state in place). Every default below was chosen by hand and is not
    yet measured against other values on the GPU (the defaults alone, 130m-mamba2 shape,
    bf16 rows, H200, in a CUDA graph: 4.1 us a step at batch 1, 8.1 at 8, 38 at 64)."""

    # rows of a head's [P, N] state per program of the state kernel (a power of 2; P
    # smaller: all of P). Chosen by hand, not yet measured: 32 x 128 f32 values a program,
    # and at 130m-mamba2, batch 1, 48 programs rather than 24.
    block_p: int = 32
    # warps of a state-kernel program; None: one per 1024 state values, 1 to 8. Chosen by
    # hand, not yet measured.
    warps: int | None = None
    # warps of a norm-kernel program; None: one per 256 channels of a group, 1 to 8. Chosen
    # by hand, not yet measured.
    norm_warps: int | None = None


CONFIG = Mamba2StepConfig()


def mamba2_step_fused_reference(
    zxbcdt: torch.Tensor,  # [B, W], W = 2 d_mlp + 2 d_ssm + 2 G N + H
    conv_state: torch.Tensor,  # [B, K-1, conv_dim], advanced in place
    ssm_state: torch.Tensor,  # [B, H, P, N], advanced in place
    conv_w: torch.Tensor,  # [conv_dim, K]
    conv_b: torch.Tensor | None,  # [conv_dim]
    dt_bias: torch.Tensor,  # [H]
    A: torch.Tensor,  # [H] < 0 (-exp(A_log))
    D: torch.Tensor | None,  # [H] or [H, P]
    norm_w: torch.Tensor | None,  # [d_ssm]; None: no norm, the plain gate y silu(z)
    eps: float,
    sizes: Sizes,  # (d_mlp, d_ssm, G, N, H, P)
    dt_limit: tuple[float, float] = (0.0, math.inf),
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """zxbcdt [B, W] (the in_proj rows, any float dtype, last stride 1, rows may be
    strided); conv_state [B, K-1, conv_dim] and ssm_state [B, H, P, N] f32 (or f64)
    advanced IN PLACE; sizes = (d_mlp, d_ssm, G, N, H, P); returns y [B, d_mlp + d_ssm] in
    zxbcdt.dtype: what out_proj reads."""
    d_mlp, d_ssm, G, N, H, P = _check(
        zxbcdt, conv_state, ssm_state, conv_w, conv_b, dt_bias, A, D, norm_w, sizes, False
    )
    Bsz = zxbcdt.shape[0]
    dtype = zxbcdt.dtype
    f = state_dtype(zxbcdt, conv_state, ssm_state)
    z0, x0, z, xBC, dt = zxbcdt.to(f).split([d_mlp, d_mlp, d_ssm, d_ssm + 2 * G * N, H], -1)
    # the conv: the window is the state's K-1 rows, then this token's; the state keeps the
    # window's last K-1
    window = torch.cat([conv_state.to(f), xBC.unsqueeze(1)], dim=1)  # [B, K, conv_dim]
    conv_state.copy_(window[:, 1:])
    xBC = (window * conv_w.to(f).t()).sum(1)
    if conv_b is not None:
        xBC = xBC + conv_b.to(f)
    xBC = F.silu(xBC).to(dtype).to(f)
    x, B, C = xBC.split([d_ssm, G * N, G * N], dim=-1)
    x = x.view(Bsz, H, P)
    B = B.view(Bsz, G, N).repeat_interleave(H // G, dim=1)  # [B, H, N]: each head's group
    C = C.view(Bsz, G, N).repeat_interleave(H // G, dim=1)
    # the state update and the readout
    delta = F.softplus(dt + dt_bias.to(f)).clamp(dt_limit[0], dt_limit[1])  # [B, H]
    decay = torch.exp(delta * A.to(f))
    h = decay[..., None, None] * ssm_state.to(f) + (delta[..., None] * x)[..., None] * B[:, :, None]
    ssm_state.copy_(h)
    y = torch.einsum("bhpn,bhn->bhp", h, C)
    if D is not None:
        Df = D.to(f)
        y = y + (Df.unsqueeze(-1) if Df.dim() == 1 else Df) * x
    y = y.flatten(1)  # [B, d_ssm]
    # the gate, with the gated RMSNorm over the groups' channels
    if norm_w is None:
        out = y * F.silu(z)
    else:
        y = y.to(dtype).to(f).view(Bsz, G, d_ssm // G)
        gate = F.silu(z).view(Bsz, G, d_ssm // G)
        v = y if norm_before_gate else y * gate
        out = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
        if norm_before_gate:
            out = out * gate
        out = out.flatten(1) * norm_w.to(f)
    if d_mlp > 0:
        out = torch.cat([F.silu(z0) * x0, out], dim=-1)
    return out.to(dtype)


def mamba2_step_triton(
    zxbcdt: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor | None,
    norm_w: torch.Tensor | None,
    eps: float,
    sizes: Sizes,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    norm_before_gate: bool = False,
    cfg: Mamba2StepConfig | None = None,
) -> torch.Tensor:
    """`mamba2_step_fused_reference` in two Triton launches (the module docstring says
    which); the states must be f32 with stride 1 in their last dim and stay where they are.
    cfg: launch parameters other than the library's `CONFIG`."""
    d_mlp, d_ssm, G, N, H, P = _check(
        zxbcdt, conv_state, ssm_state, conv_w, conv_b, dt_bias, A, D, norm_w, sizes, True
    )
    cfg = cfg or CONFIG
    if cfg.block_p < 1 or cfg.block_p & (cfg.block_p - 1):
        raise ValueError(f"cfg.block_p must be a power of 2, got {cfg.block_p}")
    Bsz = zxbcdt.shape[0]
    K = conv_w.shape[1]
    out = torch.empty(Bsz, d_mlp + d_ssm, device=zxbcdt.device, dtype=zxbcdt.dtype)
    if Bsz == 0:
        return out
    dt_bias, A, conv_b, norm_w = (
        t.contiguous() if t is not None else None for t in (dt_bias, A, conv_b, norm_w)
    )
    D = D.contiguous() if D is not None else None
    block_p = min(cfg.block_p, next_power_of_2(P))
    block_n = next_power_of_2(N)
    block_k = next_power_of_2(K)
    lo, hi = (float(v) for v in dt_limit)
    limit = (lo, hi) != (0.0, math.inf)
    pdl = pdl_args(zxbcdt)
    warps = cfg.warps or max(1, min(8, block_p * block_n // 1024))
    launch(_ssm_kernel, (Bsz, H, -(-P // block_p)),
        zxbcdt, conv_state, ssm_state, conv_w, opt(conv_b, dt_bias), dt_bias, A,
        opt(D, dt_bias), out,
        d_mlp, d_ssm, G, N, P, H // G, lo if limit else 0.0, hi if limit else 0.0,
        zxbcdt.stride(0), conv_state.stride(0), conv_state.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        conv_w.stride(0), conv_w.stride(1), D.stride(0) if D is not None else 0, out.stride(0),
        K=K, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=conv_b is not None, HAS_D=D is not None,
        D_HDIM=D is not None and D.dim() == 2, HAS_NORM=norm_w is not None, LIMIT=limit,
        num_warps=warps, **pdl,
    )  # fmt: skip
    group = d_ssm // G
    block_g = next_power_of_2(group)
    mlp_per_group = -(-d_mlp // G)
    launch(_norm_kernel, (Bsz, G),
        zxbcdt, conv_state, opt(norm_w, dt_bias), out,
        d_mlp, d_ssm, G, N, group, mlp_per_group, float(eps),
        zxbcdt.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        K=K, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_G=block_g,
        BLOCK_M=min(1024, next_power_of_2(max(mlp_per_group, 1))),
        HAS_NORM=norm_w is not None, NORM_BEFORE_GATE=bool(norm_before_gate),
        HAS_MLP=d_mlp > 0,
        num_warps=cfg.norm_warps or max(1, min(8, block_g // 256)), **pdl,
    )  # fmt: skip
    return out


def _check(zxbcdt, conv_state, ssm_state, conv_w, conv_b, dt_bias, A, D, norm_w, sizes,
           f32_state: bool) -> Sizes:  # fmt: skip
    """The sizes, after checking every argument against them (a ValueError or TypeError that
    names the argument; nothing is written before). f32_state: the Triton path's states."""
    d_mlp, d_ssm, G, N, H, P = (int(s) for s in sizes)
    if min(d_ssm, G, N, H, P) < 1 or d_mlp < 0:
        raise ValueError(f"sizes (d_mlp, d_ssm, G, N, H, P) must be positive, got {sizes}")
    if d_ssm != H * P or H % G:
        raise ValueError(f"sizes need d_ssm = H P and G dividing H, got {sizes}")
    conv_dim = d_ssm + 2 * G * N
    check_tensor("zxbcdt", zxbcdt, (None, 2 * d_mlp + d_ssm + conv_dim + H),
                 last_dim_contiguous=True)  # fmt: skip
    Bsz, dev = zxbcdt.shape[0], zxbcdt.device
    check_tensor("conv_w", conv_w, (conv_dim, None), device=dev)
    K = conv_w.shape[1]
    states = (torch.float32,) if f32_state else (torch.float32, torch.float64)
    check_tensor("conv_state", conv_state, (Bsz, K - 1, conv_dim), states, dev, True)
    check_tensor("ssm_state", ssm_state, (Bsz, H, P, N), states, dev, True)
    if conv_b is not None:
        check_tensor("conv_b", conv_b, (conv_dim,), device=dev)
    check_tensor("dt_bias", dt_bias, (H,), device=dev)
    check_tensor("A", A, (H,), device=dev)
    if D is not None:
        check_tensor("D", D, (H,) if D.dim() == 1 else (H, P), device=dev)
    if norm_w is not None:
        check_tensor("norm_w", norm_w, (d_ssm,), device=dev)
    return d_mlp, d_ssm, G, N, H, P
