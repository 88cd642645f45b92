"""Serving benchmark: the engine of `mambakit serve` (in process, no HTTP) under load,
against static batches through `generate`.

Workloads (random weights, greedy, every request runs to its own max_tokens):

- mixed: N clients (64 and 256) in a closed loop, each sending its next request when
  the last one ends (4 each), prompts and outputs drawn uniformly from 32-2048 and
  16-512 tokens (a fixed seed); the engine with max_batch N. Output tokens/s, time to first token
  and inter-token latency p50 / p99. The same requests as static batches of N through
  `generate` (each batch runs to its longest output; tokens past a request's own length
  are waste): useful output tokens/s.
- decode: `generate` at batch 1 (the batch-1 decode step, the unit of the latency
  target) and at batch 256 with equal lengths (16 + 256 tokens: the rate the engine's
  throughput is measured against).
- shared prefix: 64 requests from 16 clients, every prompt the same 1,024 tokens and a
  suffix of its own (16-64 tokens), 32 new tokens each; time to first token p50 with the
  prefix cache (warmed by two requests: the engine keeps a prompt's block states once its
  first block has been seen) and without it.

Targets (device figures, never asserts): mixed at 256 clients >= 1.5x static batching;
p99 inter-token latency <= 3x the batch-1 step; shared-prefix TTFT p50 >= 3x lower with
the cache; aim: mixed throughput within 20% of generate's batch-256 rate.

    python benchmarks/bench_serve.py --preset 130m-mamba2 --device cuda --out serve.json
    python benchmarks/bench_serve.py --smoke          # a tiny model on the CPU, < 1 minute

`--http` also runs the mixed loads through the HTTP server: uvicorn in this process (as
`mambakit serve` runs it), streaming httpx clients in `--http-procs` processes.

Prints a table and writes a results record (`--out`, JSON: benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import random
import sys
import time
from pathlib import Path

import torch

from mambakit import MambaConfig, MambaLM
from mambakit.cli.serve import prefill_hold
from mambakit.inference import generate
from mambakit.serve import Engine, SamplingParams, prefill_graphs

sys.path.insert(0, str(Path(__file__).parent))
from common import make_record, write_record  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def make_load(
    n: int,
    rng: random.Random,
    prompt: tuple[int, int],
    out: tuple[int, int],
    vocab: int,
    prefix: list[int] | None = None,
) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_tokens) drawn uniformly from the ranges."""
    load = []
    for _ in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        load.append(((prefix or []) + p, rng.randint(*out)))
    return load


class Track:
    """One request's token times, recorded as the engine hands its events out."""

    def __init__(self, done: queue.Queue) -> None:
        self.done = done
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self.tokens = 0

    def __call__(self, ev) -> None:
        now = time.perf_counter()
        if ev.token_ids:
            self.times.extend([now] * len(ev.token_ids))
            self.tokens += len(ev.token_ids)
        if ev.finish_reason is not None:
            if ev.finish_reason not in ("length", "stop"):
                print(f"request ended with {ev.finish_reason}: {ev.error}", file=sys.stderr)
            self.done.put(self)


REPORT_S = 30.0  # a load still running after this long reports its progress and stacks
# (--report-s)


