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

from .._checks import state_dtype

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


def _scan_states(
    a: torch.Tensor, b: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = a_t h_{t-1} + b_t over [B, T, D, N] from h [B, D, N]: (h_all [B, T, D, N], h_T)."""
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
    return h_all.view(Bsz, nc * L, D, N)[:, :T], h


def _group_size(Bsz: int, D: int, N: int) -> int:
    group = CHUNK
    while group < 2048 and 2 * group * Bsz * D * N <= GROUP_ELEMENTS:
        group *= 2
    return group


def _decay(dt: torch.Tensor, A: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    a = torch.exp(dt[..., None] * A)  # [B, t, D, N]
    return a if keep is None else a * keep[..., None, None]


class _Scan(torch.autograd.Function):
    """The core recurrence with a hand-written backward (DESIGN.md section 6).

    Inputs: dt [B, T, D] (after softplus), x = dt * u [B, T, D], A [D, N],
    B, C [B, T, N], keep [B, T] (0 at document starts) or None, h0 [B, D, N].
    Outputs: y_t = sum_n h_t C_t [B, T, D] and h_T. Only the states at group
    boundaries are kept; the backward recomputes each group's states, then runs
    the reverse scan g_h_t = C_t gy_t + a_{t+1} g_h_{t+1} with the same machinery.
    """

    @staticmethod
    def forward(ctx, dt, x, A, Bm, C, keep, h0):
        with torch.autocast(dt.device.type, enabled=False):  # the scan is f32 (f64) throughout
            return _Scan._forward(ctx, dt, x, A, Bm, C, keep, h0)

    @staticmethod
    def _forward(ctx, dt, x, A, Bm, C, keep, h0):
        T = dt.shape[1]
        group = _group_size(dt.shape[0], A.shape[0], A.shape[1])
        h, ys, h_bounds = h0, [], []
        for t0 in range(0, T, group):
            sl = slice(t0, min(T, t0 + group))
            h_bounds.append(h)
            a = _decay(dt[:, sl], A, None if keep is None else keep[:, sl])
            h_all, h = _scan_states(a, x[:, sl, :, None] * Bm[:, sl, None, :], h)
            ys.append(torch.einsum("btdn,btn->btd", h_all, C[:, sl]))
        ctx.save_for_backward(dt, x, A, Bm, C, keep, *h_bounds)
        ctx.group = group
        return torch.cat(ys, dim=1), h

    @staticmethod
    def backward(ctx, gy, g_hT):
        with torch.autocast(gy.device.type if gy is not None else "cpu", enabled=False):
            return _Scan._backward(ctx, gy, g_hT)

    @staticmethod
    def _backward(ctx, gy, g_hT):
        dt, x, A, Bm, C, keep, *h_bounds = ctx.saved_tensors
        gy = gy.to(dt.dtype) if gy is not None else None
        g_hT = g_hT.to(dt.dtype) if g_hT is not None else None
        T = dt.shape[1]
        group = ctx.group
        if gy is None:
            gy = torch.zeros_like(x)
        g_dt, g_x = torch.empty_like(dt), torch.empty_like(x)
        g_B, g_C = torch.empty_like(Bm), torch.empty_like(C)
        g_A = torch.zeros_like(A)
        # G: dL/dh at the end of the current group, from everything after it
        G = g_hT if g_hT is not None else torch.zeros_like(h_bounds[0])
        starts = list(range(0, T, group))
        for gi in reversed(range(len(starts))):
            sl = slice(starts[gi], min(T, starts[gi] + group))
            a = _decay(dt[:, sl], A, None if keep is None else keep[:, sl])
            xs, Bs, Cs, gys = x[:, sl], Bm[:, sl], C[:, sl], gy[:, sl]
            h_all, _ = _scan_states(a, xs[..., None] * Bs[:, :, None, :], h_bounds[gi])
            # reverse scan in flipped time: g_h_t = c_t + a_{t+1} g_h_{t+1}, g_h_last = c_last + G
            c = gys[..., None] * Cs[:, :, None, :]  # [B, t, D, N]
            a_next = torch.cat([a[:, 1:], torch.ones_like(a[:, :1])], dim=1)
            g_h, _ = _scan_states(a_next.flip(1), c.flip(1), G)
            g_h = g_h.flip(1)
            h_prev = torch.cat([h_bounds[gi].unsqueeze(1), h_all[:, :-1]], dim=1)
            dz = g_h * h_prev * a  # dL/d(dt A) through a = exp(dt A) (keep folded into a)
            g_dt[:, sl] = torch.einsum("btdn,dn->btd", dz, A)
            g_A += torch.einsum("btdn,btd->dn", dz, dt[:, sl])
            g_x[:, sl] = torch.einsum("btdn,btn->btd", g_h, Bs)
            g_B[:, sl] = torch.einsum("btdn,btd->btn", g_h, xs)
            g_C[:, sl] = torch.einsum("btdn,btd->btn", h_all, gys)
            G = a[:, 0] * g_h[:, 0]  # the carry past the group's first step
        return g_dt, g_x, g_A, g_B, g_C, None, G


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
    f = state_dtype(u)
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    uf, dt = u.to(f), delta.to(f)
    if delta_bias is not None:
        dt = dt + delta_bias.to(f)
    if delta_softplus:
        dt = F.softplus(dt)
    keep = None
    if seq_idx is not None:  # 0 where a new document starts at t
        keep = torch.ones(Bsz, T, device=u.device, dtype=f)
        keep[:, 1:] = (seq_idx[:, 1:] == seq_idx[:, :-1]).to(f)
    h0 = (
        initial_state.to(f)
        if initial_state is not None
        else torch.zeros(Bsz, Dn, N, device=u.device, dtype=f)
    )
    if T == 0:  # nothing to scan: the state passes through (a copy, gradient unchanged)
        y, h = uf.new_zeros(Bsz, 0, Dn), h0.clone()
    else:
        y, h = _Scan.apply(dt, dt * uf, A.to(f), B.to(f), C.to(f), keep, h0)
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
    """One timestep of the scan (decode): updates `ssm_state` in place, returns y [B, D].

    Written with few, fused ops: at batch 1 a decode step is bound by per-op overhead."""
    f = ssm_state.dtype
    dt = delta if delta.dtype == f else delta.to(f)
    if delta_bias is not None:
        dt = dt + delta_bias
    if delta_softplus:
        dt = F.softplus(dt)
    uf = u if u.dtype == f else u.to(f)
    dA = torch.exp(dt.unsqueeze(-1) * (A if A.dtype == f else A.to(f)))  # [B, D, N]
    Bf = B if B.dtype == f else B.to(f)
    ssm_state.mul_(dA).addcmul_((dt * uf).unsqueeze(-1), Bf.unsqueeze(1))  # + delta u B
    y = torch.bmm(ssm_state, (C if C.dtype == f else C.to(f)).unsqueeze(-1)).squeeze(-1)
    if D is not None:
        y = torch.addcmul(y, uf, D)
    if z is not None:
        y = y * F.silu(z if z.dtype == f else z.to(f))
    return y if y.dtype == u.dtype else y.to(u.dtype)
