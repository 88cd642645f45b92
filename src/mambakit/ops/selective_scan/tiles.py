"""Tile helpers shared by the scan kernels (forward, backward, carries) and the decode step.

B batch, T time, D = d_inner, N = d_state; TC the time tile. A program holds [TC, BLOCK_D]
tiles of the [B, T, D] inputs, [TC, BLOCK_N] tiles of B and C, and [TC, BLOCK_N, BLOCK_D]
tiles of decays and states (channels along the lanes). Here: the program's place on the grid,
masked or unmasked tile loads and stores, delta (bias, softplus), the decays a_t = exp2(delta_t
A log2 e) with document starts cut, the scans' combines and the reverse recurrence by rows.
"""

import triton
import triton.language as tl

from .._triton import fast_rcp

LOG2E = tl.constexpr(1.4426950408889634)

# fmt: off


@triton.jit
def _in_range(mask, t, T):
    """mask & (t < T) for a scalar t, built as a vector (the interpreter refuses
    vector & scalar)."""
    return mask & ((t + tl.zeros_like(mask).to(tl.int32)) < T)


@triton.jit
def _softplus(x):
    """log(1 + e^x) = max(x, 0) + log1p(e^-|x|), with log1p(e) = 2 atanh(e / (2 + e)) by
    its series (s = e / (2 + e) <= 1/3; terms to s^13, error below f32 rounding): one
    exponential and a few multiply-adds, accurate for large negative x too, where
    log(1 + e^x) rounds 1 + e^x. libdevice's log alone is some 30 instructions."""
    e = tl.exp2(-tl.abs(x) * LOG2E)
    s = e * fast_rcp(2.0 + e)
    s2 = s * s
    p = s2 * (1.0 / 13.0) + 1.0 / 11.0
    p = p * s2 + 1.0 / 9.0
    p = p * s2 + 1.0 / 7.0
    p = p * s2 + 1.0 / 5.0
    p = p * s2 + 1.0 / 3.0
    p = p * s2 + 1.0
    return tl.maximum(x, 0.0) + 2.0 * s * p


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _combine(a1, b1, a2, b2):
    """(a1, b1) then (a2, b2) for h -> a h + b."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _second(a, b):
    """The combine of an identity scan (every element keeps its value)."""
    return b


@triton.jit
def _row(x, rows, r):
    """Row r of a [TC, BN, BD] tile as [BN, BD]."""
    return tl.sum(tl.where((rows == r)[:, None, None], x, 0.0), axis=0)


@triton.jit
def _reverse_scan(c, a, G, rows, TC: tl.constexpr):
    """The adjoint recurrence g_t = c_t + a_{t+1} g_{t+1} over the rows of a [TC, BN, BD]
    tile, last row first, entering with G = a_TC g_TC (the carry from the later tile).
    Returns (g, a_0 g_0: the carry into the earlier tile). The rows lie within a thread, so
    each step only picks registers; `tl.associative_scan(reverse=True)` would also reverse
    the warp's lanes (a butterfly shuffle per value and operand)."""
    g = tl.zeros_like(c)
    acc = G
    for i in tl.static_range(TC):
        acc = _row(c, rows, TC - 1 - i) + acc
        g = tl.where((rows == TC - 1 - i)[:, None, None], acc[None, :, :], g)
        acc = _row(a, rows, TC - 1 - i) * acc
    return g, acc


