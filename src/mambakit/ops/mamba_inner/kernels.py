"""dt_proj for the scan, as one Triton kernel: delta through softplus in f32, B and C widened.

B batch, T time, D = d_inner, N = d_state, R = dt_rank; x_dbl = u W_x^T [B, T, R + 2N].

    raw    = x_dbl[..., :R] @ W_dt^T          [B, T, D], rounded to x_dbl's dtype (the GEMM's)
    delta  = softplus(raw + dt_bias)          [B, T, D] f32 (the scan's softplus)
    bc     = x_dbl[..., R:] in f32            [B, T, 2N]

The scan reads delta and B, C once per pass, and it makes two passes over a long row (the
segment summaries, then the outputs): given raw delta it computes softplus in both, 17
instructions and two of the exponential unit's per (t, channel), a tenth of that unit's
work in each pass. This kernel computes it once, in the epilogue of the dt_proj product,
and widens B and C to the f32 the scan reads (a launch of its own before), so the chain
cuBLAS dt_proj -> widen B, C -> scan(softplus) becomes this kernel -> scan. The forward of
the fused node runs it with softplus; its backward with `softplus=False` for raw delta, the
same bits the forward started from, for the scan's backward (which needs the raw values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import COMPILED, cdiv, fast_sigmoid, launch, next_power_of_2, opt, strides
from ..causal_conv1d.kernels import _conv_pre, _load_seq, _store_final
from ..selective_scan.tiles import _delta_of


# fmt: off
@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b in f32. Interpreted, bf16 operands go through f32 (exact products): the
    interpreter's bf16 dot (Triton 3.9) multiplies garbage."""
    if COMPILED:
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x rounded to dtype to nearest even, as torch rounds (a GEMM's output, `.to`).
    Interpreted, Triton 3.9 truncates f32 to bf16, so the rounding is done on the bits first."""
    if not COMPILED:
        if (dtype == tl.bfloat16) & (x.dtype == tl.float32):
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _summed(p_parts, offs_m, cols, mask, M, W, PARTS: tl.constexpr, dtype: tl.constexpr):
    """Columns `cols` of x_dbl's rows offs_m from its PARTS partial sums [PARTS, M, W] f32,
    added in order and rounded to dtype (as a GEMM rounds its output)."""
    acc = tl.zeros([offs_m.shape[0], cols.shape[0]], dtype=tl.float32)
    for s in tl.static_range(PARTS):
        acc += tl.load(p_parts + (s * M + offs_m[:, None]) * W + cols[None, :], mask=mask, other=0.0)
    return _round(acc, dtype)


@triton.jit
def _dt_proj_kernel(
    p_xdbl, p_parts, p_w, p_bias, p_delta, p_bc,
    M, D, R, N2,
    s_xdbl_m, s_w_d, s_w_r,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_BC: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, IEEE: tl.constexpr,
    D_TILES: tl.constexpr, STAGES: tl.constexpr, PARTS: tl.constexpr,
):
    # x_dbl [M, R + 2N] rows (M = B T) with stride 1 along them; delta [M, D] (SOFTPLUS: f32,
    # else x_dbl's dtype) and bc [M, 2N] f32, contiguous. A program: BLOCK_M rows, D_TILES
    # tiles of BLOCK_D channels one after the other (its dt rows loaded once). PARTS > 0:
    # x_dbl comes as partial sums [PARTS, M, R + 2N] f32 (conv_x_proj), and the programs of
    # the first channel tiles write it.
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    dtype = p_xdbl.dtype.element_ty
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < M
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    p_rows = p_xdbl + offs_m[:, None] * s_xdbl_m
    m_r = mask_m[:, None] & mask_r[None, :]
    if PARTS > 0:
        dt_r = _summed(p_parts, offs_m, offs_r, m_r, M, R + N2, PARTS, dtype)
        if pid_d == 0:
            tl.store(p_rows + offs_r[None, :], dt_r, mask=m_r)
    else:
        dt_r = tl.load(p_rows + offs_r[None, :], mask=m_r, other=0.0)
    for j in tl.range(D_TILES, num_stages=STAGES):
        offs_d = (pid_d * D_TILES + j) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        w = tl.load(
            p_w + offs_d[None, :] * s_w_d + offs_r[:, None] * s_w_r,
            mask=mask_r[:, None] & mask_d[None, :], other=0.0,
        )
        raw = _dot(dt_r, _round(w, dtype), tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), IEEE)
        raw = _round(raw, dtype)  # dt_proj's output, as the GEMM rounds it
        m2 = mask_m[:, None] & mask_d[None, :]
        p_out = p_delta + offs_m[:, None] * D + offs_d[None, :]
        if SOFTPLUS:
            bias = tl.zeros([BLOCK_D], dtype=tl.float32)
            if HAS_BIAS:
                bias = tl.load(p_bias + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            _, delta = _delta_of(raw.to(tl.float32), m2, bias, HAS_BIAS, True, True)
            tl.store(p_out, delta, mask=m2)
        else:
            tl.store(p_out, raw, mask=m2)
    if SOFTPLUS:
        if pid_d == 0:  # B and C, widened
            offs_c = tl.arange(0, BLOCK_BC)
            m_c = mask_m[:, None] & (offs_c < N2)[None, :]
            if PARTS > 0:
                bc = _summed(p_parts, offs_m, R + offs_c, m_c, M, R + N2, PARTS, dtype)
                tl.store(p_rows + R + offs_c[None, :], bc, mask=m_c)
            else:
                bc = tl.load(p_rows + R + offs_c[None, :], mask=m_c, other=0.0)
            tl.store(p_bc + offs_m[:, None] * N2 + offs_c[None, :], bc.to(tl.float32), mask=m_c)


@triton.jit
def _conv_x_proj_kernel(
    p_x, p_cw, p_cb, p_init, p_seq, p_u, p_final, p_wx, p_parts,
    T, D, W,
    s_x_b, s_x_t, s_cw_d, s_cw_k, s_init_b, s_init_t, s_init_d, s_seq_b, s_seq_t,
    s_u_b, s_u_t, s_final_b, s_final_t, s_wx_w, s_wx_d,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr, D_TILES: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, STORE_FINAL: tl.constexpr,
    IEEE: tl.constexpr, STAGES: tl.constexpr,
):
    # A program: BLOCK_T times of one row and D_TILES tiles of BLOCK_D channels (its part of
    # x_proj's sum over channels). Per tile: u = silu(conv(x)) stored in u's dtype, and that
    # stored u times W_x^T added to the part's sum; parts [PARTS, B, T, W] f32, contiguous.
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    dtype = p_u.dtype.element_ty
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_t = offs_t < T
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < W
    p_x += pid_b * s_x_b
    p_init += pid_b * s_init_b
    p_seq += pid_b * s_seq_b
    seq_t = offs_t
    if HAS_SEQ:
        seq_t = _load_seq(p_seq, offs_t, T, s_seq_t)
    acc = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float32)
    for j in tl.range(D_TILES, num_stages=STAGES):
        offs_d = (pid_s * D_TILES + j) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        c = _conv_pre(
            p_x, p_init, p_cw, p_cb, p_seq, offs_t, seq_t, offs_d, mask_d, T,
            s_x_t, s_init_t, s_init_d, s_cw_d, s_cw_k, s_seq_t,
            K, BLOCK_T, BLOCK_D, HAS_BIAS, HAS_INIT, HAS_SEQ,
        )
        u = (c * fast_sigmoid(c)).to(dtype)
        p_o = p_u + pid_b * s_u_b + offs_t[:, None] * s_u_t + offs_d[None, :]
        tl.store(p_o, u, mask=mask_t[:, None] & mask_d[None, :])
        w = tl.load(
            p_wx + offs_w[None, :] * s_wx_w + offs_d[:, None] * s_wx_d,
            mask=mask_d[:, None] & mask_w[None, :], other=0.0,
        )
        acc = _dot(u, _round(w, dtype), acc, IEEE)
        if STORE_FINAL:
            if pid_t == tl.num_programs(0) - 1:
                _store_final(
                    p_x, p_init, p_seq, p_final + pid_b * s_final_b, offs_d, mask_d, T,
                    s_x_t, s_init_t, s_init_d, s_seq_t, s_final_t, K, BLOCK_K, HAS_INIT, HAS_SEQ,
                )
    rows = pid_s * tl.num_programs(2) * T + pid_b * T + offs_t
    p_p = p_parts + rows[:, None] * W + offs_w[None, :]
    tl.store(p_p, acc, mask=mask_t[:, None] & mask_w[None, :])


# fmt: on


# conv + x_proj launch parameters (GPU; interpreted: the smallest tiles tl.dot allows and two
# tiles per part): BLOCK_T times x BLOCK_D channels per tile, warps, at most PARTS parts of
# the sum over channels (each program does ceil(D tiles / PARTS) tiles), pipeline stages.
# x_proj widths W = dt_rank + 2 N above MAX_W go through cuBLAS instead.
CX_BLOCK_T, CX_BLOCK_D, CX_WARPS, CX_PARTS, CX_STAGES = 32, 128, 4, 4, 2
CX_MAX_W = 256


def conv_x_proj(
    x: torch.Tensor,  # [B, T, D], stride 1 in D: the x half of in_proj's output
    conv_weight: torch.Tensor,  # [D, K]
    conv_bias: torch.Tensor | None,  # [D]
    conv_state: torch.Tensor | None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None,  # [B, T] int32
    x_proj_weight: torch.Tensor,  # [W, D]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u = silu(conv(x)) [B, T, D] in x's dtype, the conv's final state [B, K-1, D] f32,
    the partial sums of u W_x^T [PARTS, B T, W] f32 over blocks of channels), in one launch;
    `dt_proj(..., parts=)` adds the parts in order (deterministic) into x_dbl. Requires
    B, T, D > 0 and W <= CX_MAX_W."""
    Bsz, T, D = x.shape
    K = conv_weight.shape[1]
    W = x_proj_weight.shape[0]
    dev, f32 = x.device, torch.float32
    interpret = not x.is_cuda
    bt = 16 if interpret else min(CX_BLOCK_T, max(16, next_power_of_2(T)))
    bd = 16 if interpret else min(CX_BLOCK_D, max(16, next_power_of_2(D)))
    ndb = cdiv(D, bd)
    tiles = 2 if interpret else cdiv(ndb, CX_PARTS)
    n_parts = cdiv(ndb, tiles)
    u = torch.empty((Bsz, T, D), device=dev, dtype=x.dtype)
    final = torch.empty((Bsz, K - 1, D), device=dev, dtype=f32)
    parts = torch.empty((n_parts, Bsz * T, W), device=dev, dtype=f32)
    conv_bias = conv_bias.contiguous() if conv_bias is not None else None
    launch(_conv_x_proj_kernel, (cdiv(T, bt), n_parts, Bsz),
        x, conv_weight, opt(conv_bias, conv_weight), opt(conv_state, x), opt(seq_idx, x), u,
        final, x_proj_weight, parts,
        T, D, W,
        x.stride(0), x.stride(1), conv_weight.stride(0), conv_weight.stride(1),
        *strides(conv_state, 3), *strides(seq_idx, 2),
        u.stride(0), u.stride(1), final.stride(0), final.stride(1),
        x_proj_weight.stride(0), x_proj_weight.stride(1),
        K=K, BLOCK_T=bt, BLOCK_D=bd, BLOCK_W=max(16, next_power_of_2(W)),
        BLOCK_K=next_power_of_2(K - 1), D_TILES=tiles, HAS_BIAS=conv_bias is not None,
        HAS_INIT=conv_state is not None, HAS_SEQ=seq_idx is not None, STORE_FINAL=True,
        IEEE=x.dtype == f32, STAGES=CX_STAGES, num_warps=CX_WARPS,
    )  # fmt: skip
    return u, final, parts


# launch parameters (GPU; the interpreter takes the smallest tiles tl.dot allows, and two
# channel tiles per program, so the tests cover several blocks, the loop and the masked
# edges), measured on the H200 from CUDA graphs by scripts/dt_proj_sweep.py as (rows,
# channels, warps, channel tiles per program, pipeline stages), all with the same bits:
#   130m 1 x 4096:  64 x 64 x 4, 4 tiles, 3 stages  9.9 us (1 tile: 10.3; 64 x 128: 11.8)
#   1.4b 1 x 4096:  the same                       26.4 us (64 x 128, 1 tile: 30.6-31.3)
#   130m 8 x 2048:  the same                       35.1 us (1 tile: 35.4)
# It writes 4 bytes of delta per (t, channel) where cuBLAS wrote 2: 9.9 us against cuBLAS
# dt_proj 6.0 + widening B, C 2.8 at 130m, paid back by the scan (88.0 -> 79.7 us).
BLOCK_M, BLOCK_D, WARPS, D_TILES, STAGES = 64, 64, 4, 4, 3


def dt_proj(
    x_dbl: torch.Tensor,  # [B, T, R + 2N], stride 1 in the last dim
    dt_proj_weight: torch.Tensor,  # [D, R]
    dt_bias: torch.Tensor | None,  # [D]
    softplus: bool,
    parts: torch.Tensor | None = None,  # [PARTS, B T, R + 2N] f32: x_dbl's partial sums
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts: x_dbl is written, from the partial sums of `conv_x_proj` (added in order,
    rounded to x_dbl's dtype). softplus: (delta = softplus(raw + dt_bias) [B, T, D] f32, B and C side by side
    [B, T, 2N] f32); else (raw [B, T, D] in x_dbl's dtype, an empty tensor), where
    raw = x_dbl[..., :R] @ W_dt^T is rounded to x_dbl's dtype as the GEMM rounds it, the
    weight as `.to(x_dbl.dtype)` would, and softplus is the scan's own."""
    Bsz, T, W = x_dbl.shape
    D, R = dt_proj_weight.shape
    N2 = W - R
    dev, f32 = x_dbl.device, torch.float32
    assert parts is None or (softplus and x_dbl.is_contiguous()), "parts: the forward's x_dbl"
    delta = torch.empty((Bsz, T, D), device=dev, dtype=f32 if softplus else x_dbl.dtype)
    bc = torch.empty((Bsz, T, N2) if softplus else (0,), device=dev, dtype=f32)
    M = Bsz * T
    if M == 0:
        return delta, bc
    x2 = x_dbl.reshape(M, W)  # a view for the layer's contiguous x_dbl
    interpret = not x_dbl.is_cuda
    bm = 16 if interpret else BLOCK_M
    bd = 16 if interpret else BLOCK_D
    tiles = 2 if interpret else D_TILES  # interpreted: the loop runs in the tests
    launch(_dt_proj_kernel, (cdiv(M, bm), cdiv(D, bd * tiles)),
        x2, opt(parts, x2), dt_proj_weight, opt(dt_bias, dt_proj_weight), delta, bc,
        M, D, R, N2,
        x2.stride(0), dt_proj_weight.stride(0), dt_proj_weight.stride(1),
        BLOCK_M=bm, BLOCK_D=bd, BLOCK_R=max(16, next_power_of_2(R)),
        BLOCK_BC=next_power_of_2(N2), HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus,
        IEEE=x_dbl.dtype == f32, D_TILES=tiles, STAGES=STAGES,
        PARTS=parts.shape[0] if parts is not None else 0, num_warps=WARPS,
    )  # fmt: skip
    return delta, bc
