"""Launch parameters of the Mamba-3 scan's Triton kernels (`Mamba3ScanConfig`, the library's
`CONFIG`), and the choices made from them per call: the products' precision, the dtype of
their operands, whether a forward runs its chunks in parallel. chunk.py launches the kernels;
Mamba-2's SSD path (ops/mamba2) reads the same config."""

from __future__ import annotations

import dataclasses

import torch

from .._triton import cdiv, next_power_of_2, sm_count
from .terms import CONFIG as TERMS
from .terms import TermsConfig


@dataclasses.dataclass(frozen=True)
class Mamba3ScanConfig:
    """Launch parameters of the Mamba-3 scan's kernels, never autotuned (`CONFIG` is the
    library's; scripts/m3_chunk_sweep.py and m3_fwd_probe.py time others through `cfg=`).
    Measured on the H200 at the 130m-mamba3 heads (P 64, N 128) by m3_chunk_sweep.py unless
    said."""

    # The forward, in chunks of 32 steps: [P, N] state, start state, q~, k~ and the [L, L]
    # scores held in registers. 8 x 2048, bf16 products, 4 warps: 0.70 ms against 0.84 in
    # chunks of 16 and 0.90-0.98 in chunks of 64 (4 or 8 warps); with D and the gate 0.86
    # against 0.89.
    chunk: int = 32
    # The products' precision for bf16 inputs: "bf16" (operands rounded to bf16 as
    # upstream's kernels round theirs, f32 accumulation) or "tf32". 8 x 2048: forward 2.19 ms
    # in bf16 against 2.50 in tf32 (8 warps), forward + backward 7.62 against 8.53; against
    # float64 every output and gradient of tests/ops/test_mamba3.py's GPU case within 6e-3
    # relative (tf32: 2.7e-3).
    prec_16bit: str = "bf16"
    # Warps for a state of 8192 values or more (4 below): the forward computing y (chunks of
    # `chunk`) and the backward's pass storing the chunk start states (chunks of
    # `chunk_bwd`). 8 x 2048, bf16 products: the forward 1.49 ms with 4 warps against 2.19
    # with 8; the states pass spills 408 bytes a thread with 4 warps and 8 with 8 (Triton
    # 3.9 offline, sm_90a).
    fwd_warps: int = 4
    states_warps: int = 8
    # The head's P values per forward program (each block of P carries its rows of S alone):
    # more programs than the (row, head) pairs, each with a smaller state. 8 x 2048: y's
    # pass 0.83 ms whole, 0.81 in blocks of 32 with 2 warps (no gain kept); the backward's
    # states pass in blocks of 32 (so 4 warps) brings terms + forward + backward from 5.19
    # ms to 4.95.
    fwd_block_p: int = 64
    states_block_p: int = 32

    # Below `parallel_below` (row, head) pairs (None: half the SM count), a forward computing
    # y with nothing stored for the backward runs its chunks in parallel
    # (chunk_parallel_kernels.py):
    # `_chunk_end_kernel` (each chunk's own part u_c of the next start state, a program per
    # (row, head, chunk)), `_state_scan_kernel` (the start states, the chunks in order,
    # elementwise), `_chunk_y_kernel` (y from them, a program per (row, head, chunk)), with u
    # and then the start states in one f32 buffer [B, H, chunks, P, N] (100 MB at 1 x 4096
    # for the 130m-mamba3 heads); there, one program per (row, head, block of P) walking
    # every chunk leaves SMs idle. Not below `parallel_min_chunks` chunks (three launches
    # for a short prompt; not measured) nor above `parallel_max_bytes` of that buffer (the
    # walk needs none). bf16, terms + scan without autograd (m3_fwd_probe.py), walking
    # against parallel: 1 x 4096 0.63 ms against 0.48; 2 x 4096 0.83 against 0.57; 3 x 4096
    # 1.01 against 0.82; 1 x 32768 4.73 against 2.44; 4 x 2048 (96 pairs) 0.54 against
    # 0.57; 8 x 2048 0.70 against 1.05.
    parallel_below: int | None = None
    parallel_min_chunks: int = 4
    parallel_max_bytes: int = 1 << 30
    parallel_block_p: int = 64  # the head's P values a program of the parallel passes
    end_block_n: int = 64  # the states a block of `_chunk_end_kernel`'s product
    parallel_warps: int = 4

    # The backward, in chunks of `chunk_bwd` steps (see `_Core`): `_dy_chunk_kernel`'s
    # blocks of P and N, warps and stages; the start-state scans' (`_dstate_scan_kernel`,
    # and the parallel forward's `_state_scan_kernel`) blocks of P N values, chunks loaded
    # at a time and warps; `_chunk_grad_kernel`'s and `_chunk_qk_grad_kernel`'s warps and
    # blocks of N.
    chunk_bwd: int = 64
    dy_block_p: int = 64
    dy_block_n: int = 128
    dy_warps: int = 4
    dy_stages: int = 1
    scan_block: int = 1024
    scan_chunks: int = 8
    scan_warps: int = 4
    grad_warps: int = 4
    grad_block_n: int = 32
    qk_warps: int = 4
    qk_block_n: int = 32
    # Mamba-2 (G groups of B and C read by H / G heads each): the heads of one launch of
    # `_chunk_qk_grad_kernel`, whose per-head gradients are summed into their group's before
    # the next (`_qk_grads`): 8 of the 130m-mamba2's 24 heads keep 134 MB of per-head f32
    # gradients at 8 x 2048 where all 24 at once kept 400 MB (the layer's forward + backward
    # peaked at 928 MiB against mamba_ssm's 708).
    qk_head_slice: int = 8
    # Mamba-2's forward without autograd (a prefill): "ssd", its own kernels in chunks of
    # `ssd_chunk` steps, every chunk in parallel (ops/mamba2/ssd_kernels.py: the chunk's
    # state part in blocks of `ssd_block_k` rows, y in blocks of `ssd_block_m` rows, with
    # `ssd_warps`), or "chunks", the kernels above with Mamba-2's terms. 256-step chunks
    # halve the chunks' state buffers against 128 (8 x 2048 x 24 heads: 50 MB of f32 parts
    # and 25 MB of bf16 start states, where 128 kept 150 MB at once and the layer's forward
    # peaked above mamba_ssm's), at 0.236 ms against 0.221 there and faster at 1 x 4096 and
    # 1 x 32768 (H200, bf16, graph-replayed).
    m2_fwd: str = "ssd"
    ssd_chunk: int = 256
    ssd_block_m: int = 64
    ssd_block_k: int = 64
    ssd_warps: int = 4
    ssd_cb: bool = False  # the scores C . B once per group and chunk (`_ssd_cb_kernel`)
    # the y kernel's software pipelining (None: Triton's). H200, bf16, graph-replayed: 1
    # stage 0.22 ms at 8 x 2048 against 0.26 with 2 and 0.29 with Triton's
    ssd_stages: int | None = 1
    ssd_scan_chunks: int = 8  # the start states' scan: chunks loaded at a time

    terms: TermsConfig = TERMS  # the per-token terms' kernels (terms.py)

    def __post_init__(self):
        if self.prec_16bit not in ("bf16", "tf32"):
            raise ValueError(
                f"Mamba3ScanConfig.prec_16bit must be 'bf16' or 'tf32', got {self.prec_16bit!r}"
            )
        if self.m2_fwd not in ("ssd", "chunks"):
            raise ValueError(
                f"Mamba3ScanConfig.m2_fwd must be 'ssd' or 'chunks', got {self.m2_fwd!r}"
            )
        if self.ssd_chunk % self.ssd_block_m or self.ssd_chunk % self.ssd_block_k:
            raise ValueError(
                f"Mamba3ScanConfig.ssd_chunk ({self.ssd_chunk}) must be a multiple of ssd_block_m "
                f"({self.ssd_block_m}) and ssd_block_k ({self.ssd_block_k})"
            )


