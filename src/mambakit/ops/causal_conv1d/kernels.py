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

and d initial_state is dx at the negative times. Two kernels over [BLOCK_T, BLOCK_D]
tiles with channels along the lanes (every load reads row segments): the first recomputes
c and writes dc (f32, silu only; without it dc is dout), the second reads dc at the K lags
as row-shifted tiles (cache hits but for the new rows) and writes dx and per-tile partials
of dw and dbias, summed in a fixed order on the host: no atomics, bit-identical runs.
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
def _conv_dc_kernel(
    p_x, p_w, p_b, p_init, p_seq, p_dout, p_dc, p_dw_part, p_db_part,
    T, D, N_TBLK,
    stride_xb, stride_xt,
    stride_wd, stride_wk,
    stride_ib, stride_it, stride_id,
    stride_sb, stride_st,
    stride_gb, stride_gt, stride_gd,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    SILU: tl.constexpr,
):
    """dc_t = dout_t * silu'(c_t) (c recomputed as in the forward; dc = dout without silu),
    written f32 [B, T, D] when SILU, over N_TBLK tiles of times; and this program's partials
    of dw[k] = sum_t dc_t x_{t-(K-1-k)} same and dbias = sum_t dc_t, from the same taps of x
    (wide tiles of few times: the sums over time stay within a warp)."""
    pid_c = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    n_chunks = tl.num_programs(0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_k = tl.arange(0, BLOCK_K)
    p_x += pid_b * stride_xb
    p_init += pid_b * stride_ib
    p_seq += pid_b * stride_sb
    b_bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        b_bias += tl.load(p_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(N_TBLK):
        t = ((pid_c * N_TBLK + i) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        m2 = (t < T)[:, None] & mask_d[None, :]
        seq_t = t
        if HAS_SEQ:
            seq_t = _load_seq(p_seq, t, T, stride_st)
        dc = tl.load(
            p_dout + pid_b * stride_gb + t[:, None] * stride_gt + offs_d[None, :] * stride_gd,
            mask=m2, other=0.0,
        ).to(tl.float32)
        if SILU:
            c = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + b_bias[None, :]
            for k in tl.static_range(K):
                pos = t - (K - 1 - k)
                b_x = _load_x(
                    p_x, p_init, pos, offs_d, m2, T, stride_xt, stride_it, stride_id, K, HAS_INIT
                )
                if HAS_SEQ:
                    if k < K - 1:
                        b_x = tl.where((_load_seq(p_seq, pos, T, stride_st) == seq_t)[:, None], b_x, 0.0)
                w = tl.load(p_w + offs_d * stride_wd + k * stride_wk, mask=mask_d, other=0.0)
                c += b_x * w.to(tl.float32)[None, :]
            sig = 1.0 / (1.0 + tl.exp(-c))
            dc = dc * sig * (1.0 + c * (1.0 - sig))
            tl.store(p_dc + (pid_b * T + t[:, None]) * D + offs_d[None, :], dc, mask=m2)
        for k in tl.static_range(K):  # the taps again (L1 hits): fewer registers live
            pos = t - (K - 1 - k)
            b_x = _load_x(p_x, p_init, pos, offs_d, m2, T, stride_xt, stride_it, stride_id, K, HAS_INIT)
            if HAS_SEQ:
                if k < K - 1:
                    b_x = tl.where((_load_seq(p_seq, pos, T, stride_st) == seq_t)[:, None], b_x, 0.0)
            b_dw += tl.where((offs_k == k)[:, None], tl.sum(dc * b_x, axis=0)[None, :], 0.0)
        b_db += tl.sum(dc, axis=0)
    part = pid_b * n_chunks + pid_c
    p_pw = p_dw_part + part * K * D + offs_k[:, None] * D + offs_d[None, :]
    tl.store(p_pw, b_dw, mask=(offs_k < K)[:, None] & mask_d[None, :])
    tl.store(p_db_part + part * D + offs_d, b_db, mask=mask_d)


@triton.jit
def _conv_dx_kernel(
    p_w, p_seq, p_dc, p_dfinal, p_dx, p_dinit,
    T, D,
    stride_wd, stride_wk,
    stride_sb, stride_st,
    stride_cb, stride_ct, stride_cd,
    stride_fb, stride_ft, stride_fd,
    stride_dxb, stride_dxt,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_DFINAL: tl.constexpr,
):
    """dx_s = sum_lag w[K-1-lag] dc_{s+lag} same(s, s+lag) (+ d final_state) for a tile of
    times s (from -(K-1) with an initial state: dx there is d initial_state); every
    dc_{s+lag} is a row-shifted load of dc (cache hits but for the new rows)."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    s_begin = 0
    if HAS_INIT:
        s_begin = 1 - K
    s = (s_begin + pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    own = s < T
    p_seq += pid_b * stride_sb
    p_dc += pid_b * stride_cb
    seq_s = s
    if HAS_SEQ:
        seq_s = _load_seq(p_seq, s, T, stride_st)
    b_dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for lag in tl.static_range(K):
        q = s + lag
        in_q = own & (q >= 0) & (q < T)
        dck = tl.load(
            p_dc + q[:, None] * stride_ct + offs_d[None, :] * stride_cd,
            mask=in_q[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
        if HAS_SEQ:
            if lag > 0:
                dck = tl.where((_load_seq(p_seq, q, T, stride_st) == seq_s)[:, None], dck, 0.0)
        w = tl.load(p_w + offs_d * stride_wd + (K - 1 - lag) * stride_wk, mask=mask_d, other=0.0)
        b_dx += dck * w.to(tl.float32)[None, :]
    if HAS_DFINAL:
        # time s is final-state row s - (T-(K-1)) when it lies in the last document
        j_f = s - (T - (K - 1))
        in_f = (j_f >= 0) & own
        if HAS_SEQ:
            in_f = in_f & (seq_s == tl.load(p_seq + (T - 1) * stride_st))
        b_dx += tl.load(
            p_dfinal + pid_b * stride_fb + j_f[:, None] * stride_ft + offs_d[None, :] * stride_fd,
            mask=in_f[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
    m_o = own[:, None] & mask_d[None, :]
    p_o = p_dx + pid_b * stride_dxb + s[:, None] * stride_dxt + offs_d[None, :]
    tl.store(p_o, b_dx.to(p_dx.dtype.element_ty), mask=m_o & (s >= 0)[:, None])
    if HAS_INIT:
        p_o = p_dinit + (pid_b * (K - 1) + s + K - 1)[:, None] * D + offs_d[None, :]
        tl.store(p_o, b_dx, mask=m_o & (s < 0)[:, None])


# fmt: on


# ---------------------------------------------------------------------------- launchers

# launch parameters (scripts/conv_sweep.py times others by replacing these), measured on the
# H200 at 8x2048x1536: forward tiles 32 x 128, 4 warps 45 us (64 x 128: 51); the backward's
# one-kernel predecessor (one time per lane, dc moved between lanes by shuffles) 151 us
FWD_BLOCK_T, FWD_BLOCK_D, FWD_WARPS = 32, 128, 4
BWD_DC_BLOCK_T, BWD_DC_BLOCK_D, BWD_DC_TILES = 8, 512, 16  # dc pass: wide tiles, 16 per program
BWD_DX_BLOCK_T, BWD_DX_BLOCK_D = 32, 128
BWD_WARPS = 4


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
    # dc (written when silu; without it dc is dout) with the dw, dbias partials, then dx
    DC_T, DC_D = _blocks(T, D, BWD_DC_BLOCK_T, BWD_DC_BLOCK_D)
    n_tblk = triton.cdiv(T, DC_T)
    n_chunks = triton.cdiv(n_tblk, BWD_DC_TILES)
    dc, s_dc = dout, dout.stride()
    if silu:
        dc = torch.empty((Bsz, T, D), device=dev, dtype=torch.float32)
        s_dc = dc.stride()
    dw_part = torch.empty((Bsz, n_chunks, K, D), device=dev, dtype=torch.float32)
    db_part = torch.empty((Bsz, n_chunks, D), device=dev, dtype=torch.float32)
    _conv_dc_kernel[(n_chunks, triton.cdiv(D, DC_D), Bsz)](
        x, weight, _opt(bias, weight), _opt(initial_state, x), _opt(seq_idx, x), dout, dc,
        dw_part, db_part,
        T, D, triton.cdiv(n_tblk, n_chunks),
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *_strides(initial_state, 3),
        *_strides(seq_idx, 2),
        *dout.stride(),
        K=K, BLOCK_T=DC_T, BLOCK_D=DC_D, BLOCK_K=triton.next_power_of_2(K),
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, num_warps=BWD_WARPS,
    )  # fmt: skip
    s_begin = -(K - 1) if initial_state is not None else 0  # dinit: dx at the state's times
    DX_T, DX_D = _blocks(T - s_begin, D, BWD_DX_BLOCK_T, BWD_DX_BLOCK_D)
    _conv_dx_kernel[(triton.cdiv(T - s_begin, DX_T), triton.cdiv(D, DX_D), Bsz)](
        weight, _opt(seq_idx, x), dc, _opt(dfinal, x), dx, _opt(dinit, x),
        T, D,
        weight.stride(0), weight.stride(1),
        *_strides(seq_idx, 2),
        *s_dc,
        *_strides(dfinal, 3),
        dx.stride(0), dx.stride(1),
        K=K, BLOCK_T=DX_T, BLOCK_D=DX_D,
        HAS_INIT=initial_state is not None, HAS_SEQ=seq_idx is not None,
        HAS_DFINAL=dfinal is not None, num_warps=BWD_WARPS,
    )  # fmt: skip
    # fixed-order reductions of the per-program partials (deterministic)
    dw = dw_part.sum(dim=(0, 1)).t().contiguous()  # [D, K]
    db = db_part.sum(dim=(0, 1)) if bias is not None else None
    return dx, dw, db, dinit
