"""Mamba-2's forward without autograd as the SSD chunked form, a program per (row, head,
chunk) or finer, every chunk in parallel (scan.py's `ssd_fwd` launches them).

Within a chunk of L steps starting at c0, with cs_t = sum_{c0 <= s <= t} delta_s A (the
head's decays' cumulative sum, f32):

    y_t         = sum_{c0 <= s <= t} (C_t . B_s) e^(cs_t - cs_s) delta_s x_s
                  + e^(cs_t) C_t S_start^T + D x_t
    S_start(c+1) = keep_c S_start(c) + u_c,   keep_c = e^(cs_last),
    u_c         = sum_s x_s^T e^(cs_last - cs_s) delta_s B_s           [P, N]

with every sum inside one document under `seq_idx` (the start state carries into the
rows of the document it ends, `keep_c` is 0 when a document starts inside the chunk).
With DT_RAW the kernels read in_proj's dt and make delta = clamp(softplus(dt + dt_bias),
lo, hi) themselves. `_ssd_state_kernel` gives cs and u_c, chunk.py's `_state_scan_kernel`
the start states,
`_ssd_y_kernel` y from them in blocks of BLOCK_M rows. The products take bf16 operands for
bf16 inputs (PREC "bf16"), as the Mamba-3 chunk kernels' `_mm`, and accumulate in f32.
"""

import triton
import triton.language as tl

from ..mamba3.chunk_kernels import _mm
from ..selective_scan.tiles import _softplus

# fmt: off


@triton.jit
def _operand(ptr, mask, PREC: tl.constexpr):
    """A product's operand: bf16 as loaded for PREC "bf16" (fewer registers), else f32."""
    v = tl.load(ptr, mask=mask, other=0.0)
    if PREC == "bf16":
        v = v.to(tl.bfloat16)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def _delta(p_dt, off, mask, h, p_dtb, lo, hi, DT_RAW: tl.constexpr):
    """delta [rows] f32 at the offsets `off` of dt: as given, or DT_RAW: made from in_proj's
    dt, clamp(softplus(dt + dt_bias[h]), lo, hi)."""
    dt = tl.load(p_dt + off, mask=mask, other=0.0).to(tl.float32)
    if DT_RAW:
        dt = _softplus(dt + tl.load(p_dtb + h).to(tl.float32))
        dt = tl.where(mask, tl.minimum(tl.maximum(dt, lo), hi), 0.0)
    return dt


