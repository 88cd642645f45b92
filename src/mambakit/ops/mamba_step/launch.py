"""Launchers of one decode step of a Mamba block (kernels.py): `layer_step`, `linear`, and
their launch parameters `StepConfig`.

B batch, M = d_model, D = d_inner, N = d_state, R = dt_rank, K = d_conv.

Up to `rows_max_batch` rows (`rows_max_batch_narrow` with 16-bit weights of short rows,
`rows_max_batch_f32` with small float32 weights) a block is the four streaming launches of
kernels.py. Above, the projections go to cuBLAS (`F.linear`)
and the small work between them stays fused: the norm, the conv update, then dt_proj
(while row blocks x its weight <= `dt_proj_fused_bytes`) + state update + gate in
`_layer_ssm_kernel`, `ssm_rows` rows per program.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .._triton import cdiv, launch, next_power_of_2, pdl_args
from ..causal_conv1d.launch import conv_update
from ..rms_norm.launch import rms_fwd
from .kernels import _layer_in_kernel, _layer_ssm_kernel, _linear_kernel


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Launch parameters of the decode step's kernels (not autotuned: two update the state
    in place; `config` gives the library's, scripts/step_sweep.py times others).

    tile: H200, batch-1 graph step: 1.4b 1124 us at 8192, 1068 at 16384 (32768: 1068, 4096:
    1096); 130m 213-218 us at any of them. ssm_rows: H200, graph step at batch 64: 130m 675.5
    us at 2 (1: 699.2; 4: 852.9, 8: 718.1, registers spilled by the [rows, channels, R]
    dt_proj product); 1.4b 2652.7 at 2 (1: 2712.2). rows_max_batch_narrow: H100,
    MambaLM.step from a CUDA graph (scripts/step_sweep.py --models), every weight streamed
    against cuBLAS: batch 2 130m 408.4 against 561.6 us, 130m-mamba2 407.4 / 521.7,
    130m-mamba3 379.1 / 467.7, but 790m 1505.3 / 1473.9, 1.4b 1989.1 / 2009.1, 2.8b 4357.4 /
    3379.8 (the row loop's serial round trips grow with the rows' length); batch 3 130m
    497.0 / 570.2, 1.4b 2413.8 / 2020.2; batch 4 130m 562.2 / 572.2."""

    tile: int = 16384  # elements of a program's weight slab (32 KB in bf16)
    rows_max_batch: int = 1  # up to this batch the weights stream through here; above, cuBLAS
    # the same for 16-bit weights whose rows are at most `narrow_k` long, or twice that with
    # at most `narrow_bytes` of weight (the 130m models' projections and LM head)
    rows_max_batch_narrow: int = 2
    narrow_k: int = 1024
    narrow_bytes: int = 8 << 20
    # the same for float32 weights of at most `f32_stream_bytes` (the small RL models): H200,
    # d_model 128 x 3 graph step at batch 16, M1 / M3 / M2 98.7 / 62.9 / 68.1 us streamed
    # against 272.8 / 255.6 / 259.3 with cuBLAS, whose f32 kernels at 16 rows take 22-50 us
    # each; at 64 rows cuBLAS wins (89.5 / 71.1 / 72.2 against 123.6 / 86.1 / 83.9). Larger
    # f32 weights stream slower than cuBLAS at 16 rows: the 130m LM's step 1854 us against
    # 1197, its 50280 x 768 head alone 275 against 82, a d_model 2048 block 266 against 197.
    rows_max_batch_f32: int = 16
    f32_stream_bytes: int = 1 << 20  # in_proj's weight (a block) or the weight (`linear`)
    dt_proj_fused_bytes: int = 16 << 20  # row blocks x dt_proj weight bytes fused, at most
    ssm_rows: int = 2  # batch rows per program of _layer_ssm_kernel
    ssm_block_d: int = 32  # channels per program of _layer_ssm_kernel
    ssm_warps: int = 4  # warps per program of _layer_ssm_kernel


_GPU = StepConfig()
_INTERPRETED = StepConfig(ssm_block_d=16)


def config(interpret: bool) -> StepConfig:
    """The library's launch parameters: on the GPU, or under the interpreter."""
    return _INTERPRETED if interpret else _GPU


