"""The causal conv1d's backward kernels (channels-last); launched by `launch.conv_bwd`.

With c the pre-activation, dc = dout * silu'(c) and lag = K-1-k,

    dx_s      = sum_{k<K} w[k] * dc_{s+lag} * same(s, s+lag)   (+ d final_state)
    dw[k]     = sum_{b,s} dc_{s+lag} * x_s * same(s, s+lag)
    dbias     = sum_{b,t} dc_t

and d initial_state is dx at the negative times. `_conv_bwd_kernel`, every case: a program owns one
row, one D-block and a chunk of time, walked in tiles of 32 times (one per lane
of a warp) whose last K-1 times only feed the others. Per tile it loads the K
taps of x (cache hits but for the new rows) and dout, computes c and dc once per
time, and moves dc_{s+lag} between lanes with a gather (warp shuffles), so x,
dout and dx cross DRAM once each and nothing else does. dw and dbias accumulate
elementwise in registers, are reduced over time once per program into
per-program partials, and summed in a fixed order on the host: no atomics,
bit-identical runs.
"""

import triton
import triton.language as tl

from .._triton import fast_sigmoid
from .forward import _load_seq

# fmt: off


@triton.jit
def _load_x(
    p_x, p_init, pos, offs_d, mask, T, s_x_t, s_init_t, s_init_d,
    K: tl.constexpr, HAS_INIT: tl.constexpr, pos0,
):
    """The conv input in f32 at times pos [BT] (none before pos0) and channels offs_d [VEC]
    as [BT, VEC] (mask: the elements wanted), negative times reading the initial state."""
    b_x = tl.load(
        p_x + pos.to(tl.int64)[:, None] * s_x_t + offs_d[None, :],
        mask=mask & ((pos >= 0) & (pos < T))[:, None], other=0.0,
    ).to(tl.float32)
    if HAS_INIT:
        if pos0 < 0:
            t_s = pos + (K - 1)
            b_x += tl.load(
                p_init + t_s[:, None] * s_init_t + offs_d[None, :] * s_init_d,
                mask=mask & ((pos < 0) & (t_s >= 0))[:, None], other=0.0,
            ).to(tl.float32)
    return b_x


