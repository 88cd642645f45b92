"""One forward (saving states) and one backward of the scan at 8x2048x1536x16 bf16: the
program to run under a profiler, e.g.

ncu --clock-control none -k regex:_bwd_kernel -c 1 --section WarpStateStats \\
    python scripts/scan_once.py
"""

from __future__ import annotations

import torch
from scan_sweep import shape_inputs

from mambakit.ops.selective_scan import kernels as K


def main() -> None:
    a, gy = shape_inputs(8, 2048)
    _, _, states = K.scan_fwd(*a, True, None, None, True)
    K.scan_bwd(gy, None, *a, True, None, None, states)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
