"""Mamba-3 SISO on the GPU, beside upstream's module (mamba_ssm.modules.mamba3.Mamba3) and
beside mambakit's own Mamba-1.

Rows (bf16 modules, d_model 768, d_state 128, headdim 64: the 130m-mamba3 layer):

- layer forward (no autograd) and forward + backward at B x T (default 8 x 2048), mambakit
  against upstream's Triton module with the same weights, the two taking turns (median of
  rounds: upstream's wall time is bound by its host), and each call's peak extra memory;
- the 130m-mamba3 training step (Trainer, f32 weights under bf16 autocast) next to the 130m
  Mamba-1 step and to upstream's MambaLMHeadModel built with its Mamba3 layer (eager);
- prefill 1 x 4096 (forward, CUDA graph) and greedy decode (16 + 256 tokens, CUDA graph) at
  batch 1 and 8, 130m-mamba3 next to 130m. Upstream's Mamba-3 decode needs its CuteDSL
  kernel (not in the peer wheel), so decode has no upstream row.

Upstream autotunes each kernel over 27 to 81 launch configurations on first use (minutes);
the timing starts after that. `--prune-peer` keeps one configuration per upstream kernel
(a quick dry run of the rows, not a fair speed).

    PYTHONPATH=src python benchmarks/bench_mamba3.py --out bench_mamba3.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import bench_mambakit  # noqa: E402
from bench_model import measure_peer, measure_prefill, measure_trainer  # noqa: E402
from common import layer_rows as timed_layer_rows  # noqa: E402
from common import profile_fwd_bwd, write_record  # noqa: E402

from mambakit import MambaConfig, MambaLM  # noqa: E402
from mambakit.layers.mamba3 import Mamba3  # noqa: E402


def _upstream_module():
    try:
        import importlib

        mod = importlib.import_module("mamba_ssm.modules.mamba3")
    except ImportError as e:
        print(f"mamba_ssm's Mamba3 not importable ({e}): its rows are skipped")
        return None
    return mod


def prune_upstream_autotune() -> None:
    """One launch configuration per upstream Mamba-3 kernel (see the module docstring)."""
    import importlib

    from triton.runtime.autotuner import Autotuner

    for name in ("angle_dt", "mamba3_siso_fwd", "mamba3_siso_bwd", "mamba3_siso_step"):
        m = importlib.import_module(f"mamba_ssm.ops.triton.mamba3.{name}")
        for tuner in vars(m).values():
            if isinstance(tuner, Autotuner) and len(tuner.configs) > 1:
                pick = [c for c in tuner.configs if c.num_warps == 4 and c.num_stages == 1]
                tuner.configs = (pick or tuner.configs)[:1]


def layer_pair(d_model: int, peer: bool = True) -> dict:
    """bf16 Mamba3 layers at the 130m-mamba3 settings and `d_model`: {"mambakit": ours} and,
    with `peer` and upstream importable, "mamba_ssm": upstream's, ours built from its
    weights (seed 0 either way)."""
    mod = _upstream_module() if peer else None
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if mod is None:
        return {"mambakit": Mamba3(d_model, d_state=128, headdim=64, device="cuda", dtype=dtype)}
    up = _upstream_layer(mod, d_model, dtype)
    ours = Mamba3.from_upstream_state_dict(up.state_dict(), device="cuda", dtype=dtype)
    return {"mambakit": ours, "mamba_ssm": up}


def layer_rows(batch: int, seqlen: int, d_model: int, iters: int) -> list[dict]:
    layers = layer_pair(d_model)
    u = torch.randn(batch, seqlen, d_model, device="cuda", dtype=torch.bfloat16)
    return timed_layer_rows("Mamba3 layer", layers, u, iters)


def profile_layer(batch: int, seqlen: int, d_model: int, path: str) -> None:
    """Per-kernel GPU time of one mambakit Mamba3 layer forward + backward (bf16), and of
    upstream's with the same weights (to path with "-peer" before its suffix) when it is
    there."""
    layers = layer_pair(d_model)
    u = torch.randn(batch, seqlen, d_model, device="cuda", dtype=torch.bfloat16)
    profile_fwd_bwd(layers["mambakit"], u, path)
    if "mamba_ssm" in layers:
        stem = Path(path)
        profile_fwd_bwd(
            layers["mamba_ssm"], u, str(stem.with_name(f"{stem.stem}-peer{stem.suffix}"))
        )


def _upstream_layer(mod, d_model: int, dtype):
    """Upstream's Mamba3 at the 130m-mamba3 layer's settings (SISO)."""
    return mod.Mamba3(d_model, d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5,
                      A_floor=1e-4, is_outproj_norm=False, is_mimo=False, chunk_size=64,
                      layer_idx=0, device="cuda", dtype=dtype)  # fmt: skip


def model_rows(batch: int, seqlen: int, iters: int, peer: bool) -> list[dict]:
    rows = []
    for name in ("130m-mamba3", "130m"):
        cfg = MambaConfig.preset(name)
        rec = measure_trainer(f"{name} Trainer (default)", cfg, batch, seqlen, "auto", iters)
        rec["preset"] = name
        print(rec, flush=True)
        rows.append(rec)
    if peer:
        cfg = MambaConfig.preset("130m-mamba3")
        rec = measure_peer(cfg, batch, seqlen, iters)
        if rec is not None:
            rec["workload"], rec["preset"] = "mamba_ssm 130m Mamba3 eager", "130m-mamba3"
            print(rec, flush=True)
            rows.append(rec)
    return rows


def inference_rows(batches: list[int], new: int, repeats: int) -> list[dict]:
    rows = []
    for name in ("130m-mamba3", "130m"):
        cfg = MambaConfig.preset(name)
        torch.manual_seed(0)
        model = MambaLM(cfg, device="cuda").to(torch.bfloat16).eval()
        rec = {"workload": f"{name} prefill 1x4096", "impl": "mambakit", "preset": name,
               **measure_prefill(model, cfg.vocab_size)}  # fmt: skip
        print(rec, flush=True)
        rows.append(rec)
        for b in batches:
            ids = torch.randint(0, cfg.vocab_size, (b, 16), device="cuda")
            total, prefill = bench_mambakit(model, ids, new, graphs=True, repeats=repeats)
            rec = {
                "workload": f"{name} decode 16+{new} graph",
                "impl": "mambakit cuda-graph",
                "preset": name,
                "batch": b,
                "new_tokens": new,
                "tokens_per_s": b * new / total,
                "us_per_step": (total - prefill) / (new - 1) * 1e6,
            }
            print(rec, flush=True)
            rows.append(rec)
        del model
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="8x2048", help="layer rows: BATCHxSEQLEN")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batches")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--only", nargs="+", default=["layer", "model", "inference"],
                   choices=["layer", "model", "inference"])  # fmt: skip
    p.add_argument("--prune-peer", action="store_true", help="one config per upstream kernel")
    p.add_argument("--profile", help="write the per-kernel table of a layer fwd+bwd here")
    p.add_argument("--out", default=None, help="write the results record (JSON) here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    batch, seqlen = (int(v) for v in args.shape.lower().split("x"))
    if args.prune_peer and _upstream_module() is not None:
        prune_upstream_autotune()
    rows = []
    if args.profile:
        profile_layer(batch, seqlen, args.d_model, args.profile)
    if "layer" in args.only:
        rows += layer_rows(batch, seqlen, args.d_model, args.iters)
    if "model" in args.only:
        rows += model_rows(batch, seqlen, args.iters, peer=_upstream_module() is not None)
    if "inference" in args.only:
        rows += inference_rows(args.batch, args.new_tokens, repeats=3)
    peer_autotune = "one configuration per kernel (--prune-peer)" if args.prune_peer else "full"
    context = {"d_model": args.d_model, "peer_autotune": peer_autotune}
    write_record(args.out, "bench_mamba3", rows, context=context)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
