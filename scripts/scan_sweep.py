"""Time the scan kernels' launch configurations at 8x2048x1536x16 bf16; print the best as JSON.

PYTHONPATH=src python scripts/scan_sweep.py --out sweep.json   # last line: the best config

Each candidate is a `ScanConfig` (launch.py) derived from the library's GPU config and
handed to the launchers directly; the library itself always runs `config()`, so a better
config found here is adopted by editing `config()`. Forward and backward are timed
separately (the backward's tile sets how often the forward saves states, so each backward
config gets states saved at its own tile).

`--once` runs one forward (saving states) and one backward with the library's config: the
program for a profiler (gpu_check.sh's ncu stage), e.g.

    ncu --clock-control none -k regex:_bwd_kernel -c 1 --section WarpStateStats \\
        python scripts/scan_sweep.py --once
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton.testing

from mambakit.ops.selective_scan import launch as K

FWD = [  # fwd_tile, fwd_block_d, fwd_warps (H200: 8 / 32 / 1: 0.363-0.372 ms; tile 4: 0.421,
    # 16 channels: 0.400, both: 0.437)
    dict(fwd_tile=8, fwd_block_d=32, fwd_warps=1),
]
BWD = [  # bwd_tile, bwd_block_d, bwd_warps (H200, earlier designs: 4 / 16 / 1: 1.49-1.53 ms;
    # 8 channels 1.54-1.84, now the faster below D 4096: scan_config.py; tile 2: 2.91;
    # tile 8 x 8 channels: 1.69 (its forward 0.352 against 0.363);
    # the states in two halves one after the other: 1.61-1.93; the adjoint by a row loop with
    # dB's reduce-scatter in plain tensor ops (layout-independent): 3.76; the backward split in
    # two kernels, dB/dC with states on the lanes, 3.7-7.9 ms; more warps a program, H200:
    # 16 channels on 2 warps 1.57 ms, 32 on 2 1.72, 32 on 4 3.81, against 0.867). fwd_ms:
    # the forward saving states at that tile.
    dict(bwd_tile=4, bwd_block_d=16, bwd_warps=1),
    dict(bwd_tile=4, bwd_block_d=16, bwd_warps=1, bwd_maxnreg=168),  # 12 warps an SM, spills
    dict(bwd_tile=4, bwd_block_d=8, bwd_warps=1),
    dict(bwd_tile=4, bwd_block_d=8, bwd_warps=1, bwd_maxnreg=128),  # 16 warps an SM
    dict(bwd_tile=8, bwd_block_d=8, bwd_warps=1),
]
SEGMENTS = [(2, 16), (2, 8), (8, 16)]  # (seg_below_per_sm, seg_target_per_sm)
DN, N = 1536, 16


def timed(fn, graph: bool = False) -> float:
    """Median ms; graph: replayed from a CUDA graph, so the host's launch cost (several times
    a short kernel's on the H200 host) does not count."""
    try:
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
    except Exception as e:  # a config that does not compile or run is reported, not fatal
        print("  failed:", type(e).__name__, str(e)[:300], flush=True)
        return float("inf")


def shape_inputs(Bsz, T, Dn=1536, N=16):
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16
    xz = torch.randn(Bsz, T, 2 * Dn, device="cuda", generator=g).to(bf)
    xb = torch.randn(Bsz, T, 2 * N, device="cuda", generator=g).to(bf)
    dt = (torch.randn(Bsz, T, Dn, device="cuda", generator=g) * 0.1).to(bf)
    A = -torch.arange(1, N + 1, device="cuda", dtype=torch.float32).repeat(Dn, 1)
    D = torch.ones(Dn, device="cuda")
    bias = torch.full((Dn,), -4.0, device="cuda")
    a = (xz[..., :Dn], dt, A, xb[..., :N], xb[..., N:], D, xz[..., Dn:], bias)
    return a, torch.randn(Bsz, T, Dn, device="cuda", generator=g).to(bf)


def segments(pick: K.ScanConfig, rows: list) -> tuple[int, int]:
    """When to cut time into segments (programs per SM below which, and how many to aim for),
    chosen by the sum over shapes of time / best time for that shape."""
    options = SEGMENTS
    shapes = [(8, 2048), (1, 65536), (1, 4096)]
    times = {}
    for Bsz, T in shapes:
        a, gy = shape_inputs(Bsz, T, DN, N)
        for mp in options:
            c = dataclasses.replace(pick, seg_below_per_sm=mp[0], seg_target_per_sm=mp[1])
            f = timed(lambda c=c, a=a: K.scan_fwd(*a, True, None, None, True, cfg=c))
            _, _, st = K.scan_fwd(*a, True, None, None, True, cfg=c)
            b = timed(
                lambda c=c, a=a, st=st, gy=gy: K.scan_bwd(gy, None, *a, True, None, None, st, cfg=c)
            )
            times[(Bsz, T, mp)] = f + b
            row = {"kernel": "segments", "shape": f"{Bsz}x{T}", "below_target_per_sm": mp}
            rows.append({**row, "fwd_ms": f, "bwd_ms": b})
            print(rows[-1], flush=True)
        del a, gy
    score = {
        mp: sum(times[(b, t, mp)] / min(times[(b, t, o)] for o in options) for b, t in shapes)
        for mp in options
    }
    return min(options, key=lambda mp: score[mp])