@triton.jit
def _program_block(p_A, p_bias, Dn, N, Bsz, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """This program's (segment, row, channel block, state block) on the grid (D blocks,
    segments, rows x state blocks), its masks, A [BLOCK_N, BLOCK_D] and the dt bias [BLOCK_D]."""
    pid_d = tl.program_id(0)
    s = tl.program_id(1)
    b = (tl.program_id(2) % Bsz).to(tl.int64)
    pid_n = tl.program_id(2) // Bsz
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    md = d < Dn
    mn = n < N
    mdn = mn[:, None] & md[None, :]  # [BLOCK_N, BLOCK_D]: channels along the lanes
    A = tl.load(p_A + d[None, :] * N + n[:, None], mask=mdn, other=0.0)
    bias = tl.zeros([BLOCK_D], tl.float32)
    if HAS_BIAS:
        bias = tl.load(p_bias + d, mask=md, other=0.0)
    return pid_d, s, b, pid_n, d, n, md, mn, mdn, A, bias


@triton.jit
def _ld(ptrs, mask, EVEN: tl.constexpr):
    """Load as f32; EVEN: every element is in bounds, no mask."""
    if EVEN:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _st(ptrs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _delta_of(raw, m2, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, EVEN: tl.constexpr):
    """Raw delta [TC, BD] as loaded -> (raw + bias, delta); delta is 0 on rows past T."""
    if HAS_BIAS:
        raw = raw + bias[None, :]
    if SOFTPLUS:
        dt = _softplus(raw)
    else:
        dt = raw
    if not EVEN:
        dt = tl.where(m2, dt, 0.0)
    return raw, dt


@triton.jit
def _tile_dt(
    t0, rows, mt, b, d, md, p_dt, s_dt_b, s_dt_t, bias,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, EVEN: tl.constexpr,
):
    """Tile rows t0 + rows: mask [TC, BD], raw delta (+ bias), delta (0 on rows past T)."""
    m2 = mt[:, None] & md[None, :]
    raw = _ld(_tile_ptrs(p_dt, s_dt_b, s_dt_t, b, t0, rows, d, 1), m2, EVEN)
    raw, dt = _delta_of(raw, m2, bias, HAS_BIAS, SOFTPLUS, EVEN)
    return m2, raw, dt


@triton.jit
def _doc_starts(t, mt, b, p_seq, s_seq_b, s_seq_t):
    """[TC] bool: a document starts at row t (nothing flows in from t - 1)."""
    t64 = t.to(tl.int64)
    first = mt & (t > 0)
    cur = tl.load(p_seq + b * s_seq_b + t64 * s_seq_t, mask=first, other=0)
    prev = tl.load(p_seq + b * s_seq_b + (t64 - 1) * s_seq_t, mask=first, other=0)
    return cur != prev


@triton.jit
def _tile_decay(
    t0, rows, mt, b, d, md, p_dt, s_dt_b, s_dt_t, p_seq, s_seq_b, s_seq_t, A2, bias,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr, EVEN: tl.constexpr,
):
    """_tile_dt, and a_t [TC, BN, BD] (A2 = A^T log2(e), [BN, BD]). Rows past T are identities
    (delta 0: a = 1, b = 0)."""
    m2, raw, dt = _tile_dt(
        t0, rows, mt, b, d, md, p_dt, s_dt_b, s_dt_t, bias, HAS_BIAS, SOFTPLUS, EVEN
    )
    a = tl.exp2(dt[:, None, :] * A2[None, :, :])
    if HAS_SEQ:
        starts = _doc_starts(t0 + rows, mt, b, p_seq, s_seq_b, s_seq_t)
        a = tl.where(starts[:, None, None], 0.0, a)
    return m2, raw, dt, a


@triton.jit
def _tile_ptrs(ptr, s_b, s_t, b, t0, rows, cols, s_c):
    """Pointers of the [TC, len(cols)] tile at steps t0 + rows of row b of a [B, T, cols]
    tensor: a scalar int64 base and int32 offsets that stay the same from tile to tile (so
    they are computed once, outside the tile loop)."""
    return (ptr + (b * s_b + t0.to(tl.int64) * s_t)) + (rows[:, None] * s_t + cols[None, :] * s_c)


@triton.jit
def _row_ptrs(ptr, s_b, s_t, b, rows, cols, s_c):
    """Pointers of the [TC, len(cols)] tile at steps rows of row b of a [B, T, cols] tensor
    (a kernel's loop adds each tile's t0 s_t to them)."""
    return (ptr + b * s_b) + (rows[:, None] * s_t + cols[None, :] * s_c)


@triton.jit
def _tile_rows(ptr, s_b, s_t, b, t0, rows, cols, mask, EVEN: tl.constexpr):
    """A [TC, len(cols)] tile of a [B, T, cols] tensor, as f32."""
    return _ld(_tile_ptrs(ptr, s_b, s_t, b, t0, rows, cols, 1), mask, EVEN)
