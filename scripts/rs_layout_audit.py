"""Check offline (no GPU) that the scan backward's channel sums get the register layout their
inline-asm shuffles assume, for every flag combination and tile the launchers use.

The reduce-scatter in channel_sum.py exchanges values between lanes with `shfl.sync.bfly`,
which is right only when the [TC, BLOCK_N, BLOCK_D] tile entering it has Triton's default
blocked layout (channels on the low lane bits). Triton picks layouts itself, so a change to
the kernel can move the tile to another layout; the tests catch that only on a GPU.

    python scripts/rs_layout_audit.py          # prints each combination, exits 1 on a miss
    python scripts/rs_layout_audit.py --quick  # the GPU tile, flags all off or all on (CI)
"""

from __future__ import annotations

import itertools
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mambakit.ops.selective_scan import kernels as K  # noqa: E402
from mambakit.ops.selective_scan.channel_sum import reduce_scatter_fits  # noqa: E402

BF16 = {"p_u", "p_dt", "p_B", "p_C", "p_z", "p_dy", "p_du", "p_ddt", "p_dz"}
FLAGS = ["HAS_SEQ", "HAS_G", "HAS_H0", "EVEN"]


def rs_layouts(consts: dict, warps: int) -> list[str]:
    fn = K._bwd_kernel
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.startswith("p_"):
            sig[p.name] = "*i32" if "seq" in p.name else ("*bf16" if p.name in BF16 else "*fp32")
        else:
            sig[p.name] = "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ir = k.asm["ttgir"]
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ir, re.M))
    tc, bn, bd = consts["TC"], consts["BLOCK_N"], consts["BLOCK_D"]
    ins = re.findall(rf"tt\.reshape %\S+ : tensor<{tc}x{bn}x{bd}xf32, (#\w+)>", ir)
    return [defs.get(name, name) for name in ins]


def main(quick: bool) -> int:
    cfg = K.config(1536, interpret=False)
    tiles = [(cfg.bwd_tile, cfg.bwd_block_d, 16), (cfg.bwd_tile, 8, 16), (cfg.bwd_tile, 16, 8)]
    combos = list(itertools.product([False, True], repeat=4))
    if quick:
        tiles, combos = tiles[:1], [(f, f, f, e) for f in (False, True) for e in (False, True)]
    bad = 0
    for (tc, bd, bn), flags in itertools.product(tiles, combos):
        if not reduce_scatter_fits(tc, bd, bn, cfg.bwd_warps):
            continue
        consts = {p.name: True for p in K._bwd_kernel.params if p.is_constexpr}
        consts.update(dict(zip(FLAGS, flags)), SPLIT_N=False, RS=True, RS_ASM=True)
        consts.update(TC=tc, BLOCK_D=bd, BLOCK_N=bn)
        layouts = rs_layouts(consts, cfg.bwd_warps)
        default = f"threadsPerWarp = [1, {32 // bd}, {bd}]"
        ok = len(layouts) == 2 and all(
            lay.startswith("#ttg.blocked<{sizePerThread = [1, 1, 1], " + default)
            and "order = [2, 1, 0]" in lay
            for lay in layouts
        )
        bad += not ok
        print("ok  " if ok else "MISS", (tc, bd, bn), dict(zip(FLAGS, flags)), flush=True)
        if not ok:
            for lay in layouts:
                print("     ", lay[:160])
    print("triton", triton.__version__, "misses:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main("--quick" in sys.argv[1:]))
