"""Launch settings inside the model: 130m graph prefill, 1 x 4096 (H200).

PYTHONPATH=src python scripts/prefill_launch_sweep.py --out prefill_launch.json [--dt-proj]

The conv alone (scripts/conv_sweep.py) reads an input that stays in L2 from call to call;
in the model it follows in_proj's GEMM. Each setting (groups of 4 times, channels, warps of
the K <= 4 kernel; groups 0: the general tile kernel) is captured in its own graph of the
whole prefill (backbone, LM head on the last position) and replayed; the settings take
turns over three rounds, and each keeps its median. Logits are compared with the first's
(the tile kernel rounds u differently: within bf16). --dt-proj: the dt_proj kernel's
(rows, channels, warps, channel tiles per program, pipeline stages) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import capture_graph, interleaved_median_ms  # noqa: E402

from mambakit import MambaConfig, MambaLM  # noqa: E402
from mambakit.ops.causal_conv1d import kernels as K  # noqa: E402
from mambakit.ops.mamba_inner import kernels as DT  # noqa: E402

SETTINGS = [(8, 128, 4), (0, 0, 0), (16, 128, 4), (8, 64, 2), (16, 64, 2), (4, 128, 2)]
CONV = ("QUAD_BLOCK_G", "QUAD_BLOCK_D", "QUAD_WARPS")
DT_SETTINGS = [
    (64, 64, 4, 4, 3),
    (64, 128, 4, 2, 3),
    (128, 64, 4, 4, 3),
    (64, 64, 4, 2, 3),
    (32, 64, 2, 4, 3),
    (64, 64, 8, 4, 3),
    (64, 64, 4, 6, 2),
    (128, 128, 8, 1, 3),
]
DT_NAMES = ("BLOCK_M", "BLOCK_D", "WARPS", "D_TILES", "STAGES")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--dt-proj", action="store_true")
    args = ap.parse_args()
    module, names, settings = (DT, DT_NAMES, DT_SETTINGS) if args.dt_proj else (K, CONV, SETTINGS)

    def use(setting):
        for name, value in zip(names, setting):
            setattr(module, name, value)

    preset = MambaConfig.preset("130m")
    torch.manual_seed(0)
    ids = torch.randint(0, preset.vocab_size, (1, 4096), device="cuda")
    model = MambaLM(preset, device="cuda").to(torch.bfloat16).eval()
    logits = {}

    def prefill(key):
        with torch.inference_mode():
            logits[key], _ = model.last_logits(ids)

    graphs = {}
    default = tuple(getattr(module, name) for name in names)
    for s in settings:
        use(s)
        graphs[s] = capture_graph(lambda s=s: prefill(s), warmup=2)
    use(default)
    replays = {s: g.replay for s, g in graphs.items()}
    ms = interleaved_median_ms(replays, warmup=1, rounds=3, iters=10)
    rows = []
    for s in settings:
        graphs[s].replay()
        torch.cuda.synchronize()
        diff = (logits[s].float() - logits[settings[0]].float()).abs().max().item()
        rows.append(dict(zip(names, s), ms=ms[s], logits_max_diff=diff))
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
