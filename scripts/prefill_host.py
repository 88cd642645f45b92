"""Where an eager prefill's host time goes: mambakit's 1 x T forward (f32 weights under bf16
autocast, as `benchmarks/bench_model.py` times it) beside mamba_ssm's, each timed eagerly,
replayed from a graph, by its host enqueue alone (the call without a sync: above the GPU
time, the forward is host-bound; behind a sleep kernel, the host's own work), and profiled
on the host (self CPU time per op, idle device and busy device).
`--mamba3-layer D` does the same for one Mamba-3 layer's forward + backward at `--shape`
(bf16, as `benchmarks/bench_mamba3.py` times it), beside upstream's with the same weights.

    python scripts/prefill_host.py --presets 130m 1.4b --length 4096
    python scripts/prefill_host.py --mamba3-layer 768 --shape 8x2048 --prune-peer
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_model import forward_fn  # noqa: E402 (the forward bench_model times)
from common import cuda_time_ms, graph_time_ms  # noqa: E402
from decode_profile import peer_model  # noqa: E402 (scripts/, this file's folder)

from mambakit import MambaConfig, MambaLM  # noqa: E402


def enqueue_ms(fn, iters: int = 5) -> float:
    """Median host time of fn() returning, the device idle before each call."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spins for about `ms` milliseconds."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm up the kernel
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def busy_enqueue_ms(fn, cycles: int, iters: int = 5) -> float:
    """Median host time of fn() returning while the device still runs a sleep kernel queued
    before it (about 30 ms): the host's own work, free of any wait on kernels in flight. A
    figure near the sleep's length means the call waited on the device (a sync, or a full
    launch queue); one near the idle enqueue means the host time is the host's."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def synced_ops(fn) -> str:
    """The ops of one call that synchronize with the device (torch's sync debug mode)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    found = sorted({str(w.message).splitlines()[0] for w in caught} - {""})
    # (the mode's own notice, given once a process when it is first turned on, is not a sync)
    found = [m for m in found if not m.startswith("Synchronization debug mode is a prototype")]
    return "; ".join(found) if found else "none"


def host_table(fn, rows: int, cycles: int = 0) -> str:
    """Self CPU time per op of one call; with `cycles`, the device busy with a sleep kernel
    queued before the call (so no op's time is a wait on the call's own kernels)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if cycles:
            torch.cuda._sleep(cycles)
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def python_table(fn, rows: int) -> str:
    """cProfile of one call: the Python functions (launchers, wrappers) by their own time,
    which the profiler's op table does not see."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    return buf.getvalue()


def report(name: str, model, ids, rows: int, python: bool = False, fn=None) -> list[str]:
    fn = fn or forward_fn(model, ids)
    eager = cuda_time_ms(fn, warmup=2, iters=5)
    host = enqueue_ms(fn)
    cycles = sleep_cycles(30.0)
    busy = busy_enqueue_ms(fn, cycles)
    syncs = synced_ops(fn)
    try:
        graph = graph_time_ms(fn)
    except Exception as e:  # an op that cannot be captured: the eager figures still stand
        print(f"{name}: no graph ({type(e).__name__}: {e})", flush=True)
        graph = float("nan")
    head = (
        f"== {name}: eager {eager:.2f} ms, host enqueue {host:.2f} ms (behind a 30 ms sleep "
        f"kernel {busy:.2f} ms), graph {graph:.2f} ms; syncing ops: {syncs}"
    )
    print(head, flush=True)
    tables = [host_table(fn, rows), "behind a 30 ms sleep kernel:\n" + host_table(fn, rows, cycles)]
    tables += [python_table(fn, rows)] if python else []
    for table in tables:
        print(table, flush=True)
    return [head, *tables]


def mamba3_layer(d_model: int, shape: str, rows: int, peer: bool, prune: bool) -> list[str]:
    """Host time of one Mamba-3 layer's forward + backward, ours and upstream's."""
    import bench_mamba3 as bm  # benchmarks/

    batch, seqlen = (int(v) for v in shape.lower().split("x"))
    if peer and prune and bm._upstream_module() is not None:
        bm.prune_upstream_autotune()
    layers = bm.layer_pair(d_model, peer)
    u = torch.randn(batch, seqlen, d_model, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)  # fmt: skip
    cot = torch.randn_like(u)
    out: list[str] = []
    for name, layer in layers.items():

        def fwd_bwd(layer=layer):
            layer(u).backward(cot)

        out += report(f"Mamba3 layer d{d_model} {shape} fwd+bwd {name}", layer, None, rows,
                      python=True, fn=fwd_bwd)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["130m", "1.4b"])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument(
        "--mamba3-layer",
        type=int,
        metavar="D_MODEL",
        help="a Mamba-3 layer's forward + backward instead of the presets",
    )
    ap.add_argument("--shape", default="8x2048", help="the layer's BATCHxSEQLEN")
    ap.add_argument("--prune-peer", action="store_true", help="one config per upstream kernel")
    ap.add_argument("--out")
    args = ap.parse_args()
    out: list[str] = []
    if args.mamba3_layer:
        out = mamba3_layer(args.mamba3_layer, args.shape, args.rows, not args.no_peer,
                           args.prune_peer)  # fmt: skip
        args.presets = []
    for preset in args.presets:
        cfg = MambaConfig.preset(preset)
        torch.manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (1, args.length), device="cuda")
        model = MambaLM(cfg, device="cuda")
        out += report(f"{preset} mambakit 1x{args.length}", model, ids, args.rows, True)
        del model
        torch.cuda.empty_cache()
        peer = None if args.no_peer else peer_model(cfg, torch.float32)
        if peer is not None:
            out += report(f"{preset} mamba_ssm 1x{args.length}", peer, ids, args.rows)
            del peer
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("\n\n".join(out) + "\n")


if __name__ == "__main__":
    main()
