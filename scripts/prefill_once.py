"""One prefill forward of a preset (bf16, random weights, 1 x T tokens, inference mode): the
program to run under a profiler, e.g.

ncu --clock-control none -k regex:_fwd_kernel -c 2 python scripts/prefill_once.py 130m 4096
"""

from __future__ import annotations

import sys

import torch

from mambakit import MambaConfig, MambaLM


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "130m"
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    cfg = MambaConfig.preset(name)
    torch.manual_seed(0)
    model = MambaLM(cfg, device="cuda").to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    with torch.inference_mode():
        model.last_logits(ids)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
