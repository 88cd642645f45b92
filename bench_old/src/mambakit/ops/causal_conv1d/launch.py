"""Launchers of the causal conv1d kernels (channels-last): `conv_fwd`, `conv_bwd`, and the
decode step's `conv_update`, with their launch parameters (`ConvConfig`).

The kernels and their math are in `forward.py` (the general tile kernel, and groups of 4
times for K <= 4 without seq_idx), `backward.py` (the tile kernel, dc moved between lanes
by warp shuffles, and for K <= 4 with nothing but x, weight, bias and dout a kernel walking
rows; deterministic per-program partials for dweight and dbias) and `step.py` (one decode
timestep, in place on the state).
"""

from __future__ import annotations

import dataclasses

import torch

from .._triton import cdiv, launch, next_power_of_2, opt, strides
from .backward import _conv_bwd_kernel, _conv_bwd_rows_kernel
from .forward import _conv_fwd_kernel, _conv_fwd_quad_kernel
from .step import _conv_update_kernel

# ---------------------------------------------------------------------------- launchers


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """Launch parameters of the conv kernels (never autotuned: reruns are bit-identical;
    `CONFIG` is the library's, scripts/conv_sweep.py times others through `cfg=`).

    Measured on the H200 at 8x2048x1536: forward tiles 32 x 128, 4 warps 45 us (64 x 128:
    51); backward 16-byte channel vectors 151 us (32-byte: 182). Backward designs with
    channels along the lanes were slower in Triton: dc shifted in time through a
    per-program scratch 248-355 us; two passes (dc, then dx from row-shifted loads of dc)
    270-535 us. The K <= 4 forward: 8 groups of 4 times x 128 channels, 4 warps, 32.2 us
    there (general kernel 40.6), 7.3-7.8 us at 1 x 4096 x 1536 (9.3) and the fastest of six
    settings inside the 130m graph prefill (README.md)."""

    fwd_block_t: int = 32  # times per program of the general forward kernel
    fwd_block_d: int = 128  # channels per program of the general forward kernel
    fwd_warps: int = 4
    quad_block_g: int = 8  # groups of 4 times per program (K <= 4 without seq_idx); 0: off
    quad_block_d: int = 128  # channels per program of the groups kernel
    quad_warps: int = 4
    bwd_vec_bytes: int = 16  # channels per backward thread, in bytes of x
    # pipeline stages of the backward's tile loop: above 1, Triton issues the next tiles'
    # loads as async copies into shared memory while a tile computes (offline sm_90 SASS
    # at 2: LDGSTS, 168 registers against 160); 1 loads each tile when its iteration starts
    # (H100, 8x2048x1536: 0.157 ms, against 0.193 at 2 and 0.207 at 3)
    bwd_stages: int = 1
    # the backward walking rows (K <= 4 without seq_idx or initial state, as a language
    # model's training step: `_conv_bwd_rows_kernel`): times per
    # program; 0 leaves every backward to the tiles. H200, dx into half of d xz: 8 x 2048 x
    # 1536 0.116 ms against the tiles' 0.152 (chunks of 32: 0.124, 128: 0.119, 256: 0.144);
    # 4 x 2048 x 4096 0.096 ms at 128 channels (256: 0.115) against 0.198
    bwd_rows_chunk: int = 64
    bwd_rows_block_d: int = 256  # channels per program of the rows kernel (1536: 128 0.136)
    bwd_rows_block_d_wide: int = 128  # the same at D >= 4096
    bwd_rows_warps: int = 1
    # rows an iteration of the rows kernel, unrolled (offline sm_90 SASS at 256 channels:
    # 1 row 290 instructions, 168 registers; 4 rows 244 a row, 251 registers)
    bwd_rows_unroll: int = 4


CONFIG = ConvConfig()


def _blocks(T: int, D: int, block_t: int, block_d: int) -> tuple[int, int]:
    return min(block_t, next_power_of_2(max(T, 1))), min(block_d, next_power_of_2(D))


