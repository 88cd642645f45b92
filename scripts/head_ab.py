"""A/B of the LM head's norm at batch 1: in every program's prologue (today) or once before
the matrix-vector kernel (`kernels.PRENORM_ROWS`); a CUDA-graph decode step per preset.

PYTHONPATH=src python scripts/head_ab.py --presets 130m 1.4b
"""

from __future__ import annotations

import argparse

import torch

from mambakit import MambaConfig, MambaLM
from mambakit.ops.mamba_step import kernels


def graph_step_us(model, iters: int = 200) -> float:
    state = model.init_state(1)
    tok = torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model.step(tok, state)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model.step(tok, state)
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["130m", "1.4b"])
    args = ap.parse_args()
    default = kernels.PRENORM_ROWS
    for name in args.presets:
        torch.manual_seed(0)
        model = MambaLM(MambaConfig.preset(name), device="cuda").to(torch.bfloat16).eval()
        for _ in range(2):  # twice, alternating: the spread shows the noise
            for label, rows in (("prologue", default), ("norm first", 4096)):
                kernels.PRENORM_ROWS = rows
                print(f"{name} batch 1 graph step, head norm {label}: "
                      f"{graph_step_us(model):.1f} us", flush=True)  # fmt: skip
        kernels.PRENORM_ROWS = default
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
