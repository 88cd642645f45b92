"""Time the Mamba-3 per-token terms kernels (ops/mamba3/terms.py) at the 130m-mamba3 layer
shape for block sizes, chunk lengths (blocks per chunk: the programs along time) and warp
counts, forward and backward, against the bytes they move. Each candidate is a `TermsConfig`
handed to the kernels as `cfg=`; the library runs `terms.CONFIG`.

    PYTHONPATH=src python scripts/m3_terms_sweep.py [--shape 8x2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import cuda_time_ms  # noqa: E402

from mambakit.ops.mamba3 import terms  # noqa: E402

WHOLE_ROW = 1 << 20  # blocks per chunk beyond any row's: one chunk, the row in one program


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8x2048")
    args = p.parse_args()
    Bn, T = (int(v) for v in args.shape.split("x"))
    H, G, N, S = 24, 1, 128, 32
    dev, bf = "cuda", torch.bfloat16
    q, k = (torch.randn(Bn, T, G, N, device=dev, dtype=bf) for _ in range(2))
    delta = torch.rand(Bn, T, H, device=dev) * 0.1
    A = -torch.rand(Bn, T, H, device=dev)
    trap, theta = (
        torch.randn(Bn, T, H, device=dev, dtype=bf),
        torch.randn(Bn, T, S, device=dev, dtype=bf),
    )
    qb, kb = torch.ones(H, N, device=dev), torch.ones(H, N, device=dev)
    a0 = torch.zeros(Bn, H, S, device=dev)
    leaves = [q, k, delta, A, trap, theta, qb, kb]
    moved = 2 * Bn * T * H * N * 4 + Bn * T * H * S * 4  # q~, k~, phi written (f32)
    print(f"forward writes {moved / 2**20:.0f} MiB: {moved / 3.3e12 * 1e3:.3f} ms at 3.3 TB/s")
    configs = [(bt, cb, w) for bt in (16, 32) for cb in (1, 4, 8, 16, WHOLE_ROW) for w in (4, 8)]
    for BT, chunk_blocks, warps in configs:
        cfg = dataclasses.replace(
            terms.CONFIG, block_t=BT, fwd_chunk_blocks=chunk_blocks, bwd_chunk_blocks=chunk_blocks,
            fwd_warps=warps, bwd_warps=warps,
        )  # fmt: skip

        def fwd(cfg=cfg):
            with torch.no_grad():
                terms.token_terms_kernel(q, k, delta, A, trap, theta, qb, kb, a0, None, cfg=cfg)

        try:
            ms_f = cuda_time_ms(fwd, warmup=2, iters=10)
            for t in leaves:
                t.requires_grad_(True)
            out = terms.token_terms_kernel(q, k, delta, A, trap, theta, qb, kb, a0, None, cfg=cfg)
            cots = [torch.randn_like(o) for o in out]
            ms_b = cuda_time_ms(
                lambda out=out, cots=cots: torch.autograd.grad(out, leaves, cots,
                                                               retain_graph=True),
                warmup=2,
                iters=10,
            )  # fmt: skip
            for t in leaves:
                t.requires_grad_(False)
            print(
                f"BT {BT:3d} chunk {chunk_blocks:7d} blocks warps {warps}: "
                f"forward {ms_f:.3f} ms, backward {ms_b:.3f} ms",
                flush=True,
            )
        except Exception as e:
            print(f"BT {BT} chunk {chunk_blocks} warps {warps}: failed "
                  f"{type(e).__name__}: {str(e)[:100]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
