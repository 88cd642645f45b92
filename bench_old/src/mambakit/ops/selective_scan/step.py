"""One decode timestep of the selective scan, in place on the state: the Triton kernel.

B batch, D = d_inner, N = d_state. For every row b and channel d:
    h[b, d, :] = exp(delta A[d, :]) h[b, d, :] + delta u B[b, :]
    y[b, d]    = h[b, d, :] . C[b, :] + D[d] u,   then  y * silu(z)
The kernel reads the state once and writes it once; its launcher (`state_update`,
launch.py) allocates nothing but y, syncs nothing with the host and is not autotuned
(an autotuner would rerun it on the state it just updated), so it is safe inside a
CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
