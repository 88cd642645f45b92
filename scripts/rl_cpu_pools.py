"""The batch-1 T=32 window on a many-core CPU with torch's and numba's thread counts set
apart (torch x numba; the library always runs numba at torch's count), and torch's own
small matrix product alone at each count: what a numba team smaller than torch's costs,
and which libgomp copies the process loaded (one, shared by torch and numba's OpenMP
layer, or two).

    PYTHONPATH=src python scripts/rl_cpu_pools.py --torch 16 4 1 --numba 16 4 1

`--numba-spin` sets how long numba's pool spins after its regions (GOMP_SPINCOUNT, or
OMP_WAIT_POLICY=PASSIVE) after torch's libgomp read the environment and before numba's
loads: it acts only where the two are separate copies."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager

import numba
import torch
from rl_cpu_timing import step_us, window  # (scripts/: this script's folder)

from mambakit.ops.cpu_jit import common, rmsnorm, scan, scan3, terms3


def ms(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


@contextmanager
def numba_at(n: int):
    """The compiled calls on n numba threads whatever torch's count (`common.threads`
    replaced where the compiled modules call it)."""

    @contextmanager
    def threads():
        t = torch.get_num_threads()
        with common._LOCK:
            if numba.get_num_threads() != min(n, numba.config.NUMBA_NUM_THREADS):
                numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
            try:
                yield
            finally:
                if torch.get_num_threads() != t:
                    torch.set_num_threads(t)

    mods = (common, rmsnorm, scan, scan3, terms3)
    saved = [m.threads for m in mods]
    for m in mods:
        m.threads = threads
    try:
        yield
    finally:
        for m, f in zip(mods, saved):
            m.threads = f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--torch", type=int, nargs="+", default=[16, 4, 1])
    ap.add_argument("--numba", type=int, nargs="+", default=[16, 4, 1])
    ap.add_argument("--mixers", nargs="+", default=["mamba3"])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--numba-spin", default=None, metavar="N|passive")
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
        run()  # numba's threading layer loads: its libgomp is in the maps below
        if args.steps:
            torch.set_num_threads(args.torch[0])
            us = statistics.median(step_us(mixer))
            print(f"{tag}{mixer} batch 1 step, torch {args.torch[0]} threads: {us:6.1f} us")
        most = numba.config.NUMBA_NUM_THREADS
        grid = [(t, n) for t in args.torch for n in args.numba if n <= t and n <= most]
        times: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
        for _ in range(args.passes):
            for t, n in grid:
                torch.set_num_threads(t)
                with numba_at(n):
                    for _ in range(2):
                        run()
                    times[(t, n)].append(ms(run, args.reps))
        for t, n in grid:
            print(f"{tag}{mixer} batch 1 window: torch {t:2d} numba {n:2d}: "
                  f"{statistics.median(times[(t, n)]):6.2f} ms", flush=True)  # fmt: skip
    gomp = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    print(f"{tag}numba's layer {numba.threading_layer()}; libgomp copies loaded: {sorted(gomp)}")


if __name__ == "__main__":
    main()
