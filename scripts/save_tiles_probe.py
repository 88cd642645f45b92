"""The scan's saved-state interval against speed and memory, on the GPU.

PYTHONPATH=src python scripts/save_tiles_probe.py --tiles 1,4,8,16 --out probe.json

The forward saves the state every `bwd_save_tiles` backward tiles (`ScanConfig`); with more
than one, a replay kernel rebuilds every tile's start state from the saved ones before the
backward (`replay.py`). Fewer saved states (4 D N / (TC KS) bytes a token and layer) against
that replay's time:

- kernels: the scan's forward (saving states) and backward at 8 x 2048 x 1536 (130m),
  4 x 2048 x 4096 (1.4b) and 1 x 65536 x 1536, with each config's gradients against KS = 1's;
- models (`--models 130m:8,1.4b:4`, 2048 steps a row): the Trainer's default step
  (bench_model's `measure_trainer`: time and peak memory), mamba_ssm's beside it with
  `--peer`.

The library runs `config()`; this script swaps `launch.config` for one with the interval
asked for (the only place the scan reads it), so the model runs exactly the library's code
otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch

from mambakit import MambaConfig
from mambakit.ops.selective_scan import launch as K

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_model import measure_peer, measure_trainer  # noqa: E402
from scan_sweep import shape_inputs, timed  # noqa: E402

LIBRARY_CONFIG = K.config
OUT: Path | None = None  # where the rows so far are written after each one (a timeout keeps them)


def keep(rows: list, row: dict) -> None:
    rows.append(row)
    print(row, flush=True)
    if OUT is not None:
        OUT.write_text(json.dumps(rows, indent=1))


def use_save_tiles(ks: int) -> None:
    """Every scan launch from now on saves a state every ks backward tiles."""
    K.config = functools.cache(
        lambda Dn, interpret: dataclasses.replace(LIBRARY_CONFIG(Dn, interpret), bwd_save_tiles=ks)
    )


def kernels(tiles: list[int], rows: list) -> None:
    for Bsz, T, Dn in [(8, 2048, 1536), (4, 2048, 4096), (1, 65536, 1536)]:
        shape_rows(Bsz, T, Dn, tiles, rows)


def shape_rows(Bsz: int, T: int, Dn: int, tiles: list[int], rows: list) -> None:
    """The scan at one shape for each interval: times, saved bytes, gradients against the
    first interval's."""
    a, gy = shape_inputs(Bsz, T, Dn, 16)
    first = None
    for ks in tiles:
        c = dataclasses.replace(LIBRARY_CONFIG(Dn, False), bwd_save_tiles=ks)
        _, _, states = K.scan_fwd(*a, True, None, None, True, cfg=c)
        fwd = timed(lambda c=c: K.scan_fwd(*a, True, None, None, True, cfg=c))
        bwd = timed(lambda c=c, s=states: K.scan_bwd(gy, None, *a, True, None, None, s, cfg=c))
        grads = K.scan_bwd(gy, None, *a, True, None, None, states, cfg=c)
        grads = [g.float() for g in grads if g is not None]
        first = first if first is not None else grads
        err = max(((g - f).norm() / f.norm()).item() for g, f in zip(grads, first))
        keep(rows, {
            "kind": "kernels", "shape": f"{Bsz}x{T}x{Dn}x16", "bwd_save_tiles": ks,
            "fwd_ms": fwd, "bwd_ms": bwd, "fwd_bwd_ms": fwd + bwd,
            "states_mib": states.numel() * 4 / 2**20, "rel_err_vs_first": err,
        })  # fmt: skip


def models(specs: list[str], tiles: list[int], peer: bool, iters: int, rows: list) -> None:
    for spec in specs:
        preset, batch = spec.split(":")
        cfg = MambaConfig.preset(preset)
        for ks in tiles:
            use_save_tiles(ks)
            rec = measure_trainer(f"mambakit KS={ks}", cfg, int(batch), 2048, "auto", iters)
            keep(rows, {"kind": "model", "preset": preset, "bwd_save_tiles": ks, **rec})
        K.config = LIBRARY_CONFIG
        if peer:
            rec = measure_peer(cfg, int(batch), 2048, iters)
            if rec is not None:
                keep(rows, {"kind": "model", "preset": preset, **rec})
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiles", default="1,4,8,16", help="bwd_save_tiles values, comma-separated")
    ap.add_argument("--models", default="", help="preset:batch pairs, e.g. 130m:8,1.4b:4")
    ap.add_argument("--model-tiles", help="the intervals for the models (default: --tiles)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--peer", action="store_true", help="mamba_ssm's step beside each model")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    tiles = [int(k) for k in args.tiles.split(",")]
    global OUT
    OUT = Path(args.out) if args.out else None
    rows: list = []
    if not args.no_kernels:
        kernels(tiles, rows)
    if args.models:
        model_tiles = [int(k) for k in (args.model_tiles or args.tiles).split(",")]
        models(args.models.split(","), model_tiles, args.peer, args.iters, rows)


if __name__ == "__main__":
    main()
