"""What the host spends on an eager prefill (inference_mode, as bench_decode times it).

For each preset (bf16, random weights) and prompt length: wall time per call with the GPU
synchronised, and at a short prompt (GPU work negligible) the host's own time per call and
per layer; then the profiler's CPU table (self time per op and per launch API) of one call,
for mambakit and for mamba_ssm when importable.

    PYTHONPATH=src python scripts/prefill_host.py --presets 130m --lengths 64 4096 --out host.txt
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from decode_profile import peer_model  # scripts/: the peer LM, None when not importable
from host_overhead import per_call_us  # scripts/: host us per call, median of rounds
from torch.profiler import ProfilerActivity, profile

from mambakit import MambaConfig, MambaLM


def wall_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def cpu_table(fn, rows: int = 30) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def python_profile(fn, ids, rows: int = 40) -> str:
    """Python-level time per function (cProfile) over 5 calls: where the host's time goes
    inside the layers and Triton's launcher."""
    import cProfile
    import io
    import pstats

    fn(ids)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        fn(ids)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    return buf.getvalue()


def launch_cost() -> str:
    """Host us per launch of a trivial kernel with 32 scalar and 8 pointer arguments, through
    the JIT (`kernel[grid](...)`) and through the compiled kernel's own launcher."""
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(p0, p1, p2, p3, p4, p5, p6, p7, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10,
               i11, i12, i13, i14, i15, i16, i17, i18, i19, i20, i21, i22, i23, i24, i25, i26,
               i27, i28, i29, i30, i31, A: tl.constexpr, B: tl.constexpr):  # fmt: skip
        if tl.program_id(0) == 0:
            tl.store(p0, i0 + i31)

    x = torch.zeros(8, device="cuda", dtype=torch.int32)
    args = [x] * 8 + list(range(64, 96))
    compiled = _touch[(1,)](*args, A=True, B=4)
    launch = compiled[(1, 1, 1)]

    def per_call(fn, n=2000):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    jit = per_call(lambda: _touch[(1,)](*args, A=True, B=4))
    direct = per_call(lambda: launch(*args, True, 4))
    empty = per_call(lambda: torch.empty(64, device="cuda"))
    return (f"launch of a 40-argument kernel: JIT {jit:.1f} us, compiled launcher {direct:.1f} "
            f"us; torch.empty {empty:.1f} us")  # fmt: skip


def layer_pieces(model, T: int = 64) -> str:
    """Host us per call of each piece of one layer's eager inference forward at 1 x T (the
    GPU work is negligible there): the block, its norm and mixer, and the mixer's parts."""
    import torch.nn.functional as F

    from mambakit.ops import mamba_inner as inner_op
    from mambakit.ops.causal_conv1d import kernels as conv_k
    from mambakit.ops.mamba_inner.kernels import dt_proj
    from mambakit.ops.selective_scan import kernels as scan_k

    block = model.backbone.layers[0]
    mixer = block.mixer
    M, Dn, N = mixer.d_model, mixer.d_inner, mixer.d_state
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, T, M, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(1, T, M, device="cuda", generator=g)
    bf = torch.bfloat16
    with torch.inference_mode():
        normed, _ = block.norm(x, res, bf)
        xz = mixer.in_proj(normed)
        A, D, dt_bias = mixer._ssm_params()
        cw = mixer.conv1d.weight.squeeze(1)
        u, _ = conv_k.conv_fwd(xz[..., :Dn], cw, mixer.conv1d.bias, None, None, True, True)
        x_dbl = F.linear(u, mixer.x_proj.weight)
        delta, bc = dt_proj(x_dbl, mixer.dt_proj.weight, dt_bias, True)
        B, C = bc[..., :N], bc[..., N:]
    pieces = {
        "block (norm + mixer)": lambda: block(x, res, bf),
        "norm": lambda: block.norm(x, res, bf),
        "mixer": lambda: mixer(normed, return_state=True),
        "in_proj (module)": lambda: mixer.in_proj(normed),
        "F.linear in_proj": lambda: F.linear(normed, mixer.in_proj.weight),
        "_ssm_params": lambda: mixer._ssm_params(),
        "conv weight squeeze": lambda: mixer.conv1d.weight.squeeze(1),
        "mamba_inner": lambda: inner_op(
            xz,
            conv_weight=cw,
            conv_bias=mixer.conv1d.bias,
            x_proj_weight=mixer.x_proj.weight,
            dt_proj_weight=mixer.dt_proj.weight,
            A=A,
            D=D,
            dt_bias=dt_bias,
        ),
        "conv_fwd (launcher)": lambda: conv_k.conv_fwd(
            xz[..., :Dn], cw, mixer.conv1d.bias, None, None, True, True
        ),
        "F.linear x_proj": lambda: F.linear(u, mixer.x_proj.weight),
        "dt_proj (launcher)": lambda: dt_proj(x_dbl, mixer.dt_proj.weight, dt_bias, True),
        "scan_fwd (launcher)": lambda: scan_k.scan_fwd(
            u, delta, A, B, C, D, xz[..., Dn:], None, False, None, None, False
        ),
        "out_proj (module)": lambda: mixer.out_proj(u),
        "torch.empty": lambda: torch.empty(T, Dn, device="cuda"),
    }
    lines = [f"== host us per call, one 130m layer's pieces at 1x{T}, inference_mode"]
    with torch.inference_mode():
        for name, fn in pieces.items():
            lines.append(f"  {name:<26} {per_call_us(fn):8.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["130m"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--out")
    args = ap.parse_args()
    out = [launch_cost()]
    print(out[0], flush=True)
    for name in args.presets:
        cfg = MambaConfig.preset(name)
        torch.manual_seed(0)
        model = MambaLM(cfg, device="cuda").to(torch.bfloat16).eval()
        impls = {}

        def ours(ids, m=model):
            with torch.inference_mode():
                m.last_logits(ids)

        impls["mambakit"] = ours
        peer = peer_model(cfg, torch.bfloat16)
        if peer is not None:

            def theirs(ids, p=peer):
                with torch.inference_mode():
                    p(ids, num_last_tokens=1)

            impls["mamba_ssm"] = theirs
        for T in args.lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
            for impl, fn in impls.items():
                ms = wall_ms(lambda fn=fn, ids=ids: fn(ids))
                line = (f"{name} 1x{T} {impl}: {ms:.2f} ms per call, "
                        f"{ms * 1e3 / cfg.n_layers:.0f} us per layer")  # fmt: skip
                out.append(line)
                print(line, flush=True)
        out.append(layer_pieces(model))
        print(out[-1], flush=True)
        T = min(args.lengths)
        ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
        out.append(f"== {name} 1x{T} mambakit: cProfile of 5 calls\n" + python_profile(ours, ids))
        print(out[-1], flush=True)
        for impl, fn in impls.items():
            table = cpu_table(lambda f=fn, i=ids: f(i))
            out.append(f"== {name} 1x{T} {impl}: CPU profile\n" + table)
            print(out[-1], flush=True)
        del model, impls
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("\n\n".join(out) + "\n")


if __name__ == "__main__":
    main()
