"""One forward (saving states) and one backward of the scan at 8x2048x1536x16 bf16: the
program to run under a profiler, e.g.

ncu --clock-control none -k regex:_bwd_kernel -c 1 --section WarpStateStats \\
    python scripts/scan_once.py
"""

from __future__ import annotations

import torch

from mambakit.ops.selective_scan import kernels as K


def main() -> None:
    Bsz, T, Dn, N = 8, 2048, 1536, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    xz = r(Bsz, T, 2 * Dn).to(bf)
    xb = r(Bsz, T, 2 * N).to(bf)
    dt = (r(Bsz, T, Dn) * 0.1).to(bf)
    A = -torch.arange(1, N + 1, device="cuda", dtype=torch.float32).repeat(Dn, 1)
    a = (xz[..., :Dn], dt, A, xb[..., :N], xb[..., N:], r(Dn), xz[..., Dn:], r(Dn) * 0.1 - 4)
    gy = r(Bsz, T, Dn).to(bf)
    _, _, states = K.scan_fwd(*a, True, None, None, True)
    K.scan_bwd(gy, None, *a, True, None, None, states)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
