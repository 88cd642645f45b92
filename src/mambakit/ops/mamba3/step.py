"""The Mamba-3 SISO decode step as one Triton kernel: the state advances in place.

B batch, H heads of P values, G groups of B/C rows (head h reads group h // (H / G)),
N = d_state, S rotary angles. One program per (row, head) does what
`mamba3_step_reference` does for it:

    phi   = (phi + pi tanh(theta) delta) mod 2 pi
    k~    = rot(k + k_bias, phi)        q~ = rot(q + q_bias, phi)
    S     = alpha S + beta x_prev k~_prev^T + gamma x k~^T
    y     = (S q~ + D x) * silu(z)

with alpha = exp(A delta), beta = (1 - lam) delta alpha, gamma = lam delta, lam =
sigmoid(trap). The rotation turns the pairs (2i, 2i + 1), so the kernel holds the
even and the odd state columns as two [P, N/2] tiles: each pair's two values meet
in the same position of both. Pairs i >= S have angle 0 (no turn). State and
arithmetic are f32; y is stored in x's dtype. No allocation but y, no host sync:
a step can be captured in a CUDA graph. `state_update_raw` (what `Mamba3.step_` runs)
takes k, q, delta and A as in_proj gives them and makes them in the kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._triton import fast_cos_sin, launch, next_power_of_2
from .reference import Mamba3State

PI = tl.constexpr(math.pi)
TWO_PI = tl.constexpr(2 * math.pi)

# fmt: off


@triton.jit
def _load_pairs(ptr, col_stride, i, N):
    """Columns 2i and 2i + 1 of a row, as f32 (0 past N)."""
    even = tl.load(ptr + (2 * i) * col_stride, mask=2 * i < N, other=0.0).to(tl.float32)
    odd = tl.load(ptr + (2 * i + 1) * col_stride, mask=2 * i + 1 < N, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def _turn(even, odd, cos, sin):
    return even * cos - odd * sin, even * sin + odd * cos


@triton.jit
def _rms_pairs(even, odd, p_w, i, N, eps, dtype: tl.constexpr):
    """A row held as its even and odd columns, RMS-normalised over its N values with the
    weights at p_w (f32 statistics), rounded to `dtype` as `ops.rms_norm` outputs it."""
    rstd = 1.0 / tl.sqrt((tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / N + eps)
    we, wo = _load_pairs(p_w, 1, i, N)
    even = (even * rstd * we).to(dtype).to(tl.float32)
    odd = (odd * rstd * wo).to(dtype).to(tl.float32)
    return even, odd


@triton.jit
def _step_kernel(
    p_x, p_z, p_q, p_k, p_dt, p_A, p_trap, p_th, p_qb, p_kb, p_D,
    p_ang, p_ssm, p_kst, p_xst, p_y, p_dtb, p_qw, p_kw,
    P, N, S, heads_per_group, A_floor, eps,
    s_x_b, s_x_h, s_z_b, s_z_h, s_q_b, s_q_g, s_k_b, s_k_g, s_dt_b, s_A_b, s_tr_b, s_th_b,
    s_qb_h, s_kb_h, s_ang_b, s_ang_h, s_ssm_b, s_ssm_h, s_ssm_p, s_kst_b, s_kst_h,
    s_xst_b, s_xst_h, s_y_b, s_y_h,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr,
    RAW: tl.constexpr,
):
    """RAW: q, k, delta and A come as in_proj gives them (C, B, dd_dt, dd_A) and are made
    here as the layer's `_inputs` makes them: k, q RMS-normalised over N with the weights
    kw, qw (f32 statistics, rounded to the input's dtype), delta = softplus(dd_dt + dt_bias),
    A = -max(f(dd_A), A_floor) with the heavy-tail f; else they come made."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // heads_per_group
    p = tl.arange(0, BLOCK_P)
    i = tl.arange(0, BLOCK_I)  # pair index: columns 2i, 2i + 1
    mp = p < P
    mi = i < S
    me = (2 * i < N)[None, :] & mp[:, None]
    mo = (2 * i + 1 < N)[None, :] & mp[:, None]
    x = tl.load(p_x + b * s_x_b + h * s_x_h + p, mask=mp, other=0.0).to(tl.float32)
    delta = tl.load(p_dt + b * s_dt_b + h).to(tl.float32)
    A = tl.load(p_A + b * s_A_b + h).to(tl.float32)
    if RAW:
        delta += tl.load(p_dtb + h).to(tl.float32)
        delta = tl.where(delta > 20.0, delta, tl.log(1.0 + tl.exp(delta)))  # softplus
        A = -tl.maximum(tl.maximum(A, 0.0) + 1.0 / (1.0 - tl.minimum(A, 0.0)), A_floor)
    lam = tl.sigmoid(tl.load(p_trap + b * s_tr_b + h).to(tl.float32))
    # the angles: those past S stay 0 (an identity turn)
    theta = tl.load(p_th + b * s_th_b + i, mask=mi, other=0.0).to(tl.float32)
    p_ang_h = p_ang + b * s_ang_b + h * s_ang_h + i
    phi = tl.load(p_ang_h, mask=mi, other=0.0) + PI * (2 * tl.sigmoid(2 * theta) - 1) * delta
    phi = tl.where(mi, phi - TWO_PI * tl.floor(phi / TWO_PI), 0.0)
    cos, sin = fast_cos_sin(phi)
    ke, ko = _load_pairs(p_k + b * s_k_b + g * s_k_g, 1, i, N)
    qe, qo = _load_pairs(p_q + b * s_q_b + g * s_q_g, 1, i, N)
    if RAW:
        ke, ko = _rms_pairs(ke, ko, p_kw, i, N, eps, p_k.dtype.element_ty)
        qe, qo = _rms_pairs(qe, qo, p_qw, i, N, eps, p_q.dtype.element_ty)
    kbe, kbo = _load_pairs(p_kb + h * s_kb_h, 1, i, N)
    ke, ko = _turn(ke + kbe, ko + kbo, cos, sin)
    qbe, qbo = _load_pairs(p_qb + h * s_qb_h, 1, i, N)
    qe, qo = _turn(qe + qbe, qo + qbo, cos, sin)
    # the state: even and odd columns, and the previous token's key and value
    p_s = p_ssm + b * s_ssm_b + h * s_ssm_h + p[:, None] * s_ssm_p + 2 * i[None, :]
    se = tl.load(p_s, mask=me, other=0.0)
    so = tl.load(p_s + 1, mask=mo, other=0.0)
    p_kst_h = p_kst + b * s_kst_b + h * s_kst_h
    kpe, kpo = _load_pairs(p_kst_h, 1, i, N)
    p_xst_h = p_xst + b * s_xst_b + h * s_xst_h + p
    xp = tl.load(p_xst_h, mask=mp, other=0.0)
    alpha = tl.exp(A * delta)
    beta = (1 - lam) * delta * alpha
    gamma = lam * delta
    se = alpha * se + (beta * xp)[:, None] * kpe[None, :] + (gamma * x)[:, None] * ke[None, :]
    so = alpha * so + (beta * xp)[:, None] * kpo[None, :] + (gamma * x)[:, None] * ko[None, :]
    y = tl.sum(se * qe[None, :], axis=1) + tl.sum(so * qo[None, :], axis=1)
    if HAS_D:
        y += tl.load(p_D + h).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(p_z + b * s_z_b + h * s_z_h + p, mask=mp, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.debug_barrier()  # a value held by several threads: all of them load before any stores
    tl.store(p_s, se, mask=me)
    tl.store(p_s + 1, so, mask=mo)
    tl.store(p_kst_h + 2 * i, ke, mask=2 * i < N)
    tl.store(p_kst_h + 2 * i + 1, ko, mask=2 * i + 1 < N)
    tl.store(p_xst_h, x, mask=mp)
    tl.store(p_ang_h, phi, mask=mi)
    tl.store(p_y + b * s_y_b + h * s_y_h + p, y.to(p_y.dtype.element_ty), mask=mp)


# fmt: on


def state_update(
    state: Mamba3State,  # angle [B, H, S], ssm [B, H, P, N], k [B, H, N], x [B, H, P]: f32
    x: torch.Tensor,  # [B, H, P]
    q: torch.Tensor,  # [B, G, N]
    k: torch.Tensor,  # [B, G, N]
    delta: torch.Tensor,  # [B, H]
    A: torch.Tensor,  # [B, H]
    trap: torch.Tensor,  # [B, H]
    theta: torch.Tensor,  # [B, S]
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None,  # [H]
    z: torch.Tensor | None,  # [B, H, P]
) -> torch.Tensor:
    """y [B, H, P] in x.dtype; `state` advances one token in place. Every tensor's last
    dim must have stride 1 (the views of in_proj's output and of stacked states do)."""
    return _launch(state, x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, None)


def state_update_raw(
    state: Mamba3State,
    x: torch.Tensor,  # [B, H, P]
    C: torch.Tensor,  # [B, G, N], before C_norm
    B: torch.Tensor,  # [B, G, N], before B_norm
    dd_dt: torch.Tensor,  # [B, H]
    dd_A: torch.Tensor,  # [B, H]
    trap: torch.Tensor,  # [B, H]
    theta: torch.Tensor,  # [B, S]
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None,  # [H]
    z: torch.Tensor | None,  # [B, H, P]
    dt_bias: torch.Tensor,  # [H]
    A_floor: float,
    C_weight: torch.Tensor,  # [N]
    B_weight: torch.Tensor,  # [N]
    eps: float,
) -> torch.Tensor:
    """`state_update` from in_proj's rows as they come: q, k, delta and A are made in the
    kernel as `Mamba3._inputs` makes them (the RMSNorms of C and B, softplus(dd_dt +
    dt_bias), -max(heavy_tail(dd_A), A_floor)), which would be a dozen small launches a
    layer and token otherwise."""
    raw = (dt_bias, _unit_last(C_weight), _unit_last(B_weight), A_floor, eps)
    return _launch(state, x, C, B, dd_dt, dd_A, trap, theta, q_bias, k_bias, D, z, raw)


def _launch(state, x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, raw):
    for name, t in zip(state._fields, state):
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(
                f"state.{name}: the Triton step needs f32 with stride 1 in the last dim, got "
                f"{t.dtype} with strides {t.stride()}"
            )
    x, q, k, theta, q_bias, k_bias = map(_unit_last, (x, q, k, theta, q_bias, k_bias))
    delta, A, trap = map(_unit_last, (delta, A, trap))
    z = _unit_last(z) if z is not None else None
    Bsz, H, P = x.shape
    G, N = q.shape[1], q.shape[2]
    S = theta.shape[1]
    y = torch.empty(Bsz, H, P, device=x.device, dtype=x.dtype)
    ang, ssm, kst, xst = state
    zz = z if z is not None else x
    dtb, qw, kw, A_floor, eps = raw if raw is not None else (delta, q, k, 0.0, 0.0)
    launch(_step_kernel, (Bsz, H),
        x, zz, q, k, delta, A, trap, theta, q_bias, k_bias, D if D is not None else delta,
        ang, ssm, kst, xst, y, dtb, qw, kw,
        P, N, S, H // G, A_floor, eps,
        x.stride(0), x.stride(1), zz.stride(0), zz.stride(1), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), delta.stride(0), A.stride(0), trap.stride(0), theta.stride(0),
        q_bias.stride(0), k_bias.stride(0), ang.stride(0), ang.stride(1),
        ssm.stride(0), ssm.stride(1), ssm.stride(2), kst.stride(0), kst.stride(1),
        xst.stride(0), xst.stride(1), y.stride(0), y.stride(1),
        HAS_Z=z is not None, HAS_D=D is not None,
        BLOCK_P=next_power_of_2(P), BLOCK_I=next_power_of_2((N + 1) // 2), RAW=raw is not None,
        num_warps=8 if P * N >= 8192 else 4 if P * N >= 2048 else 1,  # <= 32 state values a thread
    )  # fmt: skip
    return y


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t with stride 1 in its last dim (the kernel indexes it so)."""
    return t if t.stride(-1) == 1 else t.contiguous()
