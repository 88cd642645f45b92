"""The forward scan's register caps at the prefill shapes (H200): ptxas maxnreg for the
segment summaries (LOCAL) and the output launches, against the compiler's choice.

PYTHONPATH=src python scripts/scan_regs_sweep.py --out scan_regs.json

1 x 4096 at D 1536 and 4096, delta given in f32 (as the dt_proj kernel gives it), GPU time
from CUDA graphs; every setting's y and final state checked bit for bit against the
default's (a register cap moves spills, not arithmetic).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from mambakit.ops.selective_scan import kernels as K

CAPS = [(None, None), (None, 200), (None, 168), (None, 128), (128, None), (128, 168)]


def sweep(Dn: int, rows: list) -> None:
    """Every cap in CAPS at D = Dn channels."""
    g = torch.Generator(device="cuda").manual_seed(0)
    T, N, bf = 4096, 16, torch.bfloat16
    u = torch.randn(1, T, Dn, device="cuda", generator=g).to(bf)
    z = torch.randn(1, T, Dn, device="cuda", generator=g).to(bf)
    delta = torch.nn.functional.softplus(
        torch.randn(1, T, Dn, device="cuda", generator=g) * 0.5 - 4.0
    )
    A = -torch.arange(1, N + 1, device="cuda", dtype=torch.float32).repeat(Dn, 1)
    BC = torch.randn(1, T, 2 * N, device="cuda", generator=g)
    D = torch.ones(Dn, device="cuda")

    def fn():
        return K.scan_fwd(
            u, delta, A, BC[..., :N], BC[..., N:], D, z, None, False, None, None, False
        )

    ref = None
    for local, out in CAPS:
        K.FWD_LOCAL_MAXNREG, K.FWD_OUT_MAXNREG = local, out
        y, hT, _ = fn()
        ref = ref if ref is not None else (y.clone(), hT.clone())
        same = torch.equal(y, ref[0]) and torch.equal(hT, ref[1])
        us = triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
        rows.append(dict(D=Dn, local_maxnreg=local, out_maxnreg=out, us=us, same_bits=same))
        print(rows[-1], flush=True)
    K.FWD_LOCAL_MAXNREG = K.FWD_OUT_MAXNREG = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows: list = []
    for Dn in (1536, 4096):
        sweep(Dn, rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
