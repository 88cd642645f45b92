"""Time the Mamba-3 chunk kernels (ops/mamba3/chunk.py) at the 130m-mamba3 head shape for
chunk lengths, warp counts and the products' precision for bf16 inputs (tf32 or bf16
operands), forward and forward + backward, each candidate's outputs against the library's
defaults (each candidate a `Mamba3ScanConfig` handed to the scan as `cfg=`; the library runs
`chunk.CONFIG`); then the per-kernel profile of the layer's forward + backward, mambakit's and
upstream's (when mamba_ssm is importable).

    PYTHONPATH=src python scripts/m3_chunk_sweep.py [--shape 8x2048] [--profile-out FILE]

`--once` runs one forward and one backward with the library's settings: the program for a
profiler, e.g. NCU_PROG="scripts/m3_chunk_sweep.py --once" NCU_KERNELS=_chunk_grad_kernel
STAGES=ncu bash scripts/gpu_check.sh. `--dry`: the CPU interpreter on small heads, untimed
(tests the script).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

if "--dry" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import cuda_time_ms  # noqa: E402

from mambakit.ops.mamba3 import chunk, mamba3_scan_kernel  # noqa: E402

# (chunk, warps, products for bf16 inputs, P values a program); the first is the reference.
# Slower on the H200 at 8 x 2048, so not listed: chunks of 16, chunks of 32 with 8 warps or
# in blocks of 32 of P.
FWD = [(32, 4, "bf16", 64)]
# the backward: (chunk, warps and N states a block of `_chunk_grad_kernel`, the same of
# `_chunk_qk_grad_kernel`, N states a product and warps of `_dy_chunk_kernel`); the first
# is the reference. Slower on the H200: 8 or 16 warps in the grad kernels, chunks of 32.
BWD = [(64, 4, 32, 4, 32, 128, 4), (64, 4, 32, 4, 32, 64, 4), (64, 4, 32, 4, 32, 128, 8)]
# the forward under autograd (y, and the start states it keeps): (chunk, warps, P values a
# program), timed forward + backward; chunks of 16 and 64 were slower than the reference.
FWD_GRAD = []
# the unturn kernel (`TermsConfig.turn_block_t`, `unturn_warps`): (steps a program, warps);
# (16, 1) and (32, 2) were slower than the library's.
UNTURN = []


DEV = "cuda"  # --dry: "cpu" (TRITON_INTERPRET=1, small heads, untimed), to test the script


def timed(fn) -> float:
    if DEV != "cuda":
        fn()
        return 0.0
    return cuda_time_ms(fn, warmup=2, iters=10)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def inputs(Bn: int, T: int):
    H, G, P, N, S = (24, 1, 64, 128, 32) if DEV == "cuda" else (2, 1, 16, 16, 4)
    dev, bf = DEV, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s, scale=1.0, dtype=torch.float32):
        return (torch.randn(*s, device=dev, generator=g) * scale).to(dtype)

    return dict(
        x=r(Bn, T, H, P, dtype=bf), q=r(Bn, T, G, N, scale=0.1, dtype=bf),
        k=r(Bn, T, G, N, scale=0.1, dtype=bf),
        delta=torch.rand(Bn, T, H, device=dev, generator=g) * 0.1 + 0.001,
        A=-(torch.rand(Bn, T, H, device=dev, generator=g) * 2 + 0.1),
        trap=r(Bn, T, H, dtype=bf), theta=r(Bn, T, S, dtype=bf),
        q_bias=r(H, N, scale=0.3) + 1, k_bias=r(H, N, scale=0.3) + 1,
    )  # fmt: skip


def run_fwd(inp, y_ref=None, gate=None, cfg=None) -> dict:
    def fwd():
        with torch.no_grad():
            return chunk.mamba3_scan_fwd(**inp, **(gate or {}), cfg=cfg)

    y, _ = fwd()
    ms = timed(fwd)
    return {"ms": ms, "err": rel(y, y_ref) if y_ref is not None else 0.0}, y


def run_bwd(inp, cot, ref=None, cfg=None) -> dict:
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}

    def fwd_bwd():
        y, _ = mamba3_scan_kernel(**leaves, cfg=cfg)
        return torch.autograd.grad(y, [leaves["x"], leaves["q"], leaves["delta"]], cot)

    grads = fwd_bwd()
    ms = timed(fwd_bwd)
    errs = [rel(a, b) for a, b in zip(grads, ref)] if ref is not None else [0.0] * 3
    return {"ms": ms, "err_dx_dq_ddelta": [f"{e:.1e}" for e in errs]}, grads


def profile(fn, label: str, path: str | None) -> None:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                      max_name_column_width=60)  # fmt: skip
    text = f"== {label}\n{table}\n"
    print(text, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(text)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8x2048")
    p.add_argument("--profile-out", default=None)
    p.add_argument("--dry", action="store_true", help="CPU interpreter, small heads, no timing")
    p.add_argument("--once", action="store_true", help="one forward + backward: for ncu")
    args = p.parse_args()
    global DEV
    if args.dry:
        DEV = "cpu"
    Bn, T = (int(v) for v in args.shape.split("x"))
    inp = inputs(Bn, T)
    lib = chunk.CONFIG
    H, P = inp["x"].shape[2:]
    gate = {"D": torch.randn(H, device=DEV), "z": torch.randn_like(inp["x"])}
    if args.once:
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in {**inp, **gate}.items()}
        y, _ = mamba3_scan_kernel(**leaves)
        y.backward(torch.randn_like(y))
        if DEV == "cuda":
            torch.cuda.synchronize()
        print(
            "one forward + backward", args.shape, "dx norm", leaves["x"].grad.float().norm().item()
        )
        return 0
    for with_gate in (False, True):  # the second: the layer's no-grad path (D, gate inside)
        y_ref = None
        for L, warps, prec, block_p in FWD:
            cfg = replace(lib, chunk=L, fwd_warps=warps, prec_16bit=prec, fwd_block_p=block_p)
            try:
                rec, y = run_fwd(inp, y_ref, gate if with_gate else None, cfg)
                y_ref = y if y_ref is None else y_ref
            except Exception as e:  # out of registers / shared memory
                rec = {"failed": f"{type(e).__name__}: {str(e)[:100]}"}
            print({"shape": args.shape, "gate": with_gate, "fwd_chunk": L, "warps": warps,
                   "prec": prec, "block_p": block_p, **rec}, flush=True)  # fmt: skip
    cot = torch.randn_like(inp["x"])
    ref = None
    for setting in BWD:
        names = ("chunk_bwd", "grad_warps", "grad_block_n", "qk_warps", "qk_block_n",
                 "dy_block_n", "dy_warps")  # fmt: skip
        cfg = replace(lib, **dict(zip(names, setting)))
        try:
            rec, grads = run_bwd(inp, cot, ref, cfg)
            ref = grads if ref is None else ref
        except Exception as e:
            rec = {"failed": f"{type(e).__name__}: {str(e)[:100]}"}
        print({"shape": args.shape, "bwd (chunk, grad warps, block_n, qk warps, block_n, "
               "dy block_n, dy warps)": setting, **rec}, flush=True)  # fmt: skip
    for L, warps, block_p in FWD_GRAD:
        cfg = replace(lib, chunk=L, fwd_warps=warps, fwd_block_p=block_p)
        rec, _ = run_bwd(inp, cot, ref, cfg)
        print({"shape": args.shape, "fwd_in_bwd_chunk": L, "warps": warps, "block_p": block_p,
               **rec}, flush=True)  # fmt: skip
    for bt, warps in UNTURN:
        cfg = replace(lib, terms=replace(lib.terms, turn_block_t=bt, unturn_warps=warps))
        rec, _ = run_bwd(inp, cot, ref, cfg)
        print({"shape": args.shape, "unturn_bt": bt, "warps": warps, **rec}, flush=True)

    if args.dry:
        return 0
    from mambakit.layers.mamba3 import Mamba3

    torch.manual_seed(0)
    layer = Mamba3(768, d_state=128, headdim=64, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(Bn, T, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    profile(lambda: layer(u).sum().backward(), f"mambakit Mamba3 layer fwd+bwd {args.shape}",
            args.profile_out)  # fmt: skip
    try:
        from bench_mamba3 import prune_upstream_autotune
        from mamba_ssm.modules.mamba3 import Mamba3 as Up
    except ImportError:
        return 0
    prune_upstream_autotune()  # minutes of autotuning otherwise: one configuration a kernel
    up = Up(768, d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, A_floor=1e-4,
            is_outproj_norm=False, is_mimo=False, chunk_size=64, layer_idx=0, device="cuda",
            dtype=torch.bfloat16)  # fmt: skip
    profile(lambda: up(u).sum().backward(), f"upstream Mamba3 layer fwd+bwd {args.shape}",
            args.profile_out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
