"""The Triton kernels of the Mamba-3 chunk scan's forward (chunk.py has the math, the
launchers and the autograd): y, the final state, each chunk's start state for the backward;
and the helpers the backward's kernels (chunk_bwd_kernels.py) and the parallel chunks'
(chunk_parallel_kernels.py) share with it: a chunk's inputs, its y, its decays and
document cuts, the walk over chunks.
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
    qc = tl.load(p_q + b * s_q_b + qn, mask=mq, other=0.0).to(tl.float32)
    kc = tl.load(p_k + b * s_q_b + qn, mask=mq, other=0.0).to(tl.float32)
    wo = b * s_w_b + t * s_w_t + h
    adt = tl.load(p_adt + wo, mask=mt, other=0.0)
    gam = tl.load(p_gam + wo, mask=mt, other=0.0)
    nxt = tl.load(p_late + wo + s_w_t, mask=(t + 1 < T) & (rows < last), other=0.0)
    cs = tl.cumsum(adt, axis=0)
    cs_last = tl.sum(tl.where(rows == last, cs, 0.0), axis=0)
    late0 = tl.load(p_late + b * s_w_b + c0 * s_w_t + h)
    return qn, mq, qc, kc, wo, gam, gam + nxt, cs, cs_last, late0


@triton.jit
def _chunk_y(qc, kc, xc, start, same, cs, gam, w, carry, Dh, rows, t, mt, p, mp, b, h,
             p_z, p_y, p_pre, s_z_b, s_z_t, s_z_h, s_y_b, s_y_t, s_y_h,
             HAS_Z: tl.constexpr, HAS_D: tl.constexpr, STORE_PRE: tl.constexpr,
             PREC: tl.constexpr):
    """A chunk's y [L, BLOCK_P] from its inputs and its start state S'_start [BLOCK_P, N]:
    the causal scores (q~ k~^T weighted by the decays, gamma on the diagonal, within a
    document), S'_start's share where the state carries in, D x, the gate; stored to y
    (STORE_PRE: before the gate, to pre)."""
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
    mtp = mt[:, None] & mp[None, :]
    if STORE_PRE:
        tl.store(p_pre + y_off, y.to(p_pre.dtype.element_ty), mask=mtp)
    if HAS_Z:
        zc = tl.load(p_z + b * s_z_b + t[:, None] * s_z_t + h * s_z_h + p[None, :],
                     mask=mtp, other=0.0).to(tl.float32)
        y = y * zc * tl.sigmoid(zc)
    tl.store(p_y + y_off, y.to(p_y.dtype.element_ty), mask=mtp)


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
    LS: tl.constexpr,
):
    """COMPUTE_Y: y and the final state (STORE_PRE: y before the gate, to pre, with y's
    strides: what the backward's gate gradient reads); STORE_STATES: the start state
    S'_start of each chunk of LS steps (a multiple of L) to st [B, H, T / LS, P, N] (what
    the backward reads). A program owns
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
            if c0 % LS == 0:
                c = c0 // LS
                tl.store(p_st + ((bh * tl.cdiv(T, LS) + c) * P + p[:, None]) * N + n[None, :],
                         start.to(p_st.dtype.element_ty), mask=mpn)
        if COMPUTE_Y:
            _chunk_y(qc, kc, xc, start, same, cs, gam, w, carry, Dh, rows, t, mt, p, mp, b, h,
                     p_z, p_y, p_pre, s_z_b, s_z_t, s_z_h, s_y_b, s_y_t, s_y_h,
                     HAS_Z, HAS_D, STORE_PRE, PREC)
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
def _walk_chunks(p_u, p_out, p_keep, S, bh, e, me, PN, n_chunks, i, REVERSE: tl.constexpr,
                 CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """CHUNKS steps of the scan S <- keep_c S + u_c from step i (chunks i + j, or
    n_chunks - 1 - i - j in REVERSE) over BLOCK of the P N values e of u [B, H, chunks,
    P, N]: u_c is loaded as one [CHUNKS, BLOCK] tile (one chunk at a time the loop waits
    on each load: 0.30 ms against 0.10 at 8 x 2048, H200) and the S that meets it stored in
    its place in out (u's shape: u itself, or a buffer in another dtype), keep_c S's factor
    (keep [B, H, chunks]). Returns S after them."""
    j = tl.arange(0, CHUNKS)
    if REVERSE:
        c = n_chunks - 1 - i - j
    else:
        c = i + j
    ok = (c >= 0) & (c < n_chunks)
    mc = ok[:, None] & me[None, :]
    off = (bh * n_chunks + c[:, None]) * PN + e[None, :]
    u = tl.load(p_u + off, mask=mc, other=0.0).to(tl.float32)
    keep = tl.load(p_keep + bh * n_chunks + c, mask=ok, other=1.0)
    out = tl.zeros([CHUNKS, BLOCK], dtype=tl.float32)
    for r in tl.static_range(CHUNKS):
        row = j == r
        out = tl.where(row[:, None], S[None, :], out)
        k_r = tl.sum(tl.where(row, keep, 0.0), axis=0)
        S = k_r * S + tl.sum(tl.where(row[:, None], u, 0.0), axis=0)  # 0 past the ends
    tl.store(p_out + off, out.to(p_out.dtype.element_ty), mask=mc)
    return S


@triton.jit
def _chunk_ctx(p_seq, p_adt, b, h, c0, t, mt, rows, last, s_w_b, s_w_t, s_seq_b,
               HAS_SEQ: tl.constexpr):
    """A chunk's decays and documents as the backward kernels read them: the decays'
    cumulative sum, its value at the last row, exp(cs) where the state carries in (zero
    for rows of a document that starts inside the chunk), the factor `keep` of the start
    state in the end state, and the rows of the chunk's last document."""
    adt = tl.load(p_adt + b * s_w_b + t * s_w_t + h, mask=mt, other=0.0)
    cs = tl.cumsum(adt, axis=0)
    cs_last = tl.sum(tl.where(rows == last, cs, 0.0), axis=0)
    carry = mt.to(tl.float32)
    keep_doc = mt
    if HAS_SEQ:
        prev_doc = tl.load(p_seq + b * s_seq_b + tl.maximum(c0 - 1, 0))
        doc = tl.load(p_seq + b * s_seq_b + t, mask=mt, other=-1)
        carry = tl.where(doc == prev_doc, carry, 0.0)
        doc_last = tl.sum(tl.where(rows == last, doc, 0), axis=0)
        keep_doc = mt & (doc == doc_last)
    e_cs = tl.exp(cs) * carry
    keep = tl.exp(cs_last) * tl.sum(tl.where(rows == last, carry, 0.0), axis=0)
    return cs, cs_last, carry, keep_doc, e_cs, keep


# fmt: on
