"""out_proj and the next block's add + RMSNorm, two ways, at the prefill shapes (H200).

PYTHONPATH=src python scripts/residual_sweep.py --out residual_sweep.json

- chain (the library): out = y W^T in bf16 (cuBLAS), then the norm kernel reads out and the
  f32 residual and writes residual + out (f32) and the normed rows (bf16);
- fused: cuBLAS adds y W^T into the f32 residual in place (`addmm` with out_dtype f32,
  beta 1), then the norm kernel reads that residual and writes only the normed rows.

GPU time from CUDA graphs, each piece alone and the pair; the error of each way's new
residual against float64.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from mambakit.ops.rms_norm.launch import rms_fwd

SHAPES = [("130m", 4096, 768, 1536), ("1.4b", 4096, 2048, 4096)]


def us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def measure(name: str, M: int, dm: int, D: int) -> dict:
    """The record of one shape: M rows, d_model dm, d_inner D."""
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    W = (torch.randn(dm, D, device="cuda", generator=g) * D**-0.5).to(torch.bfloat16)
    res0 = torch.randn(M, dm, device="cuda", generator=g)
    wn = torch.rand(dm, device="cuda", generator=g) + 0.5
    Wt = W.t()
    res = res0.clone()
    ref = res0.double() + y.double() @ W.double().t()

    def chain():
        out = torch.mm(y, Wt)
        return rms_fwd(out, wn, 1e-5, res, torch.bfloat16)

    def fused():
        torch.addmm(res, y, Wt, out_dtype=torch.float32, out=res)
        return rms_fwd(res, wn, 1e-5, None, torch.bfloat16, store_residual=False)

    err_chain = (chain()[1].double() - ref).abs().max().item()
    res.copy_(res0)
    try:
        fused()
        err_fused = (res.double() - ref).abs().max().item()
    except Exception as e:  # an older torch without addmm's out_dtype
        print(name, "fused: failed:", type(e).__name__, str(e)[:200], flush=True)
        err_fused = None
    out = torch.mm(y, Wt)
    rec = dict(
        shape=name, M=M, d_model=dm, D=D,
        mm_us=us(lambda: torch.mm(y, Wt)),
        norm_add_us=us(lambda: rms_fwd(out, wn, 1e-5, res, torch.bfloat16)),
        chain_us=us(chain), err_chain=err_chain, err_fused=err_fused,
    )  # fmt: skip
    if err_fused is not None:
        rec.update(
            addmm_f32_us=us(lambda: torch.addmm(res, y, Wt, out_dtype=torch.float32, out=res)),
            norm_only_us=us(
                lambda: rms_fwd(res, wn, 1e-5, None, torch.bfloat16, store_residual=False)
            ),
            fused_us=us(fused),
        )
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape))
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
