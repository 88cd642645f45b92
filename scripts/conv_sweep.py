"""Time the causal conv1d kernels' launch parameters at 8x2048x1536, K=4, bf16; the peer too.

PYTHONPATH=src python scripts/conv_sweep.py --out conv_sweep.json [--with-prefill | --prefill]

The K <= 4 forward (groups of 4 times) is timed over its settings against the general
kernel first; then the general kernel's own settings (the groups kernel off); then the
backward's tile kernel and the backward walking rows (`bwd_rows_chunk`) over theirs.

x is the left half of an in_proj output [B, T, 2D] (a strided view, as in the mixer). Each
candidate is a `ConvConfig` (causal_conv1d/launch.py) derived from the library's `CONFIG`
and handed to the launchers as `cfg=`; the library always runs `CONFIG`, so a better
candidate is adopted by editing its defaults. Every candidate's outputs are checked
against the library's. causal_conv1d (the peer, when importable) is
timed on the same input through its autograd function: forward, and forward + backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton.testing

from mambakit.ops.causal_conv1d import launch as K

TILE_ONLY = dataclasses.replace(K.CONFIG, quad_block_g=0)  # the general tile kernel alone
TILES = dataclasses.replace(K.CONFIG, bwd_rows_chunk=0)  # the backward's tile kernel alone

FWD = [(32, 128, 4), (64, 128, 4), (64, 256, 4), (128, 128, 8), (32, 256, 4), (64, 64, 2)]
BWD = [(16, 1), (32, 1), (16, 2), (16, 3)]  # bytes of channels per thread, pipeline stages
# the backward walking rows: times per program, channels per program, warps, rows unrolled
ROWS = [(64, 256, 1, 4), (64, 256, 1, 1), (32, 256, 1, 4), (128, 256, 1, 4), (64, 128, 1, 4),
        (64, 512, 2, 4), (256, 256, 1, 4)]  # fmt: skip
BYTES = 3 * 8 * 2048 * 1536 * 2  # read x and dout, write dx (bf16); the forward: 2 / 3 of it


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


PREFILL = [(32, 128, 4), (64, 128, 4), (16, 128, 2), (16, 256, 4), (32, 64, 2), (64, 64, 4),
           (128, 64, 8), (32, 256, 8), (64, 256, 8)]  # fmt: skip
QUAD = [(8, 128, 4), (4, 128, 2), (16, 128, 4), (32, 128, 4), (8, 256, 4), (16, 256, 8),
        (4, 256, 4), (8, 64, 2), (16, 128, 8), (16, 64, 2)]  # fmt: skip


def quad_sweep(rows: list, label: str, x, w, bias) -> None:
    """The forward kernel for K <= 4 (groups of 4 times): (groups, channels, warps) per
    program against the general tile kernel (groups 0), GPU time from CUDA graphs; every
    candidate's output checked against the tile kernel's."""
    ref = [t.clone() for t in K.conv_fwd(x, w, bias, None, None, True, True, TILE_ONLY)]
    gb = x.numel() * 2 * 2 / 1e9
    for g, bd, nw in [(0, 0, 0)] + QUAD:
        c = dataclasses.replace(K.CONFIG, quad_block_g=g, quad_block_d=bd, quad_warps=nw)
        fn = lambda x=x, w=w, b=bias, c=c: K.conv_fwd(x, w, b, None, None, True, True, c)  # noqa: E731
        out = fn()
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))
        us = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
        rows.append(dict(kernel=f"fwd quad {label}", groups=g, block_d=bd, warps=nw, us=us,
                         tb_s=gb / us * 1e3, max_diff=diff))  # fmt: skip
        print(rows[-1], flush=True)


def prefill(rows: list) -> None:
    """The forward alone at the prefill shapes (1 x 4096 at D 1536 and 4096), GPU time from
    CUDA graphs; the peer's causal_conv1d too when importable."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        causal_conv1d_fn = None
    for D in (1536, 4096):
        g = torch.Generator(device="cuda").manual_seed(0)
        xz = torch.randn(1, 4096, 2 * D, device="cuda", generator=g).to(torch.bfloat16)
        x = xz[..., :D]
        w = torch.randn(D, 4, device="cuda", generator=g) * 0.5
        bias = torch.randn(D, device="cuda", generator=g) * 0.1
        gb = 4096 * D * 2 * 2 / 1e9
        quad_sweep(rows, f"1x4096x{D}", x, w, bias)
        for bt, bd, nw in PREFILL:  # the tile kernel's own launch parameters
            c = dataclasses.replace(TILE_ONLY, fwd_block_t=bt, fwd_block_d=bd, fwd_warps=nw)
            fn = lambda x=x, w=w, b=bias, c=c: K.conv_fwd(x, w, b, None, None, True, True, c)  # noqa: E731
            us = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
            rows.append(dict(kernel="fwd prefill", D=D, block_t=bt, block_d=bd, warps=nw,
                             us=us, tb_s=gb / us * 1e3))  # fmt: skip
            print(rows[-1], flush=True)
        if causal_conv1d_fn is not None:
            xp = x.transpose(1, 2)
            fn = lambda x=xp, w=w, b=bias: causal_conv1d_fn(x, w, b, activation="silu")  # noqa: E731
            us = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
            rows.append(dict(kernel="peer fwd prefill", D=D, us=us, tb_s=gb / us * 1e3))
            print(rows[-1], flush=True)


