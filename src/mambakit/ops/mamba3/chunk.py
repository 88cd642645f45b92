"""The Mamba-3 SISO sequence forward as a Triton kernel (inference: no backward).

B batch, T time, H heads of P values, G groups, N = d_state, S angles, L = the chunk.
The angles, the turned keys and queries (k~, q~) and the per-token weights are
elementwise and computed in PyTorch as in the reference; the kernel does what costs:
for one (row, head) it walks the chunks in order, carrying the state S [P, N] and the
last token's k~ and x, and per chunk computes, as reference.py's chunked form,

    y_t   = sum_{s <= t} (q~_t . k~_s) exp(cs_t - cs_s) w'_{t,s} x_s
            + exp(cs_t) carry_t  q~_t S'_start
    S_end = exp(cs_last) carry_last S'_start + sum_s tail_s x_s k~_s^T

with three matrix products ([L, N] x [N, L], [L, L] x [L, P], [P, L] x [L, N]) and
the start-state product. Products run in tf32 for 16-bit inputs and tf32x3 (f32
accuracy) for f32 ones; the state is f32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import Mamba3State, token_terms

# fmt: off


@triton.jit
def _last_row(x, rows, last):
    """Row `last` of a [L, K] tile as [K]."""
    return tl.sum(tl.where((rows == last)[:, None], x, 0.0), axis=0)


@triton.jit
def _chunk_fwd_kernel(
    x_ptr, q_ptr, k_ptr, adt_ptr, gam_ptr, late_ptr, seq_ptr, z_ptr, D_ptr,
    s0_ptr, k0_ptr, x0_ptr, y_ptr, sT_ptr, kT_ptr, xT_ptr,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_z_b, s_z_t, s_z_h,
    s_y_b, s_y_t, s_y_h,
    HAS_SEQ: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rows = tl.arange(0, L)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mp, mn = p < P, n < N
    mpn = mp[:, None] & mn[None, :]
    bh = (b * H + h)
    S = tl.load(s0_ptr + bh * P * N + p[:, None] * N + n[None, :], mask=mpn, other=0.0)
    k_prev = tl.load(k0_ptr + bh * N + n, mask=mn, other=0.0)
    x_prev = tl.load(x0_ptr + bh * P + p, mask=mp, other=0.0)
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + h)
    causal = rows[:, None] >= rows[None, :]
    prev_doc = 0
    if HAS_SEQ:
        prev_doc = tl.load(seq_ptr + b * s_seq_b)  # the initial state's document: the first
    for c0 in range(0, T, L):
        t = c0 + rows
        mt = t < T
        last = tl.minimum(L, T - c0) - 1
        xc = tl.load(x_ptr + b * s_x_b + t[:, None] * s_x_t + h * s_x_h + p[None, :],
                     mask=mt[:, None] & mp[None, :], other=0.0).to(tl.float32)
        qn = t[:, None] * s_q_t + h * s_q_h + n[None, :]
        mq = mt[:, None] & mn[None, :]
        qc = tl.load(q_ptr + b * s_q_b + qn, mask=mq, other=0.0)
        kc = tl.load(k_ptr + b * s_q_b + qn, mask=mq, other=0.0)
        wo = b * s_w_b + t * s_w_t + h
        adt = tl.load(adt_ptr + wo, mask=mt, other=0.0)
        gam = tl.load(gam_ptr + wo, mask=mt, other=0.0)
        # the next token's late term joins this one's weight, inside the chunk only
        nxt = tl.load(late_ptr + wo + s_w_t, mask=(t + 1 < T) & (rows < last), other=0.0)
        w = gam + nxt
        cs = tl.cumsum(adt, axis=0)
        cs_last = tl.sum(tl.where(rows == last, cs, 0.0), axis=0)
        late0 = tl.load(late_ptr + b * s_w_b + c0 * s_w_t + h)
        start = S + late0 * x_prev[:, None] * k_prev[None, :]  # [P, N]
        same = causal & mt[None, :]
        carry = mt.to(tl.float32)
        keep_doc = mt
        if HAS_SEQ:
            doc = tl.load(seq_ptr + b * s_seq_b + t, mask=mt, other=-1)
            same = same & (doc[:, None] == doc[None, :])
            carry = tl.where(doc == prev_doc, carry, 0.0)
            doc_last = tl.sum(tl.where(rows == last, doc, 0), axis=0)
            keep_doc = mt & (doc == doc_last)
            prev_doc = doc_last
        decay = tl.exp(tl.where(same, cs[:, None] - cs[None, :], float("-inf")))
        weight = tl.where(rows[:, None] == rows[None, :], gam[None, :], decay * w[None, :])
        weight = tl.where(same, weight, 0.0)
        scores = tl.dot(qc, tl.trans(kc), input_precision=PREC) * weight  # [L(t), L(s)]
        y = tl.dot(scores, xc, input_precision=PREC)  # [L, P]
        into = tl.dot(qc, tl.trans(start), input_precision=PREC)  # [L, P]: q~_t S'_start
        y += (tl.exp(cs) * carry)[:, None] * into
        if HAS_D:
            y += Dh * xc
        if HAS_Z:
            zc = tl.load(z_ptr + b * s_z_b + t[:, None] * s_z_t + h * s_z_h + p[None, :],
                         mask=mt[:, None] & mp[None, :], other=0.0).to(tl.float32)
            y = y * zc * tl.sigmoid(zc)
        tl.store(y_ptr + b * s_y_b + t[:, None] * s_y_t + h * s_y_h + p[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mt[:, None] & mp[None, :])
        # the state after the chunk (its last token's late term is the next chunk's)
        tail = tl.where(rows == last, gam, tl.exp(cs_last - cs) * w)
        tail = tl.where(keep_doc, tail, 0.0)
        keep = tl.exp(cs_last) * tl.sum(tl.where(rows == last, carry, 0.0), axis=0)
        S = keep * start + tl.dot(tl.trans(xc * tail[:, None]), kc, input_precision=PREC)
        k_prev = _last_row(kc, rows, last)
        x_prev = _last_row(xc, rows, last)
    tl.store(sT_ptr + bh * P * N + p[:, None] * N + n[None, :], S, mask=mpn)
    tl.store(kT_ptr + bh * N + n, k_prev, mask=mn)
    tl.store(xT_ptr + bh * P + p, x_prev, mask=mp)


# fmt: on


# 16 steps a chunk: [P, N] state, start state, q~, k~ and the [L, L] scores stay in registers
# (sm_90, headdim 64 x d_state 128, 8 warps: no spills in tf32; Triton 3.6's ptxas report)
CHUNK_L = 16


def _precision(x: torch.Tensor) -> str:
    """tf32 products for 16-bit inputs (finer than the inputs), tf32x3 (f32 accuracy) for
    f32 ones; the interpreter computes in f32."""
    if not x.is_cuda:
        return "ieee"
    return "tf32x3" if x.dtype == torch.float32 else "tf32"


def mamba3_scan_fwd(
    x: torch.Tensor,  # [B, T, H, P]
    q: torch.Tensor,  # [B, T, G, N]
    k: torch.Tensor,  # [B, T, G, N]
    delta: torch.Tensor,  # [B, T, H]
    A: torch.Tensor,  # [B, T, H]
    trap: torch.Tensor,  # [B, T, H]
    theta: torch.Tensor,  # [B, T, S]
    q_bias: torch.Tensor,  # [H, N]
    k_bias: torch.Tensor,  # [H, N]
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    initial_state: Mamba3State | None = None,
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Mamba3State]:
    """`mamba3_scan_reference`'s values without its autograd: (y [B, T, H, P] in x.dtype,
    the final f32 state). The chunk is `CHUNK_L` whatever the layer's chunk_size (the
    result does not depend on it)."""
    Bsz, T, H, P = x.shape
    N, S = q.shape[-1], theta.shape[-1]
    f = torch.float32
    if initial_state is None:
        initial_state = Mamba3State.zeros(Bsz, H, P, N, S, x.device, f)
    phi, qr, kr, adt, gamma, late = token_terms(
        q, k, delta, A, trap, theta, q_bias, k_bias, initial_state.angle, seq_idx, f
    )
    qr, kr, adt, gamma, late = (t.contiguous() for t in (qr, kr, adt, gamma, late))
    xs = x if x.stride(-1) == 1 else x.contiguous()
    zs = z if z is None or z.stride(-1) == 1 else z.contiguous()
    s0 = initial_state.ssm.float().contiguous()
    k0 = initial_state.k.float().contiguous()
    x0 = initial_state.x.float().contiguous()
    y = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    sT, kT, xT = torch.empty_like(s0), torch.empty_like(k0), torch.empty_like(x0)
    seq = seq_idx.contiguous() if seq_idx is not None else adt
    _chunk_fwd_kernel[(Bsz, H)](
        xs, qr, kr, adt, gamma, late, seq, zs if zs is not None else xs,
        D.float() if D is not None else adt, s0, k0, x0, y, sT, kT, xT,
        T, H, P, N,
        xs.stride(0), xs.stride(1), xs.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
        adt.stride(0), adt.stride(1), seq.stride(0),
        *(zs.stride()[:3] if zs is not None else (0, 0, 0)),
        y.stride(0), y.stride(1), y.stride(2),
        HAS_SEQ=seq_idx is not None, HAS_Z=z is not None, HAS_D=D is not None,
        L=CHUNK_L, BLOCK_P=max(16, triton.next_power_of_2(P)),
        BLOCK_N=max(16, triton.next_power_of_2(N)), PREC=_precision(x),
        num_warps=8 if P * N >= 8192 else 4,
    )  # fmt: skip
    if T == 0:
        phi_T = initial_state.angle.float()
    else:
        phi_T = phi[:, -1]
    return y, Mamba3State(phi_T, sT, kT, xT)
