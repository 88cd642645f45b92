"""Per-kernel GPU time of the small float-input backbone's step (replayed from the library's
CUDA graph) and of its eager step, by batch: what bounds benchmarks/bench_rl.py's step.

`--stand-in` (on a machine without CUDA) times the Python a replayed step runs around its
CUDA calls: the graph is a stand-in whose replay does nothing, so `step` per call is the
key, the checks, the input copy and the output clone (on the CPU) alone. `--pieces` times
each piece of a replayed step alone and (on CUDA) checks that a step never synchronises
with the device. On CUDA each batch also runs bench_rl's step loop (wall against host
time, the slots or the spare's clones); `--built both` builds each model both ways (moved
to the device, or on it as bench_rl does), to tell apart what differs between the two
scripts' figures."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from mambakit import MambaBackbone, MambaConfig
from mambakit.inference import step_graph as sg
from mambakit.inference import step_graph_status
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
        help="StepConfig.rows_max_batch (and _f32): up to this batch the projections stream "
        "through the step's kernels (above, cuBLAS)",
    )
    ap.add_argument("--no-profile", action="store_true", help="the host split alone")
    ap.add_argument("--pieces", action="store_true",
                    help="also each piece of a replayed step timed alone, and whether a step "
                         "synchronises with the device")  # fmt: skip
    ap.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                    help="cProfile this many replayed steps: host time by function")  # fmt: skip
    ap.add_argument("--built", choices=["to", "on", "both"], default="to",
                    help="the model built on the CPU and moved (.to), built on the device as "
                         "bench_rl builds it (device=, seed 0), or each in turn")  # fmt: skip
    ap.add_argument("--bench-rl", action="store_true",
                    help="on CUDA, also bench_rl's own step benchmark on the same model, "
                         "before and after this script's loop")  # fmt: skip
    ap.add_argument("--stand-in", action="store_true",
                    help="no CUDA: the replayed step's Python, with a stand-in graph")  # fmt: skip
    args = ap.parse_args()
    if args.stand_in:
        stand_in_split(args)
        return
    if args.no_pdl:
        _triton.USE_PDL = False
    if args.rows_max is not None:
        launch._GPU = dataclasses.replace(
            launch._GPU, rows_max_batch=args.rows_max, rows_max_batch_f32=args.rows_max
        )
    g = launch._GPU
    print(
        f"== pdl {_triton.USE_PDL}, rows_max_batch {g.rows_max_batch}, {g.rows_max_batch_f32} f32"
    )
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    builds = ["to", "on"] if args.built == "both" else [args.built]
    for mixer, built in ((m, b) for m in args.mixers for b in builds):
        cfg = MambaConfig(d_model=128, n_layers=3, input_dim=64, mixer=mixer, **MIXERS[mixer])
        torch.manual_seed(0)  # the same weights either way
        if built == "on":
            model = MambaBackbone(cfg, device=dev)
        else:
            model = MambaBackbone(cfg).to(dev)
        print(f"== {mixer}, built {'on the device' if built == 'on' else 'and moved'}")
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
                    if args.bench_rl:
                        bench_rl_step(model, mixer, B)
                    host_split(model, x, state, args.calls)
                    if args.bench_rl:
                        bench_rl_step(model, mixer, B)
                    if args.pieces:
                        pieces(model, x, state, args.calls)
                if args.host_profile:
                    host_profile(model, x, state, args.host_profile)


def bench_rl_step(model, mixer: str, B: int) -> None:
    """benchmarks/bench_rl.py's step figure (its `bench_step`, default rounds) on this model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_rl

    args = SimpleNamespace(warmup=50, rounds=7, round_s=0.25)
    row = bench_rl.bench_step(model, mixer, B, torch.device("cuda"), args)
    print(f"bench_rl's bench_step: median {row['median_us']:.1f} us (p10 {row['p10_us']:.1f}, "
          f"p90 {row['p90_us']:.1f}), {row['calls_per_round']} calls a round, "
          f"{row['graph_replays']} replays")  # fmt: skip


