"""The scan backward's channel sums get the register layout their inline-asm shuffles assume.

The reduce-scatter in selective_scan/channel_sum.py exchanges values between lanes with
`shfl.sync.bfly`, which is right only when the [TC, BLOCK_N, BLOCK_D] tile entering it has
Triton's default blocked layout (channels on the low lane bits). Triton picks layouts itself,
so an edit of the kernel can move the tile to another layout (wrong dB on the GPU, nothing
else), and the interpreter that runs the kernels in CI runs no PTX. Here `_bwd_kernel` is
compiled offline for sm_90 (no GPU) with the installed Triton and the layout of the tile is
read from its TTGIR. Layouts differ between Triton versions: run it with the device's Triton
too. As a program it prints each combination and exits 1 on a miss:

    python tests/ops/test_rs_layout.py          # every tile and flag combination
    python tests/ops/test_rs_layout.py --quick  # the GPU tile, flags all off or all on

The compile runs in a subprocess: the kernels must be imported without TRITON_INTERPRET.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest

BF16 = {"p_u", "p_dt", "p_B", "p_C", "p_z", "p_dy", "p_du", "p_ddt", "p_dz"}
FLAGS = ["HAS_SEQ", "HAS_G", "HAS_H0", "EVEN"]


def rs_layouts(consts: dict, warps: int) -> list[str]:
    """The layouts of the [TC, BLOCK_N, BLOCK_D] tiles reshaped for the reduce-scatter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mambakit.ops.selective_scan.backward import _bwd_kernel

    fn = _bwd_kernel
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


def audit(quick: bool) -> int:
    """Compile each combination, print one line each; returns the number of misses."""
    import triton

    from mambakit.ops.selective_scan import launch as K
    from mambakit.ops.selective_scan.backward import _bwd_kernel
    from mambakit.ops.selective_scan.launch import reduce_scatter_fits

    narrow, wide = K.config(1536, interpret=False), K.config(4096, interpret=False)
    # (TC, BLOCK_D, BLOCK_N): the GPU tiles below D 4096 and from it, then d_state 8
    tiles = [(narrow.bwd_tile, narrow.bwd_block_d, 16), (wide.bwd_tile, wide.bwd_block_d, 16),
             (narrow.bwd_tile, 16, 8)]  # fmt: skip
    combos = list(itertools.product([False, True], repeat=4))
    if quick:
        tiles, combos = tiles[:1], [(f, f, f, e) for f in (False, True) for e in (False, True)]
    bad = 0
    for (tc, bd, bn), flags in itertools.product(tiles, combos):
        if not reduce_scatter_fits(tc, bd, bn, narrow.bwd_warps):
            continue
        consts = {p.name: True for p in _bwd_kernel.params if p.is_constexpr}
        consts.update(dict(zip(FLAGS, flags)), SPLIT_N=False, RS=True, RS_ASM=True)
        consts.update(TC=tc, BLOCK_D=bd, BLOCK_N=bn)
        layouts = rs_layouts(consts, narrow.bwd_warps)
        default = f"threadsPerWarp = [1, {32 // bd}, {bd}]"
        ok = len(layouts) == 2 and all(
            lay.startswith("#ttg.blocked<{sizePerThread = [1, 1, 1], " + default)
            and "order = [2, 1, 0]" in lay
            for lay in layouts
        )
        bad += not ok
        print("ok  " if ok else "MISS", (tc, bd, bn), dict(zip(FLAGS, flags)), flush=True)
        for lay in [] if ok else layouts:
            print("     ", lay[:160])
    print("triton", triton.__version__, "misses:", bad)
    return bad


def run_audit(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=900
    )


def test_gpu_tile_gets_the_default_layout():
    """The GPU config's tile with the flags all off or all on (the quick combination; every
    tile and flag combination, `python tests/ops/test_rs_layout.py`, takes about 2 minutes of
    compiles on a cold Triton cache)."""
    proc = run_audit("--quick")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ok  " in proc.stdout, proc.stdout[-4000:]  # at least one tile was compiled


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are imported
    sys.exit(1 if audit("--quick" in sys.argv[1:]) else 0)
