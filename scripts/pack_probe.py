# ruff: noqa: B023 (each lambda is timed inside its own iteration)
"""Packed prefill forwards (rows of prompts end to end) against whole prompts padded into
rows, on the device: the forwards (captured; timed as a caller sees them, and the device's
own time, `timed(device=True)`), the scan alone with and without `states_at`, at 130m. Prints
milliseconds; `--profile`: also the kernels of one whole and one packed forward of the same
rows (eager, the profiler's table of each), where their times part."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mambakit import MambaConfig, MambaLM  # noqa: E402
from mambakit.ops import selective_scan  # noqa: E402
from mambakit.serve.prefill_graphs import PrefillGraphs  # noqa: E402


def timed(fn, reps: int = 20, device: bool = False) -> float:
    """Median ms of `fn` between CUDA events. `device`: the device's own time of its
    work: the stream first held by a sleep kernel long enough for the host to enqueue all
    of `fn` behind it, so the events' span is the kernels back to back, none of the host's
    time (without it the span includes the host's work before the first kernel, a packed
    forward's rows built on the host among it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if device:
            torch.cuda._sleep(50_000_000)  # tens of ms at the clock rates of an H100 or H200
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="130m")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default="8x2048", help="ROWSxN: the kernel tables of one "
                    "whole and one packed forward of these rows ('' for none)")  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = MambaLM(MambaConfig.preset(args.preset)).to(dev, torch.bfloat16).eval()
    graphs = PrefillGraphs(model, 256)
    res = {}
    with torch.no_grad():
        for rows, n in ((8, 2048), (2, 2048), (16, 256), (1, 1024)):
            prompts = [[1] * n] * rows
            res[f"whole {rows}x{n}"] = timed(lambda: graphs.run_whole(prompts, dev))
            res[f"whole {rows}x{n}, device"] = timed(
                lambda: graphs.run_whole(prompts, dev), device=True
            )
            packed = [[p] for p in prompts]  # a prompt a row: the same tokens, packed
            steps = [[[n - 1]]] * rows
            keep = [(b, 0) for b in range(rows)]
            graphs.pack_tokens = max(graphs.pack_tokens, rows * n)
            res[f"packed {rows}x{n}"] = timed(
                lambda: graphs.run_packed(packed, steps, [None] * rows, keep, dev)
            )
            res[f"packed {rows}x{n}, device"] = timed(
                lambda: graphs.run_packed(packed, steps, [None] * rows, keep, dev), device=True
            )
            half = [[[1] * (n // 2)] * 2] * rows  # two prompts a row
            steps2 = [[[n // 2 - 1]] * 2] * rows
            res[f"packed {rows}x{n}, 2 prompts a row"] = timed(
                lambda: graphs.run_packed(half, steps2, [None] * rows, keep, dev)
            )
            ids = torch.ones(rows, n, dtype=torch.int64, device=dev)
            seq = torch.zeros(rows, n, dtype=torch.int32, device=dev)
            pos = torch.arange(graphs.slots, device=dev).expand(rows, -1).contiguous()
            res[f"eager states_at {rows}x{n}"] = timed(
                lambda: model._states_at(ids, pos, None, seq)
            )
            res[f"eager last_logits {rows}x{n}"] = timed(lambda: model.last_logits(ids, None, seq))
        D, N = 1536, 16
        for Bsz, T in ((8, 2048), (1, 16384)):
            u = torch.randn(Bsz, T, D, device=dev, dtype=torch.bfloat16)
            dt = torch.rand(Bsz, T, D, device=dev)
            A = -torch.rand(D, N, device=dev)
            Bm = torch.randn(Bsz, T, N, device=dev, dtype=torch.bfloat16)
            C = torch.randn_like(Bm)
            dt = dt.to(torch.bfloat16)
            pos = torch.randperm(T, device=dev)[:128].view(1, 128).expand(Bsz, 128).contiguous()
            res[f"scan {Bsz}x{T}"] = timed(lambda: selective_scan(u, dt, A, Bm, C))
            res[f"scan {Bsz}x{T} states_at 128"] = timed(
                lambda: selective_scan(u, dt, A, Bm, C, states_at=pos)
            )
    for k, v in res.items():
        print(f"{k:40s} {v:8.3f} ms")
    if args.profile:
        profile_tables(model, *map(int, args.profile.split("x")), dev)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


def profile_tables(model, rows: int, n: int, dev) -> None:
    """The profiler's kernel tables of an eager whole forward (`last_logits`, left filler
    marked by seq_idx) and an eager packed one (`_states_at`, a prompt a row, every row's
    PACK_SLOTS steps kept) of the same rows x n tokens."""
    from torch.profiler import ProfilerActivity, profile

    from mambakit.serve.prefill import PACK_SLOTS

    ids = torch.ones(rows, n, dtype=torch.int64, device=dev)
    seq = torch.zeros(rows, n, dtype=torch.int32, device=dev)
    pos = torch.arange(n - PACK_SLOTS, n, device=dev).expand(rows, -1).contiguous()
    runs = {"whole (last_logits)": lambda: model.last_logits(ids, None, seq),
            "packed (_states_at)": lambda: model._states_at(ids, pos, None, seq)}  # fmt: skip
    with torch.no_grad():
        for name, fn in runs.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            print(f"== {name} {rows}x{n}, 5 forwards")
            print(
                prof.key_averages().table(
                    sort_by="self_device_time_total", row_limit=25, max_name_column_width=70
                )
            )


if __name__ == "__main__":
    main()
