"""Time the Mamba-3 decode step kernel (`state_update_raw`) at the 130m-mamba3 layer shape
(24 heads of 64, d_state 128, one group, 32 angles) for launch settings: 24 layers' steps
(each its own state, as in a decode step) replayed from a CUDA graph, us per layer, beside
a copy of as many bytes as the states' reads and writes.

    PYTHONPATH=src python scripts/m3_step_probe.py [--batch 1 8 64] [--warps 1 2 4 8]
    PYTHONPATH=src python scripts/m3_step_probe.py --once   # one step, for ncu
    PYTHONPATH=src python scripts/m3_step_probe.py --dry    # CPU, interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys

if "--dry" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import graph_time_ms  # noqa: E402

from mambakit.ops.mamba3 import step as m3step  # noqa: E402
from mambakit.ops.mamba3.reference import Mamba3State  # noqa: E402


def graph_us(fn) -> float:
    return graph_time_ms(fn, iters=100) * 1e3


def layers(Bn: int, n_layers: int, H: int, P: int, N: int, S: int, dev: str):
    """Per layer: (state, in_proj's output rows split as the layer splits them)."""
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    out = []
    for _ in range(n_layers):
        st = Mamba3State(
            torch.rand(Bn, H, S, generator=g, device=dev),
            torch.randn(Bn, H, P, N, generator=g, device=dev),
            torch.randn(Bn, H, N, generator=g, device=dev),
            torch.randn(Bn, H, P, generator=g, device=dev),
        )
        E = H * P
        row = torch.randn(Bn, 2 * E + 2 * N + 3 * H + S, generator=g, device=dev).to(bf)
        z, x, B, C, dd_dt, dd_A, trap, theta = torch.split(row, [E, E, N, N, H, H, H, S], -1)
        inputs = (x.unflatten(-1, (H, P)), C.unflatten(-1, (1, N)), B.unflatten(-1, (1, N)),
                  dd_dt, dd_A, trap, theta)  # fmt: skip
        params = (
            torch.ones(H, N, device=dev),  # q bias
            torch.ones(H, N, device=dev),  # k bias
            torch.ones(H, device=dev),  # D
            z.unflatten(-1, (H, P)),
            torch.zeros(H, device=dev),  # dt bias
            1e-4,
            torch.ones(N, device=dev, dtype=bf),
            torch.ones(N, device=dev, dtype=bf),
            1e-5,
        )
        out.append((st, inputs, params))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[0], help="0: the library's")
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.dry else "cuda"
    H, P, N, S = (2, 16, 16, 4) if args.dry else (24, 64, 128, 32)
    n_layers = 2 if args.dry else 24
    for Bn in [1] if args.once else args.batch:
        ls = layers(Bn, n_layers, H, P, N, S, dev)

        def step(ls=ls, cfg=None):
            for st, inputs, params in ls:
                q_b, k_b, D, z, dtb, floor, C_w, B_w, eps = params
                x, C, B, dd_dt, dd_A, trap, theta = inputs
                m3step.state_update_raw(
                    st, x, C, B, dd_dt, dd_A, trap, theta, q_b, k_b, D, z, dtb, floor, C_w, B_w,
                    eps, cfg=cfg,
                )  # fmt: skip

        if args.once or args.dry:
            step()
            if not args.dry:
                torch.cuda.synchronize()
            print(f"batch {Bn}: one step of {n_layers} layers ran", flush=True)
            continue
        state_bytes = Bn * H * (P * N + N + P + S) * 4 * 2  # read and written
        src = torch.empty(n_layers, state_bytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)

        def copy(src=src, dst=dst):
            for i in range(n_layers):
                dst[i].copy_(src[i])

        copy_us = graph_us(copy) / n_layers
        for warps in args.warps:
            cfg = m3step.Mamba3StepConfig(warps=warps or None)
            us = graph_us(lambda cfg=cfg: step(cfg=cfg)) / n_layers
            print(f"batch {Bn} warps {warps or 'default'}: {us:.2f} us a layer "
                  f"(a copy of the state's {state_bytes // 2} bytes: {copy_us:.2f} us)",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
