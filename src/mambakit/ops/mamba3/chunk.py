"""The Mamba-3 SISO sequence scan as Triton kernels: the forward and its backward.

B batch, T time, H heads of P values, G groups, N = d_state, S angles, L = the chunk.
The angles, the turned keys and queries (k~, q~) and the per-token weights are
elementwise and computed in PyTorch as in the reference; the kernel does what costs:
for one (row, head) it walks the chunks in order, carrying the state S [P, N] and the
last token's k~ and x, and per chunk computes, as reference.py's chunked form,

    y_t   = sum_{s <= t} (q~_t . k~_s) exp(cs_t - cs_s) w'_{t,s} x_s
            + exp(cs_t) carry_t  q~_t S'_start
    S_end = exp(cs_last) carry_last S'_start + sum_s tail_s x_s k~_s^T

with three matrix products ([L, N] x [N, L], [L, L] x [L, P], [P, L] x [L, N]) and
the start-state product. Products take bf16 operands for bf16 inputs, tf32 for f16
ones and tf32x3 (f32 accuracy) for f32 ones, always accumulating in f32; the state is f32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import cdiv, launch, next_power_of_2, opt
from .reference import Mamba3State
from .terms import token_terms_kernel

# fmt: off


@triton.jit
def _last_row(x, rows, last):
    """Row `last` of a [L, K] tile as [K]."""
    return tl.sum(tl.where((rows == last)[:, None], x, 0.0), axis=0)


@triton.jit
def _mm(a, b, PREC: tl.constexpr, acc=None):
    """a @ b with f32 accumulation: operands rounded to bf16 for PREC "bf16", else
    `input_precision=PREC` (tf32, tf32x3, ieee). Triton's interpreter (3.9) multiplies bf16
    dot operands as raw bits, so the CPU runs ieee and only the GPU tests cover bf16."""
    if PREC == "bf16":
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc=acc)
    else:
        out = tl.dot(a, b, acc=acc, input_precision=PREC)
    return out


@triton.jit
def _chunk_fwd_kernel(
    p_x, p_q, p_k, p_adt, p_gam, p_late, p_seq, p_z, p_D,
    p_s0, p_k0, p_x0, p_y, p_pre, p_sT, p_kT, p_xT, p_st,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_z_b, s_z_t, s_z_h,
    s_y_b, s_y_t, s_y_h,
    HAS_SEQ: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    COMPUTE_Y: tl.constexpr, STORE_STATES: tl.constexpr, STORE_PRE: tl.constexpr,
):
    """COMPUTE_Y: y and the final state (STORE_PRE: y before the gate, to pre, with y's
    strides: what the backward's gate gradient reads); STORE_STATES: each chunk's start
    state S'_start to st [B, H, chunks, P, N] (the backward's recomputation). A program owns
    BLOCK_P of the head's P values (rows of S: they advance independently); the last token's
    k~ is the head's, written by the first block."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rows = tl.arange(0, L)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mp, mn = p < P, n < N
    mpn = mp[:, None] & mn[None, :]
    bh = (b * H + h)
    S = tl.load(p_s0 + bh * P * N + p[:, None] * N + n[None, :], mask=mpn, other=0.0)
    k_prev = tl.load(p_k0 + bh * N + n, mask=mn, other=0.0)
    x_prev = tl.load(p_x0 + bh * P + p, mask=mp, other=0.0)
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(p_D + h)
    causal = rows[:, None] >= rows[None, :]
    prev_doc = 0
    if HAS_SEQ:
        prev_doc = tl.load(p_seq + b * s_seq_b)  # the initial state's document: the first
    for c0 in range(0, T, L):
        t = c0 + rows
        mt = t < T
        last = tl.minimum(L, T - c0) - 1
        xc = tl.load(p_x + b * s_x_b + t[:, None] * s_x_t + h * s_x_h + p[None, :],
                     mask=mt[:, None] & mp[None, :], other=0.0).to(tl.float32)
        qn = t[:, None] * s_q_t + h * s_q_h + n[None, :]
        mq = mt[:, None] & mn[None, :]
        qc = tl.load(p_q + b * s_q_b + qn, mask=mq, other=0.0)
        kc = tl.load(p_k + b * s_q_b + qn, mask=mq, other=0.0)
        wo = b * s_w_b + t * s_w_t + h
        adt = tl.load(p_adt + wo, mask=mt, other=0.0)
        gam = tl.load(p_gam + wo, mask=mt, other=0.0)
        # the next token's late term joins this one's weight, inside the chunk only
        nxt = tl.load(p_late + wo + s_w_t, mask=(t + 1 < T) & (rows < last), other=0.0)
        w = gam + nxt
        cs = tl.cumsum(adt, axis=0)
        cs_last = tl.sum(tl.where(rows == last, cs, 0.0), axis=0)
        late0 = tl.load(p_late + b * s_w_b + c0 * s_w_t + h)
        start = S + late0 * x_prev[:, None] * k_prev[None, :]  # [P, N]
        same = causal & mt[None, :]
        carry = mt.to(tl.float32)
        keep_doc = mt
        if HAS_SEQ:
            doc = tl.load(p_seq + b * s_seq_b + t, mask=mt, other=-1)
            same = same & (doc[:, None] == doc[None, :])
            carry = tl.where(doc == prev_doc, carry, 0.0)
            doc_last = tl.sum(tl.where(rows == last, doc, 0), axis=0)
            keep_doc = mt & (doc == doc_last)
            prev_doc = doc_last
        if STORE_STATES:
            c = c0 // L
            tl.store(p_st + ((bh * tl.cdiv(T, L) + c) * P + p[:, None]) * N + n[None, :],
                     start, mask=mpn)
        if COMPUTE_Y:
            decay = tl.exp(tl.where(same, cs[:, None] - cs[None, :], float("-inf")))
            weight = tl.where(rows[:, None] == rows[None, :], gam[None, :], decay * w[None, :])
            weight = tl.where(same, weight, 0.0)
            scores = _mm(qc, tl.trans(kc), PREC) * weight  # [L(t), L(s)]
            y = _mm(scores, xc, PREC)  # [L, P]
            into = _mm(qc, tl.trans(start), PREC)  # [L, P]: q~_t S'_start
            y += (tl.exp(cs) * carry)[:, None] * into
            if HAS_D:
                y += Dh * xc
            y_off = b * s_y_b + t[:, None] * s_y_t + h * s_y_h + p[None, :]
            if STORE_PRE:
                tl.store(p_pre + y_off, y.to(p_pre.dtype.element_ty),
                         mask=mt[:, None] & mp[None, :])
            if HAS_Z:
                zc = tl.load(p_z + b * s_z_b + t[:, None] * s_z_t + h * s_z_h + p[None, :],
                             mask=mt[:, None] & mp[None, :], other=0.0).to(tl.float32)
                y = y * zc * tl.sigmoid(zc)
            tl.store(p_y + y_off, y.to(p_y.dtype.element_ty), mask=mt[:, None] & mp[None, :])
        # the state after the chunk (its last token's late term is the next chunk's)
        tail = tl.where(rows == last, gam, tl.exp(cs_last - cs) * w)
        tail = tl.where(keep_doc, tail, 0.0)
        keep = tl.exp(cs_last) * tl.sum(tl.where(rows == last, carry, 0.0), axis=0)
        S = keep * start + _mm(tl.trans(xc * tail[:, None]), kc, PREC)
        k_prev = _last_row(kc, rows, last)
        x_prev = _last_row(xc, rows, last)
    if COMPUTE_Y:
        tl.store(p_sT + bh * P * N + p[:, None] * N + n[None, :], S, mask=mpn)
        if tl.program_id(2) == 0:
            tl.store(p_kT + bh * N + n, k_prev, mask=mn)
        tl.store(p_xT + bh * P + p, x_prev, mask=mp)


