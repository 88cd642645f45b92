"""Time the RMSNorm forward's tiles (rows per program, warps) at the prefill shapes: 4096 rows
of the 130m and 1.4b widths (768, 2048), bf16 hidden plus the f32 residual, as a block runs
it; GPU time from CUDA graphs. Candidates are `NormConfig`s (ops/rms_norm/launch.py) handed
to the launcher as `cfg=`; the library runs `config(D)`, so a better rule is adopted there.

PYTHONPATH=src python scripts/rms_sweep.py --out rms_sweep.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from mambakit.ops.rms_norm import launch as K

CANDIDATES = [(1, 4), (1, 2), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8), (16, 16)]


def sweep(D: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, D, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(4096, D, device="cuda", generator=g)
    w = torch.randn(D, device="cuda", generator=g)
    gb = 4096 * D * (2 + 4 + 4 + 2) / 1e9

    def fn(c=None):
        return K.rms_fwd(x, w, 1e-5, res, torch.bfloat16, cfg=c)

    base, rows = fn(), []
    for cand in [None, *CANDIDATES]:
        c = K.config(D) if cand is None else K.NormConfig(rows=cand[0], warps=cand[1])
        name = "library" if cand is None else f"{cand[0]} rows, {cand[1]} warps"
        us = triton.testing.do_bench_cudagraph(lambda c=c: fn(c), rep=30, return_mode="median")
        us *= 1e3
        same = all(torch.equal(a, b) for a, b in zip(fn(c), base))
        rows.append(dict(D=D, tile=name, us=us, tb_s=gb / us * 1e3, same_bits=same))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = sweep(768) + sweep(2048)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
