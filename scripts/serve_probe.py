"""The two costs a serving iteration is made of, by shape: the prefill forward of `rows`
pieces of `n` tokens from a state (graph-replayed, as the engine's `PrefillGraphs`, and
eager), and the batched decode step at each batch size (graph-replayed, as `SlotPool`).
Tokens/s for the prefill, microseconds a step for the decode; bf16, random weights.

    python scripts/serve_probe.py --presets 130m 1.4b --out probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from mambakit import MambaConfig, MambaLM
from mambakit.inference.cuda_graph import capture

PREFILL = [(1, 16), (16, 16), (1, 64), (16, 64), (1, 256), (4, 256), (16, 256), (64, 256),
           (1, 1024), (8, 1024), (1, 2048), (8, 2048), (32, 2048)]  # fmt: skip
DECODE = [1, 16, 32, 64, 96, 128, 160, 192, 224, 256]


def timed(fn, device, reps: int) -> float:
    """Seconds per call, best of 3 rounds of `reps` calls."""
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


@torch.inference_mode(False)
def probe(preset: str, device) -> list[dict]:
    torch.manual_seed(0)
    model = MambaLM(MambaConfig.preset(preset)).to(device=device, dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    out = []
    for rows, n in PREFILL:
        ids = torch.randint(0, vocab, (rows, n), device=device)
        state = model.init_state(rows)
        with torch.no_grad():

            def fwd(ids=ids, state=state):
                model.last_logits(ids, state)

            eager = timed(fwd, device, 3)
            graph, _ = capture(fwd, warmup=2)
            replay = timed(graph.replay, device, 5)
        del graph
        row = dict(preset=preset, kind="prefill", rows=rows, n=n, eager_ms=eager * 1e3,
                   graph_ms=replay * 1e3, graph_tok_s=rows * n / replay)  # fmt: skip
        print(json.dumps(row), flush=True)
        out.append(row)
    for b in DECODE:
        tok = torch.randint(0, vocab, (b,), device=device)
        state = model.init_state(b)
        with torch.no_grad():
            graph, _ = capture(lambda t=tok, s=state: model.step(t, s, cuda_graph=False))
            replay = timed(graph.replay, device, 20)
        del graph
        row = dict(preset=preset, kind="decode", batch=b, step_us=replay * 1e6,
                   tok_s=b / replay)  # fmt: skip
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["130m"])
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for preset in args.presets:
        rows += probe(preset, device)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
