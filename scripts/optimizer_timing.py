"""The optimizer step as the Trainer runs it, by itself: the gradient clip and AdamW over a
model's parameter groups (`training.optim.param_groups`), f32 parameters with random
gradients, three ways taking turns within each round:

  foreach      clip_grad_norm_(foreach=True), then AdamW's default (foreach) step
  fused        clip_grad_norm_, then AdamW(fused=True)
  fused+fold   get_total_norm, the clip factor into the fused step's `grad_scale` (what the
               Trainer does with a fused AdamW: no separate pass scaling the gradients)

Median, p10 and p90 over rounds, ms a step (CUDA: synchronised per round).

    python scripts/optimizer_timing.py --out benchmarks/results/DATE-optimizer-cpu.json
    python scripts/optimizer_timing.py --device cuda --models 130m 1.4b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import write_record  # noqa: E402

from mambakit import MambaBackbone, MambaConfig, MambaLM  # noqa: E402
from mambakit.training.optim import clip_factor, param_groups  # noqa: E402

MODELS = {
    "rl-128x3": lambda: MambaBackbone(MambaConfig(d_model=128, n_layers=3, input_dim=64)),
    "tiny": lambda: MambaLM(MambaConfig.preset("tiny")),
    "130m": lambda: MambaLM(MambaConfig.preset("130m")),
    "1.4b": lambda: MambaLM(MambaConfig.preset("1.4b")),
}
WAYS = ("foreach", "fused", "fused+fold")


def stepper(params: list[torch.Tensor], model, way: str, clip: float, device):
    groups = param_groups(model, 0.1)
    opt = torch.optim.AdamW(groups, lr=1e-4, fused=way != "foreach")
    scale = torch.ones((), device=device)
    grads = [p.grad for p in params]

    def step():
        if way == "fused+fold":
            clip_factor(grads, clip, scale)
            opt.grad_scale = scale
        else:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()

    return step


def time_model(name: str, device: torch.device, rounds: int, calls: int) -> list[dict]:
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    n = sum(p.numel() for p in params)
    steps = {w: stepper(params, model, w, 1.0, device) for w in WAYS}
    for s in steps.values():  # the optimizer state, and a warm cache
        s()
        s()
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(rounds):
        for w, s in steps.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                s()
            sync()
            times[w].append((time.perf_counter() - t0) / calls * 1e3)
    rows = []
    for w, ts in times.items():
        q = statistics.quantiles(ts, n=10) if len(ts) > 1 else [ts[0]] * 9
        rows.append({"workload": "clip + AdamW step", "model": name, "params": n, "impl": w,
                     "device": device.type, "threads": torch.get_num_threads(),
                     "rounds": rounds, "calls_per_round": calls,
                     "median_ms": statistics.median(ts), "p10_ms": q[0],
                     "p90_ms": q[-1]})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", default=["rl-128x3", "tiny", "130m"],
                    choices=list(MODELS))  # fmt: skip
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    ap.add_argument("--out", help="write the results record (JSON) here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for name in args.models:
        small = name in ("rl-128x3", "tiny") or device.type == "cuda"
        rows += time_model(name, device, args.rounds, 20 if small else 1)
    write_record(args.out, "optimizer_timing", rows, device=device,
                 context={"clip": 1.0, "lr": 1e-4, "weight_decay": 0.1})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
