"""Time the scan kernels' launch configurations at 8x2048x1536x16 bf16; print the best as JSON.

PYTHONPATH=src python scripts/scan_sweep.py --out sweep.json   # last line: the best config
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from mambakit.ops.selective_scan import kernels as K

FWD = [
    dict(BLOCK_D=32, num_warps=4),
    dict(BLOCK_D=16, num_warps=1),
    dict(BLOCK_D=32, num_warps=1),
    dict(BLOCK_D=64, num_warps=2),
]
BWD = [
    dict(BWD_BLOCK_D=16, bwd_warps=1),
    dict(BWD_BLOCK_D=8, bwd_warps=1),
    dict(BWD_BLOCK_D=16, bwd_warps=2),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    Bsz, T, Dn, N = 8, 2048, 1536, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    u, dt, z = (r(Bsz, T, Dn).to(bf) for _ in range(3))
    xb = r(Bsz, T, 2 * N).to(bf)
    B, C = xb[..., :N], xb[..., N:]
    A = -torch.rand(Dn, N, device="cuda", generator=g) * 16
    D, bias = r(Dn), r(Dn) * 0.1 - 4
    a = (u, dt, A, B, C, D, z, bias)
    gy = r(Bsz, T, Dn).to(bf)
    rows = []
    for cfg in FWD:
        ms = triton.testing.do_bench(
            lambda c=cfg: K.scan_fwd(*a, True, None, None, True, 16, config_override=c),
            warmup=5,
            rep=50,
            return_mode="median",
        )
        rows.append({"kernel": "fwd", **cfg, "ms": ms})
        print(rows[-1], flush=True)
    best_f = min((r for r in rows if r["kernel"] == "fwd"), key=lambda r: r["ms"])
    _, _, st = K.scan_fwd(*a, True, None, None, True, 16)
    for cfg in BWD:
        c = dict(cfg)
        try:
            ms = triton.testing.do_bench(
                lambda c=c: K.scan_bwd(gy, None, *a, True, None, None, st, 16, config_override=c),
                warmup=3,
                rep=50,
                return_mode="median",
            )
        except Exception as e:  # a config that does not compile (registers) is reported
            print("bwd", cfg, "failed:", type(e).__name__, str(e)[:200])
            ms = float("inf")
        rows.append({"kernel": "bwd", **cfg, "ms": ms})
        print(rows[-1], flush=True)
    best_b = min((r for r in rows if r["kernel"] == "bwd"), key=lambda r: r["ms"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    pick = {
        "BLOCK_D": best_f["BLOCK_D"],
        "num_warps": best_f["num_warps"],
        "BWD_BLOCK_D": best_b["BWD_BLOCK_D"],
        "bwd_warps": best_b["bwd_warps"],
    }
    print(json.dumps(pick))


if __name__ == "__main__":
    main()
