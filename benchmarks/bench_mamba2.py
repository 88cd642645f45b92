"""Mamba-2 (SSD) on the GPU, beside mamba_ssm's Mamba2 in the same process.

Rows (bf16, d_model 768, d_state 128, headdim 64, ngroups 1: the 130m-mamba2 layer):

- layer forward (no autograd) and forward + backward at B x T (default 8 x 2048), mambakit
  against mamba_ssm's module on its default path (`mamba_split_conv1d_scan_combined`), the
  same weights, the two taking turns (median of rounds), with each call's peak extra memory;
- the 130m-mamba2 training step (Trainer default: CUDA graph, f32 weights under bf16
  autocast, fused AdamW, clipping) against mamba_ssm's `MambaLMHeadModel` with
  `ssm_cfg={"layer": "Mamba2"}` eager (bench_model.py's peer step), peak memory of each;
- prefill 1 x 4096 and greedy decode (16 + 256 tokens, CUDA graph) at batch 1, 8 and 64,
  mambakit against the peer's `generate(cg=True)` on the same preset.

mamba_ssm's SSD kernels autotune on first use (about two minutes at 8 x 2048); the timing
starts after that.

    PYTHONPATH=src python benchmarks/bench_mamba2.py --out bench_mamba2.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import bench_mamba_ssm, bench_mambakit  # noqa: E402
from bench_model import measure_peer, measure_prefill, measure_trainer  # noqa: E402
from common import layer_rows as timed_layer_rows  # noqa: E402
from common import profile_fwd_bwd, write_record  # noqa: E402

from mambakit import MambaConfig, MambaLM  # noqa: E402
from mambakit.layers.mamba2 import Mamba2  # noqa: E402

# the 130m-mamba2 layer's sizes (mamba_ssm's Mamba2 arguments)
LAYER = dict(d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256)


def _upstream_module():
    try:
        import importlib

        return importlib.import_module("mamba_ssm.modules.mamba2")
    except ImportError as e:
        print(f"mamba_ssm's Mamba2 not importable ({e}): its rows are skipped")
        return None


def layer_rows(batch: int, seqlen: int, d_model: int, iters: int) -> list[dict]:
    mod = _upstream_module()
    dtype = torch.bfloat16
    torch.manual_seed(0)
    ours = Mamba2(d_model, **LAYER, layer_idx=0, device="cuda", dtype=dtype)
    layers = {"mambakit": ours}
    if mod is not None:
        up = mod.Mamba2(d_model, **LAYER, layer_idx=0, device="cuda", dtype=dtype)
        up.load_state_dict(ours.state_dict())
        layers["mamba_ssm"] = up
    u = torch.randn(batch, seqlen, d_model, device="cuda", dtype=dtype)
    if "mamba_ssm" in layers:  # the same output from the same weights, before any timing
        with torch.no_grad():
            a, b = ours(u).float(), layers["mamba_ssm"](u).float()
        print(f"layer outputs, max |mambakit - mamba_ssm| / max |mamba_ssm|: "
              f"{((a - b).abs().max() / b.abs().max()).item():.2e}", flush=True)  # fmt: skip
    return timed_layer_rows("Mamba2 layer", layers, u, iters)


def profile_layer(batch: int, seqlen: int, d_model: int, path: str) -> None:
    """Per-kernel GPU time of one mambakit Mamba2 layer forward + backward (bf16)."""
    torch.manual_seed(0)
    layer = Mamba2(d_model, **LAYER, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(batch, seqlen, d_model, device="cuda", dtype=torch.bfloat16)
    profile_fwd_bwd(layer, u, path)


def model_rows(batch: int, seqlen: int, iters: int, peer: bool) -> list[dict]:
    cfg = MambaConfig.preset("130m-mamba2")
    rec = measure_trainer("130m-mamba2 Trainer (default)", cfg, batch, seqlen, "auto", iters)
    rec["preset"] = "130m-mamba2"
    print(rec, flush=True)
    rows = [rec]
    if peer:
        rec = measure_peer(cfg, batch, seqlen, iters)
        if rec is not None:
            rec["workload"], rec["preset"] = "mamba_ssm 130m Mamba2 eager", "130m-mamba2"
            print(rec, flush=True)
            rows.append(rec)
    return rows


def inference_rows(batches: list[int], new: int, repeats: int, peer: bool) -> list[dict]:
    cfg = MambaConfig.preset("130m-mamba2")
    torch.manual_seed(0)
    model = MambaLM(cfg, device="cuda").to(torch.bfloat16).eval()
    rec = {"workload": "130m-mamba2 prefill 1x4096", "impl": "mambakit", "preset": "130m-mamba2",
           **measure_prefill(model, cfg.vocab_size)}  # fmt: skip
    print(rec, flush=True)
    rows = [rec]
    for b in batches:
        ids = torch.randint(0, cfg.vocab_size, (b, 16), device="cuda")
        found = {}
        for impl in ("mambakit cuda-graph", "mamba_ssm cg=True"):
            if impl.startswith("mambakit"):
                res = bench_mambakit(model, ids, new, graphs=True, repeats=repeats)
            else:
                res = bench_mamba_ssm(cfg, ids, new, torch.bfloat16, repeats) if peer else None
            if res is None:
                continue
            total, prefill = res
            found[impl] = b * new / total
            rec = {"workload": f"130m-mamba2 decode 16+{new}", "impl": impl,
                   "preset": "130m-mamba2", "batch": b, "new_tokens": new,
                   "tokens_per_s": b * new / total,
                   "us_per_step": (total - prefill) / (new - 1) * 1e6}  # fmt: skip
            if impl != "mambakit cuda-graph" and "mambakit cuda-graph" in found:
                rec["mambakit_speedup"] = found["mambakit cuda-graph"] / found[impl]
            print(rec, flush=True)
            rows.append(rec)
    del model
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="8x2048", help="layer and training rows: BATCHxSEQLEN")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode batches")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--only", nargs="+", default=["layer", "model", "inference"],
                   choices=["layer", "model", "inference"])  # fmt: skip
    p.add_argument("--profile", help="write the per-kernel table of a layer fwd+bwd here")
    p.add_argument("--out", default=None, help="write the results record (JSON) here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    batch, seqlen = (int(v) for v in args.shape.lower().split("x"))
    peer = _upstream_module() is not None
    rows = []
    if args.profile:
        profile_layer(batch, seqlen, args.d_model, args.profile)
    if "layer" in args.only:
        rows += layer_rows(batch, seqlen, args.d_model, args.iters)
    if "model" in args.only:
        rows += model_rows(batch, seqlen, args.iters, peer)
    if "inference" in args.only:
        rows += inference_rows(args.batch, args.new_tokens, repeats=3, peer=peer)
    context = {"d_model": args.d_model, "peer_autotune": "full"}
    write_record(args.out, "bench_mamba2", rows, context=context)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
