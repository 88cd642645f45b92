"""Decode benchmark: prefill + token-by-token generation, with and without CUDA graphs.

GPU (default when CUDA is present): the 130m preset in bf16 (random weights),
a 16-token prompt + 256 new tokens (greedy), batch 1, 8 and 64: tokens/s and
per-token latency of mambakit with and without CUDA graphs, against
`mamba_ssm`'s `MambaLMHeadModel.generate(cg=True)` and `transformers`'
`MambaForCausalLM.generate` measured in the same run when importable. Also
counts the kernels of one decode step and the weight-streaming bound
(parameter bytes / copy rate) at batch 1.

CPU (`--device cpu`): `MambaBackbone.step()` of an RL-size model (d_model 128,
3 layers, batch 1, f32) in microseconds per step, eager (no_grad and
inference_mode) and, with `--compile`, under torch.compile; plus the aten ops
dispatched per step (what bounds it: per-op dispatch overhead).

    python benchmarks/bench_decode.py                       # H200 table
    python benchmarks/bench_decode.py --device cpu --compile
    python benchmarks/bench_decode.py --quick --device cpu  # dry run of every path

Prints a table and writes JSON records (`--out`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mambakit import MambaBackbone, MambaConfig, MambaLM
from mambakit.inference import CUDAGraphStep, generate

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
        ssm_cfg={},  # Mamba-1 mixer (the default of mamba_ssm 1.x and 2.x)
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


def decode_table(args, device: torch.device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    preset = MambaConfig.preset(args.preset)
    torch.manual_seed(0)
    model = MambaLM(preset, device=device).to(dtype).eval()
    n_params = model.num_parameters()
    weight_bytes = n_params * torch.finfo(dtype).bits // 8
    bound_us = weight_bytes / COPY_RATE * 1e6
    out = []
    shapes = (
        f"{args.preset} d_model={preset.d_model} layers={preset.n_layers} V={preset.vocab_size}"
    )
    graph_modes = [False, True] if device.type == "cuda" else [False]
    for B in args.batch:
        ids = torch.randint(0, preset.vocab_size, (B, args.prompt_len), device=device)
        new = args.new_tokens
        wl = f"decode {args.prompt_len}+{new}"
        state = model.init_state(B)

        def one_step(tok=ids[:, -1], state=state):
            with torch.no_grad():
                model.step(tok, state)

        kernels = count_kernels(one_step, device)
        for graphs in graph_modes:
            total, prefill = bench_mambakit(model, ids, new, graphs, args.repeats)
            impl = "mambakit" + (" cuda-graph" if graphs else " eager")
            extra = {"kernels_per_step": kernels, "weight_bytes": weight_bytes}
            if B == 1 and device.type == "cuda":
                extra["roofline_us_per_token"] = bound_us
            out.append(record(wl, impl, B, new, total, prefill, args.dtype, shapes, **extra))
            r = out[-1]  # progress, in case a later row does not finish
            tps, us = r["tokens_per_s"], r["us_per_token"]
            print(f"  {impl} batch {B}: {tps:,.0f} tokens/s, {us:.1f} us/token", flush=True)
        if device.type == "cuda" and not args.no_peers:
            for name, fn in (
                ("mamba_ssm cg=True", bench_mamba_ssm),
                ("transformers", bench_transformers),
            ):
                res = fn(preset, ids, new, dtype, args.repeats)
                if res is not None:
                    out.append(record(wl, name, B, new, res[0], res[1], args.dtype, shapes))
    for r in out:  # ratio to the peer measured in the same run
        peer = next(
            (p for p in out if p["impl"] == "mamba_ssm cg=True" and p["batch"] == r["batch"]),
            None,
        )
        if peer is not None:
            r["speedup_vs_mamba_ssm_cg"] = r["tokens_per_s"] / peer["tokens_per_s"]
        if "roofline_us_per_token" in r:
            r["roofline_ratio"] = r["roofline_us_per_token"] / r["us_per_token"]
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
        print(f"{'workload':<16} {'impl':<22} {'batch':>5} {'tokens/s':>12} {'us/token':>10} "
              f"{'prefill ms':>10} {'kernels':>8} {'vs mamba_ssm':>12}")  # fmt: skip
        for r in rows:
            vs = r.get("speedup_vs_mamba_ssm_cg")
            print(
                f"{r['workload']:<16} {r['impl']:<22} {r['batch']:>5} {r['tokens_per_s']:>12,.0f} "
                f"{r['us_per_token']:>10.1f} {r['prefill_s'] * 1e3:>10.2f} "
                f"{r.get('kernels_per_step') or '':>8} {f'{vs:.2f}x' if vs else '':>12}"
            )
        bound = next((r for r in rows if "roofline_us_per_token" in r), None)
        if bound:
            print(
                f"weight-streaming bound at batch 1: {bound['roofline_us_per_token']:.1f} us/token"
            )
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
    p.add_argument("--preset", default="130m")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-peers", action="store_true", help="skip mamba_ssm and transformers")
    p.add_argument("--compile", action="store_true", help="CPU: also time torch.compile'd step")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a dry run of every path")
    p.add_argument("--out", default=None, help="JSON file for the records")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.preset, args.batch, args.new_tokens, args.repeats = "tiny", [1, 2], 8, 2
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
        rows = decode_table(args, device)
        print_table(rows)
    if args.out:
        meta = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "host": platform.node(),
            "cpu_threads": torch.get_num_threads(),
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "records": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
