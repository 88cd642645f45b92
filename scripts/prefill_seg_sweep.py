"""The forward scan's segments at the prefill shapes: how each segment gets its start state
(each output program composing the summaries before it, or the carry pass) and how many
segments, timed on the scan alone and on the whole 130m graph prefill, mamba_ssm beside it.

PYTHONPATH=src:benchmarks python scripts/prefill_seg_sweep.py --out prefill_seg_sweep.json

Each candidate replaces `ScanConfig.fwd_carry`, `fwd_seg_target_per_sm` and
`fwd_local_tiles` of the library's config (selective_scan/kernels.py); its y is checked
against the library's default. GPU time from CUDA graphs (scan: do_bench_cudagraph median;
prefill: a captured 1 x 4096 forward plus the LM head on the last position, replayed, as
bench_decode's table; the candidates take turns over rounds and the median is kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import graph_time_ms  # noqa: E402

from mambakit import MambaConfig, MambaLM  # noqa: E402
from mambakit.ops.selective_scan import kernels as K  # noqa: E402

# (fwd_carry, fwd_seg_target_per_sm, fwd_local_tiles)
CANDIDATES = [
    (False, 8, 2),
    (True, 8, 2),
    (True, 10, 2),
    (True, 12, 2),
    (True, 16, 2),
    (True, 24, 2),
    (False, 12, 2),
    (True, 12, 1),
    (True, 16, 4),
]


def patched(carry: bool, target: int, local_tiles: int):
    """K.config with this candidate's segment settings (restored by the caller)."""
    orig = K.config

    def config(Dn: int, interpret: bool):
        base = orig(Dn, interpret)
        return dataclasses.replace(
            base, fwd_carry=carry, fwd_seg_target_per_sm=target, fwd_local_tiles=local_tiles
        )

    return config


def scan_rows(g: torch.Generator) -> list[dict]:
    rows = []
    orig = K.config
    for D in (1536, 4096):
        N, T, bf = 16, 4096, torch.bfloat16
        u, z = (torch.randn(1, T, D, device="cuda", generator=g).to(bf) for _ in range(2))
        dt = torch.rand(1, T, D, device="cuda", generator=g) * 0.1
        A = -torch.arange(1, N + 1, device="cuda", dtype=torch.float32).repeat(D, 1)
        B, C = (torch.randn(1, T, N, device="cuda", generator=g) for _ in range(2))
        Dv = torch.ones(D, device="cuda")

        args = (u, dt, A, B, C, Dv, z, None, False, None, None, False)

        def run(args=args):
            return K.scan_fwd(*args)

        ref = run()[0].float()
        for cand in CANDIDATES:
            K.config = patched(*cand)
            try:
                y = run()[0].float()
                us = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3
            finally:
                K.config = orig
            row = dict(kernel="scan_fwd", shape=f"1x{T}x{D}", cand=cand, us=us,
                       y_max_diff=(y - ref).abs().max().item())  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    return rows


def prefill_rows(rounds: int) -> list[dict]:
    preset = MambaConfig.preset("130m")
    torch.manual_seed(0)
    ids = torch.randint(0, preset.vocab_size, (1, 4096), device="cuda")
    model = MambaLM(preset, device="cuda").to(torch.bfloat16).eval()

    def ours():
        with torch.inference_mode():
            hidden, _ = model.backbone(ids)
            model.lm_head(hidden[:, -1])

    orig = K.config
    try:
        from mamba_ssm.models.config_mamba import MambaConfig as SSMConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        cfg = SSMConfig(d_model=preset.d_model, n_layer=preset.n_layers,
                        vocab_size=preset.vocab_size, ssm_cfg={})  # fmt: skip
        peer = MambaLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16).eval()

        def theirs():
            with torch.inference_mode():
                peer(ids, num_last_tokens=1)

    except ImportError:
        theirs = None
    times: dict = {c: [] for c in CANDIDATES}
    times["mamba_ssm"] = []
    for _ in range(rounds):
        for cand in CANDIDATES:
            K.config = patched(*cand)
            try:
                times[cand].append(graph_time_ms(ours, iters=10))
            finally:
                K.config = orig
        if theirs is not None:
            times["mamba_ssm"].append(graph_time_ms(theirs, iters=10))
    rows = []
    peer_ms = statistics.median(times["mamba_ssm"]) if times["mamba_ssm"] else None
    for key, t in times.items():
        if not t:
            continue
        ms = statistics.median(t)
        row = dict(kernel="130m prefill 1x4096 graph", impl=str(key), ms=ms, runs=t)
        if peer_ms and key != "mamba_ssm":
            row["x_peer"] = peer_ms / ms
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = scan_rows(g) + prefill_rows(args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