def mixer_inputs(Bsz: int, T: int, D: int, seed: int):
    """(xz, x = its left half, weight [D, 4], bias, dout): bf16 activations as in the mixer."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    xz = torch.randn(Bsz, T, 2 * D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(D, 4, device="cuda", generator=g) * 0.5
    bias = torch.randn(D, device="cuda", generator=g) * 0.1
    dout = torch.randn(Bsz, T, D, device="cuda", generator=g).to(torch.bfloat16)
    return xz, xz[..., :D], w, bias, dout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--prefill", action="store_true", help="only the forward at 1 x 4096")
    ap.add_argument("--with-prefill", action="store_true", help="the forward at 1 x 4096 too")
    args = ap.parse_args()
    if args.prefill:
        rows: list = []
        prefill(rows)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    Bsz, T, D = 8, 2048, 1536
    xz, x, w, bias, dout = mixer_inputs(Bsz, T, D, seed=0)
    rows = []
    if args.with_prefill:
        prefill(rows)
    quad_sweep(rows, f"{Bsz}x{T}x{D}", x, w, bias)
    base_out = K.conv_fwd(x, w, bias, None, None, True, False, TILE_ONLY)[0].float()
    for bt, bd, nw in FWD:  # the tile kernel's own launch parameters
        c = dataclasses.replace(TILE_ONLY, fwd_block_t=bt, fwd_block_d=bd, fwd_warps=nw)
        ms = timed(lambda c=c: K.conv_fwd(x, w, bias, None, None, True, False, c))
        err = (K.conv_fwd(x, w, bias, None, None, True, False, c)[0].float() - base_out).abs().max()
        rows.append(dict(kernel="fwd", block_t=bt, block_d=bd, warps=nw, ms=ms,
                         tb_s=BYTES * 2 / 3 / ms / 1e9, max_diff=err.item()))  # fmt: skip
        print(rows[-1], flush=True)
    base = None
    dxz = torch.empty_like(xz)  # dx into a strided half, as in the fused mixer
    for vb, stages in BWD:
        c = dataclasses.replace(TILES, bwd_vec_bytes=vb, bwd_stages=stages)
        for name, out_t in (("contiguous dx", None), ("dx into half of d xz", dxz[..., :D])):

            def bwd(o=out_t, c=c):
                return K.conv_bwd(dout, None, x, w, bias, None, None, True, o, cfg=c)

            ms = timed(bwd)
            out = bwd()
            base = base if base is not None else [t.clone() for t in out[:3]]
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out[:3], base))
            rows.append(dict(kernel="bwd", vec_bytes=vb, stages=stages, dx=name, ms=ms,
                             tb_s=BYTES / ms / 1e9, max_diff=err))  # fmt: skip
            print(rows[-1], flush=True)
    for chunk, bd, nw, unroll in ROWS:  # dx into the half of d xz, as the mixer's backward
        c = dataclasses.replace(K.CONFIG, bwd_rows_chunk=chunk, bwd_rows_block_d=bd,
                                bwd_rows_warps=nw, bwd_rows_unroll=unroll)  # fmt: skip

        def bwd(c=c):
            return K.conv_bwd(dout, None, x, w, bias, None, None, True, dxz[..., :D], cfg=c)

        ms = timed(bwd)
        out = bwd()
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out[:3], base))
        rows.append(dict(kernel="bwd rows", chunk=chunk, block_d=bd, warps=nw, unroll=unroll,
                         ms=ms, tb_s=BYTES / ms / 1e9, max_diff=err))  # fmt: skip
        print(rows[-1], flush=True)
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        causal_conv1d_fn = None
    if causal_conv1d_fn is not None:  # the peer wants [B, D, T] with stride 1 in D: a transpose
        xp = x.transpose(1, 2).detach().requires_grad_()
        wp = w.detach().requires_grad_()
        bp = bias.detach().requires_grad_()
        dp = dout.transpose(1, 2)
        ms_f = timed(lambda: causal_conv1d_fn(xp, wp, bp, activation="silu"))

        def fb():
            causal_conv1d_fn(xp, wp, bp, activation="silu").backward(dp)

        ms_fb = timed(fb)
        rows.append(dict(kernel="peer causal_conv1d", fwd_ms=ms_f, fwd_bwd_ms=ms_fb))
        print(rows[-1], flush=True)
    wide_backward(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def wide_backward(rows: list) -> None:
    """The backward at the 1.4b mixer's shape (4 x 2048 x 4096, dx into half of d xz): the
    tile kernel's default against the rows kernel's candidates."""
    Bsz, T, D = 4, 2048, 4096
    xz, x, w, bias, dout = mixer_inputs(Bsz, T, D, seed=1)
    dxz = torch.empty_like(xz)
    nbytes = 3 * Bsz * T * D * 2
    base = None
    for chunk, bd, nw, unroll in [(0, 0, 0, 0)] + ROWS:
        c = TILES if chunk == 0 else dataclasses.replace(
            K.CONFIG, bwd_rows_chunk=chunk, bwd_rows_block_d_wide=bd, bwd_rows_warps=nw,
            bwd_rows_unroll=unroll)  # fmt: skip

        def bwd(c=c):
            return K.conv_bwd(dout, None, x, w, bias, None, None, True, dxz[..., :D], cfg=c)

        ms = timed(bwd)
        out = bwd()
        base = base if base is not None else [t.clone() for t in out[:3]]
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out[:3], base))
        kernel = "bwd tile 4x2048x4096" if chunk == 0 else "bwd rows 4x2048x4096"
        rows.append(dict(kernel=kernel, chunk=chunk, block_d=bd, warps=nw, unroll=unroll,
                         ms=ms, tb_s=nbytes / ms / 1e9, max_diff=err))  # fmt: skip
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