def progress(engine: Engine, finished: int, total: int, elapsed: float) -> None:
    """One line of the engine's state, then every thread's stack (to stderr): what a load
    that runs far longer than it should is doing."""
    m = engine.metrics
    gauges = {k: v for k, (_help, v) in engine.gauges().items()}
    print(
        f"  ... {elapsed:.0f} s: {finished}/{total} requests done, {m.iterations} "
        f"iterations, {m.prefill_tokens} prompt tokens prefilled, {m.generation_tokens} "
        f"generated; {gauges}",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def run_engine(engine: Engine, load, clients: int) -> dict:
    """The load through the engine by `clients` closed-loop clients."""
    done: queue.Queue = queue.Queue()
    tracks: list[Track] = []
    it0 = engine.metrics.iterations
    pending = list(reversed(load))

    def send():
        prompt, max_tokens = pending.pop()
        t = Track(done)
        tracks.append(t)
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                             ignore_eos=True), sink=t)  # fmt: skip

    t0 = time.perf_counter()
    for _ in range(min(clients, len(pending))):
        send()
    if engine._thread is None:  # not started: this thread runs the loop (as the profile does)
        left = len(load)
        while left:
            engine.step()
            while not done.empty():
                done.get()
                left -= 1
                if pending:
                    send()
    else:
        finished, last, iterations, stalled = 0, t0, engine.metrics.iterations, 0
        while finished < len(load):
            try:
                done.get(timeout=REPORT_S)
            except queue.Empty:
                pass
            else:
                finished += 1
                if pending:
                    send()
            if time.perf_counter() - last >= REPORT_S:  # a load that takes long says where
                last = time.perf_counter()
                progress(engine, finished, len(load), last - t0)
                # not one iteration over two reports (one may be a capture and a compile)
                stalled = stalled + 1 if engine.metrics.iterations == iterations else 0
                if stalled >= 2:
                    print(f"the engine made no progress in {2 * REPORT_S:.0f} s: stalled",
                          file=sys.stderr, flush=True)  # fmt: skip
                    sys.stdout.flush()
                    os._exit(3)  # a hung device would keep an orderly exit waiting too
                iterations = engine.metrics.iterations
    wall = time.perf_counter() - t0
    ttft = [t.times[0] - t.t0 for t in tracks if t.times]
    itl = [b - a for t in tracks for a, b in zip(t.times, t.times[1:])]
    out = sum(t.tokens for t in tracks)
    return {
        "requests": len(load), "output_tokens": out, "wall_s": round(wall, 3),
        "tokens_per_s": out / wall,
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "itl_p50_ms": pct(itl, 0.5) * 1e3, "itl_p99_ms": pct(itl, 0.99) * 1e3,
        "iterations": engine.metrics.iterations - it0,
        "prefill_forward_tokens": None if engine.prefill_graphs is None
        else engine.prefill_graphs.forward_tokens,
        "prefill_forward_ms": None if engine.prefill_graphs is None
        or engine.prefill_graphs.forward_seconds is None
        else engine.prefill_graphs.forward_seconds * 1e3,
    }  # fmt: skip


def run_static(model, load, batch: int, device) -> dict:
    """The load as static batches of `batch` through generate (greedy, ragged prompts)."""
    sync(device)
    t0 = time.perf_counter()
    useful = 0
    steps = 0
    for i in range(0, len(load), batch):
        part = load[i : i + batch]
        n = max(m for _, m in part)
        generate(model, [p for p, _ in part], max_new_tokens=n, temperature=0)
        useful += sum(m for _, m in part)
        steps += n
    sync(device)
    wall = time.perf_counter() - t0
    return {"requests": len(load), "output_tokens": useful, "wall_s": round(wall, 3),
            "tokens_per_s": useful / wall, "decode_steps": steps}  # fmt: skip


def decode_rate(model, batch: int, prompt: int, new: int, device, vocab: int) -> dict:
    """generate's decode at `batch` with equal lengths: per-step time and tokens/s, from
    the difference of a run of `new` tokens and a run of 1 (the prefill cancels)."""
    ids = torch.randint(0, vocab, (batch, prompt), device=device)

    def timed(n):
        best = float("inf")
        for _ in range(3):
            sync(device)
            t = time.perf_counter()
            generate(model, ids, max_new_tokens=n, temperature=0)
            sync(device)
            best = min(best, time.perf_counter() - t)
        return best

    timed(new)  # warm-up: capture and compile
    step = (timed(new) - timed(1)) / (new - 1)
    return {"batch": batch, "step_ms": step * 1e3, "tokens_per_s": batch / step}


def http_clients(url: str, load: list, clients: int) -> list[tuple[float, list[float], int]]:
    """In a process of its own: `clients` closed-loop streaming clients over `load`;
    (start, token times, tokens) per request, on this process's perf_counter."""
    import asyncio

    import httpx

    pending = list(reversed(load))
    out = []

    async def worker(client):
        while pending:
            prompt, max_tokens = pending.pop()
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
            t0, times = time.perf_counter(), []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        n = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                        times.extend([now] * n)
            out.append((t0, times, len(times)))

    async def main():
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            await asyncio.gather(*(worker(client) for _ in range(clients)))

    asyncio.run(main())
    return out