@triton.jit
def _conv_bwd_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_dout, p_dfinal,
    p_dx, p_dinit, p_dw_part, p_db_part,
    T, D, N_TBLK,
    s_x_b, s_x_t,
    s_w_d, s_w_k,
    s_init_b, s_init_t, s_init_d,
    s_seq_b, s_seq_t,
    s_dout_b, s_dout_t, s_dout_d,
    s_final_b, s_final_t, s_final_d,
    s_dx_b, s_dx_t,
    K: tl.constexpr, BLOCK_T: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    SILU: tl.constexpr, HAS_DFINAL: tl.constexpr, STAGES: tl.constexpr,
):
    # One warp: a tile of BLOCK_T (32) times by VEC channels, one time per lane and VEC
    # channels per thread (a [BT, VEC] load with VEC contiguous gets this layout), so the
    # shift in time is a gather made of warp shuffles; per-tap values add an axis k < BLOCK_K
    # that stays within the thread. A tile owns (writes dx for) its first BLOCK_T - (K-1)
    # times; the last K-1 only supply dc to them. Tiles start at -(K-1) when there is an
    # initial state: dx there is d initial_state.
    # dx: [B, T, D] with stride 1 in D; dinit: contiguous [B, K-1, D];
    # partials: [B, n_chunks, K, D], [B, n_chunks, D]
    pid_c = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    n_chunks = tl.num_programs(0)
    offs_d = pid_d * VEC + tl.arange(0, VEC)
    mask_d = offs_d < D
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    lag = tl.where(mask_k, K - 1 - offs_k, 0)  # tap k: c_t reads x_{t-lag}, dx_s reads dc_{s+lag}
    offs_r = tl.arange(0, BLOCK_T)
    own_r = offs_r < BLOCK_T - (K - 1)
    p_x += pid_b * s_x_b
    p_init += pid_b * s_init_b
    p_seq += pid_b * s_seq_b
    p_dout += pid_b * s_dout_b
    p_dfinal += pid_b * s_final_b
    p_dx += pid_b * s_dx_b
    p_dinit += pid_b * (K - 1) * D
    s_begin = 0
    if HAS_INIT:
        s_begin = 1 - K
    b_w = tl.load(
        p_w + offs_d[:, None] * s_w_d + offs_k[None, :] * s_w_k,
        mask=mask_d[:, None] & mask_k[None, :], other=0.0,
    ).to(tl.float32)[None, :, :]  # [1, VEC, BK]
    b_bias = tl.zeros([VEC], dtype=tl.float32)
    if HAS_BIAS:
        b_bias += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    # dweight and dbias terms summed elementwise over the program's tiles, over time at the end
    b_dw = tl.zeros([BLOCK_T, VEC, BLOCK_K], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_T, VEC], dtype=tl.float32)
    for i in tl.range(N_TBLK, num_stages=STAGES):  # STAGES > 1: later tiles load meanwhile
        q0 = s_begin + (pid_c * N_TBLK + i) * (BLOCK_T - (K - 1))
        q = q0 + offs_r  # [BT]
        in_q = (q >= 0) & (q < T)
        seq_q = q
        if HAS_SEQ:
            seq_q = _load_seq(p_seq, q, T, s_seq_t)
        b_dc = tl.load(
            p_dout + q.to(tl.int64)[:, None] * s_dout_t + offs_d[None, :] * s_dout_d,
            mask=in_q[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
        if SILU:
            # c as in the forward: the K taps of x are one tile read K times (cache hits but
            # for the new rows)
            c = tl.zeros([BLOCK_T, VEC], dtype=tl.float32) + b_bias[None, :]
            for k in tl.static_range(K):
                pos = q - (K - 1 - k)
                b_x = _load_x(
                    p_x, p_init, pos, offs_d, mask_d[None, :], T, s_x_t, s_init_t, s_init_d,
                    K, HAS_INIT, q0 - (K - 1),
                )
                if HAS_SEQ:
                    if k < K - 1:
                        same_k = _load_seq(p_seq, pos, T, s_seq_t) == seq_q
                        b_x = tl.where(same_k[:, None], b_x, 0.0)
                c += b_x * tl.sum(tl.where(offs_k[None, None, :] == k, b_w, -0.0), axis=2)
            sig = fast_sigmoid(c)
            b_dc = b_dc * sig * (1.0 + c * (1.0 - sig))

        # dc at s + lag for every tap (within the tile for the owned s)
        shape: tl.constexpr = [BLOCK_T, VEC, BLOCK_K]
        idx = tl.minimum(offs_r[:, None] + lag[None, :], BLOCK_T - 1)
        b_dck = tl.gather(
            tl.broadcast_to(tl.reshape(b_dc, [BLOCK_T, VEC, 1]), shape),
            tl.broadcast_to(idx[:, None, :], shape), axis=0,
        )
        if HAS_SEQ:
            same = _load_seq(p_seq, q[:, None] + lag[None, :], T, s_seq_t) == seq_q[:, None]
            b_dck = tl.where(same[:, None, :], b_dck, 0.0)
        b_dx = tl.sum(b_dck * b_w, axis=2)
        # dweight[k] = sum over the owned s of dc_{s+lag} x_s same(s, s+lag); x_s is a cache hit,
        # loaded masked to the owned times so that the sum stays a fused multiply-add
        b_xo = _load_x(
            p_x, p_init, q, offs_d, own_r[:, None] & mask_d[None, :], T, s_x_t, s_init_t, s_init_d,
            K, HAS_INIT, q0,
        )
        b_dw += b_dck * tl.reshape(b_xo, [BLOCK_T, VEC, 1])
        b_db += tl.where(own_r[:, None], b_dc, 0.0)
        if HAS_DFINAL:
            if q0 + BLOCK_T > T - (K - 1):
                # time q is final-state row q - (T-(K-1)) when it lies in the last document
                j_f = q - (T - (K - 1))
                in_f = (j_f >= 0) & (q < T)
                if HAS_SEQ:
                    in_f = in_f & (seq_q == tl.load(p_seq + (T - 1) * s_seq_t))
                b_dx += tl.load(
                    p_dfinal + j_f[:, None] * s_final_t + offs_d[None, :] * s_final_d,
                    mask=in_f[:, None] & mask_d[None, :], other=0.0,
                ).to(tl.float32)
        own = own_r & (q < T)
        p_o = p_dx + q.to(tl.int64)[:, None] * s_dx_t + offs_d[None, :]
        m_o = own[:, None] & mask_d[None, :]
        tl.store(p_o, b_dx.to(p_dx.dtype.element_ty), mask=m_o & (q >= 0)[:, None])
        if HAS_INIT:
            p_o = p_dinit + (q + K - 1)[:, None] * D + offs_d[None, :]
            tl.store(p_o, b_dx, mask=m_o & (q < 0)[:, None])

    part = pid_b * n_chunks + pid_c
    p_pw = p_dw_part + part * K * D + offs_k[None, :] * D + offs_d[:, None]
    tl.store(p_pw, tl.sum(b_dw, axis=0), mask=mask_d[:, None] & mask_k[None, :])
    tl.store(p_db_part + part * D + offs_d, tl.sum(b_db, axis=0), mask=mask_d)


@triton.jit
def _load_row(ptr, r, offs, mask_d, T):
    """Row r of a [T, D] tensor as f32 (ptr: the row's start, offs: its channels' offsets);
    zeros outside 0 <= r < T (r a scalar, the mask built as a vector for the interpreter)."""
    rr = r + tl.zeros_like(mask_d).to(tl.int32)
    return tl.load(ptr + offs, mask=mask_d & (rr >= 0) & (rr < T), other=0.0).to(tl.float32)


@triton.jit
def _weight_tap(p_w, offs_d, mask_d, s_w_d, s_w_k, j: tl.constexpr, K: tl.constexpr):
    """w'[j], the weight on x_{t-j} (tap K-1-j), or zeros for j >= K."""
    if j < K:
        return tl.load(p_w + offs_d * s_w_d + (K - 1 - j) * s_w_k, mask=mask_d, other=0.0).to(
            tl.float32
        )
    else:
        return tl.zeros_like(offs_d).to(tl.float32)


@triton.jit
def _dc_row(g, c, SILU: tl.constexpr):
    """dL/dc from dL/dout at one row: dout silu'(c), or dout without the activation."""
    if SILU:
        sig = fast_sigmoid(c)
        return g * sig * (1.0 + c * (1.0 - sig))
    else:
        return g


@triton.jit
def _conv_bwd_rows_kernel(
    p_x, p_w, p_b, p_dout, p_dfinal, p_dx, p_dw_part, p_db_part,
    T, D, CHUNK_T,
    s_x_b, s_x_t, s_w_d, s_w_k, s_dout_b, s_dout_t, s_dout_d, s_final_b, s_final_t,
    s_final_d, s_dx_b, s_dx_t,
    K: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr, HAS_DFINAL: tl.constexpr,
):
    """K <= 4, no seq_idx or initial state. With w'[j] the weight on x_{t-j} (zero for
    j >= K), c_t = b + sum_j w'[j] x_{t-j}, so

        dx_s = sum_j w'[j] dc_{s+j} (+ dfinal[s - (T-K+1)] for s >= T-K+1),
        dw'[j] = sum_s dc_{s+j} x_s,    db = sum_s dc_s.

    A program owns CHUNK_T times [t0, t1) of one row (a multiple of ROWS, the rows an
    iteration) and BLOCK_D channels (along the lanes, 16 bytes a thread) and walks rows
    r = t0 .. t1 + 2 one at a time, keeping x_{r-1..r-3} and dc_{r-1..r-3} in registers: at
    row r it finishes s = r - 3. Each row of x and dout
    is loaded once (the next one while a row computes) and c, dc computed once, but for the
    3 rows before and after the chunk; no shuffles. dw', db: per-program partials
    ([B, n_chunks, K, D], [B, n_chunks, D]) summed in a fixed order on the host."""
    pid_c = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    n_chunks = tl.num_programs(0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    v0 = _weight_tap(p_w, offs_d, mask_d, s_w_d, s_w_k, 0, K)
    v1 = _weight_tap(p_w, offs_d, mask_d, s_w_d, s_w_k, 1, K)
    v2 = _weight_tap(p_w, offs_d, mask_d, s_w_d, s_w_k, 2, K)
    v3 = _weight_tap(p_w, offs_d, mask_d, s_w_d, s_w_k, 3, K)
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    p_x += pid_b * s_x_b
    p_dout += pid_b * s_dout_b
    p_dx += pid_b * s_dx_b
    p_dfinal += pid_b * s_final_b
    offs_g = offs_d * s_dout_d
    offs_f = offs_d * s_final_d
    t0 = pid_c * CHUNK_T
    x3 = _load_row(p_x + (t0 - 3).to(tl.int64) * s_x_t, t0 - 3, offs_d, mask_d, T)
    x2 = _load_row(p_x + (t0 - 2).to(tl.int64) * s_x_t, t0 - 2, offs_d, mask_d, T)
    x1 = _load_row(p_x + (t0 - 1).to(tl.int64) * s_x_t, t0 - 1, offs_d, mask_d, T)
    dc3 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dc2 = dc3
    dc1 = dc3
    for j in tl.static_range(3):  # rows t0 .. t0 + 2: their dc only
        r = t0 + j
        x0 = _load_row(p_x + r.to(tl.int64) * s_x_t, r, offs_d, mask_d, T)
        g = _load_row(p_dout + r.to(tl.int64) * s_dout_t, r, offs_g, mask_d, T)
        dc0 = _dc_row(g, bias + v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3, SILU)
        x3, x2, x1 = x2, x1, x0
        dc3, dc2, dc1 = dc2, dc1, dc0
    dw0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dw1 = dw0
    dw2 = dw0
    dw3 = dw0
    db = dw0
    r = t0 + 3
    nx_x = _load_row(p_x + r.to(tl.int64) * s_x_t, r, offs_d, mask_d, T)
    nx_g = _load_row(p_dout + r.to(tl.int64) * s_dout_t, r, offs_g, mask_d, T)
    # ROWS rows an iteration (CHUNK_T is a multiple): the registers' rotation is renaming
    for i in tl.range(0, CHUNK_T, ROWS, num_stages=1):  # the next row's loads by hand, one ahead
        for u in tl.static_range(ROWS):
            r = t0 + 3 + i + u
            x0 = nx_x
            g = nx_g
            nx_x = _load_row(p_x + (r + 1).to(tl.int64) * s_x_t, r + 1, offs_d, mask_d, T)
            nx_g = _load_row(p_dout + (r + 1).to(tl.int64) * s_dout_t, r + 1, offs_g, mask_d, T)
            dc0 = _dc_row(g, bias + v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3, SILU)
            s = r - 3  # x_s = x3; dc_{s+j}: dc3, dc2, dc1, dc0
            dx = v0 * dc3 + v1 * dc2 + v2 * dc1 + v3 * dc0
            if HAS_DFINAL:  # x_s is final-state row s - (T-K+1) (none before it or past T)
                j_f = s - (T - K + 1)
                dx += _load_row(p_dfinal + j_f.to(tl.int64) * s_final_t, j_f, offs_f, mask_d,
                                K - 1)  # fmt: skip
            m_s = mask_d & ((s + tl.zeros_like(mask_d).to(tl.int32)) < T)
            tl.store(p_dx + s.to(tl.int64) * s_dx_t + offs_d, dx.to(p_dx.dtype.element_ty),
                     mask=m_s)  # fmt: skip
            dw0 += dc3 * x3
            dw1 += dc2 * x3
            dw2 += dc1 * x3
            dw3 += dc0 * x3
            db += dc3
            x3, x2, x1 = x2, x1, x0
            dc3, dc2, dc1 = dc2, dc1, dc0
    part = pid_b * n_chunks + pid_c
    p_pw = p_dw_part + part * K * D + offs_d  # tap k = K-1-j holds dw'[j]
    tl.store(p_pw + (K - 1) * D, dw0, mask=mask_d)
    if K >= 2:
        tl.store(p_pw + (K - 2) * D, dw1, mask=mask_d)
    if K >= 3:
        tl.store(p_pw + (K - 3) * D, dw2, mask=mask_d)
    if K >= 4:
        tl.store(p_pw + (K - 4) * D, dw3, mask=mask_d)
    tl.store(p_db_part + part * D + offs_d, db, mask=mask_d)


# fmt: on
