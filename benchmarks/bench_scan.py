"""Selective scan benchmark: forward and forward+backward time against the H200 roofline.

Workloads (bf16, d_inner 1536, d_state 16): batch 8 x seqlen 2048 and batch 1 x
seqlen 65536. Each figure is reported with two roofline ratios (DESIGN.md
section 7): bytes / copy rate and exponentials / exp2 rate, each over the
measured time (1.0 = at that bound). mamba_ssm's `selective_scan_fn` is timed
in the same run when importable; the PyTorch reference once at the first shape.

    python benchmarks/bench_scan.py --out scan.json

Launch configurations are timed by scripts/scan_sweep.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_record  # noqa: E402

COPY_BPS = 4.27e12  # measured device-to-device copy, bytes/s (DESIGN.md section 7)
EXP2_PER_S = 4.0e12  # tl.math.exp2 throughput


def make_inputs(Bsz, T, Dn, N, dtype, device="cuda", grad=False):
    g = torch.Generator(device=device).manual_seed(0)

    def rn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device) * scale

    xz = rn(Bsz, T, 2 * Dn).to(dtype)  # in_proj output: u and z are strided slices
    xp = rn(Bsz, T, 96 + 2 * N).to(dtype)  # x_proj output: dt_rank, B, C
    dt_init = torch.exp(torch.rand(Dn, generator=g, device=device) * math.log(100) + math.log(1e-3))
    inp = dict(
        u=xz[..., :Dn],
        delta=rn(Bsz, T, Dn, scale=0.1).to(dtype),
        A=-torch.arange(1, N + 1, device=device, dtype=torch.float32).repeat(Dn, 1),
        B=xp[..., 96 : 96 + N],
        C=xp[..., 96 + N :],
        D=torch.ones(Dn, device=device),
        z=xz[..., Dn:],
        delta_bias=dt_init + torch.log(-torch.expm1(-dt_init)),  # softplus^-1
    )
    if grad:
        for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias"):
            inp[k] = inp[k].detach().requires_grad_()
    return inp


def bench(fn, rep=200, grad_to_none=None):
    import triton.testing

    return triton.testing.do_bench(
        fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median"
    )


def counts(Bsz, T, Dn, N, elt, backward: bool):
    """Fewest bytes moved and exponentials of a forward (or forward+backward)."""
    fwd_bytes = Bsz * T * (4 * Dn * elt + 2 * N * elt)  # u, delta, z, y; B, C
    exps = Bsz * T * Dn * N
    if not backward:
        return fwd_bytes, exps
    bwd_bytes = Bsz * T * (7 * Dn * elt + 4 * N * elt)  # + gy; du, ddelta, dz; dB, dC
    return fwd_bytes + bwd_bytes, 2 * exps  # the backward recomputes exp(delta A)


def record(workload, impl, shape, dtype, ms, backward, extra=None):
    Bsz, T, Dn, N = shape
    elt = torch.empty(0, dtype=dtype).element_size()
    nbytes, exps = counts(Bsz, T, Dn, N, elt, backward)
    t_bytes, t_exp = nbytes / COPY_BPS * 1e3, exps / EXP2_PER_S * 1e3
    rec = dict(
        workload=workload,
        impl=impl,
        shape=dict(batch=Bsz, seqlen=T, d_inner=Dn, d_state=N),
        dtype=str(dtype).replace("torch.", ""),
        time_ms=ms,
        gb_per_s=nbytes / (ms * 1e-3) / 1e9,
        ratio_bytes=t_bytes / ms,  # fraction of the copy-rate bound reached
        ratio_exp=t_exp / ms,  # fraction of the exponential bound reached
        bound_ms=max(t_bytes, t_exp),
    )
    rec.update(extra or {})
    return rec


def time_ours(shape, dtype):
    from mambakit.ops import selective_scan

    Bsz, T, Dn, N = shape
    out = []
    inp = make_inputs(*shape, dtype)
    with torch.no_grad():
        ms = bench(lambda: selective_scan(**inp, backend="triton"))
    out.append(record("forward (inference)", "mambakit", shape, dtype, ms, False))
    gi = make_inputs(*shape, dtype, grad=True)
    leaves = [v for v in gi.values() if v.requires_grad]
    ms = bench(lambda: selective_scan(**gi, backend="triton"))
    out.append(record("forward (saves states)", "mambakit", shape, dtype, ms, False))
    gy = torch.randn(Bsz, T, Dn, device="cuda", dtype=dtype)

    def fb():
        selective_scan(**gi, backend="triton").backward(gy)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fb()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = bench(fb, grad_to_none=leaves)
    from mambakit.ops.selective_scan.launch import state_chunk

    saved = Dn * N * 4 / state_chunk(Dn, True)
    out.append(
        record(
            "forward+backward",
            "mambakit",
            shape,
            dtype,
            ms,
            True,
            dict(peak_extra_mb=peak / 2**20, saved_bytes_per_token=saved),
        )  # fmt: skip
    )
    return out


def time_mamba_ssm(shape, dtype):
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception:
        return []
    Bsz, T, Dn, N = shape
    inp = make_inputs(*shape, dtype, grad=False)
    # mamba_ssm layout: u, delta, z [B, D, T]; B, C [B, N, T]
    u, dl, z = (inp[k].transpose(1, 2).contiguous().requires_grad_() for k in ("u", "delta", "z"))
    Bm, Cm = (inp[k].transpose(1, 2).contiguous().requires_grad_() for k in ("B", "C"))
    A, D, db = (inp[k].clone().requires_grad_() for k in ("A", "D", "delta_bias"))
    args = (u, dl, A, Bm, Cm, D, z, db, True)
    out = []
    with torch.no_grad():
        ms = bench(lambda: selective_scan_fn(*args))
    out.append(record("forward (inference)", "mamba_ssm", shape, dtype, ms, False))
    gy = torch.randn(Bsz, Dn, T, device="cuda", dtype=dtype)
    ms = bench(lambda: selective_scan_fn(*args).backward(gy), grad_to_none=list(args[:8]))
    out.append(record("forward+backward", "mamba_ssm", shape, dtype, ms, True))
    return out


def time_reference(shape, dtype):
    from mambakit.ops import selective_scan

    inp = make_inputs(*shape, dtype)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        selective_scan(**inp, backend="reference")
        torch.cuda.synchronize()
        if time.perf_counter() - t0 > 5:
            return []
        ms = bench(lambda: selective_scan(**inp, backend="reference"))
    return [record("forward (inference)", "reference (PyTorch)", shape, dtype, ms, False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_scan.json", help="results record (JSON) path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_scan.py needs a CUDA device")
    dtype = torch.bfloat16
    shapes = [(8, 2048, 1536, 16), (1, 65536, 1536, 16)]
    records = []
    for i, shape in enumerate(shapes):
        records += time_ours(shape, dtype)
        records += time_mamba_ssm(shape, dtype)
        if i == 0:
            records += time_reference(shape, dtype)
    hdr = (
        f"{'shape':<18} {'impl':<20} {'workload':<23} {'ms':>8} {'GB/s':>7} {'bytes':>6} {'exp':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        s = r["shape"]
        shp = f"{s['batch']}x{s['seqlen']}x{s['d_inner']}x{s['d_state']}"
        print(
            f"{shp:<18} {r['impl']:<20} {r['workload']:<23} {r['time_ms']:8.3f} "
            f"{r['gb_per_s']:7.0f} {r['ratio_bytes']:6.2f} {r['ratio_exp']:6.2f}"
        )
    ours = [r for r in records if r["impl"] == "mambakit" and "peak_extra_mb" in r]
    for r in ours:
        print(f"peak extra memory fwd+bwd {r['peak_extra_mb']:.0f} MiB; "
              f"saved {r['saved_bytes_per_token']:.0f} B/token")  # fmt: skip
    roofline = {"copy_bytes_per_s": COPY_BPS, "exp2_per_s": EXP2_PER_S}
    write_record(args.out, "bench_scan", records, context=roofline)


if __name__ == "__main__":
    main()
