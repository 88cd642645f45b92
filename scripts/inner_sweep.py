"""The mixer's forward between in_proj and out_proj, piece by piece: the fused conv + x_proj
kernel (`mambakit::conv_x_dt`) against the chain it replaces, its launch parameters, and
the scan's segment-summary (LOCAL) tile; bf16, GPU time from CUDA graphs (us).

PYTHONPATH=src python scripts/inner_sweep.py --out inner_sweep.json

chain: conv kernel -> cuBLAS x_proj -> dt_proj kernel; fused: conv + x_proj partial sums
-> dt_proj adding them. Shapes: the 130m and 1.4b prefill (1 x 4096), the 130m training
forward (8 x 2048). Candidates replace the module constants of mamba_inner/kernels.py; each
is checked against the chain. Then the whole no-grad mixer inner (fused vs chain, the scan
included) and the scan forward with 1 or 2 forward tiles per LOCAL tile.
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
# (BLOCK_T, BLOCK_D, warps, PARTS, STAGES)
CANDIDATES = [
    (32, 128, 4, 4, 2),
    (32, 128, 4, 8, 2),
    (32, 128, 4, 2, 2),
    (64, 128, 4, 4, 2),
    (64, 128, 8, 4, 2),
    (32, 64, 4, 4, 2),
    (16, 128, 4, 4, 2),
    (32, 128, 4, 4, 1),
    (64, 64, 4, 8, 2),
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

    def chain():
        u, fin = conv_fwd(x, cw, cb, None, None, True, True)
        x_dbl = F.linear(u, wx)
        return (u, fin, x_dbl, *KM.dt_proj(x_dbl, wdt, bdt, True))

    def fused():
        return MI._conv_x_dt_op(x, cw, cb, None, None, wx, wdt, bdt)

    ref = chain()
    for piece, fn in {
        "conv": lambda: conv_fwd(x, cw, cb, None, None, True, True),
        "x_proj (cuBLAS)": lambda u=ref[0]: F.linear(u, wx),
        "dt_proj": lambda xd=ref[2]: KM.dt_proj(xd, wdt, bdt, True),
        "chain": chain,
    }.items():
        rows.append({"shape": name, "piece": piece, "us": timed(fn)})
        print(rows[-1], flush=True)
    default = (KM.CX_BLOCK_T, KM.CX_BLOCK_D, KM.CX_WARPS, KM.CX_PARTS, KM.CX_STAGES)
    for cand in CANDIDATES:
        KM.CX_BLOCK_T, KM.CX_BLOCK_D, KM.CX_WARPS, KM.CX_PARTS, KM.CX_STAGES = cand
        got = fused()
        err = {
            "u_same": torch.equal(got[0], ref[0]),
            "x_dbl_rel": (
                (got[2].float() - ref[2].float()).abs().max() / ref[2].float().abs().max()
            ).item(),  # fmt: skip
            "delta_rel": ((got[3] - ref[3]).abs().max() / ref[3].abs().max()).item(),
        }
        us_cx = timed(
            lambda: KM.conv_x_proj(x, cw, cb, None, None, wx)  # the first launch alone
        )
        rows.append({"shape": name, "piece": "fused", "cfg": cand, "us": timed(fused),
                     "conv_x_proj_us": us_cx, **err})  # fmt: skip
        print(rows[-1], flush=True)
    KM.CX_BLOCK_T, KM.CX_BLOCK_D, KM.CX_WARPS, KM.CX_PARTS, KM.CX_STAGES = default
    # the whole inner, no grad (conv .. scan), fused against the chain
    args = (xz, cw, cb, wx, wdt, A, Dv, bdt, None, None, None)
    for label, max_w in (("inner, chain", 0), ("inner, fused", MI.FUSED_MAX_W)):
        saved, MI.FUSED_MAX_W = MI.FUSED_MAX_W, max_w
        with torch.no_grad():
            rows.append({"shape": name, "piece": label,
                         "us": timed(lambda: MI.mamba_inner_triton(*args))})  # fmt: skip
        MI.FUSED_MAX_W = saved
        print(rows[-1], flush=True)
    # the scan forward alone, LOCAL tile of 1 or 2 forward tiles
    if Bsz == 1:
        u, _, x_dbl, delta, bc = ref
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
