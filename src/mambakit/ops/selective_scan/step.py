"""One decode timestep of the selective scan, in place on the state.

B batch, D = d_inner, N = d_state. For every row b and channel d:
    h[b, d, :] = exp(delta A[d, :]) h[b, d, :] + delta u B[b, :]
    y[b, d]    = h[b, d, :] . C[b, :] + D[d] u,   then  y * silu(z)
The kernel reads the state once and writes it once; it allocates nothing but y,
syncs nothing with the host and is not autotuned (an autotuner would rerun it
on the state it just updated), so it is safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import cdiv, launch, next_power_of_2, strides
from .tiles import LOG2E, _softplus


@triton.jit
def _state_update_kernel(
    p_state,
    p_u,
    p_dt,
    p_A,
    p_B,
    p_C,
    p_D,
    p_z,
    p_bias,
    p_y,
    Dn,
    N,
    s_h_b,
    s_h_d,
    s_h_n,
    s_u_b,
    s_dt_b,
    s_dt_d,
    s_A_d,
    s_A_n,
    s_B_b,
    s_C_b,
    s_D,
    s_z_b,
    s_z_d,
    s_bias,
    s_y_b,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    md = d < Dn
    mn = n < N
    mdn = md[:, None] & mn[None, :]
    p_h = p_state + b * s_h_b + d[:, None] * s_h_d + n[None, :] * s_h_n
    h = tl.load(p_h, mask=mdn, other=0.0).to(tl.float32)
    u = tl.load(p_u + b * s_u_b + d, mask=md, other=0.0).to(tl.float32)
    dt = tl.load(p_dt + b * s_dt_b + d * s_dt_d, mask=md, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(p_bias + d * s_bias, mask=md, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    A = tl.load(p_A + d[:, None] * s_A_d + n[None, :] * s_A_n, mask=mdn, other=0.0).to(tl.float32)
    Bv = tl.load(p_B + b * s_B_b + n, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(p_C + b * s_C_b + n, mask=mn, other=0.0).to(tl.float32)
    h = tl.exp2(dt[:, None] * A * LOG2E) * h + (dt * u)[:, None] * Bv[None, :]
    tl.store(p_h, h.to(p_state.dtype.element_ty), mask=mdn)
    y = tl.sum(h * Cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(p_D + d * s_D, mask=md, other=0.0).to(tl.float32) * u
    if HAS_Z:
        zv = tl.load(p_z + b * s_z_b + d * s_z_d, mask=md, other=0.0).to(tl.float32)
        y = y * zv * tl.sigmoid(zv)
    tl.store(p_y + b * s_y_b + d, y.to(p_y.dtype.element_ty), mask=md)


def state_update(
    ssm_state: torch.Tensor,  # [B, D, N], updated in place
    u: torch.Tensor,  # [B, D]
    delta: torch.Tensor,  # [B, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [B, N]
    C: torch.Tensor,  # [B, N]
    D: torch.Tensor | None,  # [D]
    z: torch.Tensor | None,  # [B, D]
    delta_bias: torch.Tensor | None,  # [D]
    delta_softplus: bool,
) -> torch.Tensor:
    Bsz, Dn = u.shape
    N = ssm_state.shape[2]
    y = torch.empty(Bsz, Dn, dtype=u.dtype, device=u.device)
    block_n = next_power_of_2(N)
    block_d = max(1, min(next_power_of_2(Dn), 2048 // block_n))
    if not u.is_cuda:  # the interpreter: small blocks
        block_d = min(block_d, 16)
    grid = (Bsz, cdiv(Dn, block_d))
    launch(_state_update_kernel, grid,
        ssm_state, u, delta, A, B, C,
        D if D is not None else A, z if z is not None else u,
        delta_bias if delta_bias is not None else A, y,
        Dn, N,
        *ssm_state.stride(), u.stride(0), *delta.stride(), *A.stride(), B.stride(0), C.stride(0),
        D.stride(0) if D is not None else 0, *strides(z, 2),
        delta_bias.stride(0) if delta_bias is not None else 0, y.stride(0),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus), BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=4 if block_d * block_n >= 1024 else 2,
    )  # fmt: skip
    return y
