"""Decode benchmark: prefill + token-by-token generation, with and without CUDA graphs.

GPU (default when CUDA is present): the 130m, 370m and 1.4b presets in bf16
(random weights), a 16-token prompt + 256 new tokens (greedy), batch 1, 8 and
64: tokens/s and per-token latency of mambakit with and without CUDA graphs,
against `mamba_ssm`'s `MambaLMHeadModel.generate(cg=True)` (and, at 130m,
`transformers`' `MambaForCausalLM.generate`) measured in the same run when
importable. Also the kernels launched per token (the model step, and the step
with sampling and bookkeeping as `generate` runs it) and the streaming bound:
the bytes a step must move (every weight once, the recurrent state read and
written) over the copy rate.

CPU (`--device cpu`): `MambaBackbone.step()` of an RL-size model (d_model 128,
3 layers, batch 1, f32) in microseconds per step, eager (no_grad and
inference_mode) and, with `--compile`, under torch.compile; plus the aten ops
dispatched per step (what bounds it: per-op dispatch overhead).

    python benchmarks/bench_decode.py                       # H200 table
    python benchmarks/bench_decode.py --presets 130m --batch 1
    python benchmarks/bench_decode.py --device cpu --compile
    python benchmarks/bench_decode.py --quick --device cpu  # dry run of every path

Prints a table and writes a results record (`--out`, JSON: benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from mambakit import MambaBackbone, MambaConfig, MambaLM
from mambakit.inference import CUDAGraphStep, generate
from mambakit.state import expected_shapes

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import peer_ssm_cfg  # noqa: E402
from common import PEERS, graph_time_ms, interleaved_median_ms, write_record  # noqa: E402

COPY_RATE = 4.27e12  # bytes/s, H200 (DESIGN.md section 7)
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    """Best wall time of `repeats` calls (after one warm-up call), in seconds."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def count_kernels(fn, device) -> int | None:
    """CUDA kernels launched by one call of fn (profiler), or None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def count_aten_ops(fn) -> int:
    """aten ops dispatched by one call of fn."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def _no_grad(fn):
    """fn() without autograd, as generate runs a decode step (with it, step() records a
    differentiable forward)."""
    with torch.no_grad():
        return fn()


def record(workload, impl, batch, new, seconds, prefill_s, dtype, shapes, **extra) -> dict:
    per_token = (seconds - prefill_s) / max(new - 1, 1)  # decode latency per step
    return {
        "workload": workload,
        "impl": impl,
        "batch": batch,
        "new_tokens": new,
        "dtype": dtype,
        "shapes": shapes,
        "time_s": seconds,
        "prefill_s": prefill_s,
        "tokens_per_s": batch * new / seconds,
        "us_per_token": per_token * 1e6,
        **extra,
    }


# --- mambakit and its peers ----------------------------------------------------------------


def bench_mambakit(model, ids, new, graphs: bool, repeats: int) -> tuple[float, float]:
    device = ids.device
    kw = dict(temperature=0, cuda_graph=graphs)
    total = timed(lambda: generate(model, ids, max_new_tokens=new, **kw), device, repeats)
    prefill = timed(lambda: generate(model, ids, max_new_tokens=1, **kw), device, repeats)
    return total, prefill


def bench_mamba_ssm(preset: MambaConfig, ids, new, dtype, repeats: int):
    try:
        from mamba_ssm.models.config_mamba import MambaConfig as SSMConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    except ImportError:
        return None
    cfg = SSMConfig(
        d_model=preset.d_model,
        n_layer=preset.n_layers,
        vocab_size=preset.vocab_size,
        ssm_cfg=peer_ssm_cfg(preset),  # the preset's mixer ({}: Mamba-1, the default)
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=8,
    )
    model = MambaLMHeadModel(cfg, device=ids.device, dtype=dtype).eval()
    T = ids.shape[1]

    def run(n):
        return lambda: model.generate(
            input_ids=ids, max_length=T + n, cg=True, top_k=1, return_dict_in_generate=False
        )

    total = timed(run(new), ids.device, repeats)
    prefill = timed(run(1), ids.device, repeats)
    return total, prefill