def conv_fwd(
    x: torch.Tensor,  # [B, T, D], stride 1 in D
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    initial_state: torch.Tensor | None,  # [B, K-1, D]
    seq_idx: torch.Tensor | None,  # [B, T] int32
    silu: bool,
    return_final_state: bool,
    cfg: ConvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, D] in x.dtype, final_state [B, K-1, D] f32, or an empty tensor).
    cfg: launch parameters other than the library's `CONFIG`."""
    cfg = cfg or CONFIG
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
    BLOCK_K = next_power_of_2(K - 1)
    if K <= 4 and seq_idx is None and cfg.quad_block_g > 0:  # groups of 4 times
        BLOCK_G, BLOCK_D = _blocks(cdiv(T, 4), D, cfg.quad_block_g, cfg.quad_block_d)
        grid = (cdiv(T, 4 * BLOCK_G), cdiv(D, BLOCK_D), Bsz)
        launch(_conv_fwd_quad_kernel, grid,
            x, weight, opt(bias, weight), opt(initial_state, x), out, final,
            T, D,
            x.stride(0), x.stride(1),
            weight.stride(0), weight.stride(1),
            *strides(initial_state, 3),
            out.stride(0), out.stride(1),
            *(final.stride()[:2] if return_final_state else (0, 0)),
            K=K, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
            HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
            SILU=silu, STORE_FINAL=return_final_state,
            num_warps=cfg.quad_warps,
        )  # fmt: skip
        return out, final
    BLOCK_T, BLOCK_D = _blocks(T, D, cfg.fwd_block_t, cfg.fwd_block_d)
    grid = (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D), Bsz)
    launch(_conv_fwd_kernel, grid,
        x, weight, opt(bias, weight), opt(initial_state, x), opt(seq_idx, x), out, final,
        T, D,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *strides(initial_state, 3),
        *strides(seq_idx, 2),
        out.stride(0), out.stride(1),
        *(final.stride()[:2] if return_final_state else (0, 0)),
        K=K, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, STORE_FINAL=return_final_state,
        num_warps=cfg.fwd_warps,
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
    cfg: ConvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx in x.dtype, dweight f32 [D, K], dbias f32 [D] or None, dinit f32 or None).
    dx_out: a [B, T, D] tensor of x's dtype (any row strides, stride 1 in D) that receives
    dx, returned as dx. cfg: as for `conv_fwd`."""
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
    cfg = cfg or CONFIG
    if cfg.bwd_rows_chunk > 0 and K <= 4 and seq_idx is None and initial_state is None:
        return _conv_bwd_rows(dout, dfinal, x, weight, bias, silu, dx, cfg)
    s_begin = -(K - 1) if initial_state is not None else 0  # dinit: dx at the state's times
    # a program: one warp, VEC channels (16-byte loads), tiles of up to 32 times (one per
    # lane; a tile owns all but its last K-1)
    BLOCK_T = min(32, next_power_of_2(T - s_begin + K - 1))
    vec_bytes = cfg.bwd_vec_bytes
    VEC = min(max(vec_bytes // x.element_size(), 1), next_power_of_2(D))
    n_tblk = cdiv(T - s_begin, BLOCK_T - (K - 1))
    n_chunks = cdiv(n_tblk, 16)  # programs along time: ~16 tiles each, evenly split
    tblk_per_chunk = cdiv(n_tblk, n_chunks)
    dw_part = torch.empty((Bsz, n_chunks, K, D), device=dev, dtype=torch.float32)
    db_part = torch.empty((Bsz, n_chunks, D), device=dev, dtype=torch.float32)
    grid = (n_chunks, cdiv(D, VEC), Bsz)
    launch(_conv_bwd_kernel, grid,
        x, weight, opt(bias, weight), opt(initial_state, x), opt(seq_idx, x),
        dout, opt(dfinal, x),
        dx, opt(dinit, x), dw_part, db_part,
        T, D, tblk_per_chunk,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        *strides(initial_state, 3),
        *strides(seq_idx, 2),
        *dout.stride(),
        *strides(dfinal, 3),
        dx.stride(0), dx.stride(1),
        K=K, BLOCK_T=BLOCK_T, VEC=VEC, BLOCK_K=next_power_of_2(K),
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, HAS_DFINAL=dfinal is not None,
        STAGES=cfg.bwd_stages, num_warps=1,
    )  # fmt: skip
    return dx, *_sum_partials(dw_part, db_part, bias), dinit


def _sum_partials(dw_part, db_part, bias) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dweight [D, K], dbias or None) from the per-program partials, summed in a fixed
    order (deterministic)."""
    dw = dw_part.sum(dim=(0, 1)).t().contiguous()
    return dw, db_part.sum(dim=(0, 1)) if bias is not None else None


def _conv_bwd_rows(dout, dfinal, x, weight, bias, silu, dx, cfg: ConvConfig):
    """conv_bwd by `_conv_bwd_rows_kernel` (K <= 4, no seq_idx or initial state)."""
    Bsz, T, D = x.shape
    K = weight.shape[1]
    dev = x.device
    block_d = cfg.bwd_rows_block_d_wide if D >= 4096 else cfg.bwd_rows_block_d
    block_d = min(block_d, next_power_of_2(D))
    n_chunks = cdiv(T, cfg.bwd_rows_chunk)
    rows = cfg.bwd_rows_unroll
    chunk = cdiv(cdiv(T, n_chunks), rows) * rows  # evenly split, whole iterations
    n_chunks = cdiv(T, chunk)  # (rounding up may leave fewer programs with work)
    dw_part = torch.empty((Bsz, n_chunks, K, D), device=dev, dtype=torch.float32)
    db_part = torch.empty((Bsz, n_chunks, D), device=dev, dtype=torch.float32)
    launch(_conv_bwd_rows_kernel, (n_chunks, cdiv(D, block_d), Bsz),
        x, weight, opt(bias, weight), dout, opt(dfinal, x), dx, dw_part, db_part,
        T, D, chunk,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *dout.stride(),
        *strides(dfinal, 3), dx.stride(0), dx.stride(1),
        K=K, BLOCK_D=block_d, ROWS=rows, HAS_BIAS=bias is not None, SILU=silu,
        HAS_DFINAL=dfinal is not None, num_warps=cfg.bwd_rows_warps,
    )  # fmt: skip
    return dx, *_sum_partials(dw_part, db_part, bias), None


def conv_update(
    conv_state: torch.Tensor,  # [B, K-1, D], updated in place
    x: torch.Tensor,  # [B, D], stride 1 in D
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    silu: bool,
    out: torch.Tensor | None = None,  # [B, D] in x.dtype; allocated when None
) -> torch.Tensor:
    Bsz, D = x.shape
    K = weight.shape[1]
    if out is None:
        out = torch.empty((Bsz, D), device=x.device, dtype=x.dtype)
    if Bsz == 0 or D == 0:
        return out
    BLOCK_D = min(256, next_power_of_2(D))
    grid = (cdiv(D, BLOCK_D), Bsz)
    launch(_conv_update_kernel, grid,
        conv_state, x, weight, bias.contiguous() if bias is not None else weight, out,
        D,
        *conv_state.stride(),
        x.stride(0),
        weight.stride(0), weight.stride(1),
        out.stride(0),
        K=K, BLOCK_D=BLOCK_D, HAS_BIAS=bias is not None, SILU=silu,
        num_warps=4 if BLOCK_D >= 256 else 1,
    )  # fmt: skip
    return out