def per_call_us(fn, n: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


HOST_CALLS = 32  # few enough that the launches never wait for the device


def host_us(fn, reps: int = 41) -> float:
    """The host's time per call of fn alone: HOST_CALLS calls timed after a sync, without
    one at the end (their kernels queue behind each other), the median of reps."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        times.append((time.perf_counter() - t0) / HOST_CALLS * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[reps // 2]


def _cudart_memcpy():
    """cudaMemcpyAsync of the CUDA runtime torch loaded, through ctypes (None where it is
    not found): what a copy costs the host without torch's dispatch."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            path = next(line.split()[-1] for line in f if "libcudart.so" in line)
        fn = ctypes.CDLL(path).cudaMemcpyAsync
    except (OSError, StopIteration, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                   ctypes.c_void_p]  # fmt: skip
    fn.restype = ctypes.c_int
    return fn


class _StandIn:
    def replay(self) -> None:
        pass


def stand_in_split(args) -> None:
    """`--stand-in`: per mixer and batch, the best of 7 timings of the replayed step."""
    stand_in()
    for mixer in args.mixers:
        cfg = MambaConfig(d_model=128, n_layers=3, input_dim=64, mixer=mixer, **MIXERS[mixer])
        model = MambaBackbone(cfg)
        for B in args.batches:
            state, x = model.init_state(B), torch.randn(B, 64)
            with torch.no_grad():
                for _ in range(5):
                    model.step(x, state)
                best = min(per_call_us(partial(model.step, x, state), args.calls)
                           for _ in range(7))  # fmt: skip
            print(f"{mixer} batch {B}: replayed step's Python {best:.1f} us/call (best of 7)")
            if args.pieces:
                pieces(model, x, state, args.calls)
            if args.host_profile:
                host_profile(model, x, state, args.host_profile)


def stand_in() -> None:
    """The step's graphs on the CPU as stand-ins: captured by running the step once, their
    replay doing nothing (the state does not advance; the Python around it is all there).
    The CPU's body reads the whole-stack plan, which the Triton bodies on a GPU do not: the
    stand-in's capture hides that read, so a replay checks the step plan alone, as there."""
    sg = importlib.import_module("mambakit.inference.step_graph")
    plan = importlib.import_module("mambakit.inference.plan")
    caches: dict = {}

    def capture(fn, warmup=1, pool=None, warm=None):
        with plan.reads() as read:
            out = (warm or fn)().clone()
            read.clear()
        return _StandIn(), out

    def cache(model, create=True):
        if create or id(model) in caches:
            return caches.setdefault(id(model), {"pool": None})
        return None

    sg.capture, sg.graph_cache = capture, cache
    for mod in (sg, *map(importlib.import_module, ("mambakit.backbone", "mambakit.model"))):
        mod.use_cuda_graph = lambda flag, device: flag is not False


def host_split(model, x, state, n: int) -> None:
    """Where a replayed step's wall time goes: the whole `step`, the graph's replay alone
    (its GPU time where the launch is shorter), and the step's Python around the replay."""
    entry = next(reversed(_tables(model).graphs.values()), None)  # the one just used
    if entry is None:
        print("no graph captured")
        return
    whole = per_call_us(lambda: model.step(x, state), n)
    graph = (entry.slots or [entry.spare])[0].graph
    replay = per_call_us(graph.replay, n)
    gpu = events_us(graph.replay, n)
    print(
        f"host split: step {whole:.1f} us/call, replay loop {replay:.1f} us/call "
        f"(events {gpu:.1f}), so about {whole - replay:.1f} us of Python and copies"
    )
    loop_split(model, x, state, entry, graph)


def events_us(fn, n: int) -> float:
    """us per call of n calls of fn back to back, timed by CUDA events on the stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def loop_split(model, x, state, entry, graph, rounds: int = 7, calls: int = 4000) -> None:
    """bench_rl's step loop (`y, _ = model.step(x, state)`, synchronised at each round's
    end): its wall time per call against the host's alone (the round's calls issued, before
    the sync), the GPU time of a copy and a replay back to back, and whether the steps
    handed out the slots' outputs or cloned the spare's."""

    def call():
        y, _ = model.step(x, state)

    walls, hosts = [], []
    before = step_graph_status(model)
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) / calls * 1e6)
        hosts.append((t1 - t0) / calls * 1e6)
    after = step_graph_status(model)
    gpu = events_us(lambda: (sg._load(entry, x), graph.replay()), calls)
    print(
        f"bench_rl's loop: wall {statistics.median(walls):.1f} us/call, host "
        f"{statistics.median(hosts):.1f}; copy + replay on the GPU {gpu:.1f}; "
        f"{len(entry.slots)} slots, spare {'captured' if entry.spare else 'none'}, "
        f"{after['replays'] - before['replays']} replays, "
        f"{after['cloned'] - before['cloned']} cloned"
    )


def host_profile(model, x, state, n: int, lines: int = 28) -> None:
    """cProfile over n replayed steps (the device synchronised every HOST_CALLS calls, so
    the launches never wait for it): where the host's time goes, by function."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    prof = cProfile.Profile()
    with torch.no_grad():
        for i in range(n):
            if i % HOST_CALLS == 0:
                sync()
            prof.enable()
            model.step(x, state)
            prof.disable()
    sync()
    print(f"host profile of {n} replayed steps (cProfile; its own cost inflates every line):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(lines)


def pieces(model, x, state, n: int) -> None:
    """Each piece of a replayed step timed alone (us per call, the device synchronised at
    each loop's end only), and a step run with CUDA's sync debug mode at "error": a step
    that synchronises with the device (its time then adds the GPU's) shows where."""
    from mambakit.inference import step_graph as sg
    from mambakit.inference.plan import record

    entry = next(reversed(_tables(model).graphs.values()))
    slot = (entry.slots or [entry.spare])[0]
    parts = {
        "step": lambda: model.step(x, state),
        "checks": lambda: model._check_step(x, state),
        "key": lambda: tuple(map(sg._data_ptr, state._tensors())),
        "stands": lambda: sg._stands(model, model, None, entry),
        "copy in": lambda: entry.x.copy_(x),
        "replay": slot.graph.replay,
        "clone out (as the spare's)": slot.out.clone,
        "copy, replay": lambda: (entry.x.copy_(x), slot.graph.replay()),
    }
    fast = record(model, "step") is entry.plan and entry.plan.fresh(model)
    with torch.no_grad():
        times = ", ".join(f"{k} {per_call_us(f, n):.1f}" for k, f in parts.items())
    print(f"pieces (us/call): {times}; the plan's fast path {fast}")
    if not torch.cuda.is_available():  # (the stand-in)
        return
    memcpy = _cudart_memcpy()
    if memcpy is not None:
        dst, src, nbytes = entry.x.data_ptr(), x.data_ptr(), x.numel() * x.element_size()
        index = x.device.index
        parts["memcpy (cudart, ctypes)"] = lambda: memcpy(
            dst, src, nbytes, 3, torch._C._cuda_getCurrentRawStream(index)
        )
    with torch.no_grad():
        times = ", ".join(f"{k} {host_us(f):.1f}" for k, f in parts.items())
    print(f"host time alone (us/call, {HOST_CALLS} calls between syncs, median): {times}")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            model.step(x, state)
        print("a step does not synchronise with the device")
    except RuntimeError as exc:
        import traceback

        print(f"a step synchronises: {exc}")
        traceback.print_exc(limit=-8)
    finally:
        torch.cuda.set_sync_debug_mode(0)


if __name__ == "__main__":
    main()
