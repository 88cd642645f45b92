"""Time the Mamba-1 decode step's launch settings (`StepConfig`, ops/mamba_step/launch.py) at
a preset's shapes: every layer's `layer_step`, then the final norm and the LM head
(`linear`), as `MambaLM.step` chains them, on random bf16 weights.

`tile` (elements of a program's weight slab) sets rows per program and warps of the
matrix-vector kernels; `ssm_rows` the batch rows per program of `_layer_ssm_kernel`;
`rows_max_batch` (and `rows_max_batch_f32`) the batch up to which the projections stream
through the kernels (above it, cuBLAS). Each candidate is the library's config with these
replaced, handed to the launchers as `cfg=`; the library always runs `config()`, so a better
value found here is adopted by editing its defaults. Per preset, batch and candidate: the
step replayed from a CUDA graph (us), and each kernel's mean GPU time in an eager step
(profiler).

    PYTHONPATH=src python scripts/step_sweep.py --presets 130m 1.4b --tiles 4096 8192 16384
    PYTHONPATH=src python scripts/step_sweep.py --batch 64 --ssm-rows 1 2 4 8
    PYTHONPATH=src python scripts/step_sweep.py --batch 1 2 4 8 --rows-max 1 2 4 8  # crossover
    PYTHONPATH=src python scripts/step_sweep.py --models 130m-mamba2 --batch 2 3 --rows-max 1 2
    PYTHONPATH=src python scripts/step_sweep.py --dry   # CPU, interpreter, tiny preset, untimed
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys

if "--dry" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from mambakit import MambaConfig  # noqa: E402
from mambakit.ops import StepWeights  # noqa: E402
from mambakit.ops.mamba_step import launch  # noqa: E402


def graph_us(fn, iters: int = 200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def kernel_means(fn) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    ev.sort(key=lambda e: -e.self_device_time_total)
    return ", ".join(
        f"{e.key[:18]} {e.count}x{e.self_device_time_total / e.count:.2f}" for e in ev[:4]
    )


def model_weights(cfg: MambaConfig, dev: str, dtype: torch.dtype):
    """Random weights at the preset's shapes: (each layer's StepWeights, the final norm's
    weight, the LM head [V, M])."""
    g = torch.Generator(device=dev).manual_seed(0)
    M, D, N, R, K = cfg.d_model, cfg.expand * cfg.d_model, cfg.d_state, cfg.dt_rank, cfg.d_conv

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * shape[-1] ** -0.5).to(dtype)

    layers = [
        StepWeights(
            norm_w=torch.ones(M, device=dev, dtype=dtype),
            eps=1e-5,
            in_w=w(2 * D, M),
            in_b=None,
            conv_w=w(D, K),
            conv_b=w(D),
            x_w=w(R + 2 * N, D),
            dt_w=w(D, R),
            dt_bias=torch.randn(D, generator=g, device=dev) - 4,
            A=-torch.arange(1, N + 1, device=dev, dtype=torch.float32).repeat(D, 1),
            D=torch.ones(D, device=dev),
            out_w=w(M, D),
            out_b=None,
        )  # fmt: skip
        for _ in range(cfg.n_layers)
    ]
    return layers, torch.ones(M, device=dev, dtype=dtype), w(cfg.vocab_size, M)


def make_step(layers, norm_f, head, hidden, conv, ssm, c):
    """One decode step of the whole stack with launch settings c: (logits [B, V])."""

    def step():
        h, res = hidden, None
        for i, w in enumerate(layers):
            h, res = launch.layer_step(h, res, w, conv[i], ssm[i], cfg=c)
        return launch.linear(h, head, residual=res, norm_weight=norm_f, cfg=c)

    return step


def sweep(name: str, args, dev: str, dtype: torch.dtype) -> None:
    mcfg = MambaConfig.preset(name)
    layers, norm_f, head = model_weights(mcfg, dev, dtype)
    D, K, N = mcfg.expand * mcfg.d_model, mcfg.d_conv, mcfg.d_state
    base = launch.config(args.dry)
    for batch in args.batch:
        hidden = torch.randn(batch, mcfg.d_model, device=dev).to(dtype)
        conv = torch.zeros(len(layers), batch, K - 1, D, device=dev)
        ssm = torch.zeros(len(layers), batch, D, N, device=dev)
        for tile, rows, rows_max in itertools.product(args.tiles, args.ssm_rows, args.rows_max):
            c = dataclasses.replace(base, tile=tile, ssm_rows=rows, rows_max_batch=rows_max,
                                    rows_max_batch_f32=rows_max)  # fmt: skip
            step = make_step(layers, norm_f, head, hidden, conv, ssm, c)
            label = f"{name} batch {batch} tile {tile} ssm_rows {rows} rows_max {rows_max}"
            if args.dry:
                print(f"{label}: logits {tuple(step().shape)}", flush=True)
            else:
                us = graph_us(step)
                print(f"{label}: graph step {us:.1f} us; {kernel_means(step)}", flush=True)


def model_sweep(name: str, args) -> None:
    """`MambaLM.step` of a preset (any mixer: Mamba-2 and Mamba-3 blocks run their
    projections through `linear`) captured whole, per batch and `rows_max_batch`."""
    from mambakit import MambaLM

    torch.manual_seed(0)
    model = MambaLM(MambaConfig.preset(name), device="cuda").to(torch.bfloat16).eval()
    lib = launch._GPU
    for batch in args.batch:
        state = model.init_state(batch)
        tok = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")

        def step(state=state, tok=tok):
            with torch.no_grad():
                return model.step(tok, state, cuda_graph=False)[0]

        for rows_max in args.rows_max:
            launch._GPU = dataclasses.replace(lib, rows_max_batch=rows_max)
            label = f"{name} model step batch {batch} rows_max {rows_max}"
            try:
                us = graph_us(step)
                print(f"{label}: graph step {us:.1f} us; {kernel_means(step)}", flush=True)
            except Exception as exc:  # noqa: BLE001 - report it and go on with the next
                print(f"{label}: {exc!r}", flush=True)
            finally:
                launch._GPU = lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["130m", "1.4b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    lib = launch.config(False)
    ap.add_argument("--tiles", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--ssm-rows", type=int, nargs="+", default=[lib.ssm_rows])
    ap.add_argument("--rows-max", type=int, nargs="+", default=[lib.rows_max_batch])
    ap.add_argument(
        "--models",
        nargs="*",
        default=[],
        help="presets whose whole MambaLM.step is timed instead (any mixer)",
    )
    ap.add_argument("--dry", action="store_true", help="CPU interpreter, tiny preset, untimed")
    args = ap.parse_args()
    dev, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    if args.models:
        for name in args.models:
            model_sweep(name, args)
            torch.cuda.empty_cache()
        return
    for name in ["tiny"] if args.dry else args.presets:
        sweep(name, args, dev, dtype)
        if not args.dry:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
