"""Where a cached prompt's prefill launch spends the host's time: bench_serve's shared-prefix
load (16 clients, 64 requests, every prompt the same 1,024 tokens and 16-64 of its own,
32 output tokens), the engine's launches timed one by one, then profiled (cProfile), then
run with CUDA's sync debug mode on (a launch that waits for the device shows where).

    python scripts/prefix_probe.py                       # 130m, random bf16 weights, CUDA
    python scripts/prefix_probe.py --cache off           # the same without the cache
    python scripts/prefix_probe.py --stand-in            # no CUDA: a cut-down model, graphs
                                                         # whose replay does nothing
    python scripts/prefix_probe.py --thread              # the loop on its own thread

On the H100 a cached launch (16 prompts) took 3.3 ms of host time, as long as its forward
took on the device, against 1.5 ms for an uncached one (bench_serve --timeline, 3d919f4);
0.9-1.6 ms at 2448f08, where the probe's cached TTFT was 5.2 ms and bench_serve's, with the
loop on its thread, 7.4.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_serve as bs  # noqa: E402

from mambakit import MambaConfig, MambaLM  # noqa: E402
from mambakit.serve import Engine  # noqa: E402


class _NoReplay:
    def replay(self) -> None:
        pass


def stand_in() -> None:
    """Graph captures on the CPU as stand-ins that run the call once and replay nothing."""
    import mambakit.inference.cuda_graph as cg
    from mambakit.serve import slots

    def capture(fn, warmup=2, pool=None, stream=None):
        return _NoReplay(), fn()

    cg.capture = slots.capture = capture
    torch.cuda.graph_pool_handle = lambda: None


def engine(model, cache: bool, graphs: bool) -> Engine:
    eng = Engine(model, max_batch=16, block_size=256, prefill_tokens=8192, max_queue=1 << 20,
                 cache_bytes=(1 << 30) if cache else 0, cuda_graph=graphs)  # fmt: skip
    if not graphs:  # the stand-in: the graph paths on the CPU, as on CUDA
        from mambakit.inference.cuda_graph import static_mode
        from mambakit.serve import slots
        from mambakit.serve.prefill_graphs import PrefillGraphs

        with static_mode():
            eng.pool = slots.SlotPool(model, 16, graphs=True)
            eng.prefill_graphs = PrefillGraphs(model, 256)
        eng.pool.refresh_plans = eng.prefill_graphs.refresh_plans = eng._refresh_plans
        eng.lookahead = eng.async_prefill = True
    eng.warmup()
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="130m")
    ap.add_argument("--cache", choices=["on", "off"], default="on")
    ap.add_argument("--stand-in", action="store_true", help="no CUDA: stand-in graphs")
    ap.add_argument("--lines", type=int, default=30)
    ap.add_argument("--sort", default="tottime", help="cProfile order: tottime or cumtime")
    ap.add_argument("--thread", action="store_true",
                    help="the engine's loop on a thread of its own, as bench_serve runs it "
                         "(the clients on this one)")  # fmt: skip
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.stand_in:
        stand_in()
        cfg = MambaConfig.preset(args.preset, d_model=64, vocab_size=512)
        model, vocab = MambaLM(cfg).eval(), 512
    else:
        cfg = MambaConfig.preset(args.preset)
        model = MambaLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
        vocab = cfg.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(1024)]
    eng = engine(model, args.cache == "on", graphs=not args.stand_in)
    if args.thread:
        eng.start()
    bs.run_engine(eng, bs.make_load(16, rng, (1, 64), (2, 4), vocab), 4)
    if eng.cache.enabled:  # as bench_serve: the first request runs whole, the second keeps
        bs.run_engine(eng, [(prefix + [1], 1)], 1)  # its block states
        bs.run_engine(eng, [(prefix + [2], 1)], 1)

    def load():
        return bs.make_load(64, rng, (16, 64), (32, 32), vocab, prefix)

    launch = eng._launch_prefill
    times: list[tuple[int, float]] = []

    def timed(fresh):
        t0 = time.perf_counter()
        out = launch(fresh)
        times.append((len(fresh), (time.perf_counter() - t0) * 1e3))
        return out

    eng._launch_prefill = timed
    res = bs.run_engine(eng, load(), 16)
    print(f"cache {args.cache}: TTFT p50 {res['ttft_p50_ms']:.2f} ms; launches (prompts, host ms): "
          + ", ".join(f"({n}, {ms:.2f})" for n, ms in times))  # fmt: skip

    prof = cProfile.Profile()

    def profiled(fresh):
        prof.enable()
        try:
            return launch(fresh)
        finally:
            prof.disable()

    eng._launch_prefill = profiled
    bs.run_engine(eng, load(), 16)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(args.sort).print_stats(args.lines)
    print("the launches' host time by function (cProfile):\n" + text.getvalue())

    if torch.cuda.is_available() and not args.stand_in:
        seen: list[str] = []

        def checked(fresh):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return launch(fresh)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                    seen.extend(f"{Path(w.filename).name}:{w.lineno}: "
                                + str(w.message).splitlines()[0] for w in caught)  # fmt: skip

        eng._launch_prefill = checked
        bs.run_engine(eng, load(), 16)
        print(f"synchronising calls inside the launches: {len(seen)}")
        for line in dict.fromkeys(seen):
            print("  " + line)
    eng.shutdown(timeout=60)


if __name__ == "__main__":
    main()