def run_http(engine: Engine, load, clients: int, procs: int) -> dict:
    """The load through the HTTP server (uvicorn in a thread of this process, as
    `mambakit serve` runs it) from `procs` client processes sharing the clients."""
    import multiprocessing
    import socket
    import threading

    import uvicorn

    from mambakit.serve.server import create_app

    app = create_app(engine, model_name="bench", max_tokens_limit=1 << 20)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    procs = max(1, min(procs, clients))
    shares = [load[i::procs] for i in range(procs)]
    per = [clients // procs + (i < clients % procs) for i in range(procs)]
    url = f"http://127.0.0.1:{port}"
    try:
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            t0 = time.perf_counter()
            parts = pool.starmap(http_clients, [(url, sh, c) for sh, c in zip(shares, per)])
            wall = time.perf_counter() - t0  # includes the client processes' start
    finally:
        server.should_exit = True
        thread.join(timeout=120)
    reqs = [r for part in parts for r in part]
    ttft = [times[0] - t0 for t0, times, _ in reqs if times]
    itl = [b - a for _, times, _ in reqs for a, b in zip(times, times[1:])]
    out = sum(n for *_, n in reqs)
    first = min(t0 for t0, _, _ in reqs)
    last = max(times[-1] for _, times, _ in reqs if times)
    return {
        "requests": len(reqs), "output_tokens": out, "wall_s": round(wall, 3),
        "tokens_per_s": out / (last - first) if last > first else float("nan"),
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "itl_p50_ms": pct(itl, 0.5) * 1e3, "itl_p99_ms": pct(itl, 0.99) * 1e3,
    }  # fmt: skip


def profile_engine(engine: Engine, load, clients: int, device) -> str:
    """The load once more under the profiler, the engine's loop on this thread (the
    profiler records the host ops of its own thread): how busy the device was (its kernels'
    summed time over the wall time), the kernels and the host ops that took the most time,
    and the engine's iterations and tokens per iteration."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    it0, tok0 = engine.metrics.iterations, engine.metrics.generation_tokens
    with profile(activities=acts) as prof:
        res = run_engine(engine, load, clients)
    its = engine.metrics.iterations - it0
    toks = engine.metrics.generation_tokens - tok0
    table = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in table if e.device_type.name == "CUDA")
    wall_us = res["wall_s"] * 1e6
    lines = [
        f"{clients} clients, {res['requests']} requests: wall {res['wall_s']} s (profiled), "
        f"{its} iterations ({wall_us / max(its, 1):.0f} us each), "
        f"{toks / max(its, 1):.1f} output tokens per iteration",
        f"device kernels: {gpu_us / 1e3:.1f} ms in all, busy {gpu_us / wall_us:.1%} of the wall",
        "",
        table.table(sort_by="self_device_time_total" if device.type == "cuda"
                    else "self_cpu_time_total", row_limit=30, max_name_column_width=60),
        table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
    ]  # fmt: skip
    return "\n".join(lines)


def timeline_summary(engine: Engine, res: dict) -> dict:
    """Where the device's time went in a run with `engine.timeline` on: the decode steps',
    joins' and prefill launches' spans on their streams (union, overlap, the time none ran;
    a span starts when its stream reaches its start event, so a prefill span also holds
    the time its stream waited for the host to enqueue it: compare its host seconds), the
    mean rows and time of a step, the prefill's tokens (prompt, computed with the padding)
    and rate over its busy time, and the time the loop waited on steps' tokens."""
    torch.cuda.synchronize()  # every event recorded has completed
    tl = engine.timeline
    timed = [e for e in tl if e[0] != "wait"]
    if not timed:
        return {}
    base = timed[0][2]
    spans: dict[str, list[tuple[float, float]]] = {"decode": [], "prefill": [], "join": []}
    for kind, _, start, end in timed:
        spans[kind].append((base.elapsed_time(start), base.elapsed_time(end)))

    def union(iv):
        total, cur_s, cur_e = 0.0, None, None
        for s, e in sorted(iv):
            if cur_e is None or s > cur_e:
                total += 0.0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + (0.0 if cur_e is None else cur_e - cur_s)

    dec = union(spans["decode"] + spans["join"])  # the decode stream's work
    pre = union(spans["prefill"])
    allv = spans["decode"] + spans["join"] + spans["prefill"]
    both = union(allv)
    span = max(e for _, e in allv) - min(s for s, _ in allv)
    rows = [e[1] for e in timed if e[0] == "decode"]
    counts = [e[1] for e in timed if e[0] == "prefill"]
    tokens = sum(c[0] for c in counts)
    computed = sum(c[2] for c in counts)
    step_ms = [e - s for s, e in spans["decode"]]
    return {
        "span_ms": span, "decode_busy_ms": dec, "join_ms": union(spans["join"]),
        "prefill_busy_ms": pre,
        "overlap_ms": dec + pre - both, "idle_ms": span - both,
        "decode_steps": len(rows), "mean_rows": sum(rows) / max(len(rows), 1),
        "mean_step_ms": sum(step_ms) / max(len(step_ms), 1),
        "prefill_launches": len(counts), "prefill_tokens": tokens,
        "prefill_host_ms": sum(c[3] for c in counts) * 1e3,
        "prefill_forwards": sum(c[1] for c in counts), "prefill_computed_tokens": computed,
        "prefill_tok_per_s_busy": tokens / max(pre, 1e-9) * 1e3,
        "host_wait_ms": sum(e[1] for e in tl if e[0] == "wait") * 1e3,
        "wall_ms": res["wall_s"] * 1e3,
    }  # fmt: skip


def engine_for(model, clients: int, args, cache: bool) -> Engine:
    graphs = not args.no_cuda_graph and model_device(model).type == "cuda"
    more = (
        {} if args.prefills_in_flight is None else {"prefills_in_flight": args.prefills_in_flight}
    )
    engine = Engine(model, max_batch=clients, block_size=args.block_size,
                    prefill_tokens=args.prefill_tokens, max_queue=1 << 20, **more,
                    cache_bytes=int(args.cache_gib * (1 << 30)) if cache else 0,
                    cuda_graph=graphs)  # fmt: skip
    if args.sync_prefill:
        engine.async_prefill = False
    if args.packed != "auto":
        engine.packed = args.packed == "on"
    if args.prefill_hold is not None:
        engine.prefill_hold = prefill_hold(args.prefill_hold)
    if args.prefill_priority != "low" and engine.prefill_stream is not None:
        # the engine's streams made again: the prefill's above the decode steps' or beside
        prefill, decode = {"same": (0, 0), "high": (-1, 0)}[args.prefill_priority]
        engine.prefill_stream = torch.cuda.Stream(engine.device, priority=prefill)
        engine.decode_stream = torch.cuda.Stream(engine.device, priority=decode)
        # the prefill graphs (captured by the warm-up below) on the stream they will run on;
        # the decode graphs stay on the first decode stream they were captured on: a stream
        # of its own too (a pool's streams come round again only every 32 draws)
        if engine.prefill_graphs is not None:
            engine.prefill_graphs.capture_stream = engine.prefill_stream
    engine.warmup()
    if engine.prefill_graphs is not None:
        print(f"prefill forward's fixed cost: {engine.prefill_graphs.forward_tokens} tokens' worth")
    return engine


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="130m", help="a MambaConfig preset (random weights)")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of --preset")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    ap.add_argument(
        "--clients", default="64,256", help="closed-loop clients of the mixed loads ('none': none)"
    )
    ap.add_argument(
        "--requests-per-client",
        type=int,
        default=4,
        help="requests each client sends in turn: with few, the run's end, where "
        "clients have stopped and the batch drains, weighs on the figure",
    )
    ap.add_argument("--prompt-range", default="32,2048")
    ap.add_argument("--output-range", default="16,512")
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    ap.add_argument("--prefix-clients", type=int, default=16)
    ap.add_argument("--prefix-requests", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=16384)
    ap.add_argument("--prefill-hold", default=None, metavar="TOKENS,MS",
                    help="the engine's prefill_hold: 'auto' (its default), 'none', or "
                         "launches wait for TOKENS prompt tokens, a prompt MS at most, while "
                         "decode steps run")  # fmt: skip
    ap.add_argument(
        "--prefills-in-flight",
        type=int,
        default=None,
        help="the engine's prefills_in_flight (prefill launches running at once)",
    )
    ap.add_argument("--packed", default="auto", choices=["auto", "on", "off"],
                    help="the engine's packed prefill (Engine.packed: Mamba-1 models); auto: "
                         "the engine's default")  # fmt: skip
    ap.add_argument("--cache-gib", type=float, default=4.0)
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report-s", type=float, default=30.0,
                    help="a load running longer prints its progress and every thread's "
                    "stack this often; two reports without an iteration end the run")  # fmt: skip
    ap.add_argument("--http", action="store_true",
                    help="also run the mixed loads through the HTTP server (streaming clients "
                         "in --http-procs processes)")  # fmt: skip
    ap.add_argument("--http-procs", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, small loads")
    ap.add_argument("--no-prefix", action="store_true", help="skip the shared-prefix load")
    ap.add_argument("--no-static", action="store_true",
                    help="skip the static batches through generate (engine settings compared "
                         "in one run)")  # fmt: skip
    ap.add_argument("--profile", default=None,
                    help="write here where the engine's time goes at the largest client count "
                         "(the load again under the profiler)")  # fmt: skip
    ap.add_argument("--timeline", action="store_true",
                    help="the largest mixed load once more with the engine timeline on: "
                         "where the device time went (decode, prefill, overlap, idle)")  # fmt: skip
    ap.add_argument("--prefill-rows", type=int, default=None,
                    help="rows of a captured prefill forward at most (prefill_graphs."
                         "GRAPH_MAX_ROWS)")  # fmt: skip
    ap.add_argument("--sync-prefill", action="store_true",
                    help="on CUDA, each iteration's prefill joined at once (serial with the "
                         "decode steps) instead of beside them")  # fmt: skip
    ap.add_argument("--prefill-priority", default="low", choices=["low", "same", "high"],
                    help="the prefill stream's priority against the decode steps' (the "
                         "engine's: low, the decode stream above it); same and high "
                         "make the decode stream's priority the default one")  # fmt: skip
    ap.add_argument("--out", default=None, help="write the results record (JSON) here")
    args = ap.parse_args()
    global REPORT_S
    if not args.report_s > 0:
        ap.error(f"--report-s must be > 0, got {args.report_s}")
    REPORT_S = args.report_s
    if args.prefill_hold is not None:
        try:
            prefill_hold(args.prefill_hold)
        except ValueError as e:
            ap.error(str(e))
    if args.prefill_rows is not None:
        if args.prefill_rows < 1:
            ap.error(f"--prefill-rows must be >= 1, got {args.prefill_rows}")
        # (rounded up to a power of two, within the graphs' memory bound): every engine here
        prefill_graphs.GRAPH_MAX_ROWS = args.prefill_rows
    if args.smoke:
        args.device = "cpu" if args.device == "auto" else args.device
        args.preset = "tiny"
        args.clients = "4,8" if args.clients == "64,256" else args.clients  # (the default)
        args.requests_per_client = 2
        args.prompt_range, args.output_range = "8,96", "4,32"
        args.prefix, args.prefix_clients, args.prefix_requests = 64, 4, 8
        args.block_size, args.prefill_tokens = 16, 128
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(args.seed)
    if args.model:
        model = MambaLM.from_pretrained(args.model, device=device, dtype=dtype).eval()
        name = Path(args.model).name
    else:
        overrides = dict(d_model=64, n_layers=2) if args.smoke else {}
        cfg = MambaConfig.preset(args.preset, **overrides)
        model = MambaLM(cfg).to(device=device, dtype=dtype).eval()
        name = args.preset + (" (cut down)" if overrides else "")
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    prompt_range = tuple(int(x) for x in args.prompt_range.split(","))
    output_range = tuple(int(x) for x in args.output_range.split(","))
    clients = [] if args.clients == "none" else [int(c) for c in args.clients.split(",")]
    figures: list[dict] = []
    base = {"model": name, "dtype": str(dtype).replace("torch.", ""), "device": str(device)}

    def row(**kw):
        figures.append({**base, **kw})
        show = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in kw.items()}
        print("  ".join(f"{k}={v}" for k, v in show.items()), flush=True)
        if args.out:  # the rows so far: a run cut short by a time limit keeps them
            record = make_record("bench_serve", figures, device=device,
                                 context={"args": vars(args), "partial": True})  # fmt: skip
            Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")

    # the unit of the latency target and the rate of the throughput aim
    b1 = decode_rate(model, 1, 16, 256 if not args.smoke else 32, device, vocab)
    row(workload="generate decode, equal lengths", impl="generate", **b1)
    big = max(clients, default=0)
    if clients:
        bN = decode_rate(model, big, 16, 256 if not args.smoke else 32, device, vocab)
        row(workload="generate decode, equal lengths", impl="generate", **bN)

    loads = {}  # the mixed load of each client count (the timeline and profile rerun the largest)
    for n in clients:
        load = make_load(n * args.requests_per_client, rng, prompt_range, output_range, vocab)
        loads[n] = load
        engine = engine_for(model, n, args, cache=True).start()
        run_engine(engine, make_load(n, rng, (1, 64), (2, 8), vocab), n)  # warm-up
        res = run_engine(engine, load, n)
        engine.shutdown(timeout=60)
        row(workload=f"mixed, {n} clients", impl="engine", clients=n,
            prefill_hold=engine.prefill_hold, packed=engine.packed,
            prefill_priority=args.prefill_priority, **res)  # fmt: skip
        if args.http:
            engine = engine_for(model, n, args, cache=True)
            hres = run_http(engine, load, n, args.http_procs)
            row(workload=f"mixed, {n} clients", impl="HTTP server", clients=n, **hres)
        if args.no_static:
            continue
        run_static(model, load, n, device)  # warm-up: every padded length compiled once
        st = run_static(model, load, n, device)
        row(workload=f"mixed, {n} clients", impl="generate static batches", clients=n, **st)
        row(workload=f"mixed, {n} clients", impl="ratios", clients=n,
            throughput_vs_static=res["tokens_per_s"] / st["tokens_per_s"],
            itl_p99_over_batch1_step=res["itl_p99_ms"] / b1["step_ms"],
            throughput_vs_generate_equal=res["tokens_per_s"] / bN["tokens_per_s"]
            if n == big else None)  # fmt: skip

    if args.timeline and clients and device.type == "cuda":
        load = loads[big]
        engine = engine_for(model, big, args, cache=True).start()
        run_engine(engine, make_load(big, rng, (1, 64), (2, 8), vocab), big)  # warm-up
        engine.timeline = []
        res = run_engine(engine, load, big)
        engine.shutdown(timeout=60)
        rows = engine.prefill_graphs.max_rows if engine.prefill_graphs is not None else None
        row(workload=f"mixed, {big} clients", impl="engine timeline", clients=big,
            tokens_per_s=res["tokens_per_s"], prefill_rows=rows,
            prefill_hold=engine.prefill_hold, packed=engine.packed,
            prefill_priority=args.prefill_priority, **timeline_summary(engine, res))  # fmt: skip
    if args.profile and clients:
        load = loads[big]
        engine = engine_for(model, big, args, cache=True)
        run_engine(engine, make_load(big, rng, (1, 64), (2, 8), vocab), big)  # warm-up
        Path(args.profile).write_text(profile_engine(engine, load, big, device))
        engine.shutdown(timeout=60)
        print(f"wrote {args.profile}")
    if args.no_prefix:
        write_record(args.out, "bench_serve", figures, device=device,
                     context={"args": vars(args)})  # fmt: skip
        return
    prefix = [rng.randrange(vocab) for _ in range(args.prefix)]
    load = make_load(args.prefix_requests, rng, (16, 64), (32, 32), vocab, prefix)
    ttft = {}
    # with --timeline each setting runs once more with the engine's timeline on (its events
    # cost the host a little: the ratio is the timed runs'), on another load of the same
    # shape (the first one's prompts are cached whole by then)
    timelines = (False, True) if args.timeline and device.type == "cuda" else (False,)
    again = None
    if len(timelines) > 1:
        again = make_load(args.prefix_requests, rng, (16, 64), (32, 32), vocab, prefix)
    for cache in (False, True):
        engine = engine_for(model, args.prefix_clients, args, cache=cache).start()
        run_engine(engine, make_load(args.prefix_clients, rng, (1, 64), (2, 4), vocab), 4)
        if cache:  # the shared prefix as a server sees it after a while: the first request
            # runs whole (a first block never seen), the second keeps its block states
            run_engine(engine, [(prefix + [1], 1)], 1)
            run_engine(engine, [(prefix + [2], 1)], 1)
        for timed in timelines:
            if timed:
                engine.timeline = []
            before = engine.cache.hits
            res = run_engine(engine, again if timed else load, args.prefix_clients)
            hits = engine.cache.hits  # (since the engine started, its warm-up's included)
            more = timeline_summary(engine, res) if timed else {}
            if not timed:
                ttft[cache] = res["ttft_p50_ms"]
            row(workload=f"shared {args.prefix}-token prefix, {args.prefix_clients} clients",
                impl="engine, cache " + ("on" if cache else "off")
                + (", timeline" if timed else ""), cache_hits=hits,
                cache_hits_in_run=hits - before,
                prefill_hold=engine.prefill_hold, packed=engine.packed,
                prefill_priority=args.prefill_priority, **res, **more)  # fmt: skip
        engine.shutdown(timeout=60)
    row(workload=f"shared {args.prefix}-token prefix", impl="ratios",
        ttft_p50_without_over_with_cache=ttft[False] / ttft[True])  # fmt: skip
    write_record(args.out, "bench_serve", figures, device=device,
                 context={"args": vars(args)})  # fmt: skip


if __name__ == "__main__":
    main()