@triton.jit
def _ssd_state_kernel(
    p_x, p_b, p_dt, p_dtb, p_A, p_seq, p_cs, p_u, p_keep,
    T, H, P, N, R, lo, hi,
    s_x_b, s_x_t, s_x_h, s_b_b, s_b_t, s_b_g, s_dt_b, s_dt_t, s_seq_b,
    HAS_SEQ: tl.constexpr, DT_RAW: tl.constexpr, L: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """Chunk c's decays' cumulative sum (to cs [B, H, T] f32), its own part u_c of the next
    start state (to u [B, H, chunks, P, N] f32) and the factor keep_c (keep [B, H, chunks]).
    A program per (row, head, chunk); the product over the chunk's rows in blocks of
    BLOCK_K. R: heads per group of B."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2).to(tl.int64)
    nc = tl.cdiv(T, L)
    c0 = c * L
    bh = b * H + h
    g = h // R
    A = tl.load(p_A + h).to(tl.float32)
    rows = tl.arange(0, L)
    t = c0 + rows
    mt = t < T
    adt = _delta(p_dt, b * s_dt_b + t * s_dt_t + h, mt, h, p_dtb, lo, hi, DT_RAW) * A
    cs = tl.cumsum(adt, axis=0)
    last = tl.minimum(L, T - c0) - 1
    cs_last = tl.sum(tl.where(rows == last, cs, 0.0), axis=0)
    tl.store(p_cs + bh * T + t, cs, mask=mt)
    keep = tl.exp(cs_last)
    doc_last = 0
    if HAS_SEQ:
        doc_last = tl.load(p_seq + b * s_seq_b + c0 + last)
        prev_doc = tl.load(p_seq + b * s_seq_b + tl.maximum(c0 - 1, 0))
        keep = tl.where(doc_last == prev_doc, keep, 0.0)
    tl.store(p_keep + bh * nc + c, keep)
    tl.debug_barrier()  # cs is read back below in blocks of rows, by other threads
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mp, mn = p < P, n < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, L, BLOCK_K):
        tk = c0 + k0 + tl.arange(0, BLOCK_K)
        mk = tk < T
        cs_k = tl.load(p_cs + bh * T + tk, mask=mk, other=0.0)
        dt_k = _delta(p_dt, b * s_dt_b + tk * s_dt_t + h, mk, h, p_dtb, lo, hi, DT_RAW)
        ok = mk
        if HAS_SEQ:
            ok = ok & (tl.load(p_seq + b * s_seq_b + tk, mask=mk, other=-1) == doc_last)
        tail = tl.where(ok, tl.exp(cs_last - cs_k) * dt_k, 0.0)
        xk = tl.load(p_x + b * s_x_b + tk[:, None] * s_x_t + h * s_x_h + p[None, :],
                     mask=mk[:, None] & mp[None, :], other=0.0).to(tl.float32)
        bk = _operand(p_b + b * s_b_b + tk[:, None] * s_b_t + g * s_b_g + n[None, :],
                      mk[:, None] & mn[None, :], PREC)
        xt = tl.trans(xk * tail[:, None])
        if PREC == "bf16":
            xt = xt.to(tl.bfloat16)
        acc = _mm(xt, bk, PREC, acc)
    tl.store(p_u + ((bh * nc + c) * P + p[:, None]) * N + n[None, :], acc,
             mask=mp[:, None] & mn[None, :])


@triton.jit
def _ssd_cb_kernel(
    p_b, p_c, p_cb, T, G, N, s_b_b, s_b_t, s_b_g, s_c_b, s_c_t, s_c_g,
    L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """The scores C_t . B_s of chunk c for one group, a [BLOCK_M, BLOCK_M] block of (t, s) a
    program, to cb [B, G, chunks, L, L] f32 (blocks above the diagonal are not written: no
    row reads them). Grid (row x group, chunk, blocks of t x blocks of s)."""
    b = (tl.program_id(0) // G).to(tl.int64)
    g = tl.program_id(0) % G
    c = tl.program_id(1).to(tl.int64)
    blocks = L // BLOCK_M
    mb = tl.program_id(2) // blocks
    kb = tl.program_id(2) % blocks
    if kb <= mb:
        c0 = c * L
        rows = tl.arange(0, BLOCK_M)
        tm = c0 + mb * BLOCK_M + rows
        tk = c0 + kb * BLOCK_M + rows
        n = tl.arange(0, BLOCK_N)
        mn = n < N
        cm = _operand(p_c + b * s_c_b + tm[:, None] * s_c_t + g * s_c_g + n[None, :],
                      (tm < T)[:, None] & mn[None, :], PREC)
        bk = _operand(p_b + b * s_b_b + tk[:, None] * s_b_t + g * s_b_g + n[None, :],
                      (tk < T)[:, None] & mn[None, :], PREC)
        base = ((b * G + g) * tl.cdiv(T, L) + c) * L * L
        tl.store(p_cb + base + (mb * BLOCK_M + rows)[:, None] * L + (kb * BLOCK_M + rows)[None, :],
                 _mm(cm, tl.trans(bk), PREC))


@triton.jit
def _ssd_y_kernel(
    p_x, p_b, p_c, p_dt, p_dtb, p_cs, p_seq, p_z, p_D, p_st, p_y, p_cb,
    T, H, P, N, R, G, lo, hi,
    s_x_b, s_x_t, s_x_h, s_b_b, s_b_t, s_b_g, s_c_b, s_c_t, s_c_g, s_dt_b, s_dt_t, s_seq_b,
    s_z_b, s_z_t, s_z_h, s_y_b, s_y_t, s_y_h,
    HAS_SEQ: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr, HAS_CB: tl.constexpr,
    DT_RAW: tl.constexpr, L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """y for BLOCK_M rows of chunk c from its start state (st [B, H, chunks, P, N] f32):
    the start state's share, then the chunk's causal scores block by block up to the
    diagonal, D x and the gate y silu(z). HAS_CB: the scores C_t . B_s read from cb (
    `_ssd_cb_kernel`'s, once per group rather than per head). A program per (row, head,
    chunk x blocks of BLOCK_M rows)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    blocks = L // BLOCK_M
    c = (tl.program_id(2) // blocks).to(tl.int64)
    c0 = c * L
    m0 = c0 + (tl.program_id(2) % blocks) * BLOCK_M
    nc = tl.cdiv(T, L)
    bh = b * H + h
    g = h // R
    tm = m0 + tl.arange(0, BLOCK_M)
    mm = tm < T
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mp, mn = p < P, n < N
    cm = _operand(p_c + b * s_c_b + tm[:, None] * s_c_t + g * s_c_g + n[None, :],
                  mm[:, None] & mn[None, :], PREC)
    cs_m = tl.load(p_cs + bh * T + tm, mask=mm, other=0.0)
    start = _operand(p_st + ((bh * nc + c) * P + p[:, None]) * N + n[None, :],
                     mp[:, None] & mn[None, :], PREC)
    y = _mm(cm, tl.trans(start), PREC)  # [M, P]: C_t S_start^T
    carry = mm
    doc_m = 0
    if HAS_SEQ:
        doc_m = tl.load(p_seq + b * s_seq_b + tm, mask=mm, other=-1)
        carry = carry & (doc_m == tl.load(p_seq + b * s_seq_b + tl.maximum(c0 - 1, 0)))
    y = y * tl.where(carry, tl.exp(cs_m), 0.0)[:, None]
    for k0 in range(c0, m0 + BLOCK_M, BLOCK_M):
        tk = k0 + tl.arange(0, BLOCK_M)
        mk = tk < T
        xk = _operand(p_x + b * s_x_b + tk[:, None] * s_x_t + h * s_x_h + p[None, :],
                      mk[:, None] & mp[None, :], PREC)
        cs_k = tl.load(p_cs + bh * T + tk, mask=mk, other=0.0)
        dt_k = _delta(p_dt, b * s_dt_b + tk * s_dt_t + h, mk, h, p_dtb, lo, hi, DT_RAW)
        ok = (tm[:, None] >= tk[None, :]) & mk[None, :]
        if HAS_SEQ:
            doc_k = tl.load(p_seq + b * s_seq_b + tk, mask=mk, other=-2)
            ok = ok & (doc_m[:, None] == doc_k[None, :])
        w = tl.exp(tl.where(ok, cs_m[:, None] - cs_k[None, :], float("-inf"))) * dt_k[None, :]
        if HAS_CB:
            at = ((b * G + g) * nc + c) * L * L + (tm - c0)[:, None] * L + (tk - c0)[None, :]
            scores = tl.load(p_cb + at, mask=ok, other=0.0) * w  # [M, K]
        else:
            bk = _operand(p_b + b * s_b_b + tk[:, None] * s_b_t + g * s_b_g + n[None, :],
                          mk[:, None] & mn[None, :], PREC)
            scores = _mm(cm, tl.trans(bk), PREC) * w
        if PREC == "bf16":
            scores = scores.to(tl.bfloat16)
        y = _mm(scores, xk, PREC, y)
    mtp = mm[:, None] & mp[None, :]
    if HAS_D:
        xm = tl.load(p_x + b * s_x_b + tm[:, None] * s_x_t + h * s_x_h + p[None, :], mask=mtp,
                     other=0.0).to(tl.float32)
        y += tl.load(p_D + h) * xm
    if HAS_Z:
        zm = tl.load(p_z + b * s_z_b + tm[:, None] * s_z_t + h * s_z_h + p[None, :], mask=mtp,
                     other=0.0).to(tl.float32)
        y = y * zm * tl.sigmoid(zm)
    tl.store(p_y + b * s_y_b + tm[:, None] * s_y_t + h * s_y_h + p[None, :],
             y.to(p_y.dtype.element_ty), mask=mtp)


# fmt: on
