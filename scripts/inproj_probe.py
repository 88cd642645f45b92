"""in_proj's GEMM at the 130m prefill shape, several ways (H200): GPU time from CUDA graphs and
the kernels each launches (cuBLAS puts a Memset before some of its kernels).

PYTHONPATH=src python scripts/inproj_probe.py --out inproj_probe.json

h [4096, 768] bf16 times W^T, W [3072, 768] bf16 (1.4b: [8192, 2048] and h [4096, 2048]).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing
from torch.profiler import ProfilerActivity, profile


def kernels(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"]


def probe(name: str, M: int, K: int, N: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    W = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    Wt = W.t()
    Wc = Wt.contiguous()  # [K, N]: the other operand layout
    half = N // 2
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(h, W)

    def lib_blas(which):
        def fn():
            prev = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(which)
            try:
                return torch.mm(h, Wt)
            finally:
                torch.backends.cuda.preferred_blas_library(prev)

        return fn

    def no_reduced():
        prev = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            return torch.mm(h, Wt)
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = prev

    ways = {
        "F.linear": lambda: F.linear(h, W),
        "mm(h, W.t())": lambda: torch.mm(h, Wt),
        "mm(h, W^T contiguous)": lambda: torch.mm(h, Wc),
        "mm out=": lambda: torch.mm(h, Wt, out=out),
        "two halves": lambda: torch.cat([torch.mm(h, Wt[:, :half]), torch.mm(h, Wt[:, half:])], 1),
        "(W h^T)^T": lambda: torch.mm(W, h.t()).t(),
        "no bf16 reduced-precision reduction": no_reduced,
        "cublas (not Lt)": lib_blas("cublas"),
        "cublaslt": lib_blas("cublaslt"),
    }
    rows = []
    for way, fn in ways.items():
        try:
            got = fn()
            err = (got.float() - ref.float()).abs().max().item()
            us = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
            ks = kernels(fn)
            rows.append(dict(shape=name, way=way, us=us, max_diff=err, kernels=ks))
        except Exception as e:
            rows.append(dict(shape=name, way=way, failed=f"{type(e).__name__}: {str(e)[:160]}"))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = probe("130m", 4096, 768, 3072) + probe("1.4b", 4096, 2048, 8192)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
