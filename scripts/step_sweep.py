"""Time the decode step for each weight-slab size of the matrix-vector kernels and each
row count of the SSM kernel.

`mamba_step.kernels.TILE` (elements of a program's weight slab) sets rows per program and
warps at batch 1; `kernels.SSM_ROWS` the batch rows per program of `_layer_ssm_kernel`. The
library always runs the module's values, so a better one found here is adopted by editing
it. Per preset, batch, TILE and SSM_ROWS: the step replayed from a CUDA graph (us), and each
kernel's mean GPU time in an eager step (profiler).

    PYTHONPATH=src python scripts/step_sweep.py --presets 130m 1.4b --tiles 4096 8192 16384
    PYTHONPATH=src python scripts/step_sweep.py --batch 64 --tiles 16384 --ssm-rows 1 2 4 8
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mambakit import MambaConfig, MambaLM
from mambakit.ops.mamba_step import kernels


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["130m", "1.4b"])
    ap.add_argument("--tiles", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--ssm-rows", type=int, nargs="+", default=[kernels.SSM_ROWS])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    args = ap.parse_args()
    default = kernels.TILE, kernels.SSM_ROWS
    for name in args.presets:
        cfg = MambaConfig.preset(name)
        torch.manual_seed(0)
        model = MambaLM(cfg, device="cuda").to(torch.bfloat16).eval()
        for batch in args.batch:
            state = model.init_state(batch)
            tok = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")

            def step(model=model, state=state, tok=tok):
                with torch.inference_mode():
                    model.step(tok, state)

            for tile in args.tiles:
                for rows in args.ssm_rows:
                    kernels.TILE, kernels.SSM_ROWS = tile, rows
                    us = graph_us(step)
                    print(f"{name} batch {batch} TILE {tile} SSM_ROWS {rows}: graph step "
                          f"{us:.1f} us; {kernel_means(step)}", flush=True)  # fmt: skip
            del state
        kernels.TILE, kernels.SSM_ROWS = default
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
