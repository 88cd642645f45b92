"""The launcher of the dt_proj kernel (kernels.py), `dt_proj`, and its launch parameters.

B batch, T time, D = d_inner, N = d_state, R = dt_rank; x_dbl [B, T, R + 2N] is viewed as
[B T, R + 2N] rows, and a program owns BLOCK_M rows and `d_tiles` tiles of BLOCK_D channels.
"""

from __future__ import annotations

import dataclasses

import torch

from .._triton import cdiv, launch, next_power_of_2, opt
from .kernels import _dt_proj_kernel


@dataclasses.dataclass(frozen=True)
class DtProjConfig:
    """Launch parameters of `_dt_proj_kernel` (never autotuned; `config` gives the library's).

    Measured on the H200 from CUDA graphs by scripts/dt_proj_sweep.py as (rows, channels,
    warps, channel tiles per program, pipeline stages), all with the same bits:
      130m 1 x 4096:  64 x 64 x 4, 4 tiles, 3 stages  9.9 us (1 tile: 10.3; 64 x 128: 11.8)
      1.4b 1 x 4096:  the same                       26.4 us (64 x 128, 1 tile: 30.6-31.3)
      130m 8 x 2048:  the same                       35.1 us (1 tile: 35.4)
    It writes 4 bytes of delta per (t, channel) where cuBLAS wrote 2: 9.9 us against cuBLAS
    dt_proj 6.0 + widening B, C 2.8 at 130m, paid back by the scan (88.0 -> 79.7 us)."""

    block_m: int = 64  # rows (B T) per program
    block_d: int = 64  # channels per tile
    warps: int = 4
    d_tiles: int = 4  # channel tiles per program, one after the other
    stages: int = 3  # pipeline stages of the loads


_GPU = DtProjConfig()
# under the interpreter: the smallest tiles tl.dot allows, and two channel tiles per
# program, so the tests cover several blocks, the loop and the masked edges
_INTERPRETED = DtProjConfig(block_m=16, block_d=16, d_tiles=2)


def config(interpret: bool) -> DtProjConfig:
    """The library's launch parameters: on the GPU, or under the interpreter."""
    return _INTERPRETED if interpret else _GPU


def dt_proj(
    x_dbl: torch.Tensor,  # [B, T, R + 2N], stride 1 in the last dim
    dt_proj_weight: torch.Tensor,  # [D, R]
    dt_bias: torch.Tensor | None,  # [D]
    softplus: bool,
    cfg: DtProjConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softplus: (delta = softplus(raw + dt_bias) [B, T, D] f32, B and C side by side
    [B, T, 2N] f32); else (raw [B, T, D] in x_dbl's dtype, an empty tensor), where
    raw = x_dbl[..., :R] @ W_dt^T is rounded to x_dbl's dtype as the GEMM rounds it, the
    weight as `.to(x_dbl.dtype)` would, and softplus is the scan's own. cfg: launch
    parameters other than the library's (`config`)."""
    Bsz, T, W = x_dbl.shape
    D, R = dt_proj_weight.shape
    N2 = W - R
    dev, f32 = x_dbl.device, torch.float32
    delta = torch.empty((Bsz, T, D), device=dev, dtype=f32 if softplus else x_dbl.dtype)
    bc = torch.empty((Bsz, T, N2) if softplus else (0,), device=dev, dtype=f32)
    M = Bsz * T
    if M == 0:
        return delta, bc
    x2 = x_dbl.reshape(M, W)  # a view for the layer's contiguous x_dbl
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None  # the kernel reads it densely
    cfg = cfg or config(not x_dbl.is_cuda)
    bm, bd, tiles = cfg.block_m, cfg.block_d, cfg.d_tiles
    launch(_dt_proj_kernel, (cdiv(M, bm), cdiv(D, bd * tiles)),
        x2, dt_proj_weight, opt(dt_bias, dt_proj_weight), delta, bc,
        M, D, R, N2,
        x2.stride(0), dt_proj_weight.stride(0), dt_proj_weight.stride(1),
        BLOCK_M=bm, BLOCK_D=bd, BLOCK_R=max(16, next_power_of_2(R)),
        BLOCK_BC=next_power_of_2(N2), HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus,
        IEEE=x_dbl.dtype == f32, D_TILES=tiles, STAGES=cfg.stages,
        num_warps=cfg.warps,
    )  # fmt: skip
    return delta, bc
