"""The Mamba-2 (SSD) scan in plain PyTorch: the CPU path and the oracle (Dao & Gu 2024).

Glossary: B batch, T time, H heads of P values (headdim), G groups of the B/C rows
(head h reads group h // (H / G)), N = d_state. Per row, head h and time t, with the
head's group's rows B_t, C_t [N] and a scalar A_h < 0 per head:

    a_t = exp(delta_t A_h)
    h_t = a_t h_{t-1} + delta_t x_t B_t^T          [P, N]
    y_t = h_t C_t + D x_t,  then  y_t * silu(z_t) when a gate z is given

Unrolled over a chunk of L steps from its start state h_s, with cs_t = sum_{r<=t} delta_r A:

    y_t   = sum_{s<=t} (C_t . B_s) exp(cs_t - cs_s) delta_s x_s  +  exp(cs_t) h_s C_t
    h_end = exp(cs_last) h_s + sum_s exp(cs_last - cs_s) delta_s x_s B_s^T

so a chunk is one [L, L] decay-weighted score matrix per head (the "state space
duality": a masked attention inside the chunk, a recurrence across chunks), and a loop
over T / L chunks carries h. Decays are exp of non-positive sums only.

With `seq_idx` [B, T] (non-decreasing document ids) a document starts from a zero state:
no decay or contribution crosses its start, and the initial state feeds only the row's
first document.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import check_tensor, state_dtype

CHUNK = 64  # timesteps per quadratic block; the carry loop runs T / CHUNK times
Sizes = tuple[int, int, int, int, int, int]  # a step's (d_mlp, d_ssm, G, N, H, P)


def _by_group(t: torch.Tensor, G: int) -> torch.Tensor:
    """[..., H, X] -> [..., G, H / G, X]: heads beside the group whose B and C they read."""
    return t.unflatten(-2, (G, t.shape[-2] // G))


def mamba2_delta_reference(
    dt: torch.Tensor,  # [..., H], in_proj's dt rows
    dt_bias: torch.Tensor,  # [H]
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """The scan's delta from in_proj's dt: clamp(softplus(dt + dt_bias), *dt_limit), in the
    state dtype (f32, f64 for float64 inputs)."""
    f = state_dtype(dt, dt_bias)
    delta = F.softplus(dt.to(f) + dt_bias.to(f))
    if tuple(dt_limit) != (0.0, math.inf):
        delta = delta.clamp(*dt_limit)
    return delta


def mamba2_scan_reference(
    x: torch.Tensor,  # [B, T, H, P]
    delta: torch.Tensor,  # [B, T, H] > 0 (after softplus and the limits)
    A: torch.Tensor,  # [H] < 0
    B: torch.Tensor,  # [B, T, G, N]
    C: torch.Tensor,  # [B, T, G, N]
    D: torch.Tensor | None = None,  # [H] or [H, P]
    z: torch.Tensor | None = None,  # [B, T, H, P] gate
    initial_state: torch.Tensor | None = None,  # [B, H, P, N]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32 document ids
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, T, H, P] in x.dtype, the final state [B, H, P, N] in f32, or f64 for float64
    inputs), differentiable in every input."""
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    f = state_dtype(x)
    xf = _by_group(x.to(f), G)  # [B, T, G, R, P]
    dtf = _by_group(delta.to(f).unsqueeze(-1), G).squeeze(-1)  # [B, T, G, R]
    adt = dtf * _by_group(A.to(f).unsqueeze(-1), G).squeeze(-1)
    Bf, Cf = B.to(f), C.to(f)
    if initial_state is None:
        h = x.new_zeros(Bsz, H, P, N, dtype=f)
    else:
        h = initial_state.to(f)
    h = _by_group(h.flatten(-2), G).unflatten(-1, (P, N))  # [B, G, R, P, N]
    ys = []
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        L = c1 - c0
        cs = torch.cumsum(adt[:, c0:c1], dim=1)  # [B, L, G, R]
        diff = cs.unsqueeze(2) - cs.unsqueeze(1)  # [B, L(t), L(s), G, R]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None]
        carry = torch.ones(Bsz, L, dtype=f, device=x.device)  # t still sees the start state
        if seq_idx is not None:
            doc = seq_idx[:, c0:c1]
            causal = causal & (doc.unsqueeze(2) == doc.unsqueeze(1))
            prev = seq_idx[:, c0 - 1 : c0] if c0 > 0 else seq_idx[:, :1]
            carry = (doc == prev).to(f)
        decay = torch.exp(diff.masked_fill(~causal[..., None, None], float("-inf")))
        xc, Bc, Cc, dtc = xf[:, c0:c1], Bf[:, c0:c1], Cf[:, c0:c1], dtf[:, c0:c1]
        scores = torch.einsum("btgn,bsgn->btsg", Cc, Bc).unsqueeze(-1) * decay
        y = torch.einsum("btsgr,bsgr,bsgrp->btgrp", scores, dtc, xc)
        start = torch.exp(cs) * carry[:, :, None, None]  # [B, L, G, R]
        y = y + start.unsqueeze(-1) * torch.einsum("bgrpn,btgn->btgrp", h, Cc)
        ys.append(y)
        tail = torch.exp(cs[:, -1:] - cs) * dtc  # [B, L, G, R]
        if seq_idx is not None:  # only the last document's tokens stay in the state
            tail = tail * (doc == doc[:, -1:])[:, :, None, None]
        keep = start[:, -1]  # [B, G, R]
        h = keep[..., None, None] * h + torch.einsum("bsgr,bsgrp,bsgn->bgrpn", tail, xc, Bc)
    if not ys:  # T = 0: no output, the state passes through
        return x.new_empty(x.shape), h.flatten(1, 2)
    y = torch.cat(ys, dim=1).flatten(2, 3)  # [B, T, H, P]
    if D is not None:
        Df = D.to(f)
        y = y + (Df.unsqueeze(-1) if Df.dim() == 1 else Df) * x.to(f)
    if z is not None:
        y = y * F.silu(z.to(f))
    return y.to(x.dtype), h.flatten(1, 2)


