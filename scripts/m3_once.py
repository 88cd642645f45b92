"""One forward and one backward of the Mamba-3 scan kernels (ops/mamba3/chunk.py) at the
130m-mamba3 head shape, bf16, 8 x 2048 (or --shape): the program to run under a profiler,

    NCU_PROG=scripts/m3_once.py NCU_KERNELS="_chunk_grad_kernel" STAGES=ncu \\
        bash scripts/gpu_check.sh

--dry: the CPU interpreter on small heads (tests the script).
"""

from __future__ import annotations

import argparse

import m3_chunk_sweep as sweep
import torch

from mambakit.ops.mamba3 import chunk


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8x2048")
    p.add_argument("--dry", action="store_true")
    args = p.parse_args()
    if args.dry:
        sweep.DEV = "cpu"
    Bn, T = (int(v) for v in args.shape.split("x"))
    inp = sweep.inputs(Bn, T)
    H = inp["x"].shape[2]
    inp["D"] = torch.randn(H, device=sweep.DEV)
    inp["z"] = torch.randn_like(inp["x"])
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    y, _ = chunk.mamba3_scan_kernel(**leaves)
    y.backward(torch.randn_like(y))
    if sweep.DEV == "cuda":
        torch.cuda.synchronize()
    print("m3_once", args.shape, "dx norm", leaves["x"].grad.float().norm().item())


if __name__ == "__main__":
    main()
