"""Registers and spills of the scan kernels for sm_90, compiled offline (no GPU needed).

python scripts/ptxas_report.py '{"TC": 16, "BLOCK_D": 16, "num_warps": 4}' ...
Each argument is a JSON config (keys TC, BLOCK_D, BLOCK_N, num_warps); prints registers and
stack bytes (spills) per kernel from cuobjdump -res-usage of Triton's own cubin.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mambakit.ops.selective_scan import kernels as K  # noqa: E402

KERNELS = ["_fwd_kernel", "_bwd_kernel", "_bwd_local_kernel"]


def report(cfg: dict) -> None:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    for name in KERNELS:
        fn = getattr(K, name)
        sig, consts = {}, {}
        for p in fn.params:
            if p.is_constexpr:
                consts[p.name] = cfg.get(p.name, p.name not in ("LOCAL", "SPLIT_N"))
                sig[p.name] = "constexpr"
            elif p.name.startswith("p_"):
                t = p.name[2:]  # the tensor
                sig[p.name] = "*i32" if "seq" in t else ("*bf16" if t[0] in "udzCB" else "*fp32")
            else:
                sig[p.name] = "i32"
        for k in ("TC", "BLOCK_D", "BLOCK_N"):
            consts[k] = cfg[k]
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        k = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]}
        )
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True)
        out = out.stdout + out.stderr
        regs = re.findall(r"REG:(\d+)", out)
        spill = re.findall(r"STACK:(\d+)", out)
        print(json.dumps(cfg), name, "regs", regs, "stack", spill, flush=True)


if __name__ == "__main__":
    for arg in sys.argv[1:] or ['{"TC": 16, "BLOCK_D": 16, "BLOCK_N": 16, "num_warps": 4}']:
        report(json.loads(arg))