def mamba2_step_reference(
    x: torch.Tensor,  # [B, H, P]
    delta: torch.Tensor,  # [B, H] > 0
    A: torch.Tensor,  # [H] < 0
    B: torch.Tensor,  # [B, G, N]
    C: torch.Tensor,  # [B, G, N]
    D: torch.Tensor | None,  # [H] or [H, P]
    z: torch.Tensor | None,  # [B, H, P]
    ssm: torch.Tensor,  # [B, H, P, N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One timestep, functionally: (y [B, H, P] in x.dtype, the next state in ssm's dtype)."""
    G = B.shape[1]
    f = ssm.dtype if ssm.dtype == torch.float64 else torch.float32
    H = x.shape[1]
    xf, dtf = x.to(f), delta.to(f)
    Bh = B.to(f).repeat_interleave(H // G, dim=1)  # [B, H, N]
    Ch = C.to(f).repeat_interleave(H // G, dim=1)
    a = torch.exp(dtf * A.to(f))  # [B, H]
    new = a[..., None, None] * ssm.to(f) + (dtf[..., None] * xf).unsqueeze(-1) * Bh.unsqueeze(-2)
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        Df = D.to(f)
        y = y + (Df.unsqueeze(-1) if Df.dim() == 1 else Df) * xf
    if z is not None:
        y = y * F.silu(z.to(f))
    return y.to(x.dtype), new.to(ssm.dtype)


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
    check: bool = True,
) -> torch.Tensor:
    """zxbcdt [B, W] (the in_proj rows, any float dtype, last stride 1, rows may be
    strided); conv_state [B, K-1, conv_dim] and ssm_state [B, H, P, N] f32 (or f64)
    advanced IN PLACE; sizes = (d_mlp, d_ssm, G, N, H, P); returns y [B, d_mlp + d_ssm] in
    zxbcdt.dtype: what out_proj reads. check=False: the caller checked every argument (a
    decode step, once per token for the whole stack)."""
    if check:
        _check_step(zxbcdt, conv_state, ssm_state, conv_w, conv_b, dt_bias, A, D, norm_w, sizes,
                    False)  # fmt: skip
    d_mlp, d_ssm, G, N, H, P = sizes
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


def _check_step(zxbcdt, conv_state, ssm_state, conv_w, conv_b, dt_bias, A, D, norm_w, sizes,
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
