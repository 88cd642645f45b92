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

from .._triton import launch, next_power_of_2, opt, pdl_args
from .reference import Sizes, _check_step, mamba2_step_fused_reference  # noqa: F401
from .step_kernels import _norm_kernel, _ssm_kernel


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
    check: bool = True,
) -> torch.Tensor:
    """`mamba2_step_fused_reference` in two Triton launches (the module docstring says
    which); the states must be f32 with stride 1 in their last dim and stay where they are.
    cfg: launch parameters other than the library's `CONFIG`. check=False: the caller
    checked every argument."""
    if check:
        _check_step(zxbcdt, conv_state, ssm_state, conv_w, conv_b, dt_bias, A, D, norm_w, sizes,
                    True)  # fmt: skip
    d_mlp, d_ssm, G, N, H, P = sizes
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
