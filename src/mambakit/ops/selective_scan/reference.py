"""Selective scan in plain PyTorch: the CPU path and the oracle of the Triton kernels.

Glossary (Mamba paper, Algorithm 2): B batch, T time, D = d_inner channels,
N = d_state. For every row, channel d and state n:

    delta_t = softplus(delta_raw_t + delta_bias)          (when delta_softplus)
    a_t     = exp(delta_t * A[d, n])                      (discretised A, ZOH)
    b_t     = delta_t * u_t * B_t[n]                      (discretised B, Euler)
    h_t     = a_t * h_{t-1} + b_t                         h_0 = initial_state
    y_t     = sum_n h_t[n] * C_t[n] + D * u_t,  then  y_t * silu(z_t)

A document start (seq_idx changes between t-1 and t) sets a_t = 0, so nothing
flows across it. The recurrence h_t = a_t h_{t-1} + b_t is a first-order linear
one, so it is solved with an associative scan over pairs (a, b):
(a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2). Time is cut in groups small
enough to stay in cache and groups in chunks of `CHUNK`; all chunks of a group
are scanned at once with a Hillis-Steele scan (log2 CHUNK steps of whole-tensor
ops), then one short loop over chunks carries the state across.
No exp of a positive number is ever taken, so it is stable for any delta.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 16  # timesteps scanned in parallel; the carry loop runs T / CHUNK times
GROUP_ELEMENTS = 1 << 20  # [B, group, D, N] tensors are kept near this size to stay in cache


def _scan_pairs(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of (a, b) pairs along dim 2 of [B, nc, L, D, N] tensors."""
    L = a.shape[2]
    k = 1
    while k < L:
        b = torch.cat([b[:, :, :k], torch.addcmul(b[:, :, k:], a[:, :, k:], b[:, :, :-k])], dim=2)
        a = torch.cat([a[:, :, :k], a[:, :, k:] * a[:, :, :-k]], dim=2)
        k *= 2
    return a, b


def _scan_group(
    a: torch.Tensor, b: torch.Tensor, C: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = a_t h_{t-1} + b_t over [B, T, D, N] from h [B, D, N]; returns (y [B, T, D], h_T)."""
    Bsz, T, D, N = a.shape
    L = min(CHUNK, T)
    nc = -(-T // L)
    pad = nc * L - T
    if pad:  # identity pairs (1, 0) leave the state unchanged
        a = torch.cat([a, a.new_ones(Bsz, pad, D, N)], dim=1)
        b = torch.cat([b, b.new_zeros(Bsz, pad, D, N)], dim=1)
    a_cum, b_cum = _scan_pairs(a.view(Bsz, nc, L, D, N), b.view(Bsz, nc, L, D, N))
    h_in = []
    for c in range(nc):  # carry across chunks: h_in of chunk c+1 = h_out of chunk c
        h_in.append(h)
        h = torch.addcmul(b_cum[:, c, -1], a_cum[:, c, -1], h)
    h_all = torch.addcmul(b_cum, a_cum, torch.stack(h_in, dim=1).unsqueeze(2))
    h_all = h_all.view(Bsz, nc * L, D, N)[:, :T]
    y = torch.einsum("btdn,btn->btd", h_all, C)
    return y, h


def selective_scan_reference(
    u: torch.Tensor,  # [B, T, D]
    delta: torch.Tensor,  # [B, T, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [B, T, N]
    C: torch.Tensor,  # [B, T, N]
    D: torch.Tensor | None = None,  # [D]
    z: torch.Tensor | None = None,  # [B, T, D]
    delta_bias: torch.Tensor | None = None,  # [D]
    delta_softplus: bool = True,
    initial_state: torch.Tensor | None = None,  # [B, D, N]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Inputs are checked by `mambakit.ops.selective_scan`; see the module docstring."""
    f = torch.float64 if u.dtype == torch.float64 else torch.float32
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    uf, dt = u.to(f), delta.to(f)
    if delta_bias is not None:
        dt = dt + delta_bias.to(f)
    if delta_softplus:
        dt = F.softplus(dt)
    Af, Bf, Cf = A.to(f), B.to(f), C.to(f)
    keep = None
    if seq_idx is not None:  # 0 where a new document starts at t
        keep = torch.ones(Bsz, T, device=u.device, dtype=f)
        keep[:, 1:] = (seq_idx[:, 1:] == seq_idx[:, :-1]).to(f)
    h = (
        initial_state.to(f)
        if initial_state is not None
        else torch.zeros(Bsz, Dn, N, device=u.device, dtype=f)
    )
    group = CHUNK
    while group < 2048 and 2 * group * Bsz * Dn * N <= GROUP_ELEMENTS:
        group *= 2
    ys = []
    for t0 in range(0, T, group):
        sl = slice(t0, min(T, t0 + group))
        a = torch.exp(dt[:, sl, :, None] * Af)  # [B, t, D, N]
        if keep is not None:
            a = a * keep[:, sl, None, None]
        b = (dt[:, sl] * uf[:, sl])[..., None] * Bf[:, sl, None, :]  # [B, t, D, N]
        y, h = _scan_group(a, b, Cf[:, sl], h)
        ys.append(y)
    y = torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]
    if D is not None:
        y = y + uf * D.to(f)
    if z is not None:
        y = y * F.silu(z.to(f))
    y = y.to(u.dtype)
    return (y, h) if return_final_state else y


def selective_state_update_reference(
    ssm_state: torch.Tensor,  # [B, D, N], updated in place
    u: torch.Tensor,  # [B, D]
    delta: torch.Tensor,  # [B, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [B, N]
    C: torch.Tensor,  # [B, N]
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = True,
) -> torch.Tensor:
    """One timestep of the scan (decode): updates `ssm_state` in place, returns y [B, D]."""
    f = ssm_state.dtype
    dt = delta.to(f)
    if delta_bias is not None:
        dt = dt + delta_bias.to(f)
    if delta_softplus:
        dt = F.softplus(dt)
    uf = u.to(f)
    a = torch.exp(dt[..., None] * A.to(f))
    h = ssm_state * a + (dt * uf)[..., None] * B.to(f)[:, None, :]
    ssm_state.copy_(h)
    y = torch.einsum("bdn,bn->bd", h, C.to(f))
    if D is not None:
        y = y + uf * D.to(f)
    if z is not None:
        y = y * F.silu(z.to(f))
    return y.to(u.dtype)
