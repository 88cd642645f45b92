"""Shared helpers of the benchmark programs: timing, the matmul ceiling, tables, and the
results record every program writes with `--out`.

A results record is one JSON object (`make_record`):

    schema     "mambakit-benchmark/1"
    benchmark  the program's name ("bench_decode", ...)
    date       UTC, ISO 8601 ("2026-12-03T17:40:12Z")
    commit     `git rev-parse --short HEAD` of this checkout, else $MAMBAKIT_COMMIT, else
               "unknown" (a device that runs a copy of the tree without .git)
    dirty      tracked files differ from the commit (git status), else $MAMBAKIT_DIRTY
               ("1" / "0"), else null
    device     {"name": GPU name or "cpu", "torch", "triton", "cuda", ...}
    peer       {"mamba_ssm": version or null, "causal_conv1d": ..., ...}, null when none
               is importable
    command    the command line that ran
    context    what the program measured under (matmul rate, roofline constants, ...)
    figures    the rows the program printed, one dict per figure

benchmarks/table.py turns the records under benchmarks/results/ into docs/performance.md.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

RECORD_SCHEMA = "mambakit-benchmark/1"
PEERS = ("mamba_ssm", "causal_conv1d")  # the libraries the benchmarks time beside mambakit
REPO = Path(__file__).resolve().parents[1]


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


def layer_rows(label: str, layers: dict, u: torch.Tensor, iters: int) -> list[dict]:
    """Records of each layer's forward (no autograd) and forward + backward on u, the
    layers ({impl: module}, "mambakit" first, the same weights) taking turns (median of
    rounds: a peer's wall time is bound by its host and moves with it, so a slow spell
    falls on every side alike), with what one call holds beyond the inputs and weights
    (saved activations, transients) as peak_extra_mib. `label`: "Mamba2 layer" ...;
    workloads read "<label> forward BxT"."""
    ug = u.clone().requires_grad_(True)
    cot = torch.randn_like(u)
    fns = {}
    for name, layer in layers.items():

        def fwd(layer=layer):
            with torch.no_grad():
                layer(u)

        def fwd_bwd(layer=layer):
            layer(ug).backward(cot)

        fns[name] = {"forward": fwd, "forward+backward": fwd_bwd}
    shape = f"{u.shape[0]}x{u.shape[1]}"
    rows = []
    for what in ("forward", "forward+backward"):
        ms = interleaved_median_ms({name: f[what] for name, f in fns.items()}, warmup=3,
                                   rounds=max(5, iters), iters=2)  # fmt: skip
        for name, f in fns.items():
            rec = {"workload": f"{label} {what} {shape}", "impl": name, "ms": ms[name]}
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            f[what]()
            torch.cuda.synchronize()
            rec["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20)
            if name != "mambakit":
                rec["mambakit_speedup"] = ms[name] / ms["mambakit"]
            rows.append(rec)
            print(rec, flush=True)
    return rows


def profile_fwd_bwd(layer, u: torch.Tensor, path: str) -> None:
    """The per-kernel GPU time table of one forward + backward of `layer` on u, to path."""
    from torch.profiler import ProfilerActivity, profile

    u = u.clone().requires_grad_(True)
    for _ in range(2):
        layer(u).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(u).sum().backward()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=70
    )
    Path(path).write_text(table)
    print(table)


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


def _git(root: Path, *args: str) -> list[str] | None:
    """Lines of `git args` run in root, or None where git is missing or fails."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=20, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()


def source_state(root: Path = REPO) -> tuple[str, bool | None]:
    """(commit, dirty) of the checkout at root: from git when root is the top of a git work
    tree, else from $MAMBAKIT_COMMIT and $MAMBAKIT_DIRTY, else ("unknown", None)."""
    lines = _git(root, "rev-parse", "--show-toplevel", "--short", "HEAD")
    if lines and len(lines) == 2 and Path(lines[0]).resolve() == Path(root).resolve():
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        return lines[1], None if status is None else bool(status)
    dirty = {"1": True, "0": False}.get(os.environ.get("MAMBAKIT_DIRTY", ""))
    return os.environ.get("MAMBAKIT_COMMIT") or "unknown", dirty


def device_info(device: str | torch.device | None = None) -> dict:
    """The device the figures come from and the versions that ran on it. `device` defaults
    to CUDA when present, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {"name": "cpu", "torch": torch.__version__, "triton": triton_version, "cuda": None}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        info.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    capability=f"{major}.{minor}")  # fmt: skip
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def peer_versions(names: tuple[str, ...] = PEERS) -> dict | None:
    """{name: version or None (not importable)} of the peer libraries; None if none is."""
    versions = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # absent, or present but broken (a missing CUDA extension)
            versions[name] = None
            continue
        version = getattr(module, "__version__", None)
        if version is None:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = "unknown"
        versions[name] = str(version)
    return versions if any(v is not None for v in versions.values()) else None


def command_line() -> str:
    """The command that is running, the program's path relative to the repository."""
    argv = list(sys.argv)
    if argv and argv[0]:
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(REPO))
        except ValueError:
            pass
    return shlex.join(["python", *argv])


def make_record(
    benchmark: str,
    figures: list[dict],
    context: dict | None = None,
    device: str | torch.device | None = None,
    peers: tuple[str, ...] = PEERS,
) -> dict:
    """One self-describing results record (the module docstring lists its fields)."""
    commit, dirty = source_state()
    return {
        "schema": RECORD_SCHEMA,
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit,
        "dirty": dirty,
        "device": device_info(device),
        "peer": peer_versions(peers),
        "command": command_line(),
        "context": context or {},
        "figures": figures,
    }


def write_record(path: str | None, benchmark: str, figures: list[dict], **kw) -> None:
    """make_record(benchmark, figures, **kw) as JSON at path (nothing when path is empty)."""
    if not path:
        return
    record = make_record(benchmark, figures, **kw)
    Path(path).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {path}")