CONFIG = Mamba3ScanConfig()


def _precision(x: torch.Tensor, cfg: Mamba3ScanConfig) -> str:
    """cfg.prec_16bit for bf16 inputs, tf32 for f16 ones (bf16 would drop 3 of their bits),
    tf32x3 (f32 accuracy) for f32 ones; the interpreter computes in f32."""
    if not x.is_cuda:
        return "ieee"
    return {torch.float32: "tf32x3", torch.bfloat16: cfg.prec_16bit}.get(x.dtype, "tf32")


def _operands_dtype(x: torch.Tensor, cfg: Mamba3ScanConfig) -> torch.dtype:
    """The dtype of what the scan kernels read mostly as products' operands: q~ and k~, the
    chunk start states kept for the backward and their gradients. bf16 where the products
    take bf16 operands (the sums and elementwise terms over them are f32 all the same), else
    f32. The state the forward carries, and every gradient the scan returns, are f32."""
    return torch.bfloat16 if _precision(x, cfg) == "bf16" else torch.float32


def _block(v: int) -> int:
    return max(16, next_power_of_2(v))


def _parallel(x: torch.Tensor, N: int, L: int, cfg: Mamba3ScanConfig) -> bool:
    Bsz, T, H, P = x.shape
    below = cfg.parallel_below
    if below is None:
        below = sm_count(x.device.index) // 2 if x.is_cuda else 0
    nc = cdiv(T, L)
    return (
        Bsz * H < below
        and nc >= cfg.parallel_min_chunks
        and Bsz * H * nc * P * N * 4 <= cfg.parallel_max_bytes
    )
