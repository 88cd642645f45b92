"""Small-batch f32 GEMMs as the decode steps of small models issue them (x [B, K] times
W [N, K]^T): F.linear against other ways to get the same product, CUDA-graph-free, per
shape. cuBLAS picked kernels of 20-50 us for [16, 128] x [512, 128]^T in float32 on the
H200, where batch 64 took a few us. "triton stream" is the decode step's own matrix-vector
kernel (ops/mamba_step) at that batch.

    PYTHONPATH=src python scripts/small_gemm_probe.py --batches 1 16 64"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from mambakit.ops.mamba_step import launch

# the decode step's streaming kernel (`_linear_kernel`) at any batch
STREAM = dataclasses.replace(
    launch.config(False), rows_max_batch=1 << 20, rows_max_batch_f32=1 << 20
)


def time_us(fn, iters=200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters * 1e3


def variants(x, x32, w, wt, bias, B) -> dict:
    return {
        "F.linear": lambda: F.linear(x, w, bias),
        "x @ wT(contig)": lambda: torch.addmm(bias, x, wt),
        "(w @ x.T).T": lambda: (w @ x.t()).t(),
        "pad to 32": lambda: F.linear(x32, w, bias)[:B],
        "bmm": lambda: torch.bmm(x[None], wt[None])[0],
        "triton stream": lambda: launch.linear(x, w, bias, cfg=STREAM),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--shapes", nargs="+", default=["128x512", "256x128", "256x40", "64x128"],
                    help="KxN")  # fmt: skip
    args = ap.parse_args()
    for shape in args.shapes:
        K, N = map(int, shape.split("x"))
        w = torch.randn(N, K, device="cuda")
        wt = w.t().contiguous()
        bias = torch.randn(N, device="cuda")
        for B in args.batches:
            x = torch.randn(B, K, device="cuda")
            x32 = torch.zeros(max(B, 32), K, device="cuda")
            row = variants(x, x32, w, wt, bias, B)
            times = {k: round(time_us(f), 1) for k, f in row.items()}
            print({"K": K, "N": N, "B": B, **times}, flush=True)


if __name__ == "__main__":
    main()
