"""Triton kernels for the depthwise causal conv1d (channels-last), then their launchers.

B batch, T time, D channels, K = d_conv taps. Tap k of output t reads the input
at time t - (K-1-k); negative times read `initial_state` row K-1+t (oldest
first); with `seq_idx` a tap reading another document reads zero, and times
before 0 belong to the document of t = 0.

Forward: one program per (T-block, D-block, batch row). The K shifted loads of a
[BLOCK_T, BLOCK_D] tile overlap in all but K-1 rows, so DRAM traffic is one
read of x and one write of out; the overlap is served from L1/L2.

Backward: with c the pre-activation, dc = dout * silu'(c) and lag = K-1-k,

    dx_s      = sum_{k<K} w[k] * dc_{s+lag} * same(s, s+lag)   (+ d final_state)
    dw[k]     = sum_{b,s} dc_{s+lag} * x_s * same(s, s+lag)
    dbias     = sum_{b,t} dc_t

and d initial_state is dx at the negative times. One kernel: a program owns one
row, one D-block and a chunk of time, walked in tiles of BLOCK_T times from the last,
channels along the lanes so every load reads row segments. Per tile it loads the K taps of
x (cache hits but for the new rows) and dout, computes c and dc once per time, and stores dc
to a small per-program scratch (L1/L2); after a barrier, dc_{s+lag} is a row-shifted load of
it. So x, dout and dx cross DRAM once each. dw and dbias accumulate in registers into
per-program partials, summed in a fixed order on the host: no atomics,
bit-identical runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# fmt: off
@triton.jit
def _load_x(
    p_x, p_init, pos, offs_d, mask, T, stride_xt, stride_it, stride_id,
    K: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """The conv input in f32 at times pos [BT] and channels offs_d [BD] (mask: the elements
    wanted), negative times reading the initial state, times past T zero."""
    b_x = tl.load(
        p_x + pos.to(tl.int64)[:, None] * stride_xt + offs_d[None, :],
        mask=mask & ((pos >= 0) & (pos < T))[:, None], other=0.0,
    ).to(tl.float32)
    if HAS_INIT:
        t_s = pos + (K - 1)
        b_x += tl.load(
            p_init + t_s[:, None] * stride_it + offs_d[None, :] * stride_id,
            mask=mask & ((pos < 0) & (t_s >= 0))[:, None], other=0.0,
        ).to(tl.float32)
    return b_x


@triton.jit
def _load_seq(p_seq, pos, T, stride_st):
    """seq_idx at times pos, where times before 0 read seq_idx[0] (and past T-1 read T-1)."""
    t = tl.minimum(tl.maximum(pos, 0), T - 1)
    return tl.load(p_seq + t * stride_st)


@triton.jit
def _conv_pre(
    p_x, p_init, p_w, p_b, p_seq, q, seq_q, offs_d, mask_d, T,
    stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st,
    K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
):
    """Pre-activation conv output at times q [BT] (any q; the caller masks q outside [0, T))."""
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(K):
        pos = q - (K - 1 - k)
        b_x = _load_x(p_x, p_init, pos, offs_d, mask_d[None, :], T, stride_xt, stride_it, stride_id, K, HAS_INIT)
        if HAS_SEQ:
            if k < K - 1:
                same = _load_seq(p_seq, pos, T, stride_st) == seq_q
                b_x = tl.where(same[:, None], b_x, 0.0)
        b_w = tl.load(p_w + offs_d * stride_wd + k * stride_wk, mask=mask_d, other=0.0).to(tl.float32)
        acc += b_x * b_w[None, :]
    if HAS_BIAS:
        acc += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_out, p_final,
    T, D,
    stride_xb, stride_xt,
    stride_wd, stride_wk,
    stride_ib, stride_it, stride_id,
    stride_sb, stride_st,
    stride_ob, stride_ot,
    stride_fb, stride_ft,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    SILU: tl.constexpr, STORE_FINAL: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # t * stride may pass 2^31
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    p_x += pid_b * stride_xb
    p_init += pid_b * stride_ib
    p_seq += pid_b * stride_sb

    seq_t = offs_t
    if HAS_SEQ:
        seq_t = _load_seq(p_seq, offs_t, T, stride_st)
    acc = _conv_pre(
        p_x, p_init, p_w, p_b, p_seq, offs_t, seq_t, offs_d, mask_d, T,
        stride_xt, stride_it, stride_id, stride_wd, stride_wk, stride_st,
        K, BLOCK_T, BLOCK_D, HAS_BIAS, HAS_INIT, HAS_SEQ,
    )
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    p_o = p_out + pid_b * stride_ob + offs_t[:, None] * stride_ot + offs_d[None, :]
    tl.store(p_o, acc.to(p_out.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])

    if STORE_FINAL:
        if pid_t == tl.num_programs(0) - 1:
            # final state row j = the input at time T-(K-1)+j, zero outside the last document
            offs_j = tl.arange(0, BLOCK_K)
            mask_j = offs_j < K - 1
            pos = (T - (K - 1) + offs_j).to(tl.int64)
            b_f = _load_x(p_x, p_init, pos, offs_d, mask_d[None, :], T, stride_xt, stride_it, stride_id, K, HAS_INIT)
            if HAS_SEQ:
                seq_last = tl.load(p_seq + (T - 1) * stride_st)
                same = _load_seq(p_seq, pos, T, stride_st) == seq_last
                b_f = tl.where(same[:, None], b_f, 0.0)
            p_f = p_final + pid_b * stride_fb + offs_j[:, None] * stride_ft + offs_d[None, :]
            tl.store(p_f, b_f, mask=mask_j[:, None] & mask_d[None, :])


@triton.jit
def _conv_bwd_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_dout, p_dfinal,
    p_dx, p_dinit, p_dw_part, p_db_part, p_scr,
    T, D, N_TBLK,
    stride_xb, stride_xt,
    stride_wd, stride_wk,
    stride_ib, stride_it, stride_id,
    stride_sb, stride_st,
    stride_gb, stride_gt, stride_gd,
    stride_fb, stride_ft, stride_fd,
    stride_dxb, stride_dxt,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    SILU: tl.constexpr, HAS_DFINAL: tl.constexpr,
):
    # A program owns N_TBLK tiles of BLOCK_T times x BLOCK_D channels (channels along the
    # lanes: every load is a row segment) and walks them last to first, after one more tile
    # past its end whose dc only feeds the first. Per tile: dc once per time, stored to this
    # program's scratch (two alternating [BLOCK_T + K - 1, BLOCK_D] f32 buffers, in L1/L2)
    # with the K-1 first rows of the later tile's dc after it; one barrier; then dc at s + lag
    # is a row-shifted load of the scratch. Tiles start at -(K-1) when there is an initial
    # state: dx there is d initial_state.
    # dx: [B, T, D] with stride 1 in D; dinit: contiguous [B, K-1, D]; partials:
    # [B, n_chunks, K, D], [B, n_chunks, D]
    pid_c = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    n_chunks = tl.num_programs(0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_T)
    SR: tl.constexpr = BLOCK_T + K - 1  # scratch rows of one buffer
    p_x += pid_b * stride_xb
    p_init += pid_b * stride_ib
    p_seq += pid_b * stride_sb
    p_dout += pid_b * stride_gb
    p_dfinal += pid_b * stride_fb
    p_dx += pid_b * stride_dxb
    p_dinit += pid_b * (K - 1) * D
    prog = (pid_b * n_chunks + pid_c) * tl.num_programs(1) + pid_d
    p_scr += prog * (2 * SR * BLOCK_D)
    scr_tile = rows[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    s_begin = 0
    if HAS_INIT:
        s_begin = 1 - K
    b_bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        b_bias += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_D], dtype=tl.float32)
    prev = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)  # dc of the later tile
    for i in range(N_TBLK + 1):
        s = s_begin + ((pid_c + 1) * N_TBLK - i) * BLOCK_T + rows  # [BT]
        in_s = (s >= 0) & (s < T)
        seq_s = s
        if HAS_SEQ:
            seq_s = _load_seq(p_seq, s, T, stride_st)
        b_dc = tl.load(
            p_dout + s.to(tl.int64)[:, None] * stride_gt + offs_d[None, :] * stride_gd,
            mask=in_s[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
        # the K taps of x (cache hits but for the new rows); tap K-1 is x_s itself
        x_s = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        c = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + b_bias[None, :]
        for k in tl.static_range(K):
            if SILU or k == K - 1:
                pos = s - (K - 1 - k)
                b_x = _load_x(
                    p_x, p_init, pos, offs_d, mask_d[None, :], T, stride_xt, stride_it,
                    stride_id, K, HAS_INIT,
                )
            if k == K - 1:
                x_s = b_x
            if SILU:
                if HAS_SEQ:
                    if k < K - 1:
                        b_x = tl.where((_load_seq(p_seq, pos, T, stride_st) == seq_s)[:, None], b_x, 0.0)
                w_k = tl.load(p_w + offs_d * stride_wd + k * stride_wk, mask=mask_d, other=0.0)
                c += b_x * w_k.to(tl.float32)[None, :]
        if SILU:
            sig = 1.0 / (1.0 + tl.exp(-c))
            b_dc = b_dc * sig * (1.0 + c * (1.0 - sig))
        # this tile's dc, then the later tile's first K-1 rows after it; dc at s + lag below
        p_buf = p_scr + (i % 2) * (SR * BLOCK_D)
        tl.store(p_buf + scr_tile, b_dc)
        tl.store(p_buf + BLOCK_T * BLOCK_D + scr_tile, prev, mask=(rows < K - 1)[:, None])
        prev = b_dc
        tl.debug_barrier()
        b_dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        own = (s < T) & ((rows * 0 + i) > 0)  # (vector first: the interpreter)
        for lag in tl.static_range(K):
            dck = tl.load(p_buf + lag * BLOCK_D + scr_tile)
            if HAS_SEQ:
                if lag > 0:
                    same = _load_seq(p_seq, s + lag, T, stride_st) == seq_s
                    dck = tl.where(same[:, None], dck, 0.0)
            w_k = tl.load(p_w + offs_d * stride_wd + (K - 1 - lag) * stride_wk, mask=mask_d, other=0.0)
            b_dx += dck * w_k.to(tl.float32)[None, :]
            # dweight[K-1-lag] = sum over the owned s of dc_{s+lag} x_s same(s, s+lag)
            dw_k = tl.sum(tl.where(own[:, None], dck * x_s, 0.0), axis=0)
            b_dw += tl.where((offs_k == K - 1 - lag)[:, None], dw_k[None, :], 0.0)
        b_db += tl.sum(tl.where((own & in_s)[:, None], b_dc, 0.0), axis=0)
        if HAS_DFINAL:
            # time s is final-state row s - (T-(K-1)) when it lies in the last document
            j_f = s - (T - (K - 1))
            in_f = (j_f >= 0) & (s < T)
            if HAS_SEQ:
                in_f = in_f & (seq_s == tl.load(p_seq + (T - 1) * stride_st))
            b_dx += tl.load(
                p_dfinal + j_f[:, None] * stride_ft + offs_d[None, :] * stride_fd,
                mask=in_f[:, None] & mask_d[None, :], other=0.0,
            ).to(tl.float32)
        m_o = own[:, None] & mask_d[None, :]
        p_o = p_dx + s.to(tl.int64)[:, None] * stride_dxt + offs_d[None, :]
        tl.store(p_o, b_dx.to(p_dx.dtype.element_ty), mask=m_o & (s >= 0)[:, None])
        if HAS_INIT:
            p_o = p_dinit + (s + K - 1)[:, None] * D + offs_d[None, :]
            tl.store(p_o, b_dx, mask=m_o & (s < 0)[:, None])

    part = pid_b * n_chunks + pid_c
    p_pw = p_dw_part + part * K * D + offs_k[:, None] * D + offs_d[None, :]
    tl.store(p_pw, b_dw, mask=(offs_k < K)[:, None] & mask_d[None, :])
    tl.store(p_db_part + part * D + offs_d, b_db, mask=mask_d)


# fmt: on


# ---------------------------------------------------------------------------- launchers

# launch parameters (scripts/conv_sweep.py times others by replacing these)
FWD_BLOCK_T, FWD_BLOCK_D, FWD_WARPS = 32, 128, 4  # H200: 45 us at 8x2048x1536 (64 x 128: 51)
BWD_BLOCK_T, BWD_BLOCK_D, BWD_WARPS = 32, 64, 4
BWD_TILES = 16  # backward tiles per program (each program also recomputes one more tile)


def _blocks(T: int, D: int, block_t: int, block_d: int) -> tuple[int, int]:
    return min(block_t, triton.next_power_of_2(max(T, 1))), min(block_d, triton.next_power_of_2(D))


def _opt(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A stand-in pointer for an absent optional input (never dereferenced)."""
    return t if t is not None else like


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def conv_fwd(
    x: torch.Tensor,  # [B, T, D], stride 1 in D
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    initial_state: torch.Tensor | None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None,  # [B, T] int32
    silu: bool,
    return_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, D] in x.dtype, final_state [B, K-1, D] f32, or an empty tensor)."""
    Bsz, T, D = x.shape
    K = weight.shape[1]
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty((Bsz, T, D), device=x.device, dtype=x.dtype)
    if return_final_state:
        final = torch.empty((Bsz, K - 1, D), device=x.device, dtype=torch.float32)
    else:
        final = torch.empty((0,), device=x.device, dtype=torch.float32)
    if Bsz == 0 or D == 0:
        return out, final
    if T == 0:
        if return_final_state:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return out, final
    BLOCK_T, BLOCK_D = _blocks(T, D, FWD_BLOCK_T, FWD_BLOCK_D)
    BLOCK_K = triton.next_power_of_2(K - 1)
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D), Bsz)
    _conv_fwd_kernel[grid](
        x, weight, _opt(bias, weight), _opt(initial_state, x), _opt(seq_idx, x), out, final,
        T, D,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *_strides(initial_state, 3),
        *_strides(seq_idx, 2),
        out.stride(0), out.stride(1),
        *(final.stride()[:2] if return_final_state else (0, 0)),
        K=K, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, STORE_FINAL=return_final_state,
        num_warps=FWD_WARPS,
    )  # fmt: skip
    return out, final


def conv_bwd(
    dout: torch.Tensor | None,  # [B, T, D], any strides (stride 0 from .sum() losses)
    dfinal: torch.Tensor | None,  # [B, K-1, D], any strides
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    silu: bool,
    dx_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx in x.dtype, dweight f32 [D, K], dbias f32 [D] or None, dinit f32 or None).
    dx_out: a [B, T, D] tensor of x's dtype (any row strides, stride 1 in D) that receives
    dx, returned as dx."""
    Bsz, T, D = x.shape
    K = weight.shape[1]
    dev = x.device
    bias = bias.contiguous() if bias is not None else None
    dx = dx_out if dx_out is not None else torch.empty((Bsz, T, D), device=dev, dtype=x.dtype)
    dinit = (
        torch.empty((Bsz, K - 1, D), device=dev, dtype=torch.float32)
        if initial_state is not None
        else None
    )
    if T == 0 or Bsz == 0 or D == 0:
        if dinit is not None:
            dinit.copy_(dfinal if dfinal is not None and T == 0 else torch.zeros_like(dinit))
        dw = torch.zeros((D, K), device=dev, dtype=torch.float32)
        db = torch.zeros((D,), device=dev, dtype=torch.float32) if bias is not None else None
        return dx, dw, db, dinit
    if dout is None:
        dout = torch.zeros((), device=dev, dtype=x.dtype).expand(Bsz, T, D)
    s_begin = -(K - 1) if initial_state is not None else 0  # dinit: dx at the state's times
    BLOCK_T = max(min(BWD_BLOCK_T, triton.next_power_of_2(T - s_begin)), triton.next_power_of_2(K))
    BLOCK_D = min(BWD_BLOCK_D, triton.next_power_of_2(D))
    n_tblk = triton.cdiv(T - s_begin, BLOCK_T)
    n_chunks = triton.cdiv(n_tblk, BWD_TILES)  # programs along time, evenly split
    tblk_per_chunk = triton.cdiv(n_tblk, n_chunks)
    n_dblk = triton.cdiv(D, BLOCK_D)
    dw_part = torch.empty((Bsz, n_chunks, K, D), device=dev, dtype=torch.float32)
    db_part = torch.empty((Bsz, n_chunks, D), device=dev, dtype=torch.float32)
    scratch = torch.empty(
        (Bsz * n_chunks * n_dblk, 2, BLOCK_T + K - 1, BLOCK_D), device=dev, dtype=torch.float32
    )
    grid = (n_chunks, n_dblk, Bsz)
    _conv_bwd_kernel[grid](
        x, weight, _opt(bias, weight), _opt(initial_state, x), _opt(seq_idx, x),
        dout, _opt(dfinal, x),
        dx, _opt(dinit, x), dw_part, db_part, scratch,
        T, D, tblk_per_chunk,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *_strides(initial_state, 3),
        *_strides(seq_idx, 2),
        *dout.stride(),
        *_strides(dfinal, 3),
        dx.stride(0), dx.stride(1),
        K=K, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_K=triton.next_power_of_2(K),
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, HAS_DFINAL=dfinal is not None,
        num_warps=BWD_WARPS,
    )  # fmt: skip
    # fixed-order reductions of the per-program partials (deterministic)
    dw = dw_part.sum(dim=(0, 1)).t().contiguous()  # [D, K]
    db = db_part.sum(dim=(0, 1)) if bias is not None else None
    return dx, dw, db, dinit
