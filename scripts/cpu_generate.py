"""`generate` on the CPU per token, the tiny presets at batch 1: greedy, sampled and top-k,
on the default path beside the path before the LM's step and the sampler's noise were
compiled (`--baseline`: the general step with torch's head and the noise as tensor ops,
swapped in by hand; the blocks compiled in both). Each figure is the best of `--rounds`,
the two paths in turns. Writes a record with `--out`.

    python scripts/cpu_generate.py --out cpu-generate.json
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import write_record  # noqa: E402

from mambakit import MambaConfig, MambaLM  # noqa: E402
from mambakit.inference import sampling  # noqa: E402
from mambakit.threads import apply_threads  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.0),
    "top_k 50": dict(temperature=1.0, top_k=50),
}


def baseline(on: bool, saved={}) -> None:  # noqa: B006 - the originals, kept across calls
    """Swap in (on) or back (off) the step's general path and the tensor-op noise."""
    model_mod = importlib.import_module("mambakit.model")
    saved.setdefault("rows", model_mod.compiled_rows)
    saved.setdefault("noise", sampling._noise)
    model_mod.compiled_rows = (lambda *a: None) if on else saved["rows"]
    sampling._noise = (
        (lambda s, t, ids: sampling.gumbel_noise(sampling.row_keys(s, t), ids))
        if on
        else saved["noise"]
    )


def per_token_us(model, ids, n: int, kw: dict) -> float:
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=n, **kw)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "tiny-mamba2", "tiny-mamba3"])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = apply_threads()
    figures = []
    for preset in args.presets:
        torch.manual_seed(0)
        model = MambaLM(MambaConfig.preset(preset)).eval()
        ids = torch.tensor([[65, 66, 67]])
        for name, kw in SETTINGS.items():
            best = {}
            for _ in range(args.rounds):
                for path in ("baseline", "default"):
                    baseline(path == "baseline")
                    model.generate(ids, max_new_tokens=8, **kw)
                    us = per_token_us(model, ids, args.tokens, kw)
                    best[path] = min(best.get(path, us), us)
            baseline(False)
            for path, us in best.items():
                figures.append(dict(workload="generate per token", impl=f"mambakit {path}",
                                    preset=preset, batch=1, sampling=name, us=us))  # fmt: skip
            print(f"{preset} {name}: {best['default']:.0f} us/token "
                  f"(baseline {best['baseline']:.0f})", flush=True)  # fmt: skip
    write_record(args.out, "cpu_generate", figures, device="cpu",
                 context={"threads": threads, "tokens": args.tokens, "rounds": args.rounds,
                          "prompt": 3, "settings": SETTINGS})  # fmt: skip


if __name__ == "__main__":
    main()