def bench_transformers(preset: MambaConfig, ids, new, dtype, repeats: int):
    try:
        from transformers import MambaConfig as HFConfig
        from transformers import MambaForCausalLM
    except ImportError:
        return None
    cfg = HFConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.d_model,
        num_hidden_layers=preset.n_layers,
        state_size=preset.d_state,
        expand=preset.expand,
        conv_kernel=preset.d_conv,
    )
    model = MambaForCausalLM(cfg).to(device=ids.device, dtype=dtype).eval()

    def run(n):
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)
        return lambda: model.generate(ids, pad_token_id=0, **kw)

    with torch.inference_mode():
        total = timed(run(new), ids.device, max(1, repeats // 2))
        prefill = timed(run(1), ids.device, max(1, repeats // 2))
    return total, prefill


def step_bytes(model, preset: MambaConfig, batch: int, dtype: torch.dtype) -> tuple[int, int]:
    """(weight bytes, state bytes read + written) of one decode step."""
    weights = model.num_parameters() * torch.finfo(dtype).bits // 8
    state = sum(math.prod(s) for s in expected_shapes(preset, batch).values()) * 4  # f32
    return weights, 2 * state


def decode_table(args, device: torch.device) -> list[dict]:
    from mambakit.inference.generate import _Decoder
    from mambakit.inference.sampling import SamplingConfig

    dtype = DTYPES[args.dtype]
    out = []
    for name in args.presets:
        preset = MambaConfig.preset(name)
        torch.manual_seed(0)
        model = MambaLM(preset, device=device).to(dtype).eval()
        shapes = f"{name} d_model={preset.d_model} layers={preset.n_layers} V={preset.vocab_size}"
        graph_modes = [False, True] if device.type == "cuda" else [False]
        for B in args.batch:
            ids = torch.randint(0, preset.vocab_size, (B, args.prompt_len), device=device)
            new = args.new_tokens
            wl = f"{name} decode {args.prompt_len}+{new}"
            weight_bytes, state_bytes = step_bytes(model, preset, B, dtype)
            bound_us = (weight_bytes + state_bytes) / COPY_RATE * 1e6
            dec = _Decoder(model, B, preset.vocab_size, SamplingConfig(temperature=0), 8, device)

            def one_step(model=model, state=dec.state, tok=ids[:, -1]):
                with torch.no_grad():
                    model.step(tok, state)

            extra = {
                "preset": name,
                "kernels_per_step": count_kernels(one_step, device),
                "kernels_per_token": count_kernels(
                    lambda dec=dec: _no_grad(dec.decode_step), device
                ),
                "weight_bytes": weight_bytes,
                "state_bytes": state_bytes,
                "bound_us_per_step": bound_us,
            }
            for graphs in graph_modes:
                total, prefill = bench_mambakit(model, ids, new, graphs, args.repeats)
                impl = "mambakit" + (" cuda-graph" if graphs else " eager")
                out.append(record(wl, impl, B, new, total, prefill, args.dtype, shapes, **extra))
                r = out[-1]  # progress, in case a later row does not finish
                tps, us = r["tokens_per_s"], r["us_per_token"]
                print(f"  {name} {impl} batch {B}: {tps:,.0f} tokens/s, {us:.1f} us/step")
            del dec
            if device.type == "cuda" and not args.no_peers:
                peers = [("mamba_ssm cg=True", bench_mamba_ssm)]
                if name == "130m":
                    peers.append(("transformers", bench_transformers))
                for peer_name, fn in peers:
                    res = fn(preset, ids, new, dtype, args.repeats)
                    if res is not None:
                        out.append(
                            record(
                                wl,
                                peer_name,
                                B,
                                new,
                                res[0],
                                res[1],
                                args.dtype,
                                shapes,
                                preset=name,
                                bound_us_per_step=bound_us,
                            )  # fmt: skip
                        )
                        r = out[-1]
                        print(f"  {name} {peer_name} batch {B}: {r['tokens_per_s']:,.0f} tokens/s, "
                              f"{r['us_per_token']:.1f} us/step", flush=True)  # fmt: skip
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for r in out:  # ratio to the peer measured in the same run
        peer = next(
            (
                p
                for p in out
                if p["impl"] == "mamba_ssm cg=True"
                and p["batch"] == r["batch"]
                and p["preset"] == r["preset"]
            ),
            None,
        )
        if peer is not None:
            r["speedup_vs_mamba_ssm_cg"] = r["tokens_per_s"] / peer["tokens_per_s"]
        r["bound_ratio"] = r["us_per_token"] / r["bound_us_per_step"]
    return out


def prefill_table(args, device: torch.device) -> list[dict]:
    """Prefill as `generate` runs it (`MambaLM.last_logits`): the parallel forward over 1 x T
    prompt tokens, the final norm and the LM head on the last position only, under
    inference_mode; eager (CUDA events around the
    call: launch gaps count; the median of 15 rounds of 2 calls, the implementations taking
    turns) and replayed from a CUDA graph; mamba_ssm's `model(ids, num_last_tokens=1)` the
    same ways."""
    dtype = DTYPES[args.dtype]
    T = args.prefill_len
    out = []
    for name in args.presets:
        preset = MambaConfig.preset(name)
        torch.manual_seed(0)
        ids = torch.randint(0, preset.vocab_size, (1, T), device=device)
        model = MambaLM(preset, device=device).to(dtype).eval()

        def ours(model=model, ids=ids):
            with torch.inference_mode():
                model.last_logits(ids)

        impls = [("mambakit", ours)]
        peer = None
        if not args.no_peers:
            try:
                from mamba_ssm.models.config_mamba import MambaConfig as SSMConfig
                from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

                cfg = SSMConfig(d_model=preset.d_model, n_layer=preset.n_layers,
                                vocab_size=preset.vocab_size, ssm_cfg={})  # fmt: skip
                peer = MambaLMHeadModel(cfg, device=device, dtype=dtype).eval()

                def theirs(peer=peer, ids=ids):
                    with torch.inference_mode():
                        peer(ids, num_last_tokens=1)

                impls.append(("mamba_ssm", theirs))
            except ImportError:
                pass
        rows = {}
        eager = interleaved_median_ms(dict(impls))  # the same host conditions for each
        for impl, fn in impls:
            rec = {"workload": f"{name} prefill 1x{T}", "impl": impl, "preset": name,
                   "dtype": args.dtype, "kernels": count_kernels(fn, device),
                   "eager_ms": eager[impl]}  # fmt: skip
            try:
                rec["graph_ms"] = graph_time_ms(fn, iters=10)
            except Exception as e:  # a model that cannot be captured: say so
                rec["graph_ms"] = f"n/a ({type(e).__name__})"
            rows[impl] = rec
            print(f"  {rec['workload']} {impl}: eager {rec['eager_ms']:.2f} ms, "
                  f"graph {rec['graph_ms']}", flush=True)  # fmt: skip
        if "mamba_ssm" in rows:
            for key in ("eager_ms", "graph_ms"):
                a, b = rows["mambakit"][key], rows["mamba_ssm"][key]
                if isinstance(a, float) and isinstance(b, float):
                    rows["mambakit"][f"{key[:-3]}_x_peer"] = b / a
        out += list(rows.values())
        del model, peer
        torch.cuda.empty_cache()
    return out


# --- CPU: backbone step of an RL-size model ------------------------------------------------


def step_table(args) -> list[dict]:
    d_model, layers = (32, 2) if args.quick else (128, 3)
    cfg = MambaConfig(d_model=d_model, n_layers=layers)
    torch.manual_seed(0)
    bb = MambaBackbone(cfg).eval()
    x = torch.randn(1, d_model)
    n = 50 if args.quick else 2000
    shapes = f"d_model={d_model} layers={layers} batch=1 d_state={cfg.d_state}"
    out = []
    threads0 = torch.get_num_threads()

    def measure(fn, label, threads):
        torch.set_num_threads(threads)
        for _ in range(n // 10 + 5):
            fn()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n)
        out.append(
            {
                "workload": "backbone step (RL)",
                "impl": label,
                "batch": 1,
                "dtype": "f32",
                "shapes": shapes,
                "threads": threads,
                "us_per_step": min(runs) * 1e6,
                "us_per_step_median": statistics.median(runs) * 1e6,
                "target_us": 150.0,
            }
        )

    state = bb.init_state(1)

    def eager():
        bb.step(x, state)

    with torch.no_grad():
        eager()  # the first step derives and caches the decode weights: count a later one
        aten_ops = count_aten_ops(eager)
    for threads in sorted({1, threads0}):
        with torch.no_grad():
            measure(eager, "eager no_grad", threads)
        with torch.inference_mode():
            measure(eager, "eager inference_mode", threads)
    actor = CUDAGraphStep(bb, batch_size=1)
    measure(lambda: actor(x), "CUDAGraphStep (eager on CPU)", 1)
    if args.compile:
        t0 = time.perf_counter()
        compiled = CUDAGraphStep(bb, batch_size=1, compile=True)
        with torch.no_grad():
            compiled(x)
        compile_s = time.perf_counter() - t0
        measure(lambda: compiled(x), "CUDAGraphStep(compile=True)", 1)
        out[-1]["compile_s"] = compile_s
    torch.set_num_threads(threads0)
    for r in out:
        r["aten_ops_per_step"] = aten_ops
        r["us_per_aten_op"] = r["us_per_step"] / aten_ops
    return out


# --- output ----------------------------------------------------------------------------------


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    if "tokens_per_s" in rows[0]:
        print(f"{'workload':<22} {'impl':<20} {'batch':>5} {'tokens/s':>10} {'us/step':>8} "
              f"{'bound us':>8} {'x bound':>7} {'prefill ms':>10} {'kernels':>9} "
              f"{'vs mamba_ssm':>12}")  # fmt: skip
        for r in rows:
            vs = r.get("speedup_vs_mamba_ssm_cg")
            kern = ""
            if r.get("kernels_per_step"):
                kern = f"{r['kernels_per_step']}/{r['kernels_per_token']}"
            print(
                f"{r['workload']:<22} {r['impl']:<20} {r['batch']:>5} "
                f"{r['tokens_per_s']:>10,.0f} {r['us_per_token']:>8.1f} "
                f"{r['bound_us_per_step']:>8.1f} {r['bound_ratio']:>7.2f} "
                f"{r['prefill_s'] * 1e3:>10.2f} {kern:>9} {f'{vs:.2f}x' if vs else '':>12}"
            )
        print("kernels: launched by model.step / by one whole token of generate (step, sampling,"
              " bookkeeping); bound: weights + state r/w at the copy rate")  # fmt: skip
    else:
        print(f"{'workload':<20} {'impl':<30} {'threads':>7} {'us/step':>9} {'median':>9} "
              f"{'aten ops':>8} {'us/op':>6}")  # fmt: skip
        for r in rows:
            print(
                f"{r['workload']:<20} {r['impl']:<30} {r['threads']:>7} {r['us_per_step']:>9.1f} "
                f"{r['us_per_step_median']:>9.1f} {r['aten_ops_per_step']:>8} "
                f"{r['us_per_aten_op']:>6.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--presets", nargs="+", default=["130m", "370m", "1.4b"])
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-len", type=int, default=4096, help="0: no prefill table (GPU)")
    p.add_argument("--no-peers", action="store_true", help="skip mamba_ssm and transformers")
    p.add_argument("--no-decode", action="store_true", help="GPU: only the prefill table")
    p.add_argument("--compile", action="store_true", help="CPU: also time torch.compile'd step")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a dry run of every path")
    p.add_argument("--out", default=None, help="write the results record (JSON) here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.presets, args.batch, args.new_tokens, args.repeats = ["tiny"], [1, 2], 8, 2
        args.prompt_len = min(args.prompt_len, 8)
        if device.type == "cpu":
            args.dtype = "f32"
    rows = []
    if device.type == "cpu":
        steps = step_table(args)
        print_table(steps)
        rows += steps
        if args.quick:  # the decode table's code path, at tiny size
            dec = decode_table(args, device)
            print_table(dec)
            rows += dec
    else:
        if not args.no_decode:
            rows = decode_table(args, device)
            print_table(rows)
        if args.prefill_len:
            pre = prefill_table(args, device)
            print(f"{'workload':<22} {'impl':<10} {'kernels':>7} {'eager ms':>9} {'x peer':>7} "
                  f"{'graph ms':>9} {'x peer':>7}")  # fmt: skip
            for r in pre:
                g = r["graph_ms"]
                g = g if isinstance(g, str) else f"{g:.2f}"
                print(f"{r['workload']:<22} {r['impl']:<10} {r['kernels'] or '':>7} "
                      f"{r['eager_ms']:>9.2f} {r.get('eager_x_peer', ''):>7.4} "
                      f"{g:>9} {r.get('graph_x_peer', ''):>7.4}")  # fmt: skip
            rows += pre
    context = {"cpu_threads": torch.get_num_threads(), "copy_bytes_per_s": COPY_RATE}
    write_record(args.out, "bench_decode", rows, context=context, device=device,
                 peers=(*PEERS, "transformers"))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