# fwd_block_d, fwd_warps, fwd_tile, fwd_local_tiles (H200, 1 x 4096 at D 1536, aiming at 8
# programs per SM: 32 / 1 / 8 / 2 78.2 us, 8 / 1: 79.5, 8 / 4: 84.6)
PREFILL = [(32, 1, 8, 2), (32, 1, 8, 1), (32, 1, 4, 2), (32, 1, 4, 4), (16, 1, 8, 2)]


def prefill(rows: list) -> None:
    """The inference forward (no saved states) of one long row, 1 x 4096, as a prefill runs
    it (timed from CUDA graphs: GPU time; delta given in f32, as the dt_proj kernel gives it),
    at the 130m and 1.4b widths (D 1536, 4096):
    channels per program, tile and how far time is cut into segments; then the training
    forward (states saved) at 8 x 2048."""
    base = K.config(DN, interpret=False)
    shapes = [(1, 4096, 1536, False), (1, 4096, 4096, False), (8, 2048, 1536, True)]
    for Bsz, T, Dn, save in shapes:
        a, _ = shape_inputs(Bsz, T, Dn, N)
        # as the layer runs it: delta through softplus already (the dt_proj kernel), in f32
        delta = torch.nn.functional.softplus(a[1].float() + a[7])
        given = (a[0], delta, *a[2:7], None)
        for bd, warps, tile, local in PREFILL:
            for target in (6, 8, 12) if Bsz == 1 else (16,):
                c = dataclasses.replace(
                    base, fwd_block_d=bd, fwd_warps=warps, fwd_tile=tile, fwd_local_tiles=local,
                    seg_below_per_sm=2, fwd_seg_target_per_sm=target,
                )  # fmt: skip
                ms = timed(
                    lambda c=c, a=given, s=save: K.scan_fwd(*a, False, None, None, s, cfg=c),
                    graph=True,
                )
                row = {
                    "kernel": "fwd" + (" (states saved)" if save else ""),
                    "shape": f"{Bsz}x{T}x{Dn}",
                    "fwd_block_d": bd,
                    "fwd_warps": warps,
                    "fwd_tile": tile,
                    "fwd_local_tiles": local,
                    "fwd_seg_target_per_sm": target,
                }
                rows.append({**row, "ms": ms})  # fmt: skip
                print(rows[-1], flush=True)
        del a, given, delta


def wide_backward(rows: list) -> None:
    """The backward configs at the 1.4b mixer's width (4 x 2048 x 4096 x 16, states saved
    every 8 tiles and replayed, as the library runs it there), after a forward saving them."""
    a, gy = shape_inputs(4, 2048, 4096, N)
    base = K.config(4096, interpret=False)
    for bw in BWD:
        c = dataclasses.replace(base, **bw)
        try:
            _, _, states = K.scan_fwd(*a, True, None, None, True, cfg=c)
            ms = timed(lambda c=c, st=states: K.scan_bwd(gy, None, *a, True, None, None, st, cfg=c))
        except Exception as e:
            print("  failed:", type(e).__name__, str(e)[:300], flush=True)
            ms = float("inf")
        rows.append({"kernel": "bwd 4x2048x4096", **bw, "ms": ms})
        print(rows[-1], flush=True)


