"""The small float-input backbone on the CPU in one line, for timing two trees in turn:

    for t in new old new old; do PYTHONPATH=<tree>/src python scripts/rl_cpu_timing.py; done

MambaBackbone(d_model 128, 3 layers, input_dim 64), f32, batch 1: `step()` under no_grad,
15 timings of 500 calls (us per call, min and median); forward + backward of a T=32
window (MSE of a Linear(128, 8) head, gradients dropped), 9 timings of 20 (ms)."""

from __future__ import annotations

import statistics
import timeit

import torch
import torch.nn.functional as F
from torch import nn

from mambakit import MambaBackbone, MambaConfig

MIXERS = {"mamba1": {}, "mamba3": {"headdim": 16}, "mamba2": {"headdim": 32}}


def model(mixer: str) -> MambaBackbone:
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=128, n_layers=3, input_dim=64, mixer=mixer, **MIXERS[mixer])
    return MambaBackbone(cfg)


def step_us(mixer: str) -> list[float]:
    m = model(mixer)
    state, x = m.init_state(1), torch.randn(1, 64)
    with torch.no_grad():
        for _ in range(50):
            m.step(x, state)
        return [timeit.timeit(lambda: m.step(x, state), number=500) / 500 * 1e6
                for _ in range(15)]  # fmt: skip


def window(mixer: str, batch: int = 1):
    """A forward + backward of a T=32 window (MSE of a Linear(128, 8) head), gradients dropped."""
    m = model(mixer)
    head = nn.Linear(128, 8)
    params = [*m.parameters(), *head.parameters()]
    x, target, state = torch.randn(batch, 32, 64), torch.randn(batch, 32, 8), m.init_state(batch)

    def run() -> None:
        out, _ = m(x, state)
        F.mse_loss(head(out), target).backward()
        for p in params:
            p.grad = None

    return run


def fwd_bwd_ms(mixer: str) -> list[float]:
    run = window(mixer)
    for _ in range(10):
        run()
    return [timeit.timeit(run, number=20) / 20 * 1e3 for _ in range(9)]


def main() -> None:
    parts = []
    for mixer in MIXERS:
        t = step_us(mixer)
        parts.append(f"{mixer} step min {min(t):.1f} median {statistics.median(t):.1f}")
    for mixer in ("mamba1", "mamba3"):
        t = fwd_bwd_ms(mixer)
        parts.append(f"{mixer} fwd+bwd min {min(t):.2f} median {statistics.median(t):.2f} ms")
    print(" | ".join(parts))


if __name__ == "__main__":
    main()
