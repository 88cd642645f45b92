"""Time Mamba-2's scan without autograd (a prefill's) at the 130m-mamba2 head shape (24
heads of 64, d_state 128, one group, D per head, bf16): the SSD kernels (ops/mamba2/
ssd_kernels.py) for chunk lengths, row blocks and warps, against the Mamba-3 chunk kernels
with Mamba-2's terms (`m2_fwd="chunks"`) and mamba_ssm's `mamba_chunk_scan_combined`
(chunk 256) in the same process, each replayed from a CUDA graph (the GPU's time) and
eager; each variant's y against the first's.

    PYTHONPATH=src python scripts/m2_fwd_probe.py [--shapes 1x4096 8x2048 1x32768]
    PYTHONPATH=src python scripts/m2_fwd_probe.py --dry   # CPU, interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

if "--dry" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import cuda_time_ms, graph_time_ms  # noqa: E402

from mambakit.ops.mamba2 import mamba2_scan_kernel  # noqa: E402
from mambakit.ops.mamba3.chunk import CONFIG  # noqa: E402

VARIANTS = {  # name: config fields
    "ssd128": {},
    "ssd128-s2": dict(ssd_stages=2),
    "ssd128-sc16": dict(ssd_scan_chunks=16),
    "ssd256-sc16": dict(ssd_chunk=256, ssd_scan_chunks=16),
    "ssd128-m128-w8": dict(ssd_block_m=128, ssd_warps=8),
    "ssd64": dict(ssd_chunk=64),
    "ssd256": dict(ssd_chunk=256),
    "ssd128-w8": dict(ssd_warps=8),
    "ssd128-m32": dict(ssd_block_m=32),
    "ssd256-m128-w8": dict(ssd_chunk=256, ssd_block_m=128, ssd_warps=8),
    "ssd64-cb": dict(ssd_chunk=64, ssd_cb=True),
    "ssd128-cb": dict(ssd_cb=True),
    "ssd256-cb": dict(ssd_chunk=256, ssd_cb=True),
    "chunks": dict(m2_fwd="chunks"),
}


def _peer():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        return mamba_chunk_scan_combined
    except ImportError as e:
        print(f"mamba_ssm not importable ({e}): no peer row")
        return None


def kernel_table(fn, title: str) -> str:
    """The per-kernel GPU time of three calls of fn, as a table under `title`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25,
                                      max_name_column_width=60)  # fmt: skip
    return f"== {title} (3 calls)\n{table}\n"


def prefill_table(length: int, device: str = "cuda") -> str:
    """The 130m-mamba2 model's forward at 1 x length without autograd (bf16 weights under
    bf16 autocast, bench_model.py's prefill), by kernel."""
    from bench_model import forward_fn

    from mambakit import MambaConfig, MambaLM

    model = MambaLM(MambaConfig.preset("130m-mamba2"), device=device).to(torch.bfloat16).eval()
    ids = torch.randint(0, 50000, (1, length), device=device)
    if device != "cuda":  # the dry run: the calls, not the profile
        forward_fn(model, ids)
        return ""
    return kernel_table(forward_fn(model, ids), f"130m-mamba2 forward 1x{length}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x4096", "8x2048", "1x32768"])
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="write per-kernel tables here")
    ap.add_argument("--prefill-length", type=int, default=4096)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.dry else "cuda"
    H, P, N = (2, 16, 16) if args.dry else (args.heads, 64, 128)
    shapes = ["1x80"] if args.dry else args.shapes
    dt = torch.float32 if args.dry else torch.bfloat16
    variants = {k: VARIANTS[k] for k in args.variants}
    if args.dry:  # blocks the interpreter runs quickly
        variants = {"ssd128": {}, "ssd32-m16": dict(ssd_chunk=32, ssd_block_m=16, ssd_block_k=16),
                    "ssd32-m16-cb": dict(ssd_chunk=32, ssd_block_m=16, ssd_block_k=16, ssd_cb=True),
                    "chunks": dict(m2_fwd="chunks")}  # fmt: skip
    peer = None if args.dry else _peer()
    g = torch.Generator(device=dev).manual_seed(0)
    rows, tables = [], []
    if args.profile:
        tables.append(prefill_table(args.prefill_length, dev))
        if not args.dry:
            Path(args.profile).write_text("".join(tables))
    for shape in shapes:
        Bn, T = (int(v) for v in shape.split("x"))
        x = torch.randn(Bn, T, H, P, generator=g, device=dev).to(dt)
        Bm = (torch.randn(Bn, T, 1, N, generator=g, device=dev) * 0.2).to(dt)
        Cm = (torch.randn(Bn, T, 1, N, generator=g, device=dev) * 0.2).to(dt)
        delta = torch.rand(Bn, T, H, generator=g, device=dev) * 0.1 + 0.001
        A = -torch.rand(H, generator=g, device=dev) * 4 - 0.5
        D = torch.ones(H, device=dev)
        row, ref = {"shape": shape, "heads": H}, None
        for name, fields in variants.items():
            cfg = dataclasses.replace(CONFIG, **fields)

            def fwd(cfg=cfg, inp=(x, delta, A, Bm, Cm, D)):
                with torch.no_grad():
                    return mamba2_scan_kernel(*inp, cfg=cfg)

            y = fwd()[0].float()
            ref = y if ref is None else ref
            if dev == "cuda":  # the GPU's time alone (a CUDA graph), and eager with the host's
                row[f"{name}_ms"] = round(graph_time_ms(fwd), 4)
                row[f"{name}_eager_ms"] = round(cuda_time_ms(fwd, warmup=3, iters=20), 4)
            row[f"{name}_rel"] = float(f"{((y - ref).norm() / ref.norm()).item():.1e}")
        if peer is not None:

            def up(inp=(x, delta, A, Bm, Cm), D=D):
                return peer(*inp, chunk_size=256, D=D, return_final_states=True)

            y = up()[0].float()
            try:
                row["mamba_ssm_ms"] = round(graph_time_ms(up), 4)
            except Exception as e:  # a peer that cannot be captured: say so
                row["mamba_ssm_ms"] = f"n/a ({type(e).__name__})"
            row["mamba_ssm_eager_ms"] = round(cuda_time_ms(up, warmup=3, iters=20), 4)
            row["mamba_ssm_rel"] = float(f"{((y - ref).norm() / ref.norm()).item():.1e}")
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.profile and not args.dry:
            for name in ("ssd128", "ssd128-cb"):
                cfg = dataclasses.replace(CONFIG, **VARIANTS[name])
                tables.append(kernel_table(
                    lambda cfg=cfg, inp=(x, delta, A, Bm, Cm, D): mamba2_scan_kernel(*inp, cfg=cfg),
                    f"{name} {shape}"))  # fmt: skip
            Path(args.profile).write_text("".join(tables))

    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
