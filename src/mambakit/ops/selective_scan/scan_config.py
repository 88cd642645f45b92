"""The selective scan's launch parameters (`ScanConfig`) and the library's choice of them per
channel count and device kind (`config`). Never autotuned: the same parameters every run,
so reruns are bit-identical. launch.py launches the kernels with them."""

import dataclasses
import functools

from .._triton import next_power_of_2


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Launch parameters of the scan kernels for one channel count D (fixed per device kind,
    never autotuned, so reruns are bit-identical; `config` gives the library's choice).

    Channels lie along the lanes; the states of a channel stay in one thread, so sums over N
    need no shuffles. The backward's sums over channels (dB, dC) use a warp reduce-scatter
    whenever its tile layout allows (`reduce_scatter_fits`)."""

    fwd_tile: int  # FWD_TC: time steps per forward tile
    fwd_local_tiles: int  # forward tiles per tile of the segment summaries' (LOCAL) pass
    bwd_tile: int  # TC: time steps per backward tile
    bwd_save_tiles: int  # KS: the forward saves the state every KS TC steps; KS > 1: a replay
    # kernel rebuilds every tile's start state from them before the backward (replay.py)
    fwd_block_d: int  # channels per forward program
    bwd_block_d: int  # channels per backward program
    fwd_warps: int  # warps per forward program
    bwd_warps: int  # warps per backward program
    carry_block: int  # BLOCK_E: state elements per program of the segment carry scans
    carry_rows: int  # CB: segments per step of the carry scans
    seg_tiles: int  # tiles per segment (beyond the sequence's tiles: one segment); 0: by SMs
    seg_below_per_sm: int  # (seg_tiles 0) cut time only below this many programs per SM,
    seg_target_per_sm: int  # into enough segments for this many programs per SM (backward)
    fwd_seg_target_per_sm: int  # the same for the forward
    bwd_maxnreg: int = 0  # registers per thread the backward is capped at (0: the compiler's)
    bwd_block_d_seg: int = 0  # channels per backward program where time is cut into segments
    # (rows x channel blocks at bwd_block_d fill too few programs: long rows); 0: bwd_block_d

    def __post_init__(self) -> None:
        # the forward stores a state at a tile's start or at rows inside its tile: the save
        # interval must be a multiple of its tile or divide it (fwd 8, bwd 4: KS 1, 2, 4, ...)
        ts = self.bwd_tile * self.bwd_save_tiles
        if self.bwd_save_tiles < 1 or (ts % self.fwd_tile and self.fwd_tile % ts):
            raise ValueError(
                f"ScanConfig: bwd_save_tiles * bwd_tile = {self.bwd_save_tiles} * "
                f"{self.bwd_tile} must be a multiple or a divisor of fwd_tile {self.fwd_tile}"
            )
        for name in ("fwd_block_d", "bwd_block_d", "bwd_block_d_seg"):
            v = getattr(self, name)
            if v < 0 or v & (v - 1) or (v == 0 and name != "bwd_block_d_seg"):
                raise ValueError(f"ScanConfig: {name} = {v} must be a power of two")


@functools.cache
def config(Dn: int, interpret: bool) -> ScanConfig:
    """The launch parameters for D = Dn channels: on the GPU, or under the interpreter
    (cached: the same few channel counts come back every layer and every call)."""
    p2 = next_power_of_2(Dn)
    if interpret:  # small tiles, and segments of two tiles so the carries run in every test
        return ScanConfig(
            fwd_tile=4, fwd_local_tiles=2, bwd_tile=8, bwd_save_tiles=2,
            fwd_block_d=min(8, p2), bwd_block_d=min(8, p2),
            fwd_warps=1, bwd_warps=1, carry_block=64, carry_rows=8,
            seg_tiles=2, seg_below_per_sm=2, seg_target_per_sm=8, fwd_seg_target_per_sm=8,
        )  # fmt: skip
    # measured on the H200 at 8x2048x1536x16 bf16 (scripts/scan_sweep.py): forward tile 8 x
    # 32 channels, 1 warp, 3 pipeline stages 0.363 ms (tile 2: 1.41; tile 16 / 4 warps: 1.52);
    # backward tile 4 x 16 channels, 1 warp, loads one tile ahead, reduce-scatter, adjoint by a
    # row loop 0.935 ms (8 channels 0.926, tile 8 x 8: 1.19; with the reverse associative_scan
    # 1.49; with tl.sum channel sums 1.92; without loading ahead 2.02; tile 2: 2.91).
    # Segments below 2 programs per SM, aiming at 16: 1x65536 fwd+bwd 8.15 ms with the
    # shuffle-free local pass (before it: 9.45; aiming at 8: 9.82, 12: 10.9; no segments:
    # 42.2), 1x4096 0.67 (8: 0.69); 8x2048 unchanged (below 8 per SM, cutting it: 2.50).
    # The forward alone (inference, 1 x 4096, from CUDA graphs, output programs composing the
    # summaries before them): aiming at 8 per SM 0.094 ms at D 1536 (16: 0.106, 32: 0.150;
    # the longer serial compositions), 0.216 ms at D 4096 (16: 0.219, 32: 0.232). The segment
    # summaries (LOCAL) in tiles of 16 steps, two forward tiles: 78.2 us at D 1536 and 186.1
    # at D 4096, against 79.5 and 190.0 in tiles of 8 and 84.6 and 210.5 in tiles of 32
    # (with their decay product as one exp2 of the summed delta).
    # The saved states, 4 D N / (KS TC) bytes a token and layer, are most of a wide model's
    # training memory: at d_inner 4096 (1.4b, 4 x 2048, Trainer step, an H100) a state per
    # tile peaks at 57.1 GiB against mamba_ssm's 37.5, one every 8 tiles at 36.3 for 5% of
    # the step (237.9 ms against 226.7; `replay.py` rebuilds a layer's per-tile states before
    # its backward: 0.35 ms at 4 x 2048 x 4096, the write of those states). At 130m (d_inner
    # 1536) a state per tile already peaks below mamba_ssm (17.0 GiB against 18.0) and KS 8
    # would cost 7% (76.5 ms against 71.3): narrower layers keep one per tile.
    # Backward programs of 8 channels below D 4096, 16 from it (H200, scripts/scan_sweep.py,
    # one run): 8 x 2048 x 1536 0.866 ms against 0.958 (8 channels capped at 128 registers:
    # 0.935; 16 capped at 168: 1.347, spilling); 4 x 2048 x 4096 with its replay 1.307 ms
    # at 16 against 1.669 at 8 (1.503 capped at 128).
    # Where time is cut into segments (long rows), 16 channels a program at every width
    # (H100, scripts/scan_sweep.py --long, D 1536, fwd + bwd): 1 x 65536 6.78 ms against
    # 9.01 at 8 (8 aiming at 24 per SM: 7.55; 16 aiming at 24: 6.99), 1 x 16384 1.73 against
    # 2.29, 1 x 4096 0.618 against 0.759: fewer programs over more segments, each tile's
    # channel sums over twice the channels.
    wide = Dn >= 4096
    return ScanConfig(
        fwd_tile=8, fwd_local_tiles=2, bwd_tile=4, bwd_save_tiles=8 if wide else 1,
        fwd_block_d=min(32, p2), bwd_block_d=min(16 if wide else 8, p2),
        fwd_warps=1, bwd_warps=1, carry_block=256, carry_rows=16,
        seg_tiles=0, seg_below_per_sm=2, seg_target_per_sm=16, fwd_seg_target_per_sm=8,
        bwd_block_d_seg=min(16, p2),
    )  # fmt: skip


def save_interval(cfg: ScanConfig) -> int:
    """Timesteps between the states the forward saves: KS backward tiles of TC steps."""
    return cfg.bwd_tile * cfg.bwd_save_tiles
