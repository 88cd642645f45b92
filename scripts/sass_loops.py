"""A Triton kernel's sm_90 SASS without a GPU: registers, spills, and each loop's instructions.

PYTHONPATH=src python scripts/sass_loops.py mambakit.ops.selective_scan.backward:_bwd_kernel \\
    --warps 1 TC=4 BLOCK_D=16 BLOCK_N=16 HAS_Z=1 HAS_D=1 EVEN=1 RS=1 RS_ASM=1

or every selective-scan kernel as its launchers launch it at one shape, with their arguments,
strides and the library's GPU config (`--set FIELD=INT` changes a ScanConfig field; time is
cut into segments as on a device of `--sms` SMs):

PYTHONPATH=src python scripts/sass_loops.py --scan 1x65536x1536x16 [--set bwd_block_d=16]

Constexprs not given are 0 (flags off); pointer arguments are f32 unless `--bf16 p_u,p_z`
names them. As the JIT specializes them, `--div16` marks every pointer and integer argument
divisible by 16 (allocations are; sizes and strides at the shapes of interest mostly are:
it is what lets masked loads vectorize) and NAME=1 on an integer argument makes it the
constant 1 (a unit stride). Prints the cubin's REG / STACK / LOCAL usage, then for every
loop (a backward branch) its static instruction count and mix: a loop body without branches
runs each of them once an iteration. The SASS depends on the Triton version: the device runs 3.6
(`pip install --target DIR triton==3.6.0`, then PYTHONPATH=DIR:src). Counts are a proxy,
not a timing: what an instruction costs depends on the stalls around it.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile


def _signature(fn, bf16: set[str]) -> dict:
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.startswith("p_"):
            sig[p.name] = "*i32" if "seq" in p.name else "*bf16" if p.name in bf16 else "*fp32"
        elif p.name in ("eps", "lo", "hi"):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
    return sig


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """(start, end, opcode counts) of every loop: a branch back to an earlier label."""
    ins, labels, pending = [], {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            pending = m.group(1)
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            ins.append((addr, m.group(2)))
            if pending:
                labels[pending], pending = addr, None
    found = []
    for addr, text in ins:
        m = re.search(r"BRA.*?`\(\.(L_x_\d+)\)", text)
        if m and labels.get(m.group(1), addr) < addr:
            lo = labels[m.group(1)]
            ops = collections.Counter(
                re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if lo <= a <= addr
            )
            found.append((lo, addr, ops))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "kernel", nargs="?", help="module:function, e.g. mambakit.ops.rms_norm.kernels:_fwd"
    )
    ap.add_argument("consts", nargs="*", help="NAME=int constexprs")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--bf16", default="", help="pointer arguments that are bf16, comma-separated")
    ap.add_argument("--div16", action="store_true", help="pointers and integers divisible by 16")
    ap.add_argument("--sass", help="write the whole SASS here")
    ap.add_argument("--maxnreg", type=int, help="cap the registers per thread (spills show)")
    ap.add_argument("--scan", metavar="BxTxDxN", help="every selective-scan kernel at this shape")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help="--scan: a ScanConfig field other than the library's (repeatable)",
    )
    ap.add_argument("--sms", type=int, default=132, help="--scan: SMs for the time segments")
    args = ap.parse_intermixed_args()
    if args.scan:
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
        scan_kernels(args.scan, args.set, args.sms, args.sass)
        return
    if not args.kernel:
        ap.error("a kernel (module:function) or --scan BxTxDxN")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, name = args.kernel.split(":")
    fn = getattr(importlib.import_module(mod), name)
    consts = {p.name: 0 for p in fn.params if p.is_constexpr}
    for kv in args.consts:
        k, v = kv.split("=")
        consts[k] = int(v)
    sig = _signature(fn, set(args.bf16.split(",")))
    for k in consts:
        sig[k] = "constexpr"
    attrs = {}
    if args.div16:
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, p in enumerate(fn.params)
            if sig[p.name] != "constexpr" and not sig[p.name].startswith("fp")
        }
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": args.warps}
    if args.maxnreg:
        options["maxnreg"] = args.maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    report(name, k.asm["cubin"], args.sass)


def report(name: str, cubin: bytes, sass_path: str | None) -> None:
    """Print a compiled kernel's register use and each of its loops' instruction mix."""
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True)
        res = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True
        )
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res.stdout)
    print(f"triton {triton.__version__}, {name}:", usage.group(0) if usage else res.stdout.strip())
    if sass_path:
        with open(sass_path, "w") as f:
            f.write(sass.stdout)
    for lo, hi, ops in loops(sass.stdout):
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(14))
        print(f"loop {lo:#x}-{hi:#x}: {sum(ops.values())} instructions: {top}")


class _Sm90Driver:
    """What the JIT asks Triton's driver before it compiles: device, stream, target."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def scan_kernels(shape: str, sets: list[str], sms: int, sass_dir: str | None) -> None:
    """Compile every selective-scan kernel of a forward (saving states) and backward at
    shape BxTxDxN as the launchers would (bf16 inputs, the library's GPU config), through a
    stand-in driver; nothing runs (CPU tensors give the dtypes, strides and alignment)."""
    import dataclasses

    import torch
    import triton

    from mambakit.ops.selective_scan import launch as K
    from mambakit.ops.selective_scan import programs

    Bsz, T, Dn, N = (int(v) for v in shape.lower().split("x"))
    triton.runtime.driver.set_active(_Sm90Driver())
    cfg = K.config(Dn, False)
    for item in sets:
        key, _, value = item.partition("=")
        cfg = dataclasses.replace(cfg, **{key: int(value)})
    compiled = {}

    def compile_only(kernel, grid, *a, **kw):
        if "RS_ASM" in kw:  # the launchers pass u.is_cuda: these are CPU tensors
            kw["RS_ASM"] = True
        name = kernel.fn.__name__ + (" (LOCAL)" if kw.get("LOCAL") else "")
        compiled.setdefault(name, kernel.warmup(*a, grid=grid, **kw))

    K.launch = compile_only
    programs.sm_count = lambda index=0: sms
    cut = programs.time_segments  # cuts time only on a CUDA device: tell it it is on one
    K.time_segments = lambda nc, n, per, c, dev: cut(nc, n, per, c, torch.device("cuda", 0))
    bf16 = torch.bfloat16
    u, delta, z, gy = (torch.randn(Bsz, T, Dn, dtype=bf16) for _ in range(4))
    B, C = (torch.randn(Bsz, T, N, dtype=bf16) for _ in range(2))
    A, D, bias = -torch.rand(Dn, N), torch.randn(Dn), torch.randn(Dn)
    states = torch.zeros(Bsz, -(-T // K.save_interval(cfg)), Dn, N)
    K.scan_fwd(u, delta, A, B, C, D, z, bias, True, None, None, True, cfg=cfg)
    try:
        K.scan_bwd(gy, None, u, delta, A, B, C, D, z, bias, True, None, None, states, cfg=cfg)
    except Exception as e:  # the torch ops after the kernels (nothing ran: CPU tensors)
        print(f"scan_bwd stopped after its kernels: {type(e).__name__}: {e}")
    print(f"{shape}: {cfg}")
    for name, k in compiled.items():
        path = os.path.join(sass_dir, name.replace(" ", "") + ".sass") if sass_dir else None
        report(name, k.asm["cubin"], path)


if __name__ == "__main__":
    main()
