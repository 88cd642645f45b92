"""How a scan launch is cut into programs, and the forms of the inputs its kernels read:
state blocks, time segments, whether every tile is whole (the kernels then drop their
masks), whether the backward's channel sums can take the warp reduce-scatter, B and C as
f32, the parameters without strides, the inputs' row and step strides."""

import torch

from .._triton import cdiv, next_power_of_2, sm_count, strides
from .scan_config import ScanConfig

MAX_BLOCK_N = 32  # states per program; larger N is split over programs


def time_segments(
    nc: int, programs: int, per_sm: int, cfg: ScanConfig, device: torch.device
) -> tuple[int, int]:
    """(segments, tiles per segment) for nc tiles and `programs` programs per segment.

    The target is a whole number of waves (per_sm programs per SM, with one-warp
    programs at about 250 registers 8 fit on an SM at once), so the count rounds down: one
    segment more puts a few programs in a wave of their own (H200, 1 x 4096 at D 4096: 17
    segments, 2176 programs in 3 waves of 1056, made the output pass 164 us against the
    summaries' 91 us)."""
    per = cfg.seg_tiles
    if per <= 0:
        sms = sm_count(device.index or 0) if device.type == "cuda" else 0
        below = cfg.seg_below_per_sm * sms
        target = max(below, per_sm * sms)
        nseg = 1 if programs >= below else max(1, min(nc, target // programs))
        per = cdiv(nc, nseg)
    per = max(1, min(per, nc))
    return cdiv(nc, per), per


def whole_tiles(T, Dn, N, tc, bd, bn) -> bool:
    """Every tile of every program lies inside the tensors: the kernels drop their masks (a
    program walks only its segment's tiles that hold steps: the last segment may be short)."""
    return T % tc == 0 and Dn % bd == 0 and N % bn == 0


def state_block(N: int) -> int:
    return min(next_power_of_2(N), MAX_BLOCK_N)


def reduce_scatter_fits(tc: int, bd: int, bn: int, warps: int) -> bool:
    """Whether the channel sums of a [tc, bn, bd] tile can use `_store_channel_sum`'s
    reduce-scatter: one warp whose tiles put the bd channels on the low lane bits and 32 / bd
    states on the others, every lane busy."""
    if warps != 1 or bd < 2 or bd > 32 or 32 % bd:
        return False
    nl = 32 // bd
    return bn % nl == 0 and tc * (bn // nl) >= bd


def bc_f32(B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B and C as f32, for the forward kernel: it broadcasts every (t, n) value to all the
    channels of a warp, and widening bf16 after that broadcast costs about 1.5 instructions
    per state element and step (a quarter of the loop); one [B, T, 2N] conversion costs a
    few microseconds. B, C side by side in one tensor (x_proj's output) convert in one op."""
    if B.dtype == torch.float32 and C.dtype == torch.float32:
        return B, C
    N = B.shape[-1]
    adjacent = (
        B.dtype == C.dtype
        and B.shape == C.shape
        and B.stride() == C.stride()
        and B.stride(-1) == 1
        and C.data_ptr() == B.data_ptr() + N * B.element_size()
    )
    if adjacent:
        BC = B.as_strided((*B.shape[:-1], 2 * N), B.stride()).float()
        return BC[..., :N], BC[..., N:]
    return B.float(), C.float()


def contiguous_params(*params: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """A [D, N], D and delta_bias [D] as the kernels index them (row-major, no strides):
    a strided view (a column of a stacked parameter, an expanded scalar) is copied."""
    return tuple(p.contiguous() if p is not None else None for p in params)


def input_strides(u, delta, B, C, z, seq_idx) -> tuple[int, ...]:
    """The scan kernels' stride arguments of its [B, T, *] inputs: rows and steps of each."""
    return (
        u.stride(0),
        u.stride(1),
        delta.stride(0),
        delta.stride(1),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        *strides(z, 2),
        *strides(seq_idx, 2),
    )


def steps_need_int64(T: int, *step_strides: int) -> bool:
    """Whether some offset t s (t < T, s one of a kernel's step strides) passes int32: the
    kernel then computes its per-tile offsets in int64."""
    return any(T * abs(s) >= 2**31 for s in step_strides)


def tile_slots(slot: torch.Tensor, tc: int) -> torch.Tensor:
    """The largest of slot [B, T]'s entries in each tile of tc steps: [B, T / tc] (-1: a
    tile that keeps no state)."""
    Bsz, T = slot.shape
    nc = cdiv(T, tc)
    return torch.nn.functional.pad(slot, (0, nc * tc - T), value=-1).view(Bsz, nc, tc).amax(-1)
