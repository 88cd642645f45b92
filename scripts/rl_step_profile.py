"""Per-kernel GPU time of the small float-input backbone's step (replayed from the library's
CUDA graph) and of its eager step, by batch: what bounds benchmarks/bench_rl.py's step."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mambakit import MambaBackbone, MambaConfig

MIXERS = {"mamba1": {}, "mamba2": dict(headdim=32), "mamba3": dict(headdim=16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mixers", nargs="+", default=["mamba1"], choices=list(MIXERS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for mixer in args.mixers:
        cfg = MambaConfig(d_model=128, n_layers=3, input_dim=64, mixer=mixer, **MIXERS[mixer])
        model = MambaBackbone(cfg).to(dev)
        for B in args.batches:
            state, x = model.init_state(B), torch.randn(B, 64, device=dev)
            with torch.no_grad():
                for _ in range(5):
                    model.step(x, state)
                for graph in (True, False):
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


if __name__ == "__main__":
    main()
