"""The mixer's forward between in_proj and out_proj, piece by piece: x_proj and dt_proj in
one kernel (`mambakit::x_dt_proj`) against the chain it replaces, its launch parameters,
and the scan's segment-summary (LOCAL) tile; bf16, GPU time from CUDA graphs (us).

PYTHONPATH=src python scripts/inner_sweep.py --out inner_sweep.json

chain: cuBLAS x_proj -> dt_proj kernel; fused: the x_dt_proj kernel. Shapes: the 130m and
1.4b prefill (1 x 4096), the 130m training forward (8 x 2048). Candidates replace the module
constants of mamba_inner/kernels.py; each is checked against the chain. Then the whole
no-grad mixer inner (fused vs chain, the scan included) and the scan forward with 1, 2 or 4
forward tiles per LOCAL tile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F
import triton.testing

from mambakit.ops.causal_conv1d.kernels import conv_fwd
from mambakit.ops.mamba_inner import kernels as KM
from mambakit.ops.selective_scan import kernels as KS

MI = sys.modules["mambakit.ops.mamba_inner"]  # the package (mambakit.ops.mamba_inner is the op)
SHAPES = {"130m 1x4096": (1, 4096, 1536, 48), "1.4b 1x4096": (1, 4096, 4096, 128),
          "130m 8x2048": (8, 2048, 1536, 48)}  # fmt: skip
N, K = 16, 4
# (BLOCK_M, BLOCK_K, BLOCK_D, warps, STAGES)
CANDIDATES = [
    (32, 128, 64, 4, 3),
    (16, 128, 64, 4, 3),
    (64, 128, 64, 4, 3),
    (32, 64, 64, 4, 3),
    (32, 128, 128, 4, 3),
    (16, 256, 64, 4, 2),
    (32, 128, 64, 8, 3),
    (16, 64, 128, 2, 3),
    (32, 128, 64, 4, 2),
]


DEV = "cuda"


def timed(fn) -> float:
    if DEV != "cuda":  # --dry: one call, no timing
        fn()
        return 0.0
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def shape_inputs(Bsz, T, D, R, g):
    xz = torch.randn(Bsz, T, 2 * D, device=DEV, generator=g).to(torch.bfloat16)
    cw = torch.randn(D, K, device=DEV, generator=g) * 0.5
    cb = torch.randn(D, device=DEV, generator=g) * 0.1
    wx = (torch.randn(R + 2 * N, D, device=DEV, generator=g) * D**-0.5).to(torch.bfloat16)
    wdt = (torch.randn(D, R, device=DEV, generator=g) * R**-0.5).to(torch.bfloat16)
    bdt = torch.randn(D, device=DEV, generator=g) - 4
    A = -torch.arange(1, N + 1, device=DEV).float().repeat(D, 1)
    Dv = torch.ones(D, device=DEV)
    return xz, cw, cb, wx, wdt, bdt, A, Dv


def sweep(name, Bsz, T, D, R, g) -> list[dict]:
    rows = []
    xz, cw, cb, wx, wdt, bdt, A, Dv = shape_inputs(Bsz, T, D, R, g)
    x = xz[..., :D]

    u, fin = conv_fwd(x, cw, cb, None, None, True, True)

    def chain():
        x_dbl = F.linear(u, wx)
        return (x_dbl, *KM.dt_proj(x_dbl, wdt, bdt, True))

    def fused():
        return KM.x_dt_proj(u, wx, wdt, bdt)

    ref = chain()
    for piece, fn in {
        "conv": lambda: conv_fwd(x, cw, cb, None, None, True, True),
        "x_proj (cuBLAS)": lambda: F.linear(u, wx),
        "dt_proj": lambda xd=ref[0]: KM.dt_proj(xd, wdt, bdt, True),
        "chain x_proj + dt_proj": chain,
    }.items():
        rows.append({"shape": name, "piece": piece, "us": timed(fn)})
        print(rows[-1], flush=True)
    default = (KM.XD_BLOCK_M, KM.XD_BLOCK_K, KM.XD_BLOCK_D, KM.XD_WARPS, KM.XD_STAGES)
    for cand in CANDIDATES:
        KM.XD_BLOCK_M, KM.XD_BLOCK_K, KM.XD_BLOCK_D, KM.XD_WARPS, KM.XD_STAGES = cand
        got = fused()
        err = {
            "x_dbl_rel": (
                (got[0].float() - ref[0].float()).abs().max() / ref[0].float().abs().max()
            ).item(),  # fmt: skip
            "delta_rel": ((got[1] - ref[1]).abs().max() / ref[1].abs().max()).item(),
            "bc_same": torch.equal(got[2], ref[2]),
        }
        rows.append({"shape": name, "piece": "x_dt_proj", "cfg": cand, "us": timed(fused),
                     **err})  # fmt: skip
        print(rows[-1], flush=True)
    KM.XD_BLOCK_M, KM.XD_BLOCK_K, KM.XD_BLOCK_D, KM.XD_WARPS, KM.XD_STAGES = default
    # the whole inner, no grad (conv .. scan), fused against the chain
    args = (xz, cw, cb, wx, wdt, A, Dv, bdt, None, None, None)
    for label, max_w in (("inner, chain", 0), ("inner, fused", MI.FUSED_MAX_WIDTH)):
        saved, MI.FUSED_MAX_WIDTH = MI.FUSED_MAX_WIDTH, max_w
        with torch.no_grad():
            rows.append({"shape": name, "piece": label,
                         "us": timed(lambda: MI.mamba_inner_triton(*args))})  # fmt: skip
        MI.FUSED_MAX_WIDTH = saved
        print(rows[-1], flush=True)
    # the scan forward alone, LOCAL tile of 1 or 2 forward tiles
    if Bsz == 1:
        _, delta, bc = ref
        base = KS.config(D, DEV != "cuda")
        y0 = None
        for m in (1, 2, 4):
            cfg = dataclasses.replace(base, fwd_local_tiles=m)
            y = KS.scan_fwd(u, delta, A, bc[..., :N], bc[..., N:], Dv, xz[..., D:], None, False,
                            None, None, False, cfg=cfg)[0]  # fmt: skip
            y0 = y if y0 is None else y0
            us = timed(lambda c=cfg: KS.scan_fwd(
                u, delta, A, bc[..., :N], bc[..., N:], Dv, xz[..., D:], None, False, None, None,
                False, cfg=c))  # fmt: skip
            rows.append({"shape": name, "piece": "scan fwd", "local_tiles": m, "us": us,
                         "y_rel_vs_1": ((y.float() - y0.float()).abs().max()
                                        / y0.float().abs().max()).item()})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--dry", action="store_true", help="CPU, interpreter, tiny shapes")
    args = ap.parse_args()
    global DEV
    if args.dry:
        DEV = "cpu"
        SHAPES.update({name: (Bsz, 64, 48, 8) for name, (Bsz, *_) in SHAPES.items()})
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for name in args.shapes:
        rows += sweep(name, *SHAPES[name], g)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
