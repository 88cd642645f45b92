"""Time the Mamba-3 forward without autograd (`mamba3_scan_fwd`: the terms and the chunk
scan) at the 130m-mamba3 head shape (24 heads of 64, d_state 128, one group, 32 angles,
bf16), one program per (row, head) walking the chunks against the chunks in parallel
(`Mamba3ScanConfig.parallel_below`, passed as `cfg=`), for batch x length shapes: where the
default switches.

    PYTHONPATH=src python scripts/m3_fwd_probe.py [--shapes 1x4096 2x4096 4x2048 8x2048]
    PYTHONPATH=src python scripts/m3_fwd_probe.py --dry   # CPU, interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

if "--dry" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import cuda_time_ms  # noqa: E402

from mambakit.ops.mamba3 import chunk  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x4096", "2x4096", "4x2048", "8x2048"])
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.dry else "cuda"
    H, P, N, S = (2, 16, 16, 4) if args.dry else (24, 64, 128, 32)
    shapes = ["1x40"] if args.dry else args.shapes
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.float32 if args.dry else torch.bfloat16

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    for shape in shapes:
        Bn, T = (int(v) for v in shape.split("x"))
        inp = dict(
            x=rn(Bn, T, H, P), q=rn(Bn, T, 1, N), k=rn(Bn, T, 1, N),
            delta=torch.rand(Bn, T, H, generator=g, device=dev) * 0.1,
            A=-torch.rand(Bn, T, H, generator=g, device=dev) - 0.1,
            trap=rn(Bn, T, H), theta=rn(Bn, T, S),
            q_bias=torch.ones(H, N, device=dev), k_bias=torch.ones(H, N, device=dev),
            D=torch.ones(H, device=dev), z=rn(Bn, T, H, P),
        )  # fmt: skip
        row = {"shape": shape}
        outs = {}
        for name, below in (("walk", 0), ("parallel", 10**9)):
            cfg = dataclasses.replace(chunk.CONFIG, parallel_below=below)

            def fwd(inp=inp, cfg=cfg):
                return chunk.mamba3_scan_fwd(**inp, cfg=cfg)

            outs[name] = fwd()[0].float()
            row[f"{name}_ms"] = cuda_time_ms(fwd, warmup=3, iters=20) if dev == "cuda" else 0.0
        diff = (outs["walk"] - outs["parallel"]).norm() / outs["walk"].norm()
        row["y_rel_diff"] = f"{diff.item():.1e}"  # two roundings of bf16 products apart
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
