"""Per-kernel GPU time of the small float-input backbone's step (replayed from the library's
CUDA graph) and of its eager step, by batch: what bounds benchmarks/bench_rl.py's step."""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mambakit import MambaBackbone, MambaConfig
from mambakit.inference.step_graph import _tables
from mambakit.ops import _triton
from mambakit.ops.mamba_step import launch

MIXERS = {"mamba1": {}, "mamba2": dict(headdim=32), "mamba3": dict(headdim=16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mixers", nargs="+", default=["mamba1"], choices=list(MIXERS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--calls", type=int, default=3000, help="calls timed by the host split")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without programmatic dependent launch")  # fmt: skip
    ap.add_argument(
        "--rows-max",
        type=int,
        default=None,
        help="StepConfig.rows_max_batch: up to this batch the projections stream "
        "through the step's kernels (above, cuBLAS)",
    )
    ap.add_argument("--no-profile", action="store_true", help="the host split alone")
    args = ap.parse_args()
    if args.no_pdl:
        _triton.USE_PDL = False
    if args.rows_max is not None:
        launch._GPU = dataclasses.replace(launch._GPU, rows_max_batch=args.rows_max)
    print(f"== pdl {_triton.USE_PDL}, rows_max_batch {launch._GPU.rows_max_batch}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for mixer in args.mixers:
        cfg = MambaConfig(d_model=128, n_layers=3, input_dim=64, mixer=mixer, **MIXERS[mixer])
        model = MambaBackbone(cfg).to(dev)
        for B in args.batches:
            state, x = model.init_state(B), torch.randn(B, 64, device=dev)
            with torch.no_grad():
                for _ in range(5):
                    model.step(x, state)
                for graph in () if args.no_profile else (True, False):
                    acts = [ProfilerActivity.CPU] + (
                        [ProfilerActivity.CUDA] if dev == "cuda" else []
                    )
                    with profile(activities=acts) as prof:
                        for _ in range(10):
                            model.step(x, state, cuda_graph="auto" if graph else False)
                        if dev == "cuda":
                            torch.cuda.synchronize()
                    key = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
                    print(f"== {mixer} batch {B} {'graph' if graph else 'eager'} (10 steps)")
                    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
                if dev == "cuda":
                    host_split(model, x, state, args.calls)


def per_call_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def host_split(model, x, state, n: int) -> None:
    """Where a replayed step's wall time goes: the whole `step`, the graph's replay alone
    (its GPU time where the launch is shorter), and the step's Python around the replay."""
    entry = next(reversed(_tables(model).graphs.values()), None)  # the one just used
    if entry is None:
        print("no graph captured")
        return
    whole = per_call_us(lambda: model.step(x, state), n)
    replay = per_call_us(entry.graph.replay, n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        entry.graph.replay()
    end.record()
    end.synchronize()
    gpu = start.elapsed_time(end) * 1e3 / n
    print(
        f"host split: step {whole:.1f} us/call, replay loop {replay:.1f} us/call "
        f"(events {gpu:.1f}), so about {whole - replay:.1f} us of Python and copies"
    )


if __name__ == "__main__":
    main()
