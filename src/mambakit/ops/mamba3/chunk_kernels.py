"""The Triton kernels of the Mamba-3 chunk scan (chunk.py has the math, the launchers and
the autograd): the forward (y, the final state, or each chunk's start state for the
backward), the backward over blocks of the N states, and the gate's backward.
"""

import triton
import triton.language as tl

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
def _chunk_inputs(p_q, p_k, p_adt, p_gam, p_late, b, h, c0, t, n, mt, mn, rows, last, T,
                  s_q_b, s_q_t, s_q_h, s_w_b, s_w_t):
    """What both scans read per chunk: q~ and k~'s rows (offsets qn, mask mq) for the states
    n, the weights' offsets wo, gamma, w = gamma plus the next token's late term (inside the
    chunk only), the decays' cumulative sum and its value at the last row, and the chunk's
    first late term."""
    qn = t[:, None] * s_q_t + h * s_q_h + n[None, :]
    mq = mt[:, None] & mn[None, :]
    qc = tl.load(p_q + b * s_q_b + qn, mask=mq, other=0.0)
    kc = tl.load(p_k + b * s_q_b + qn, mask=mq, other=0.0)
    wo = b * s_w_b + t * s_w_t + h
    adt = tl.load(p_adt + wo, mask=mt, other=0.0)
    gam = tl.load(p_gam + wo, mask=mt, other=0.0)
    nxt = tl.load(p_late + wo + s_w_t, mask=(t + 1 < T) & (rows < last), other=0.0)
    cs = tl.cumsum(adt, axis=0)
    cs_last = tl.sum(tl.where(rows == last, cs, 0.0), axis=0)
    late0 = tl.load(p_late + b * s_w_b + c0 * s_w_t + h)
    return qn, mq, qc, kc, wo, gam, gam + nxt, cs, cs_last, late0


@triton.jit
def _chunk_fwd_kernel(
    p_x, p_q, p_k, p_adt, p_gam, p_late, p_seq, p_z, p_D,
    p_s0, p_k0, p_x0, p_y, p_pre, p_sT, p_kT, p_xT, p_st, p_qk,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_z_b, s_z_t, s_z_h,
    s_y_b, s_y_t, s_y_h,
    HAS_SEQ: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    COMPUTE_Y: tl.constexpr, STORE_STATES: tl.constexpr, STORE_PRE: tl.constexpr,
    STORE_QK: tl.constexpr,
):
    """COMPUTE_Y: y and the final state (STORE_PRE: y before the gate, to pre, with y's
    strides: what the backward's gate gradient reads; STORE_QK: each chunk's q~ k~^T [L, L]
    to qk [B, H, chunks, L, L], f32, by the first block of P); STORE_STATES: each chunk's
    start state S'_start to st [B, H, chunks, P, N] (what the backward reads). A program owns
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
        qn, mq, qc, kc, wo, gam, w, cs, cs_last, late0 = _chunk_inputs(
            p_q, p_k, p_adt, p_gam, p_late, b, h, c0, t, n, mt, mn, rows, last, T,
            s_q_b, s_q_t, s_q_h, s_w_b, s_w_t)
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
            qk = _mm(qc, tl.trans(kc), PREC)  # [L(t), L(s)]
            if STORE_QK:
                if tl.program_id(2) == 0:
                    tl.store(p_qk + ((bh * tl.cdiv(T, L) + c0 // L) * L + rows[:, None]) * L
                             + rows[None, :], qk)
            scores = qk * weight
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
    p_x, p_q, p_k, p_adt, p_gam, p_late, p_seq, p_st, p_qk, p_k0, p_x0,
    p_dy, p_dsT,
    p_dx, p_dq, p_dk, p_dadt, p_dgam, p_dlate, p_ds0, p_dk0, p_dx0,
    T, H, P, N,
    s_x_b, s_x_t, s_x_h, s_q_b, s_q_t, s_q_h, s_w_b, s_w_t, s_seq_b, s_dy_b, s_dy_t, s_dy_h,
    s_dx_b, s_dx_t, s_dx_h, s_part_x, s_part_w, s_part_x0,
    HAS_SEQ: tl.constexpr, HAS_DST: tl.constexpr, HAS_QK: tl.constexpr,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NF: tl.constexpr,
    PREC: tl.constexpr,
):
    """One (row, head) and BLOCK_N of its N states, the chunks in reverse, carrying dS
    [P, BLOCK_N] (the gradient of the state after the chunk) and what the next chunk's
    start term owes this chunk's last x and k~. The chunk's start state S'_start comes from
    st and q~ k~^T from qk (HAS_QK; else it is computed here), both the forward kernel's.
    Gradients of the core (no D, no gate): x, q~, k~ (as x's layout / [B, T, H, N], f32),
    A delta, gamma, late [B, T, H] f32, and the initial state's S, k~, x. The states'
    columns are independent but for q~ . k~ (HAS_QK, or read whole: BLOCK_NF) and the sums
    over N: what a block adds to x, A delta, gamma, late and the initial x goes to its own
    slice of those outputs (s_part_*: the stride between blocks' slices), summed after; q~,
    k~ and the initial S and k~ are the block's alone. Terms that do not depend on the
    block are added by the first. dy is the gradient of the core (`_gate_bwd`'s, which adds
    D dy to dx as one more slice)."""
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
        qn, mq, qc, kc, wo, gam, w, cs, cs_last, late0 = _chunk_inputs(
            p_q, p_k, p_adt, p_gam, p_late, b, h, c0, t, n, mt, mn, rows, last, T,
            s_q_b, s_q_t, s_q_h, s_w_b, s_w_t)
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
        if HAS_QK:  # the forward's q~ k~^T
            qk = tl.load(p_qk + ((bh * n_chunks + c) * L + rows[:, None]) * L + rows[None, :])
        elif BLOCK_N < BLOCK_NF:  # q~ . k~ over all N states
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
