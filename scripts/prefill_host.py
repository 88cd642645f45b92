"""Where an eager prefill's host time goes: mambakit's 1 x T forward (f32 weights under bf16
autocast, as `benchmarks/bench_model.py` times it) beside mamba_ssm's, each timed eagerly,
replayed from a graph, by its host enqueue alone (the call without a sync: above the GPU
time, the forward is host-bound), and profiled on the host (self CPU time per op).

    python scripts/prefill_host.py --presets 130m 1.4b --length 4096
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


def host_table(fn, rows: int) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
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


def report(name: str, model, ids, rows: int, python: bool = False) -> list[str]:
    fn = forward_fn(model, ids)
    eager = cuda_time_ms(fn, warmup=2, iters=5)
    host = enqueue_ms(fn)
    graph = graph_time_ms(fn)
    head = f"== {name}: eager {eager:.2f} ms, host enqueue {host:.2f} ms, graph {graph:.2f} ms"
    print(head, flush=True)
    tables = [host_table(fn, rows)] + ([python_table(fn, rows)] if python else [])
    for table in tables:
        print(table, flush=True)
    return [head, *tables]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["130m", "1.4b"])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    out: list[str] = []
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
