"""Compile the selective scan's kernels for a GPU on a machine without one, and count their
SASS instructions: the whole kernel and the main loop's body, by opcode.

The scan's backward is bound by instructions and latency (ops/selective_scan/README.md),
so instructions per state element is the figure to cut. This compiles the kernels exactly as
the launchers would launch them (the library's GPU `config`, or the tile and channel counts
given) through a stand-in driver that names an sm_90 target, and reads the cubin with the
`nvdisasm`/`cuobjdump` Triton ships. Nothing runs: the tensors are CPU tensors whose only use
is their dtypes, strides and alignment.

    python scripts/sass_probe.py --shape 8x2048x1536x16 [--kernel _bwd_kernel] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class _Sm90Driver:
    """The part of Triton's driver the JIT asks before compiling: device, stream, target."""

    def __init__(self, capability: int, warp_size: int = 32) -> None:
        self.target = GPUTarget("cuda", capability, warp_size)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def _parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) != 4 or min(parts) < 1:
        raise SystemExit(f"--shape: expected BxTxDxN with positive sizes, got {text!r}")
    return tuple(parts)  # type: ignore[return-value]


def _instructions(sass: str) -> list[tuple[str | None, str]]:
    """(label or None, instruction) per line of Triton's SASS listing ("ctrl<TAB>INSTR;" lines,
    labels as "LBB<n>:")."""
    out = []
    for ln in sass.splitlines():
        if re.match(r"^\.?L\w*:$", ln.strip()):
            out.append((ln.strip()[:-1], ""))
        elif "\t" in ln:
            out.append((None, ln.split("\t", 1)[1].strip()))
    return out


def _loop_body(sass: str) -> list[str]:
    """The instructions of the longest loop: from a label to the last branch back to it."""
    lines = _instructions(sass)
    where = {label: i for i, (label, _) in enumerate(lines) if label}
    best = (0, 0)
    for i, (_, ins) in enumerate(lines):
        m = re.search(r"\bBRA\s+(\S+?);", ins)
        if m and m.group(1) in where and where[m.group(1)] < i:
            j = where[m.group(1)]
            if i - j > best[1] - best[0]:
                best = (j, i + 1)
    return [ins for label, ins in lines[best[0] : best[1]] if not label]


def _opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P[T0-9]+\s+", "", ins)
    return ins.split()[0].rstrip(";") if ins else "?"


def _registers(cubin: bytes) -> str:
    """Registers per thread, from the resource usage cuobjdump reports for the cubin."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    spill = re.search(r"LOCAL:(\d+)", out)
    regs = m.group(1) if m else "?"
    return regs + (f" ({spill.group(1)} bytes local)" if spill and spill.group(1) != "0" else "")


def _report(name: str, kernel, dump: str | None) -> None:
    sass = kernel.asm["sass"]
    if sass is None:
        raise SystemExit("no SASS: this Triton cannot disassemble its cubin here")
    meta = kernel.metadata
    body = _loop_body(sass)
    counts = collections.Counter(_opcode(ln) for ln in body)
    total = sum(1 for label, _ in _instructions(sass) if not label)
    print(f"{name}: {meta.num_warps} warp(s), {_registers(kernel.asm['cubin'])} registers, "
          f"{total} instructions, loop body {len(body)}")  # fmt: skip
    print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common()))
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{name}.sass"), "w") as f:
            f.write(sass)
        with open(os.path.join(dump, f"{name}.ttgir"), "w") as f:
            f.write(kernel.asm["ttgir"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8x2048x1536x16", help="BxTxDxN")
    ap.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    ap.add_argument("--capability", type=int, default=90)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help="a ScanConfig field other than the library's (repeatable)",
    )
    ap.add_argument(
        "--sms",
        type=int,
        default=132,
        help="SMs the launch geometry assumes (time segments; H100 132, H200 132)",
    )
    ap.add_argument("--dump", help="write each kernel's SASS and TTGIR here")
    args = ap.parse_args()
    Bsz, T, Dn, N = _parse_shape(args.shape)
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")
    triton.runtime.driver.set_active(_Sm90Driver(args.capability))

    from mambakit.ops.selective_scan import launch as scan_launch
    from mambakit.ops.selective_scan import programs
    from mambakit.ops.selective_scan.scan_config import config

    cfg = config(Dn, False)
    fields = {f.name for f in dataclasses.fields(cfg)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields or not value.lstrip("-").isdigit():
            raise SystemExit(
                f"--set: expected FIELD=INT, FIELD one of {sorted(fields)}; got {item!r}"
            )
        cfg = dataclasses.replace(cfg, **{key: int(value)})
    compiled: dict[str, object] = {}

    def compile_only(kernel, grid, *a, **kw):
        name = kernel.fn.__name__
        if args.kernel and name not in args.kernel:
            return
        if "RS_ASM" in kw:  # the launchers pass u.is_cuda: these are CPU tensors
            kw["RS_ASM"] = True
        compiled[name] = kernel.warmup(*a, grid=grid, **kw)

    scan_launch.launch = compile_only
    programs.sm_count = lambda index=0: args.sms
    cut = programs.time_segments  # cuts time only on a CUDA device: tell it it is on one
    scan_launch.time_segments = lambda nc, n, per_sm, c, device: cut(
        nc, n, per_sm, c, torch.device("cuda", 0)
    )
    bf16 = torch.bfloat16
    u = torch.randn(Bsz, T, Dn, dtype=bf16)
    delta = torch.randn(Bsz, T, Dn, dtype=bf16)
    z = torch.randn(Bsz, T, Dn, dtype=bf16)
    A = -torch.rand(Dn, N)
    Bm = torch.randn(Bsz, T, N, dtype=bf16)
    Cm = torch.randn(Bsz, T, N, dtype=bf16)
    Dv, bias = torch.randn(Dn), torch.randn(Dn)
    ks = cfg.bwd_tile * cfg.bwd_save_tiles
    states = torch.zeros(Bsz, -(-T // ks), Dn, N)
    scan_launch.scan_fwd(u, delta, A, Bm, Cm, Dv, z, bias, True, None, None, True, cfg=cfg)
    gy = torch.randn(Bsz, T, Dn, dtype=bf16)
    try:
        scan_launch.scan_bwd(gy, None, u, delta, A, Bm, Cm, Dv, z, bias, True, None, None,
                             states, cfg=cfg)  # fmt: skip
    except Exception as e:  # the torch sums after the kernels read buffers nothing filled
        if not compiled:
            raise
        print(f"(after the kernels: {type(e).__name__})", file=sys.stderr)
    print(f"shape {Bsz}x{T}x{Dn}x{N}, sm_{args.capability}, {cfg}")
    for name, kernel in compiled.items():
        _report(name, kernel, args.dump)


if __name__ == "__main__":
    main()
