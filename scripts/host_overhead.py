"""The host's cost of the eager training step, apart from the GPU's: where launch overhead goes.

At a tiny shape (130m layers, batch 1 x 64) the GPU work of a step is small, so the step's
time is what the host needs to issue it. Prints, for mambakit's eager Trainer step and
mamba_ssm's (when importable) at that shape, the time per step; then, at the training shape
(8 x 2048), each op's host enqueue time through the custom-op dispatcher and straight to
its launcher beside its GPU time; then bench_model's host profile of one mambakit step.

    PYTHONPATH=src python scripts/host_overhead.py --out host.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_model import host_profile, measure_peer_step, trainer_for  # noqa: E402

from mambakit import MambaConfig  # noqa: E402


def per_call_us(fn, n: int = 300) -> float:
    """Host time per call with the GPU never the limit (tiny work), median of 5 rounds."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(rounds)[2]


def enqueue_us(fn, n: int = 15) -> float:
    """Host time of one call that starts on an idle GPU (its launches only queue), median."""
    fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[n // 2]


def gpu_us(fn) -> float:
    """GPU time of one call, replayed from a CUDA graph (no host in the way)."""
    from common import graph_time_ms

    return graph_time_ms(fn) * 1e3


def op_costs(B: int = 8, T: int = 2048, dev: str = "cuda") -> list[str]:
    """Host enqueue time against GPU time of the mixer's ops at the training shape."""
    import mambakit.ops.mamba_inner as inner
    from mambakit.layers.mixer import Mamba
    from mambakit.ops import selective_scan
    from mambakit.ops.causal_conv1d.kernels import conv_bwd, conv_fwd
    from mambakit.ops.selective_scan import kernels as K

    bf = torch.bfloat16
    torch.manual_seed(0)
    mixer = Mamba(768, device=dev)
    D, N, R = mixer.d_inner, mixer.d_state, mixer.dt_rank

    def rn(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    xz = rn(B, T, 2 * D)
    x_in, z = xz[..., :D], xz[..., D:]
    cw = mixer.conv1d.weight.detach().squeeze(1)
    cb = mixer.conv1d.bias.detach()
    u, _ = conv_fwd(x_in, cw, cb, None, None, True, False)
    x_dbl = rn(B, T, R + 2 * N)
    Bm, Cm = x_dbl[..., R : R + N], x_dbl[..., R + N :]
    delta = rn(B, T, D, scale=0.1)
    A = -torch.exp(mixer.A_log.detach())
    Dv = mixer.D.detach()
    db = mixer.dt_proj.bias.detach()
    gy = rn(B, T, D)
    sargs = (u, delta, A, Bm, Cm, Dv, z, db, True, None, None)
    _, _, states = K.scan_fwd(*sargs, True)
    iargs = (
        gy, None, None, xz, x_dbl, cw, cb, mixer.x_proj.weight.detach(),
        mixer.dt_proj.weight.detach(), A, Dv, db, None, None, None, states,
    )  # fmt: skip
    leaves = [t.detach().clone().requires_grad_() for t in (u, delta, Bm, Cm, z)]

    def scan_fwd_bwd():
        ug, dg, bg, cg, zg = leaves
        selective_scan(ug, dg, A, bg, cg, Dv, zg, db, delta_softplus=True).backward(gy)
        for t in leaves:
            t.grad = None

    xm = rn(B, T, 768, dtype=torch.float32).requires_grad_()
    gm = rn(B, T, 768)

    def mixer_fwd_bwd():
        with torch.autocast(dev, dtype=bf):
            out = mixer(xm)
        out.backward(gm)
        xm.grad = None
        for p in mixer.parameters():
            p.grad = None

    rows = {
        "torch.add (aten baseline)": lambda: torch.add(xz, xz),
        "conv fwd: launcher": lambda: conv_fwd(x_in, cw, cb, None, None, True, False),
        "conv fwd: torch.ops": lambda: torch.ops.mambakit.causal_conv1d_fwd(
            x_in, cw, cb, None, None, True, False
        ),
        "conv bwd: launcher": lambda: conv_bwd(gy, None, x_in, cw, cb, None, None, True),
        "scan fwd (saves states): launcher": lambda: K.scan_fwd(*sargs, True),
        "scan fwd (saves states): torch.ops": lambda: torch.ops.mambakit.selective_scan_fwd(
            *sargs, True
        ),
        "scan bwd: launcher": lambda: K.scan_bwd(gy, None, *sargs, states),
        "mamba_inner_bwd: its Python body": lambda: inner._inner_bwd._init_fn(*iargs),
        "mamba_inner_bwd: torch.ops": lambda: torch.ops.mambakit.mamba_inner_bwd(*iargs),
        "scan: public forward + backward": scan_fwd_bwd,
        "mixer (130m layer): forward + backward": mixer_fwd_bwd,
    }
    out = [f"{'op at ' + f'{B}x{T}':44s} {'host us':>9s} {'gpu us':>9s}"]
    for name, fn in rows.items():
        try:
            h = enqueue_us(fn)
            try:
                gt = f"{gpu_us(fn):9.1f}"
            except Exception as e:  # not capturable: say so
                gt = f"n/a ({type(e).__name__})"
            out.append(f"{name:44s} {h:9.1f} {gt}")
        except Exception as e:  # report, keep going
            out.append(f"{name:44s} failed: {type(e).__name__}: {str(e)[:200]}")
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = MambaConfig.preset("130m")
    b, t = args.batch, args.seqlen
    lines = [f"130m, batch {b} x {t}: host-bound step times (ms, synchronised per step)"]
    trainer = trainer_for(cfg, b, t, cuda_graph=False)
    ms = per_call_us(trainer.train_step, n=20) / 1e3
    lines.append(f"mambakit Trainer eager step  {ms:8.2f} ms")
    peer = measure_peer_step(cfg, b, t)
    if peer is not None:
        lines.append(f"mamba_ssm eager step         {per_call_us(peer, n=20) / 1e3:8.2f} ms")
    print("\n".join(lines), flush=True)
    lines.append("")
    lines.extend(op_costs())

    text = "\n".join(lines) + "\n\n" + host_profile(trainer)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
