"""The Mamba-3 SISO decode step as one Triton kernel: the state advances in place.

B batch, H heads of P values, G groups of B/C rows (head h reads group h // (H / G)),
N = d_state, S rotary angles. One program per (row, head) does what
`mamba3_step_reference` does for it:

    phi   = (phi + pi tanh(theta) delta) mod 2 pi
    k~    = rot(k + k_bias, phi)        q~ = rot(q + q_bias, phi)
    S     = alpha S + beta x_prev k~_prev^T + gamma x k~^T
    y     = (S q~ + D x) * silu(z)

with alpha = exp(A delta), beta = (1 - lam) delta alpha, gamma = lam delta, lam =
sigmoid(trap). The state [P, N] is one tile, its rows contiguous; the turn acts on the
vectors k and q alone: column n reads its pair's partner n ^ 1 and the angle n // 2
(columns 2i, 2i + 1 share angle i; those of i >= S have angle 0, no turn). State and
arithmetic are f32; y is stored in x's dtype. No allocation but y, no host sync: a step
can be captured in a CUDA graph. `state_update_raw` (what `Mamba3.step_` runs) takes k, q,
delta and A as in_proj gives them and makes them in the kernel.

One program holds a head's whole state: the state of its last key and angle is read by
every row of the head's state, so a head split over programs would need them to agree on
who writes it after all have read. On sm_90+ the kernel is launched with programmatic
dependent launch: it loads the weights (biases, norm weights, D) while in_proj finishes
and waits for it before reading anything a kernel writes.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ...state import Mamba3State
from .._triton import (
    cdiv,
    fast_cos_sin,
    launch,
    next_power_of_2,
    pdl_args,
    pdl_start,
    pdl_wait,
    sm_count,
)

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
        delta += dt_bias
        delta = tl.where(delta > 20.0, delta, tl.log(1.0 + tl.exp(delta)))  # softplus
        A = -tl.maximum(tl.maximum(A, 0.0) + 1.0 / (1.0 - tl.minimum(A, 0.0)), A_floor)
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


@dataclasses.dataclass(frozen=True)
class Mamba3StepConfig:
    """Launch parameters of the step kernel (not autotuned: it updates the state in place;
    `CONFIG` is the library's, scripts/m3_step_probe.py times others through `cfg=`)."""

    warps: int | None = None  # per program; None: `_warps`, by the state's size and programs


CONFIG = Mamba3StepConfig()


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
    cfg: Mamba3StepConfig | None = None,
) -> torch.Tensor:
    """y [B, H, P] in x.dtype; `state` advances one token in place. Every tensor's last
    dim must have stride 1 (the views of in_proj's output and of stacked states do). cfg:
    launch parameters other than the library's `CONFIG`."""
    return _launch(state, x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, None, cfg)


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
    cfg: Mamba3StepConfig | None = None,
) -> torch.Tensor:
    """`state_update` from in_proj's rows as they come: q, k, delta and A are made in the
    kernel as `Mamba3._inputs` makes them (the RMSNorms of C and B, softplus(dd_dt +
    dt_bias), -max(heavy_tail(dd_A), A_floor)), which would be a dozen small launches a
    layer and token otherwise."""
    raw = (dt_bias, _unit_last(C_weight), _unit_last(B_weight), A_floor, eps)
    return _launch(state, x, C, B, dd_dt, dd_A, trap, theta, q_bias, k_bias, D, z, raw, cfg)


def _launch(state, x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, raw, cfg):
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
    block_n = next_power_of_2(N)
    warps = (cfg or CONFIG).warps or _warps(next_power_of_2(P) * block_n, Bsz * H, x)
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
        BLOCK_P=next_power_of_2(P), BLOCK_N=block_n, RAW=raw is not None,
        num_warps=warps,
        **pdl_args(x),
    )  # fmt: skip
    return y


def _warps(values: int, programs: int, x: torch.Tensor) -> int:
    """Warps of a program holding `values` state values: 32 values a thread while the
    programs fit the SMs once, 64 up to twice, 128 beyond (more programs an SM, fewer
    registers on the vectors every thread repeats). H200, 130m-mamba3 layer (24 heads of
    64 x 128), us a layer (scripts/m3_step_probe.py; a copy of the state: 1.7, 5.0, 26.0):
    batch 1: 3.07 at 8 warps, 3.61 at 4; batch 8: 7.11 at 4, 9.77 at 8; batch 64: 34.6 at
    2, 38.0 at 4, 53.0 at 8."""
    per_sm = cdiv(programs, sm_count(x.device.index or 0)) if x.is_cuda else 1
    per_thread = 32 * min(4, next_power_of_2(per_sm))
    return max(1, min(16, values // (32 * per_thread)))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t with stride 1 in its last dim (the kernel indexes it so)."""
    return t if t.stride(-1) == 1 else t.contiguous()
