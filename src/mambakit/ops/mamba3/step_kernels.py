"""The Mamba-3 decode step's Triton kernel (`@triton.jit` only); step.py says what it does
and launches it."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .._triton import fast_cos_sin, pdl_start, pdl_wait
from .activations_kernels import delta_and_A

PI = tl.constexpr(math.pi)
TWO_PI = tl.constexpr(2 * math.pi)

# fmt: off


@triton.jit
def _load_pair(ptr, n, pair, N):
    """A row's columns n and their partners n ^ 1, as f32 (0 past N)."""
    v = tl.load(ptr + n, mask=n < N, other=0.0).to(tl.float32)
    return v, tl.load(ptr + pair, mask=pair < N, other=0.0).to(tl.float32)


@triton.jit
def _step_kernel(
    p_x, p_z, p_q, p_k, p_dt, p_A, p_trap, p_th, p_qb, p_kb, p_D,
    p_ang, p_ssm, p_kst, p_xst, p_y, p_dtb, p_qw, p_kw,
    P, N, S, heads_per_group, A_floor, eps,
    s_x_b, s_x_h, s_z_b, s_z_h, s_q_b, s_q_g, s_k_b, s_k_g, s_dt_b, s_A_b, s_tr_b, s_th_b,
    s_qb_h, s_kb_h, s_ang_b, s_ang_h, s_ssm_b, s_ssm_h, s_ssm_p, s_kst_b, s_kst_h,
    s_xst_b, s_xst_h, s_y_b, s_y_h,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    RAW: tl.constexpr, PDL: tl.constexpr,
):
    """RAW: q, k, delta and A come as in_proj gives them (C, B, dd_dt, dd_A) and are made
    here as the layer's `_inputs` makes them: k, q RMS-normalised over N with the weights
    kw, qw (f32 statistics, rounded to the input's dtype), delta = softplus(dd_dt + dt_bias),
    A = -max(f(dd_A), A_floor) with the heavy-tail f; else they come made."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // heads_per_group
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mp = p < P
    mn = n < N
    pair = n ^ 1  # the column turned with n
    i = n // 2  # its angle
    mi = mn & (i < S)
    # the weights: no kernel writes them
    kb, kb_pair = _load_pair(p_kb + h * s_kb_h, n, pair, N)
    qb, qb_pair = _load_pair(p_qb + h * s_qb_h, n, pair, N)
    if RAW:
        dt_bias = tl.load(p_dtb + h).to(tl.float32)
        kw, kw_pair = _load_pair(p_kw, n, pair, N)
        qw, qw_pair = _load_pair(p_qw, n, pair, N)
    if HAS_D:
        Dh = tl.load(p_D + h).to(tl.float32)
    pdl_wait(PDL)
    # the state: a [P, N] tile, the previous token's key and value, the angles
    p_s = p_ssm + b * s_ssm_b + h * s_ssm_h + p[:, None] * s_ssm_p + n[None, :]
    m_s = mp[:, None] & mn[None, :]
    st = tl.load(p_s, mask=m_s, other=0.0)
    p_kst_h = p_kst + b * s_kst_b + h * s_kst_h
    k_prev = tl.load(p_kst_h + n, mask=mn, other=0.0)
    p_xst_h = p_xst + b * s_xst_b + h * s_xst_h + p
    x_prev = tl.load(p_xst_h, mask=mp, other=0.0)
    p_ang_h = p_ang + b * s_ang_b + h * s_ang_h
    phi = tl.load(p_ang_h + i, mask=mi, other=0.0)
    # this token's inputs
    x = tl.load(p_x + b * s_x_b + h * s_x_h + p, mask=mp, other=0.0).to(tl.float32)
    delta = tl.load(p_dt + b * s_dt_b + h).to(tl.float32)
    A = tl.load(p_A + b * s_A_b + h).to(tl.float32)
    lam = tl.sigmoid(tl.load(p_trap + b * s_tr_b + h).to(tl.float32))
    theta = tl.load(p_th + b * s_th_b + i, mask=mi, other=0.0).to(tl.float32)
    k, k_pair = _load_pair(p_k + b * s_k_b + g * s_k_g, n, pair, N)
    q, q_pair = _load_pair(p_q + b * s_q_b + g * s_q_g, n, pair, N)
    if RAW:
        delta, A = delta_and_A(delta + dt_bias, A, A_floor)
        # a row's statistics once: the pair's values are the same row's, permuted
        rstd_k = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) / N + eps)
        rstd_q = 1.0 / tl.sqrt(tl.sum(q * q, axis=0) / N + eps)
        k = (k * rstd_k * kw).to(p_k.dtype.element_ty).to(tl.float32)
        k_pair = (k_pair * rstd_k * kw_pair).to(p_k.dtype.element_ty).to(tl.float32)
        q = (q * rstd_q * qw).to(p_q.dtype.element_ty).to(tl.float32)
        q_pair = (q_pair * rstd_q * qw_pair).to(p_q.dtype.element_ty).to(tl.float32)
    # the angles (those past S stay 0: an identity turn), then the turn: for n = 2i,
    # k~ = k cos - k_pair sin; for n = 2i + 1, k~ = k cos + k_pair sin
    phi += PI * (2 * tl.sigmoid(2 * theta) - 1) * delta
    phi = tl.where(mi, phi - TWO_PI * tl.floor(phi / TWO_PI), 0.0)
    cos, sin = fast_cos_sin(phi)
    sin = tl.where(n % 2 == 0, -sin, sin)
    k = (k + kb) * cos + (k_pair + kb_pair) * sin
    q = (q + qb) * cos + (q_pair + qb_pair) * sin
    alpha = tl.exp(A * delta)
    beta = (1 - lam) * delta * alpha
    gamma = lam * delta
    st = alpha * st + (beta * x_prev)[:, None] * k_prev[None, :] + (gamma * x)[:, None] * k[None, :]
    y = tl.sum(st * q[None, :], axis=1)
    if HAS_D:
        y += Dh * x
    if HAS_Z:
        z = tl.load(p_z + b * s_z_b + h * s_z_h + p, mask=mp, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.debug_barrier()  # a value held by several threads: all of them load before any stores
    tl.store(p_s, st, mask=m_s)
    tl.store(p_kst_h + n, k, mask=mn)
    tl.store(p_xst_h, x, mask=mp)
    tl.store(p_ang_h + i, phi, mask=mi & (n % 2 == 0))
    tl.store(p_y + b * s_y_b + h * s_y_h + p, y.to(p_y.dtype.element_ty), mask=mp)


# fmt: on
