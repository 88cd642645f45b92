"""Every Triton kernel compiles for the H200 (sm_90) without a GPU.

The interpreter that runs the kernels in CI accepts code that the GPU compiler
rejects (a plain Python global read inside a kernel, say); compiling each kernel
to a cubin for sm_90 here catches that before a device run does. The compile
runs in a subprocess: the kernels must be imported without TRITON_INTERPRET.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

MODULES = [
    "mambakit.ops.selective_scan.forward",
    "mambakit.ops.selective_scan.backward",
    "mambakit.ops.selective_scan.replay",
    "mambakit.ops.selective_scan.carry",
    "mambakit.ops.selective_scan.step",
    "mambakit.ops._triton",
    "mambakit.ops.causal_conv1d.forward",
    "mambakit.ops.causal_conv1d.backward",
    "mambakit.ops.causal_conv1d.step",
    "mambakit.ops.rms_norm.kernels",
    "mambakit.ops.rms_norm_gated.kernels",
    "mambakit.ops.cross_entropy.kernels",
    "mambakit.ops.argmax.kernels",
    "mambakit.ops.mamba_step.kernels",
    "mambakit.ops.mamba2.step_kernels",
    "mambakit.ops.mamba2.ssd_kernels",
    "mambakit.ops.mamba3.chunk_kernels",
    "mambakit.ops.mamba3.chunk_bwd_kernels",
    "mambakit.ops.mamba3.chunk_parallel_kernels",
]
CONSTS = {  # representative values of the kernels' constexpr parameters
    "BLOCK_D": 32, "BLOCK_N": 16, "BLOCK_E": 64, "BLOCK_T": 16, "BLOCK_K": 4, "BLOCK_M": 4,
    "CHUNK": 16, "CB": 8, "K": 4, "TC": 4, "TS": 2, "STAGES": 2, "BLOCK_V": 128, "IGNORE": -100,
    "L": 32, "LS": 64, "PREC": "bf16", "BLOCK_P": 32, "BLOCK": 256, "CHUNKS": 4,
}  # fmt: skip
# where a kernel's products need other values (tl.dot takes blocks of 16 or more)
OVERRIDES = {"_ssd_y_kernel": {"BLOCK_M": 16}, "_ssd_state_kernel": {"BLOCK_K": 16}}
# kernels compiled once more with other values: the code paths those values select
VARIANTS = {  # a replay, masked or not; the conv backward's rows unrolled
    "_replay_kernel": [{"KS": 8}, {"KS": 8, "EVEN": False}],
    "_conv_bwd_rows_kernel": [{"ROWS": 4, "BLOCK_D": 256}],
}


def _signature(fn) -> tuple[dict, dict]:
    sig, consts = {}, {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            consts[name] = CONSTS.get(name, True)  # flags: the path with every feature on
            sig[name] = "constexpr"
        elif name.startswith("p_"):
            sig[name] = "*i32" if "seq" in name else "*i64" if "tgt" in name else "*fp32"
        elif name in ("eps", "lo", "hi"):  # floats: the norm's eps, delta's limits
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    if "BLOCK_M" in consts:  # the norm holds a whole row per program
        consts["BLOCK_N"] = 128
    consts.update(OVERRIDES.get(fn.__name__, {}))
    return sig, consts


def compile_all() -> list[str]:
    """Compile every `*_kernel` of MODULES for sm_90; returns the failures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures, n = [], 0
    for mod in MODULES:
        m = importlib.import_module(mod)
        for name in sorted(vars(m)):
            fn = getattr(m, name)
            if not (name.endswith("_kernel") and hasattr(fn, "params")):
                continue
            sig, consts = _signature(fn)
            for extra in [{}, *VARIANTS.get(name, [])]:
                try:
                    src = ASTSource(fn=fn, signature=sig, constexprs={**consts, **extra})
                    k = triton.compile(
                        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}
                    )
                    assert k.asm["cubin"]
                    n += 1
                except Exception as e:  # report every kernel, not just the first
                    failures.append(f"{mod}.{name} {extra}: {type(e).__name__}: {str(e)[-400:]}")
    if n == 0:
        failures.append("no kernel found to compile")
    return failures


def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


if __name__ == "__main__":
    bad = compile_all()
    print("\n".join(bad) if bad else "all kernels compiled for sm_90")
    sys.exit(1 if bad else 0)
