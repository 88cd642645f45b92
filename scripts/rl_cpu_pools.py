"""The batch-1 T=32 window on a many-core CPU with torch's and numba's thread counts set
apart (torch x numba), and torch's own small matrix product alone at each count: which
pool's threads cost the time when both run in one process.

    PYTHONPATH=src python scripts/rl_cpu_pools.py --torch 16 4 1 --numba 16 4 1"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from rl_cpu_timing import step_us, window  # (scripts/: this script's folder)

from mambakit.ops.mamba3 import layers_compiled


def ms(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--torch", type=int, nargs="+", default=[16, 4, 1])
    ap.add_argument("--numba", type=int, nargs="+", default=[16, 4, 1])
    ap.add_argument("--mixers", nargs="+", default=["mamba3"])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--numba-spin", default=None, metavar="N|passive",
                    help="how long numba's OpenMP pool spins after its regions before it "
                    "sleeps (GOMP_SPINCOUNT, or OMP_WAIT_POLICY=PASSIVE), set after torch's "
                    "libgomp read the environment, before numba's loads")  # fmt: skip
    ap.add_argument("--steps", action="store_true", help="also the batch-1 step (us)")
    args = ap.parse_args()
    if args.numba_spin == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    elif args.numba_spin not in (None, "default"):
        os.environ["GOMP_SPINCOUNT"] = args.numba_spin
    tag = f"numba spin {args.numba_spin or 'default'}: "
    x, w = torch.randn(32, 128), torch.randn(384, 128)
    for t in args.torch:
        torch.set_num_threads(t)
        for _ in range(200):
            torch.nn.functional.linear(x, w)
        us = statistics.median(ms(lambda: torch.nn.functional.linear(x, w), 500) * 1e3
                               for _ in range(5))  # fmt: skip
        print(f"{tag}linear 32x128 @ 128x384 alone, torch {t:2d} threads: {us:7.1f} us", flush=True)
    for mixer in args.mixers:
        run = window(mixer)
        grid = [(t, n) for t in args.torch for n in args.numba if n <= t]
        times: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
        for _ in range(args.passes):
            for t, n in grid:
                torch.set_num_threads(t)
                layers_compiled.ROWS_PER_THREAD = -(-32 // n)  # the cap: n threads at 32 rows
                for _ in range(2):
                    run()
                times[(t, n)].append(ms(run, args.reps))
        if args.steps:
            torch.set_num_threads(args.torch[0])
            layers_compiled.ROWS_PER_THREAD = 8
            us = statistics.median(step_us(mixer))
            print(f"{tag}{mixer} batch 1 step, torch {args.torch[0]} threads: {us:6.1f} us")
        for t, n in grid:
            print(f"{tag}{mixer} batch 1 window: torch {t:2d} numba {n:2d}: "
                  f"{statistics.median(times[(t, n)]):6.2f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