@triton.jit
def _chunk_bwd_kernel(
    p_x, p_q, p_k, p_adt, p_gam, p_late, p_seq, p_st, p_k0, p_x0,
    p_dy, p_dsT,
    p_dx, p_dq, p_dk, p_dadt, p_dgam, p_dlate, p_ds0, p_dk0, p_dx0,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_dy_b, s_dy_t, s_dy_h,
    s_dx_b, s_dx_t, s_dx_h, s_part_x, s_part_w, s_part_x0,
    HAS_SEQ: tl.constexpr, HAS_DST: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NF: tl.constexpr,
    PREC: tl.constexpr,
):
    """One (row, head) and BLOCK_N of its N states, the chunks in reverse, carrying dS
    [P, BLOCK_N] (the gradient of the state after the chunk) and what the next chunk's
    start term owes this chunk's last x and k~. The chunk's start state S'_start comes from
    st (the forward kernel's STORE_STATES pass). Gradients of the core (no D, no gate): x,
    q~, k~ (as x's layout / [B, T, H, N], f32), A delta, gamma, late [B, T, H] f32, and the
    initial state's S, k~, x. The states' columns are independent but for q~ . k~ (read
    whole, BLOCK_NF) and the sums over N: what a block adds to x, A delta, gamma, late and
    the initial x goes to its own slice of those outputs (s_part_*: the stride between
    blocks' slices), summed after; q~, k~ and the initial S and k~ are the block's alone.
    Terms that do not depend on the block are added by the first. dy is the gradient of
    the core (`_gate_bwd`'s, which adds D dy to dx as one more slice)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    nb = tl.program_id(2)
    first = nb == 0
    rows = tl.arange(0, L)
    p = tl.arange(0, BLOCK_P)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mp, mn = p < P, n < N
    p_dx += nb * s_part_x
    p_dadt += nb * s_part_w
    p_dgam += nb * s_part_w
    p_dlate += nb * s_part_w
    p_dx0 += nb * s_part_x0
    mpn = mp[:, None] & mn[None, :]
    bh = b * H + h
    causal = rows[:, None] >= rows[None, :]
    diag = rows[:, None] == rows[None, :]
    below = rows[:, None] == rows[None, :] + 1  # [r, s]: s = r - 1
    if HAS_DST:
        dS = tl.load(p_dsT + bh * P * N + p[:, None] * N + n[None, :], mask=mpn, other=0.0)
    else:
        dS = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    dx_owed = tl.zeros([BLOCK_P], dtype=tl.float32)
    dk_owed = tl.zeros([BLOCK_N], dtype=tl.float32)
    n_chunks = tl.cdiv(T, L)
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        c0 = c * L
        t = c0 + rows
        mt = t < T
        last = tl.minimum(L, T - c0) - 1
        mtp = mt[:, None] & mp[None, :]
        xc = tl.load(p_x + b * s_x_b + t[:, None] * s_x_t + h * s_x_h + p[None, :],
                     mask=mtp, other=0.0).to(tl.float32)
        dy = tl.load(p_dy + b * s_dy_b + t[:, None] * s_dy_t + h * s_dy_h + p[None, :],
                     mask=mtp, other=0.0).to(tl.float32)
        qn = t[:, None] * s_q_t + h * s_q_h + n[None, :]
        mq = mt[:, None] & mn[None, :]
        qc = tl.load(p_q + b * s_q_b + qn, mask=mq, other=0.0)
        kc = tl.load(p_k + b * s_q_b + qn, mask=mq, other=0.0)
        wo = b * s_w_b + t * s_w_t + h
        adt = tl.load(p_adt + wo, mask=mt, other=0.0)
        gam = tl.load(p_gam + wo, mask=mt, other=0.0)
        nxt = tl.load(p_late + wo + s_w_t, mask=(t + 1 < T) & (rows < last), other=0.0)
        w = gam + nxt
        cs = tl.cumsum(adt, axis=0)
        cs_last = tl.sum(tl.where(rows == last, cs, 0.0), axis=0)
        late0 = tl.load(p_late + b * s_w_b + c0 * s_w_t + h)
        start = tl.load(p_st + ((bh * n_chunks + c) * P + p[:, None]) * N + n[None, :],
                        mask=mpn, other=0.0)
        # the token before the chunk: the previous chunk's last, or the initial state's
        inside_p, inside_n = (p * 0 + c0) > 0, (n * 0 + c0) > 0  # not the first chunk
        x_prev = tl.load(p_x + b * s_x_b + (c0 - 1) * s_x_t + h * s_x_h + p,
                         mask=mp & inside_p, other=0.0).to(tl.float32)
        x_prev += tl.load(p_x0 + bh * P + p, mask=mp & ~inside_p, other=0.0)
        k_prev = tl.load(p_k + b * s_q_b + (c0 - 1) * s_q_t + h * s_q_h + n,
                         mask=mn & inside_n, other=0.0)
        k_prev += tl.load(p_k0 + bh * N + n, mask=mn & ~inside_n, other=0.0)
        same = causal & mt[None, :]
        carry = mt.to(tl.float32)
        keep_doc = mt
        if HAS_SEQ:
            prev_doc = tl.load(p_seq + b * s_seq_b + tl.maximum(c0 - 1, 0))
            doc = tl.load(p_seq + b * s_seq_b + t, mask=mt, other=-1)
            same = same & (doc[:, None] == doc[None, :])
            carry = tl.where(doc == prev_doc, carry, 0.0)
            doc_last = tl.sum(tl.where(rows == last, doc, 0), axis=0)
            keep_doc = mt & (doc == doc_last)
        # the forward's terms
        decay = tl.exp(tl.where(same, cs[:, None] - cs[None, :], float("-inf")))
        weight = tl.where(diag, gam[None, :], decay * w[None, :])
        weight = tl.where(same, weight, 0.0)
        if BLOCK_N < BLOCK_NF:  # q~ . k~ over all N states
            nf = tl.arange(0, BLOCK_NF)
            qf_off = b * s_q_b + t[:, None] * s_q_t + h * s_q_h + nf[None, :]
            mqf = mt[:, None] & (nf < N)[None, :]
            qk = _mm(tl.load(p_q + qf_off, mask=mqf, other=0.0),
                     tl.trans(tl.load(p_k + qf_off, mask=mqf, other=0.0)), PREC)
        else:
            qk = _mm(qc, tl.trans(kc), PREC)  # [L(t), L(s)]
        e_cs = tl.exp(cs) * carry
        tail_decay = tl.where(keep_doc & (rows != last), tl.exp(cs_last - cs), 0.0)
        tail = tl.where(rows == last, gam, tail_decay * w)
        tail = tl.where(keep_doc, tail, 0.0)
        keep = tl.exp(cs_last) * tl.sum(tl.where(rows == last, carry, 0.0), axis=0)
        # y = (qk * weight) x + e_cs q~ S'^T ;  S_end = keep S' + x^T diag(tail) k~
        d_scores = _mm(dy, tl.trans(xc), PREC)  # [L(t), L(s)]
        d_qk = d_scores * weight
        k_ds = _mm(kc, tl.trans(dS), PREC)  # [L, P]: dS k~_s
        dx = tl.where(first, _mm(tl.trans(qk * weight), dy, PREC), 0.0) + tail[:, None] * k_ds
        dy_s = _mm(dy, start, PREC)  # [L, N]: dy_t S'
        dq = _mm(d_qk, kc, PREC) + e_cs[:, None] * dy_s
        dk = _mm(tl.trans(d_qk), qc, PREC)
        dk += tail[:, None] * _mm(xc, dS, PREC)
        d_weight = d_scores * qk
        g = d_weight * weight  # d/d(cs_t - cs_s), zero off the mask and net zero on the diagonal
        d_tail = tl.sum(xc * k_ds, axis=1)
        g_tail = d_tail * tail  # d/d(cs_last - cs_s)
        # the start term e_cs_t (q~_t S'^T) . dy_t = e_cs_t q~_t . (dy_t S')
        dcs = tl.where(first, tl.sum(g, axis=1) - tl.sum(g, axis=0), 0.0)
        dcs += e_cs * tl.sum(qc * dy_s, axis=1) - g_tail
        dcs += tl.where(rows == last, keep * tl.sum(tl.sum(dS * start, axis=1), axis=0)
                        + tl.sum(g_tail, axis=0), 0.0)
        strict = same & (rows[:, None] > rows[None, :])
        dw = tl.sum(tl.where(strict & first, d_weight * decay, 0.0), axis=0)
        dw += d_tail * tail_decay
        dgam = tl.sum(tl.where(diag & same & first, d_weight, 0.0), axis=0) + dw
        dgam += tl.where((rows == last) & keep_doc, d_tail, 0.0)
        dlate = tl.sum(tl.where(below, dw[None, :], 0.0), axis=1)  # token r's late term: w_{r-1}
        d_start = _mm(tl.trans(dy * e_cs[:, None]), qc, PREC, keep * dS)
        dlate += tl.where(rows == 0, tl.sum(tl.sum(d_start * x_prev[:, None] * k_prev[None, :],
                                                   axis=1), axis=0), 0.0)
        # what the next chunk's start owed this chunk's last token
        dx += tl.where((rows == last)[:, None], dx_owed[None, :], 0.0)
        dk += tl.where((rows == last)[:, None], dk_owed[None, :], 0.0)
        dadt = tl.sum(dcs, axis=0) - tl.cumsum(dcs, axis=0) + dcs  # A delta_r: every cs_t, t >= r
        tl.store(p_dx + b * s_dx_b + t[:, None] * s_dx_t + h * s_dx_h + p[None, :],
                 dx.to(p_dx.dtype.element_ty), mask=mtp)
        tl.store(p_dq + b * s_q_b + qn, dq, mask=mq)
        tl.store(p_dk + b * s_q_b + qn, dk, mask=mq)
        tl.store(p_dadt + wo, dadt, mask=mt)
        tl.store(p_dgam + wo, dgam, mask=mt)
        tl.store(p_dlate + wo, dlate, mask=mt)
        dx_owed = late0 * tl.sum(d_start * k_prev[None, :], axis=1)
        dk_owed = late0 * tl.sum(d_start * x_prev[:, None], axis=0)
        dS = d_start
    tl.store(p_ds0 + bh * P * N + p[:, None] * N + n[None, :], dS, mask=mpn)
    tl.store(p_dk0 + bh * N + n, dk_owed, mask=mn)
    tl.store(p_dx0 + bh * P + p, dx_owed, mask=mp)


@triton.jit
def _gate_bwd_kernel(
    p_dy, p_z, p_pre, p_x, p_D, p_dyc, p_dz, p_dD, p_dxD,
    M, T, H, P, s_z_b, s_z_t, s_z_h, s_x_b, s_x_t, s_x_h,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """y = pre silu(z), pre = core + D x, over the rows m = b T + t of [B, T, H, P] (dy, pre,
    dyc, dz, dxD contiguous; z and x strided): dyc = dy silu(z) (the core's gradient, f32),
    dz = dy pre silu'(z), x's share D dyc (dxD, f32) and this program's share of dD
    [programs along M, H]."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    b, t = m // T, m % T
    p = tl.arange(0, BLOCK_P)
    mask = (m < M)[:, None] & (p < P)[None, :]
    off = (m[:, None] * H + h) * P + p[None, :]
    dy = tl.load(p_dy + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        z_off = (b * s_z_b + t * s_z_t)[:, None] + h * s_z_h + p[None, :]
        z = tl.load(p_z + z_off, mask=mask, other=0.0).to(tl.float32)
        pre = tl.load(p_pre + off, mask=mask, other=0.0).to(tl.float32)
        sz = tl.sigmoid(z)
        tl.store(p_dz + off, (dy * pre * sz * (1.0 + z * (1.0 - sz))).to(p_dz.dtype.element_ty),
                 mask=mask)
        dy = dy * z * sz
    tl.store(p_dyc + off, dy, mask=mask)
    if HAS_D:
        x_off = (b * s_x_b + t * s_x_t)[:, None] + h * s_x_h + p[None, :]
        x = tl.load(p_x + x_off, mask=mask, other=0.0).to(tl.float32)
        tl.store(p_dD + pid_m * H + h, tl.sum(tl.sum(dy * x, axis=1), axis=0))
        tl.store(p_dxD + off, tl.load(p_D + h).to(tl.float32) * dy, mask=mask)


# fmt: on


# 16 steps a chunk in the forward: [P, N] state, start state, q~, k~ and the [L, L] scores
# held in registers (sm_90, headdim 64 x d_state 128: with 4 warps and bf16 products, 376
# bytes of spills a thread, which the sweep below still finds the faster; chunks of 32
# with 8 warps: 1.70 ms, 208 bytes)
CHUNK_L = 16


# The products' precision for 16-bit inputs: "bf16" (operands rounded to bf16 as upstream's
# kernels round theirs, f32 accumulation) or "tf32". H200, 130m-mamba3 heads, 8 x 2048
# (scripts/m3_chunk_sweep.py, session 17): forward 2.19 ms in bf16 against 2.50 in tf32
# (8 warps), forward + backward 7.62 against 8.53; against float64 every output and gradient
# of tests/ops/test_mamba3.py's GPU case within 6e-3 relative (tf32: 2.7e-3).
PREC_16BIT = "bf16"


def _precision(x: torch.Tensor) -> str:
    """PREC_16BIT for bf16 inputs, tf32 for f16 ones (bf16 would drop 3 of their bits),
    tf32x3 (f32 accuracy) for f32 ones; the interpreter computes in f32."""
    if not x.is_cuda:
        return "ieee"
    return {torch.float32: "tf32x3", torch.bfloat16: PREC_16BIT}.get(x.dtype, "tf32")


def _block(v: int) -> int:
    return max(16, next_power_of_2(v))


# Warps for a state of 8192 values or more (4 below): the forward computing y (chunks of
# CHUNK_L) and the backward's pass storing the chunk start states (chunks of CHUNK_BWD).
# H200, 8 x 2048, bf16 products: the forward 1.49 ms with 4 warps against 2.19 with 8; the
# states pass spills 408 bytes a thread with 4 warps and 8 with 8 (Triton 3.9 offline, sm_90a).
FWD_WARPS = 4
STATES_WARPS = 8
# The head's P values per forward program (each block of P carries its rows of S alone):
# more programs than the (row, head) pairs, each with a smaller state. H200, 8 x 2048
# (scripts/m3_chunk_sweep.py, session 17): y's pass 0.83 ms whole, 0.81 in blocks of 32
# with 2 warps (no gain kept); the backward's states pass in blocks of 32 (so 4 warps)
# brings terms + forward + backward from 5.19 ms to 4.95.
FWD_BLOCK_P = 64
STATES_BLOCK_P = 32


def _warps(block_p: int, N: int, states: bool) -> int:
    """Warps for a program holding a [block_p, N] state (at most 4 below 8192 values)."""
    w = STATES_WARPS if states else FWD_WARPS
    return w if block_p * N >= 8192 else min(w, 4)


def _launch_fwd(
    x, qr, kr, adt, gamma, late, seq_idx, D, z, s0, k0, x0, y, L, states=None, pre=None
):
    """The forward kernel over (row, head): y and the final state into y, and the returned
    (sT, kT, xT), or only each chunk's start state into `states` (y is None). `pre` (y's
    shape and strides): y before the gate, stored too."""
    Bsz, T, H, P = x.shape
    N = qr.shape[-1]
    sT, kT, xT = torch.empty_like(s0), torch.empty_like(k0), torch.empty_like(x0)
    seq = seq_idx if seq_idx is not None else adt
    ys = y if y is not None else x
    block_p = min(_block(P), FWD_BLOCK_P if y is not None else STATES_BLOCK_P)
    launch(_chunk_fwd_kernel, (Bsz, H, cdiv(P, block_p)),
        x, qr, kr, adt, gamma, late, seq, z if z is not None else x,
        D.float() if D is not None else adt, s0, k0, x0, ys, pre if pre is not None else ys,
        sT, kT, xT, states if states is not None else s0,
        T, H, P, N,
        x.stride(0), x.stride(1), x.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
        adt.stride(0), adt.stride(1), seq.stride(0),
        *(z.stride()[:3] if z is not None else (0, 0, 0)),
        ys.stride(0), ys.stride(1), ys.stride(2),
        HAS_SEQ=seq_idx is not None, HAS_Z=z is not None, HAS_D=D is not None,
        L=L, BLOCK_P=block_p, BLOCK_N=_block(N), PREC=_precision(x),
        COMPUTE_Y=y is not None, STORE_STATES=states is not None, STORE_PRE=pre is not None,
        num_warps=_warps(block_p, N, states is not None),
    )  # fmt: skip
    return sT, kT, xT


def _terms(q, k, delta, A, trap, theta, q_bias, k_bias, initial_state, seq_idx):
    """The per-token terms on their kernels (terms.py): (phi_T, q~, k~, A delta, gamma, late,
    int32 document ids or None), f32 and contiguous."""
    seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else None
    out = token_terms_kernel(q, k, delta, A, trap, theta, q_bias, k_bias, initial_state.angle,
                             seq)  # fmt: skip
    return *out, seq


def _prepare(x, q, k, delta, A, trap, theta, q_bias, k_bias, initial_state, seq_idx):
    """What both scans launch with: (the initial state, f32 zeros if None; phi_T, q~, k~,
    A delta, gamma, late and seq from the terms kernels; x with unit last stride; the
    initial S, k~, x in f32, contiguous)."""
    Bsz, T, H, P = x.shape
    N, S = q.shape[-1], theta.shape[-1]
    if initial_state is None:
        initial_state = Mamba3State.zeros(Bsz, H, P, N, S, x.device, torch.float32)
    terms = _terms(q, k, delta, A, trap, theta, q_bias, k_bias, initial_state, seq_idx)
    xs = x if x.stride(-1) == 1 else x.contiguous()
    s0, k0, x0 = (t.float().contiguous() for t in initial_state[1:])
    return initial_state, *terms, xs, s0, k0, x0


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
    result does not depend on it). D and the gate are applied inside the kernel."""
    _, phi_T, qr, kr, adt, gamma, late, seq, xs, s0, k0, x0 = _prepare(
        x, q, k, delta, A, trap, theta, q_bias, k_bias, initial_state, seq_idx
    )
    zs = z if z is None or z.stride(-1) == 1 else z.contiguous()
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    sT, kT, xT = _launch_fwd(xs, qr, kr, adt, gamma, late, seq, D, zs, s0, k0, x0, y, CHUNK_L)
    return y, Mamba3State(phi_T, sT, kT, xT)


# The backward's chunk and warps: its loop carries dS [P, N] and reads S'_start [P, N] per
# chunk; BWD_BLOCK_N of the N states per program (below N: more programs, each with a
# smaller state, and the block sums of dx and the per-token weights' gradients added
# after). H200, 130m-mamba3 heads, 8 x 2048, bf16 products, terms + forward + backward
# (scripts/m3_chunk_sweep.py, session 17): chunks of 16 in blocks of 64 states, 8 warps,
# 6.71 ms; 4 warps 6.71; blocks of 32: 6.85; chunks of 32: 7.16 in blocks of 64, 7.42
# whole, 10.8 in blocks of 32. Chunks of 16 keep twice the start states of 32 for the
# backward ([B, H, T/16, P, N] f32, 805 MB at that shape, freed after the layer).
CHUNK_BWD = 16
BWD_WARPS = 8
BWD_BLOCK_N = 64


class _Core(torch.autograd.Function):
    """The scan with its kernels: (x, q~, k~, A delta, gamma, late, initial S, k~, x, D, z)
    -> (y with D and the gate, in x.dtype; the final S). The forward keeps y before the gate
    (in x.dtype) when there is one; the backward recomputes each chunk's start state (the
    forward kernel, STORE_STATES), then walks the chunks in reverse, the gate's and D's
    gradients included."""

    @staticmethod
    def forward(ctx, x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z):
        y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        pre = torch.empty_like(y) if z is not None else None
        sT, _, _ = _launch_fwd(x, qr, kr, adt, gamma, late, seq, D, z, s0, k0, x0, y, CHUNK_L,
                               pre=pre)  # fmt: skip
        ctx.save_for_backward(x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, pre)
        return y, sT

    @staticmethod
    def backward(ctx, dy, dsT):
        x, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, z, pre = ctx.saved_tensors
        Bsz, T, H, P = x.shape
        N = qr.shape[-1]
        L = CHUNK_BWD
        states = torch.empty(Bsz, H, cdiv(T, L), P, N, device=x.device,
                             dtype=torch.float32)  # fmt: skip
        _launch_fwd(x, qr, kr, adt, gamma, late, seq, None, None, s0, k0, x0, None, L, states)
        dy = dy.contiguous() if dy is not None else torch.zeros_like(x)
        block_n = min(_block(N), BWD_BLOCK_N)
        nb = cdiv(N, block_n)
        f32 = dict(device=x.device, dtype=torch.float32)
        # what each block of N adds (summed below; D x's share in one more), adt's layout for
        # the per-token terms
        dx = torch.empty(nb + (D is not None), Bsz, T, H, P, **f32)
        dz = dD = None
        if z is not None or D is not None:  # dy becomes the gradient of the core
            dy, dz, dD = _gate_bwd(dy, z, pre, x, D, dx[nb] if D is not None else None)
        dadt, dgam, dlate = (torch.empty(nb, *adt.shape, **f32) for _ in range(3))
        dx0 = torch.empty(nb, *x0.shape, **f32)
        dq, dk = torch.empty_like(qr), torch.empty_like(kr)
        ds0, dk0 = torch.empty_like(s0), torch.empty_like(k0)
        dsT = dsT.contiguous() if dsT is not None else None
        seqt = seq if seq is not None else adt
        launch(_chunk_bwd_kernel, (Bsz, H, nb),
            x, qr, kr, adt, gamma, late, seqt, states, k0, x0,
            dy, dsT if dsT is not None else s0,
            dx, dq, dk, dadt, dgam, dlate, ds0, dk0, dx0,
            T, H, P, N,
            x.stride(0), x.stride(1), x.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
            adt.stride(0), adt.stride(1), seqt.stride(0), dy.stride(0), dy.stride(1),
            dy.stride(2), dx.stride(1), dx.stride(2), dx.stride(3), dx.stride(0),
            dadt.stride(0), dx0.stride(0),
            HAS_SEQ=seq is not None, HAS_DST=dsT is not None,
            L=L, BLOCK_P=_block(P), BLOCK_N=block_n, BLOCK_NF=_block(N), PREC=_precision(x),
            num_warps=BWD_WARPS if P * block_n >= 8192 else 4,
        )  # fmt: skip
        # fixed order: bit-identical reruns
        dx = dx.sum(0) if dx.shape[0] > 1 else dx[0]
        if nb > 1:
            dadt, dgam, dlate, dx0 = (t.sum(0) for t in (dadt, dgam, dlate, dx0))
        else:
            dadt, dgam, dlate, dx0 = dadt[0], dgam[0], dlate[0], dx0[0]
        dD = dD.sum(0).to(D.dtype) if D is not None else None
        return dx.to(x.dtype), dq, dk, dadt, dgam, dlate, None, ds0, dk0, dx0, dD, dz


GATE_BLOCK_M = 32  # rows (b, t) per program of the gate's backward


def _gate_bwd(dy, z, pre, x, D, dxD):
    """`_gate_bwd_kernel`: (dy_core f32, dz in z's dtype or None, dD [programs, H] f32 or
    None), D dy_core into dxD; dy contiguous [B, T, H, P]."""
    has_D = D is not None
    Bsz, T, H, P = dy.shape
    M = Bsz * T
    dyc = torch.empty(dy.shape, device=dy.device, dtype=torch.float32)
    dz = torch.empty(z.shape, device=z.device, dtype=z.dtype) if z is not None else None
    grid = (cdiv(M, GATE_BLOCK_M), H)
    dD = torch.empty(grid, device=dy.device, dtype=torch.float32) if has_D else None
    zs = z.stride()[:3] if z is not None else (0, 0, 0)
    launch(_gate_bwd_kernel, grid,
        dy, opt(z, dy), opt(pre, dy), x, opt(D, dyc), dyc, opt(dz, dyc), opt(dD, dyc),
        opt(dxD, dyc),
        M, T, H, P, *zs, x.stride(0), x.stride(1), x.stride(2),
        HAS_Z=z is not None, HAS_D=has_D, BLOCK_M=GATE_BLOCK_M, BLOCK_P=_block(P),
    )  # fmt: skip
    return dyc, dz, dD


def mamba3_scan_kernel(
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
    """`mamba3_scan_reference` on the kernels, differentiable in every input and the initial
    state: (y [B, T, H, P] in x.dtype, the final f32 state). Outside autograd it is
    `mamba3_scan_fwd` (D and the gate inside the kernel). Under autograd the per-token terms
    are `_Terms` (terms.py) and the scan with D and the gate is `_Core`."""
    tensors = (x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z, *(initial_state or ()))
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors):
        return mamba3_scan_fwd(x, q, k, delta, A, trap, theta, q_bias, k_bias, D, z,
                               initial_state, seq_idx)  # fmt: skip
    initial_state, phi_T, qr, kr, adt, gamma, late, seq, xs, s0, k0, x0 = _prepare(
        x, q, k, delta, A, trap, theta, q_bias, k_bias, initial_state, seq_idx
    )
    if x.shape[1] == 0:
        return x.new_empty(x.shape), Mamba3State(*(t.float() for t in initial_state))
    zs = z if z is None or z.stride(-1) == 1 else z.contiguous()
    y, sT = _Core.apply(xs, qr, kr, adt, gamma, late, seq, s0, k0, x0, D, zs)
    return y, Mamba3State(phi_T, sT, kr[:, -1], x[:, -1].float())