def _rows_per_program(n_rows: int, k_pad: int, tile: int, interp: bool) -> int:
    """Weight rows per program: a `tile`-element slab, fewer while that leaves under two
    programs per SM (more programs keep more of the weight in flight)."""
    block = max(1, tile // k_pad)
    if interp:
        return min(block, 4)
    while block > 1 and cdiv(n_rows, block) < 264:
        block //= 2
    return block


def _streams(batch: int, weight: torch.Tensor, k_pad: int, cfg: StepConfig) -> bool:
    """Whether the projections stream through this module's kernels (else cuBLAS), by the
    batch and the largest weight they read."""
    rows = cfg.rows_max_batch
    short = k_pad <= cfg.narrow_k
    if weight.element_size() == 2 and (
        short or (k_pad <= 2 * cfg.narrow_k and weight.numel() * 2 <= cfg.narrow_bytes)
    ):
        rows = max(rows, cfg.rows_max_batch_narrow)
    if weight.dtype == torch.float32 and weight.numel() * 4 <= cfg.f32_stream_bytes:
        rows = max(rows, cfg.rows_max_batch_f32)
    return batch <= rows and k_pad <= cfg.tile


def _block_b(batch: int) -> int:
    return min(16, next_power_of_2(batch))


def _warps(tile: int) -> int:
    return 8 if tile >= 8192 else 4


def layer_step(
    hidden: torch.Tensor,  # [B, M]
    residual: torch.Tensor | None,  # [B, M] f32
    w,  # StepWeights
    conv_state: torch.Tensor,  # [B, K-1, D] f32, updated in place
    ssm_state: torch.Tensor,  # [B, D, N] f32, updated in place
    cfg: StepConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of a Mamba block: (out [B, M] in the compute dtype, residual [B, M] f32).
    cfg: launch parameters other than the library's (`config`)."""
    Bsz, M = hidden.shape
    Dn = w.A.shape[0]
    K = w.conv_w.shape[1]
    dev, cdt = hidden.device, w.in_w.dtype
    interp = not hidden.is_cuda
    cfg = cfg or (_INTERPRETED if interp else _GPU)
    tile = cfg.tile
    k_pad = next_power_of_2(M)
    if not _streams(Bsz, w.in_w, k_pad, cfg):
        normed, res_out, _ = rms_fwd(hidden, w.norm_w, w.eps, residual, cdt)
        xz = F.linear(normed, w.in_w, w.in_b)
        u = conv_update(conv_state, xz[:, :Dn], w.conv_w, w.conv_b, silu=True)
        z = xz[:, Dn:]
        x_dbl = F.linear(u, w.x_w)
        y = _ssm(x_dbl, w, u, z, ssm_state, cfg)
        return F.linear(y, w.out_w, w.out_b), res_out
    fuse_norm = Bsz == 1
    if fuse_norm:
        res_out = torch.empty(Bsz, M, device=dev, dtype=torch.float32)
        x, x_res = hidden, residual
    else:
        x, res_out, _ = rms_fwd(hidden, w.norm_w, w.eps, residual, cdt)
        x_res = None
    z = torch.empty(Bsz, Dn, device=dev, dtype=cdt)
    u = torch.empty(Bsz, Dn, device=dev, dtype=cdt)
    block_b = _block_b(Bsz)
    # two slabs (x and z rows) of `tile` elements: at d_model 2048 that halves the
    # programs, so half as many reloads of the row for the norm prologue
    block_d = _rows_per_program(Dn, k_pad, tile, interp)
    launch(_layer_in_kernel, (cdiv(Bsz, block_b), cdiv(Dn, block_d)),
        x, x_res if x_res is not None else x, w.norm_w, res_out,
        w.in_w, w.in_b if w.in_b is not None else w.in_w,
        conv_state, w.conv_w, w.conv_b if w.conv_b is not None else w.conv_w,
        z, u,
        Bsz, M, Dn, w.eps,
        x.stride(0), x_res.stride(0) if x_res is not None else 0, res_out.stride(0),
        w.in_w.stride(0), *conv_state.stride(), *w.conv_w.stride(), z.stride(0), u.stride(0),
        K=K, HAS_NORM=fuse_norm, HAS_RES=x_res is not None,
        HAS_IN_BIAS=w.in_b is not None, HAS_CONV_BIAS=w.conv_b is not None,
        BLOCK_B=block_b, BLOCK_D=block_d, K_PAD=k_pad, KC=next_power_of_2(K),
        num_warps=_warps(2 * block_d * k_pad), **pdl_args(x),
    )  # fmt: skip
    x_dbl = linear(u, w.x_w, cfg=cfg)
    y = _ssm(x_dbl, w, u, z, ssm_state, cfg)
    return linear(y, w.out_w, w.out_b, cfg=cfg), res_out


def _ssm(x_dbl, w, u, z, ssm_state, cfg: StepConfig) -> torch.Tensor:
    """dt_proj + softplus + state update + D skip + gate: y [B, D] in the compute dtype.

    cfg.ssm_rows rows per program (fewer at a smaller batch), as one tile dimension. When
    the programs' reads of dt_proj's weight (one per row block) exceed
    cfg.dt_proj_fused_bytes, dt_proj is a cuBLAS GEMM."""
    Bsz, Dn = u.shape
    N, R = w.A.shape[1], w.dt_w.shape[1]
    y = torch.empty(Bsz, Dn, device=u.device, dtype=u.dtype)
    block_b = min(cfg.ssm_rows, next_power_of_2(Bsz))
    row_blocks = cdiv(Bsz, block_b)
    # each row block's programs read dt_proj's weight again (from L2): worth it while that
    # stays small; a cuBLAS GEMM of a few rows costs ~5 us
    dt_proj = row_blocks * w.dt_w.numel() * w.dt_w.element_size() <= cfg.dt_proj_fused_bytes
    delta = y if dt_proj else F.linear(x_dbl[:, :R], w.dt_w)
    block_d = cfg.ssm_block_d
    launch(_layer_ssm_kernel, (row_blocks, cdiv(Dn, block_d)),
        x_dbl, w.dt_w, delta, w.dt_bias, w.A, w.D, u, z, ssm_state, y,
        Bsz, Dn, R, N,
        x_dbl.stride(0), w.dt_w.stride(0), delta.stride(0), w.A.stride(0), u.stride(0),
        z.stride(0), ssm_state.stride(0), ssm_state.stride(1), y.stride(0),
        DT_PROJ=dt_proj, BLOCK_B=block_b, BLOCK_D=block_d,
        BLOCK_R=max(2, next_power_of_2(R)), BLOCK_N=max(2, next_power_of_2(N)),
        num_warps=cfg.ssm_warps, **pdl_args(u),
    )  # fmt: skip
    return y


def linear(
    x: torch.Tensor,  # [B, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,  # [B, K] f32
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm (of x + residual) first
    eps: float = 1e-5,
    return_residual: bool = False,
    cfg: StepConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x W^T (+ bias) at small batch, streaming W once; optionally on rmsnorm(x + residual).
    return_residual (with norm_weight): (out, x + residual in f32), the block's next
    residual, stored by the same kernel. cfg: as for `layer_step`."""
    if return_residual and norm_weight is None:
        raise ValueError(
            "linear: return_residual needs norm_weight (the residual is the norm's input)"
        )
    Bsz = x.shape[0]
    Nout, Kin = weight.shape
    cdt = weight.dtype
    cfg = cfg or _GPU  # (the interpreter's differs in the SSM kernel's fields alone)
    tile = cfg.tile
    k_pad = next_power_of_2(Kin)
    res_out = None
    if norm_weight is not None and (Bsz > 1 or k_pad > tile):
        x, res_out, _ = rms_fwd(x, norm_weight, eps, residual, cdt, store_residual=return_residual)
        residual = norm_weight = None
    if not _streams(Bsz, weight, k_pad, cfg):
        out = F.linear(x if x.dtype == cdt else x.to(cdt), weight, bias)
        return (out, res_out) if return_residual else out
    out = torch.empty(Bsz, Nout, device=x.device, dtype=cdt)
    if return_residual and res_out is None:
        res_out = torch.empty(Bsz, Kin, device=x.device, dtype=torch.float32)
    store_res = return_residual and norm_weight is not None
    block_b = _block_b(Bsz)
    block_n = _rows_per_program(Nout, k_pad, tile, not x.is_cuda)
    launch(_linear_kernel, (cdiv(Bsz, block_b), cdiv(Nout, block_n)),
        x, residual if residual is not None else out,
        norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out, res_out if store_res else out,
        Bsz, Nout, Kin, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        out.stride(0), res_out.stride(0) if store_res else 0,
        HAS_RES=residual is not None, HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None, RES_OUT=store_res,
        BLOCK_B=block_b, BLOCK_N=block_n, K_PAD=k_pad, num_warps=_warps(block_n * k_pad),
        **pdl_args(x),
    )  # fmt: skip
    return (out, res_out) if return_residual else out
