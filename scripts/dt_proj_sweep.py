"""dt_proj with softplus in its epilogue (ops/mamba_inner/kernels.py) against the chain it
replaces, and its launch parameters; bf16, GPU time from CUDA graphs.

PYTHONPATH=src python scripts/dt_proj_sweep.py --out dt_proj_sweep.json

chain: cuBLAS dt_proj -> B, C widened -> scan (bias and softplus in both of its passes);
ours: dt_proj kernel (delta f32 through softplus, B, C widened) -> scan without softplus.
Each piece is timed alone too. Shapes: the 130m and 1.4b prefill (1 x 4096), the 130m
training step's forward (8 x 2048). Candidates are `DtProjConfig`s handed to the launcher as
`cfg=`; the library runs `config(False)`, so a better one is adopted by editing its defaults.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from mambakit.ops.mamba_inner import launch as KM
from mambakit.ops.selective_scan import launch as KS

SHAPES = {"130m 1x4096": (1, 4096, 1536, 48), "1.4b 1x4096": (1, 4096, 4096, 128),
          "130m 8x2048": (8, 2048, 1536, 48)}  # fmt: skip
# (block_m, block_d, warps, d_tiles, stages): DtProjConfig's fields
CANDIDATES = [
    (64, 64, 4, 1, 1),
    (64, 64, 4, 2, 2),
    (64, 64, 4, 4, 2),
    (64, 64, 4, 4, 3),
    (64, 128, 4, 2, 2),
    (128, 64, 4, 2, 2),
    (128, 64, 8, 4, 2),
    (64, 64, 8, 4, 2),
    (32, 64, 4, 4, 3),
    (32, 64, 2, 4, 3),
    (16, 64, 2, 4, 3),
    (32, 128, 4, 2, 3),
]


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3  # us


def sweep(name: str, Bsz: int, T: int, D: int, R: int, g: torch.Generator) -> list[dict]:
    N, bf = 16, torch.bfloat16
    x_dbl = torch.randn(Bsz, T, R + 2 * N, device="cuda", generator=g).to(bf)
    w = (torch.randn(D, R, device="cuda", generator=g) * R**-0.5).to(bf)
    bias = torch.randn(D, device="cuda", generator=g) - 4
    u = torch.randn(Bsz, T, D, device="cuda", generator=g).to(bf)
    z = torch.randn(Bsz, T, D, device="cuda", generator=g).to(bf)
    A = -torch.arange(1, N + 1, device="cuda", dtype=torch.float32).repeat(D, 1)
    Dv = torch.ones(D, device="cuda")
    dt_r, B, C = x_dbl.split([R, N, N], dim=-1)
    raw = F.linear(dt_r, w)
    delta, bc = KM.dt_proj(x_dbl, w, bias, True)
    Bf, Cf = bc[..., :N], bc[..., N:]

    def scan_old():
        return KS.scan_fwd(u, raw, A, Bf, Cf, Dv, z, bias, True, None, None, False)

    def scan_new():
        return KS.scan_fwd(u, delta, A, Bf, Cf, Dv, z, None, False, None, None, False)

    def chain():
        r = F.linear(dt_r, w)
        b32, c32 = KS.bc_f32(B, C)
        return KS.scan_fwd(u, r, A, b32, c32, Dv, z, bias, True, None, None, False)

    def ours():
        d, bc2 = KM.dt_proj(x_dbl, w, bias, True)
        return KS.scan_fwd(u, d, A, bc2[..., :N], bc2[..., N:], Dv, z, None, False, None, None,
                           False)  # fmt: skip

    y_old, y_new = scan_old()[0].float(), scan_new()[0].float()
    rows = [dict(shape=name, y_max_diff=(y_old - y_new).abs().max().item(),
                 y_max=y_old.abs().max().item())]  # fmt: skip
    pieces = {
        "cuBLAS dt_proj": lambda: F.linear(dt_r, w),
        "widen B, C": lambda: KS.bc_f32(B, C),
        "scan, softplus inside": scan_old,
        "scan, delta given": scan_new,
        "chain": chain,
        "ours": ours,
    }
    for piece, fn in pieces.items():
        rows.append(dict(shape=name, piece=piece, us=timed(fn)))
    for cand in CANDIDATES:
        c = KM.DtProjConfig(*cand)
        try:
            us = timed(lambda c=c: KM.dt_proj(x_dbl, w, bias, True, c))
            same = torch.equal(KM.dt_proj(x_dbl, w, bias, True, c)[0], delta)
        except Exception as e:  # a candidate that does not compile
            rows.append(dict(shape=name, piece="dt_proj kernel", cfg=cand, error=str(e)[:200]))
            continue
        rows.append(dict(shape=name, piece="dt_proj kernel", cfg=cand, us=us, same_bits=same))
    for r in rows:
        print(r, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, shape in SHAPES.items():
        rows += sweep(name, *shape, g)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