def long_rows(rows: list) -> None:
    """Forward (saving states) + backward of long single rows, where time is cut into
    segments: channels per backward program (which set its registers, so how many programs
    an SM holds: 12 at 8 channels, 8 at 16) against the segments' target programs per SM
    (a target that is not a whole number of an SM's programs leaves a part-filled wave)."""
    base = K.config(DN, interpret=False)
    for Bsz, T in ((1, 65536), (1, 16384), (1, 4096)):
        a, gy = shape_inputs(Bsz, T, DN, N)
        first = None
        for bd in (8, 16):
            for target in (12, 16, 24):
                c = dataclasses.replace(base, bwd_block_d=bd, bwd_block_d_seg=bd,
                                        seg_target_per_sm=target)  # fmt: skip
                _, _, st = K.scan_fwd(*a, True, None, None, True, cfg=c)
                f = timed(lambda c=c, a=a: K.scan_fwd(*a, True, None, None, True, cfg=c))
                b = timed(
                    lambda c=c, a=a, st=st, gy=gy: K.scan_bwd(gy, None, *a, True, None, None, st,
                                                              cfg=c)
                )  # fmt: skip
                grads = [g.float() for g in K.scan_bwd(gy, None, *a, True, None, None, st, cfg=c)
                         if g is not None]  # fmt: skip
                first = first if first is not None else grads
                err = max(((g - f0).norm() / f0.norm()).item() for g, f0 in zip(grads, first))
                row = {"kernel": "long", "shape": f"{Bsz}x{T}", "bwd_block_d": bd,
                       "seg_target_per_sm": target, "fwd_ms": f, "bwd_ms": b, "ms": f + b,
                       "rel_err_vs_first": err}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
        del a, gy, st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--no-segments", action="store_true", help="skip the segment sweep")
    ap.add_argument("--prefill", action="store_true", help="only the forward: 1 x T, 8 x 2048")
    ap.add_argument(
        "--bwd",
        type=json.loads,
        default=None,
        help="only these backward configs at 8 x 2048 (a JSON list of ScanConfig fields, e.g. "
        '\'[{"bwd_block_d": 32, "bwd_warps": 4}]\'), each against the library\'s config',
    )
    ap.add_argument(
        "--once",
        action="store_true",
        help="one forward (saving states) and one backward, the library's config: for ncu",
    )
    ap.add_argument(
        "--long",
        action="store_true",
        help="only long single rows: backward channels against the segments' target per SM",
    )
    args = ap.parse_args()
    if args.long or args.prefill:  # one sweep alone
        rows = []
        (long_rows if args.long else prefill)(rows)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.once:
        a, gy = shape_inputs(8, 2048, DN, N)
        _, _, states = K.scan_fwd(*a, True, None, None, True)
        K.scan_bwd(gy, None, *a, True, None, None, states)
        torch.cuda.synchronize()
        return
    if args.bwd is not None:
        global BWD
        BWD = [{}, *args.bwd]  # the library's config first: the others' gradients against it
    a, gy = shape_inputs(8, 2048, DN, N)
    base = K.config(DN, interpret=False)
    rows = []
    if args.bwd is None:
        wide_backward(rows)
    for fw in FWD if args.bwd is None else FWD[:1]:  # (--bwd: the library's forward alone)
        c = dataclasses.replace(base, **fw)
        ms = timed(lambda c=c: K.scan_fwd(*a, True, None, None, True, cfg=c))
        rows.append({"kernel": "fwd", **fw, "ms": ms})
        print(rows[-1], flush=True)
    first = None  # every config's gradients against the first config's (a wrong layout
    # assumption would show here, not only in the tests, which run the default config)
    for bw in BWD:
        c = dataclasses.replace(base, **bw)
        err = None
        try:
            _, _, states = K.scan_fwd(*a, True, None, None, True, cfg=c)
            fwd_ms = timed(lambda c=c: K.scan_fwd(*a, True, None, None, True, cfg=c))
            ms = timed(lambda c=c, st=states: K.scan_bwd(gy, None, *a, True, None, None, st, cfg=c))
            grads = K.scan_bwd(gy, None, *a, True, None, None, states, cfg=c)
            grads = [g.float() for g in grads if g is not None]
            if first is None:
                first = grads
            err = max(((g - f).norm() / f.norm()).item() for g, f in zip(grads, first))
        except Exception as e:
            print("  failed:", type(e).__name__, str(e)[:300], flush=True)
            ms = fwd_ms = float("inf")
        if err is not None and not err < 1e-2:
            print(f"  WRONG: gradients differ from the first config's by {err:.3g}", flush=True)
            ms = float("inf")
        rows.append({"kernel": "bwd", **bw, "ms": ms, "fwd_ms": fwd_ms, "rel_err_vs_first": err})
        print(rows[-1], flush=True)
    best_f = min((r for r in rows if r["kernel"] == "fwd"), key=lambda r: r["ms"])
    best_b = min((r for r in rows if r["kernel"] == "bwd"), key=lambda r: r["ms"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("best fwd", best_f, "best bwd", best_b, flush=True)
    if args.bwd is not None:
        return
    fields = {f.name for f in dataclasses.fields(K.ScanConfig)}
    pick = dataclasses.replace(
        base, **{k: best_f[k] for k in FWD[0]},
        **{"bwd_maxnreg": 0, **{k: v for k, v in best_b.items() if k in fields}},
    )  # fmt: skip
    if not args.no_segments:
        below, target = segments(pick, rows)
        pick = dataclasses.replace(pick, seg_below_per_sm=below, seg_target_per_sm=target)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(dataclasses.asdict(pick)))


if __name__ == "__main__":
    main()
