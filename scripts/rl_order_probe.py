"""Does what ran before a model's step move its time? benchmarks/bench_rl.py times the
Mamba-2 and Mamba-3 steps after the Mamba-1 model's training windows (eager, then captured
whole by `WindowStep`); scripts/rl_step_profile.py times them in a fresh process. Here, in
one process, each point a new model timed as bench_rl times its step (the earlier models
still alive): fresh, again, after another model's training windows (at one batch), after
`gc.collect()` and with Python's garbage collector off, with the collector's counts and
the number of objects it tracks at each point.

    python scripts/rl_order_probe.py --mixer mamba3 --before mamba1
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_rl  # noqa: E402

from mambakit import MambaBackbone  # noqa: E402


def step_us(mixer: str, device, args) -> tuple[float, object]:
    torch.manual_seed(0)
    model = MambaBackbone(bench_rl.make_config(mixer), device=device)
    row = bench_rl.bench_step(model, mixer, 1, device, args)
    return row["median_us"], model


def heap() -> str:
    return f"gc counts {gc.get_count()}, tracked objects {len(gc.get_objects()):,}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mixer", default="mamba3", choices=list(bench_rl.MIXERS))
    ap.add_argument("--before", default="mamba1", choices=list(bench_rl.MIXERS))
    ap.add_argument("--batch", type=int, default=16, help="the training windows' batch")
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = SimpleNamespace(rounds=2 if a.dry else 7, round_s=0.005 if a.dry else 0.25,
                           warmup=50, warmup_windows=1 if a.dry else 5, dry=a.dry)  # fmt: skip
    fresh, _ = step_us(a.mixer, device, args)
    print(f"{a.mixer} step, fresh process: {fresh:.1f} us; {heap()}", flush=True)
    again, model = step_us(a.mixer, device, args)
    print(f"{a.mixer} step, a second model: {again:.1f} us; {heap()}", flush=True)
    del model
    torch.manual_seed(0)
    other = MambaBackbone(bench_rl.make_config(a.before), device=device)
    benches = [bench_rl.bench_step, bench_rl.bench_window, bench_rl.bench_fwd_bwd]
    if device.type == "cuda" or a.dry:
        benches.append(bench_rl.bench_window_graphed)
    for bench in benches:
        row = bench(other, a.before, a.batch, device, args)
        print(f"  {a.before} {row['workload']} batch {a.batch} ran", flush=True)
    del other
    if device.type == "cuda":
        torch.cuda.empty_cache()
    after, model = step_us(a.mixer, device, args)
    print(f"{a.mixer} step, after {a.before}'s windows: {after:.1f} us; {heap()}", flush=True)
    gc.collect()
    collected, _ = step_us(a.mixer, device, args)
    print(f"{a.mixer} step, after gc.collect(): {collected:.1f} us; {heap()}", flush=True)
    gc.disable()
    off, _ = step_us(a.mixer, device, args)
    gc.enable()
    print(f"{a.mixer} step, collector off: {off:.1f} us; {heap()}", flush=True)


if __name__ == "__main__":
    main()
