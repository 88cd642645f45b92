"""The training step by kernel against each kernel's roofline (DESIGN.md section 7).

Reads the per-kernel table that `bench_model.py --profile` writes (one eager step of a
Mamba-1 preset: kernel name, GPU time, calls) and the results record of the same run, and
groups the kernels by what they do. For each group it computes what the work must cost at
the H200's rates: bytes moved once at the copy rate, exponentials at the `exp2` rate, GEMM
FLOPs at the bf16 matmul rate measured in that run; the bound is the largest, "of bound"
that time over the measured one (100% = at the bound). The shapes are the preset's; the
bytes are the kernels' inputs and outputs as the library lays them out (bf16 activations,
f32 delta, the scan states the library saves (`selective_scan.scan_config`: every 4 steps, or
32 at d_inner >= 4096, rebuilt per tile before each backward), dB/dC partials per 16
channels).

    python benchmarks/kernel_roofline.py --profile profile_train_step.txt \\
        --record bench_model.json --out benchmarks/results/DATE-kernels-130m.json

Writes a results record (benchmark "kernel_roofline") whose figures are the groups;
benchmarks/table.py puts them in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mambakit import MambaConfig  # noqa: E402
from mambakit.ops.selective_scan.scan_config import config, save_interval  # noqa: E402

COPY = 4.27e12  # B/s, device-to-device copy on the H200 (DESIGN.md section 7)
EXP2 = 4.0e12  # exponentials/s, tl.math.exp2

# (group, what it does, name test), first match wins
GROUPS = [
    ("scan backward", "selective scan backward (recomputes the states)", "^_bwd_kernel$"),
    ("scan forward", "selective scan forward, saving states", "^_fwd_kernel$"),
    ("scan replay", "the scan's tile-start states rebuilt from the saved ones",
     "^_replay_kernel$"),
    ("scan dB/dC sum", "sum of the backward's per-block dB, dC partials (and dA, dD, dbias)",
     "^_sum_partials_kernel$|sum_blocks_kernel"),
    ("conv backward", "causal conv1d backward", "_conv_bwd"),
    ("conv forward", "causal conv1d + silu (forward and its recompute)", "_conv_fwd"),
    ("dt_proj", "dt_proj GEMM + softplus epilogue (forward and recompute)", "_dt_proj_kernel"),
    ("rmsnorm backward", "residual add + RMSNorm backward", "_rms_bwd"),
    ("rmsnorm forward", "residual add + RMSNorm forward", "_rms_fwd"),
    ("cross-entropy", "cross-entropy over the logits, forward and backward", "_ce_"),
    ("GEMM", "cuBLAS GEMMs: projections, head, their gradients", "nvjet|gemm|xmma|cutlass"
     "|splitKreduce"),
    ("optimizer", "fused AdamW, gradient norm and clipping (foreach kernels)",
     "multi_tensor_apply"),
    ("other", "PyTorch elementwise, casts, copies, reductions, memsets", ""),
]  # fmt: skip

_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_profile(text: str) -> tuple[list[tuple[str, float, int]], float | None, int | None]:
    """(kernel name, GPU ms, calls) of each row of the profiler's table (the first table
    in the file: one eager step's kernels, its largest rows), and the step's GPU ms and
    kernel count from the line above it (None where the file has none)."""
    head = re.search(r"one eager step: (\d+) GPU kernels/copies, ([\d.]+) ms of GPU time", text)
    total = float(head.group(2)) if head else None
    count = int(head.group(1)) if head else None
    rows = []
    for line in text.splitlines():
        if line.startswith("Self CPU time total") or line.startswith("Self CUDA time total"):
            if rows:
                break
        m = re.match(r"^(.*?)\s{2,}(.*)$", line.strip())
        if not m:
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) < 6 or not cells[-1].isdigit():
            continue
        times = [c for c in cells if re.fullmatch(r"[\d.]+(us|ms|s)", c)]
        if len(times) < 3:
            continue
        value = re.fullmatch(r"([\d.]+)(us|ms|s)", times[-3])  # Self CUDA
        rows.append((cells[0], float(value.group(1)) * _UNIT[value.group(2)], int(cells[-1])))
    return rows, total, count


def group_of(name: str) -> str:
    for group, _, test in GROUPS:
        if not test or re.search(test, name):
            return group
    return "other"


def bounds(cfg: MambaConfig, batch: int, seqlen: int, tflops: float, params: int) -> dict:
    """{group: (bound ms, what bounds it, per call)}: a kernel group's time at the
    roofline, per call (one call per layer, or its recompute too) or for the whole step."""
    n = batch * seqlen
    M, D, N = cfg.d_model, cfg.expand * cfg.d_model, cfg.d_state
    R, V, L = cfg.dt_rank, cfg.vocab_size, cfg.n_layers

    def copy_ms(bytes_per_token: float) -> float:
        return n * bytes_per_token / COPY * 1e3

    def larger(exp_ms: float, bytes_ms: float) -> tuple:
        return (exp_ms, "exp2", True) if exp_ms > bytes_ms else (bytes_ms, "bytes", True)

    exp_ms = n * D * N / EXP2 * 1e3  # one exponential per (token, channel, state)
    scan = config(D, False)  # the GPU's launch parameters at this width
    saved = 4 * D * N / save_interval(scan)  # the forward's states, bytes a token
    per_tile = 4 * D * N / scan.bwd_tile  # the backward's tile-start states
    partials = 2 * 4 * N * D / scan.bwd_block_d  # dB, dC partials per backward program
    inputs = 2 * D + 4 * D + 2 * D + 2 * 2 * N  # u, delta (f32), z, B, C
    per_layer = M * 2 * D + D * (R + 2 * N) + D * M  # in_proj, x_proj, out_proj
    gemm_flops = 6 * n * (L * per_layer + M * V) + 4 * n * L * R * D  # + dt_proj's gradients
    return {
        "scan forward": larger(exp_ms, copy_ms(inputs + 2 * D + saved)),
        "scan backward": larger(exp_ms, copy_ms(inputs + 2 * D + per_tile + 8 * D + partials)),
        "scan replay": (copy_ms(saved + 2 * D + 4 * D + 2 * N + per_tile), "bytes", True),
        "scan dB/dC sum": (copy_ms(partials + 2 * 4 * N), "bytes", True),
        "conv forward": (copy_ms(2 * D + 2 * D), "bytes", True),
        "conv backward": (copy_ms(3 * 2 * D), "bytes", True),
        "dt_proj": (copy_ms(2 * R + 4 * D), "bytes", True),
        "rmsnorm forward": (copy_ms(12 * M), "bytes", True),
        "rmsnorm backward": (copy_ms(16 * M), "bytes", True),
        "cross-entropy": (copy_ms(2 * V + 4 * V), "bytes", False),  # logits read; grad
        "GEMM": (gemm_flops / (tflops * 1e12) * 1e3, "FLOPs", False),
        "optimizer": (40 * params / COPY * 1e3, "bytes", False),  # AdamW 28 B, clipping 12
    }


def kernel_figures(rows, cfg, batch, seqlen, tflops, params, preset, total=None, count=None):
    """One figure per group: calls, ms, share of the step's GPU time, bound and of bound;
    the kernels past the table's rows (`total`, `count`: the whole step's) as "the rest"."""
    listed = sum(ms for _, ms, _ in rows)
    total = max(total or 0.0, listed)
    limits = bounds(cfg, batch, seqlen, tflops, params)
    out = []
    base = {"workload": "training step by kernel", "preset": preset, "batch": batch,
            "seqlen": seqlen}  # fmt: skip
    for group, what, _ in GROUPS:
        mine = [(name, ms, c) for name, ms, c in rows if group_of(name) == group]
        if not mine:
            continue
        ms = sum(m for _, m, _ in mine)
        calls = sum(c for _, _, c in mine)
        names = sorted({name for name, _, _ in mine})[:6]
        fig = {**base, "group": group, "what": what, "calls": calls, "ms": ms,
               "share": ms / total, "kernels": names}  # fmt: skip
        if group in limits:
            limit, kind, per_call = limits[group]
            bound_ms = limit * calls if per_call else limit
            fig.update(bound_ms=bound_ms, bound=kind, of_bound=bound_ms / ms)
        out.append(fig)
    calls = sum(c for _, _, c in rows)
    if total > listed:
        out.append({**base, "group": "the rest", "what": "kernels past the profile's rows",
                    "calls": (count or calls) - calls, "ms": total - listed,
                    "share": (total - listed) / total})  # fmt: skip
    # the step with every group at its bound (the groups without one as measured)
    at_bounds = sum(f.get("bound_ms", f["ms"]) for f in out)
    out.append({**base, "group": "all", "what": "one eager step's kernels",
                "calls": count or calls, "ms": total, "share": 1.0, "bound_ms": at_bounds,
                "bound": "each group at its bound", "of_bound": at_bounds / total})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="bench_model.py --profile's file")
    ap.add_argument("--record", required=True, help="bench_model.py's record of the same run")
    ap.add_argument("--out", help="write the results record (JSON) here")
    args = ap.parse_args()
    record = json.loads(Path(args.record).read_text())
    ctx = record.get("context", {})
    preset = ctx.get("preset", "130m")
    row = next(f for f in record["figures"] if "seqlen" in f)
    cfg = MambaConfig.preset(preset)
    if cfg.mixer != "mamba1":
        raise SystemExit(f"--record: a Mamba-1 preset's step is modelled here, not {cfg.mixer}")
    rows, total, count = parse_profile(Path(args.profile).read_text())
    if not rows:
        raise SystemExit(f"--profile: no kernel table in {args.profile}")
    figures = kernel_figures(rows, cfg, row["batch"], row["seqlen"], ctx["matmul_tflops"],
                             ctx["params"], preset, total, count)  # fmt: skip
    for f in figures:
        bound = ""
        if "bound" in f:
            bound = f"{f['bound_ms']:8.2f} ms {f['bound']:>6} {f['of_bound']:5.0%}"
        print(f"{f['group']:18} {f['calls']:5d} {f['ms']:8.2f} ms {f['share']:5.1%}  {bound}")
    if args.out:
        out = {**record, "benchmark": "kernel_roofline", "figures": figures}
        out["command"] = " ".join(["python", "benchmarks/kernel_roofline.py", *sys.argv[1:]])
        out["context"] = {**ctx, "from": record.get("command"), "copy_bytes_per_s": COPY,
                          "exp2_per_s": EXP2}  # fmt: skip
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
