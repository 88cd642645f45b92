"""The small float-input backbone's T=32 forward + backward on the CPU at each thread count:
what count the work wants, by mixer and batch (benchmarks/bench_rl.py's window).

    PYTHONPATH=src python scripts/rl_cpu_threads.py --threads 1 2 4 8 16 --batches 1 16 64

Each (mixer, batch) times every thread count in turn, `--passes` times over (the counts
interleaved, so a machine that slows in the middle slows them all), `--reps` windows a
timing; it prints the median per count (ms) and the count of the fastest. Each count is
torch's for the whole process (the compiled calls run numba on as many). `--profile N`
also prints the ops' self time of one batch-1 window at N threads."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rl_cpu_timing import MIXERS, window  # (scripts/: this script's folder)
from torch.profiler import profile

from mambakit.ops import cpu_jit

try:
    import numba
except ImportError:
    numba = None


def time_ms(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mixers", nargs="+", default=["mamba3", "mamba1"], choices=list(MIXERS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="windows a timing")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="ops' self time of a batch-1 window at N threads")  # fmt: skip
    args = ap.parse_args()
    start = torch.get_num_threads()
    jit = "numba " + numba.__version__ if numba and cpu_jit.available() else "off"
    print(f"torch threads at start {start}; counts {args.threads}; compiled CPU paths: {jit}")
    for mixer in args.mixers:
        for batch in args.batches:
            run = window(mixer, batch)
            counts = args.threads
            times: dict = {n: [] for n in counts}
            for n in counts:  # warm at each count (OpenMP's pool grows)
                torch.set_num_threads(n)
                time_ms(run, 3)
            for _ in range(args.passes):
                for n in counts:
                    torch.set_num_threads(n)
                    times[n].append(time_ms(run, args.reps))
            med = {n: statistics.median(v) for n, v in times.items()}
            best = min(args.threads, key=med.get)
            cells = "  ".join(f"{n}:{med[n]:7.2f}" for n in counts)
            print(f"{mixer:<7} batch {batch:<3} ms by threads  {cells}   fastest {best}")
        if args.profile:
            run = window(mixer, 1)
            torch.set_num_threads(args.profile)
            time_ms(run, 5)
            with profile() as prof:
                time_ms(run, 10)
            print(f"== {mixer} batch 1, {args.profile} threads, 10 windows")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    if numba is not None and cpu_jit.available():
        print(f"numba's threading layer: {numba.threading_layer()}")
    torch.set_num_threads(start)


if __name__ == "__main__":
    main()
