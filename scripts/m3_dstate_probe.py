"""Time the Mamba-3 backward's first two kernels (`_dy_chunk_kernel`, `_dstate_scan_kernel`)
at the 130m-mamba3 head shape, 8 x 2048 bf16, for launch settings, beside a copy of as
many bytes as the start states' gradients for the bandwidth.

    PYTHONPATH=src python scripts/m3_dstate_probe.py [--dry]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import cuda_time_ms  # noqa: E402

from mambakit.ops.mamba3 import chunk  # noqa: E402
from mambakit.ops.mamba3.chunk_kernels import _dstate_scan_kernel, _dy_chunk_kernel  # noqa: E402

DEV = "cuda"


def timed(fn) -> float:
    if DEV != "cuda":
        fn()
        return 0.0
    return cuda_time_ms(fn, warmup=3, iters=20)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    global DEV
    if args.dry:
        DEV = "cpu"
    Bn, T, H, P, N = (8, 2048, 24, 64, 128) if DEV == "cuda" else (1, 150, 2, 16, 16)
    L = 64
    nc = -(-T // L)
    bf = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)

    def rn(*shape, dtype=bf):
        return torch.randn(*shape, generator=g, device=DEV).to(dtype)

    dy, z, pre = rn(Bn, T, H, P), rn(Bn, T, H, P), rn(Bn, T, H, P)
    xz = rn(Bn, T, 2 * H * P)
    x = xz[..., H * P :].view(Bn, T, H, P)
    qr = rn(Bn, T, H, N, dtype=torch.float32)
    adt = -torch.rand(Bn, T, H, generator=g, device=DEV) * 0.1
    dsT = rn(Bn, H, P, N, dtype=torch.float32)
    prec = chunk._precision(x)
    dyc = torch.empty(dy.shape, device=DEV, dtype=torch.float32)
    dz, dD = torch.empty_like(z), torch.empty(Bn, nc, H, device=DEV)
    keep, ds0 = torch.empty(Bn, H, nc, device=DEV), torch.empty_like(dsT)
    dst = torch.empty(Bn * H * nc * P * N, device=DEV, dtype=bf)
    copy_src = torch.empty_like(dst)
    print({"copy_ms": timed(lambda: dst.copy_(copy_src)), "mb": dst.numel() * 2 / 2**20})
    ref = None
    for block_n, warps, stages in ((128, 4, 1), (64, 4, 1), (128, 8, 1), (128, 4, None)):
        kw = {} if stages is None else {"num_stages": stages}

        def dy_kernel(block_n=block_n, warps=warps, kw=kw):
            _dy_chunk_kernel[(Bn, H, nc)](
                dy, z, pre, x, qr, adt, adt, dyc, dz, dD, dst, keep,
                T, H, P, N, *z.stride()[:3], *x.stride()[:3], *qr.stride()[:3],
                adt.stride(0), adt.stride(1), 0,
                HAS_SEQ=False, HAS_Z=True, HAS_D=True, L=L, BLOCK_P=P, BLOCK_N=block_n,
                PREC=prec, num_warps=warps, **kw,
            )  # fmt: skip

        print({"dy_kernel (block_n, warps, stages)": (block_n, warps, stages),
               "ms": timed(dy_kernel)}, flush=True)  # fmt: skip
    for block, chunks, warps in ((1024, 8, 4), (1024, 16, 4), (2048, 8, 8), (512, 8, 4),
                                 (1024, 4, 4), (2048, 16, 8)):  # fmt: skip

        def scan(block=block, chunks=chunks, warps=warps):
            _dstate_scan_kernel[(Bn * H, -(-P * N // block))](
                keep, dsT, dst, ds0, T, P * N, L,
                HAS_DST=True, BLOCK=block, CHUNKS=min(chunks, 1 << (nc - 1).bit_length()),
                num_warps=warps,
            )  # fmt: skip

        dy_kernel()
        scan()
        out = ds0.clone()
        ref = out if ref is None else ref
        err = ((out - ref).norm() / ref.norm()).item()
        dy_kernel()  # u again: the scan overwrites it
        print({"scan (block, chunks, warps)": (block, chunks, warps), "ms": timed(scan),
               "err": err}, flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
