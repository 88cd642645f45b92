"""Graph and eager prefill (benchmarks/bench_decode.py's prefill table) with programmatic
dependent launch on and off, in one process, with the peer when installed:

    PYTHONPATH=src python scripts/prefill_pdl.py --presets 130m 1.4b --out pdl.json
"""

import argparse
import importlib.util
import json
from pathlib import Path

import torch

import mambakit.ops._triton as triton_helpers

spec = importlib.util.spec_from_file_location(
    "bench_decode", Path(__file__).parents[1] / "benchmarks" / "bench_decode.py"
)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--presets", nargs="+", default=["130m"])
    p.add_argument("--rounds", type=int, default=2, help="on/off alternations")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    args = argparse.Namespace(dtype="bf16", prefill_len=4096, presets=a.presets, no_peers=False)
    device = torch.device("cuda")
    rows = []
    for r in range(a.rounds):
        for pdl in (True, False):
            triton_helpers.USE_PDL = pdl
            for rec in bench.prefill_table(args, device):
                rec.update(pdl=pdl, round=r)
                rows.append(rec)
                print(
                    f"round {r} pdl {pdl}: {rec['workload']} {rec['impl']} "
                    f"eager {rec['eager_ms']:.3f} graph {rec['graph_ms']}",
                    flush=True,
                )
    triton_helpers.USE_PDL = True
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
