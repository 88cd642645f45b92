"""Batch-64 decode probe (130m, bf16): the graph step for each (SSM_ROWS, SSM_BLOCK_D,
SSM_WARPS), then the GPU time of every kernel of one eager generate token (step + sampling).

    PYTHONPATH=src python scripts/b64_probe.py
"""

from __future__ import annotations

import itertools
import sys

import torch
from step_sweep import graph_us
from torch.profiler import ProfilerActivity, profile

from mambakit import MambaConfig, MambaLM
from mambakit.inference.generate import _Decoder
from mambakit.inference.sampling import SamplingConfig
from mambakit.ops.mamba_step import kernels


def main() -> None:
    cfg = MambaConfig.preset("130m")
    torch.manual_seed(0)
    model = MambaLM(cfg, device="cuda").to(torch.bfloat16).eval()
    batch = 64
    state = model.init_state(batch)
    tok = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")

    def step():
        with torch.inference_mode():
            model.step(tok, state)

    default = kernels.SSM_ROWS, kernels.SSM_BLOCK_D, kernels.SSM_WARPS
    sweep = itertools.product((1, 2), (16, 32, 64), (2, 4, 8))
    for rows, bd, warps in sweep if "--no-sweep" not in sys.argv else ():
        kernels.SSM_ROWS, kernels.SSM_BLOCK_D, kernels.SSM_WARPS = rows, bd, warps
        print(f"rows {rows} block_d {bd} warps {warps}: graph step {graph_us(step):.1f} us",
              flush=True)  # fmt: skip
    kernels.SSM_ROWS, kernels.SSM_BLOCK_D, kernels.SSM_WARPS = default
    dec = _Decoder(model, batch, cfg.vocab_size, SamplingConfig(temperature=0.0), 1024, "cuda")
    with torch.inference_mode():
        for _ in range(3):
            dec.decode_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.decode_step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))
        print("step, graph:", f"{graph_us(step):.1f} us")
        print("generate token, graph:", f"{graph_us(dec.decode_step):.1f} us")


if __name__ == "__main__":
    main()
