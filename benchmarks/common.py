"""Shared helpers of the benchmark programs: timing, the matmul ceiling, tables and JSON."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch


def cuda_time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Mean wall time of fn() on the GPU, in ms (CUDA events around `iters` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def interleaved_median_ms(fns: dict, warmup: int = 2, rounds: int = 15, iters: int = 2) -> dict:
    """{name: median over `rounds` of cuda_time_ms(fn, iters)}, the functions taking turns
    round by round: a slow spell of the shared host (it moves an eager 130m prefill 1.5x
    between runs) then falls on every function alike instead of on whichever ran during it."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(cuda_time_ms(fn, warmup=0, iters=iters))
    return {name: statistics.median(t) for name, t in times.items()}


def cpu_time_ms(fn, warmup: int = 1, iters: int = 3) -> float:
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def capture_graph(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after `warmup` calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time_ms(fn, iters: int = 20) -> float:
    """GPU time of fn() captured once in a CUDA graph and replayed (no launch overhead)."""
    return cuda_time_ms(capture_graph(fn).replay, warmup=3, iters=iters)


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """The bf16 matmul rate of this GPU on random data, measured now (TFLOP/s)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = cuda_time_ms(lambda: a @ b, warmup=3, iters=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_tbps(n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate (bytes read + written per second), TB/s."""
    x = torch.empty(n_bytes // 2, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time_ms(lambda: y.copy_(x), warmup=3, iters=10)
    return n_bytes / (ms * 1e-3) / 1e12


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str | None, records: list[dict], meta: dict | None = None) -> None:
    if not path:
        return
    out = {"meta": meta or {}, "records": records}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


def device_meta() -> dict:
    meta = {"torch": torch.__version__}
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta
