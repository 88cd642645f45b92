"""`mambakit demo`: build a model, run a parallel forward, then the same tokens with step()."""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ..config import MambaConfig
from ..model import MambaLM
from ..ops import resolve_backend
from ._common import UsageError, add_threads_flag, check_device, check_seed, set_threads


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", default="tiny", help="model preset (tiny, 130m, ...)")
    p.add_argument("--seqlen", type=int, default=4096, help="timesteps of the parallel forward")
    p.add_argument(
        "--steps", type=int, default=16, help="first timesteps replayed with step() and compared"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    add_threads_flag(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokens")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.seqlen < 1 or args.steps < 1:
        raise UsageError(f"--seqlen and --steps must be positive, got {args.seqlen}, {args.steps}")
    check_seed(args.seed)
    device = check_device(args.device)
    args.device = str(device)
    print(set_threads(args.threads))
    torch.manual_seed(args.seed)
    cfg = MambaConfig.preset(args.preset)
    model = MambaLM(cfg).to(args.device).eval()
    n_params = model.num_parameters()
    ids = torch.randint(0, cfg.vocab_size, (1, args.seqlen), device=args.device)
    backend = resolve_backend("auto", torch.empty(0, device=args.device))
    print(
        f"mambakit demo: preset {args.preset!r} ({n_params / 1e6:.2f}M parameters, "
        f"d_model {cfg.d_model}, {cfg.n_layers} layers), device {args.device}, backend {backend}"
    )
    with torch.inference_mode():
        model(ids[:, :8])  # warm-up
        t0 = time.perf_counter()
        out = model(ids)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(
            f"forward over {args.seqlen} timesteps: {dt * 1e3:.1f} ms "
            f"({args.seqlen / dt:,.0f} tokens/s); state: "
            + ", ".join(f"{k} {list(v.shape)}" for k, v in _tensors(out.state).items())
        )
        n = min(args.steps, args.seqlen)
        state = model.init_state(1)
        t0 = time.perf_counter()
        logits = []
        for t in range(n):
            lt, state = model.step(ids[:, t], state)
            logits.append(lt)
        dt = time.perf_counter() - t0
        prefix = model(ids[:, :n])
        err = (torch.stack(logits, 1) - prefix.logits).abs().max().item()
        ref = _tensors(prefix.state)
        serr = max((v - ref[k]).abs().max().item() for k, v in _tensors(state).items())
        print(
            f"step() x {n}: {dt / n * 1e6:.0f} us per step; max |step - forward| logits "
            f"{err:.2e}, state {serr:.2e}"
        )
    return 0


def _tensors(state) -> dict[str, torch.Tensor]:
    """A model state's buffers by name, whatever the mixer (conv and ssm for Mamba-1)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
