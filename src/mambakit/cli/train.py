"""`mambakit train`: train a Mamba LM on text; defaults: the tiny preset on the embedded corpus."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from ..config import MambaConfig
from ..model import MambaLM
from ..training import (
    RowBatches,
    TrainConfig,
    Trainer,
    build_splits,
    eval_batches,
    load_tokenizer,
)
from ..training.report import plot_loss
from ..training.trainer import resolve_device


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a Mamba LM (default: tiny preset on the Python standard library's source)",
    )
    p.add_argument("--preset", default="tiny", help="model preset (tiny, 130m, ...)")
    p.add_argument("--config", help="JSON file of MambaConfig fields (overrides the preset)")
    p.add_argument("--data", nargs="*", help="text files or folders (default: embedded corpus)")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json / its folder")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "f16", "f32"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--tbptt-len", type=int, default=None, help="chunk length of truncated BPTT")
    p.add_argument("--tbptt-grad-chunks", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="default: 280 on CPU, 3000 on GPU")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this long")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="train eagerly (default on CUDA: the whole step is captured and replayed)",
    )
    p.add_argument(
        "--cuda-graph", action="store_true", help="require the CUDA graph (error if impossible)"
    )
    p.add_argument("--compile", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--name", default="tiny-stdlib", help="run name: files go to RUNS/NAME/")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--resume", action="store_true", help="continue RUNS/NAME from its latest")
    p.add_argument("--sample-tokens", type=int, default=300, help="sample length at the end")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def _model_config(args) -> MambaConfig:
    overrides = {}
    if args.config:
        overrides = json.loads(Path(args.config).read_text())
        if not isinstance(overrides, dict):
            raise SystemExit(
                f"--config {args.config}: must hold a JSON object of MambaConfig fields"
            )
    return MambaConfig.preset(args.preset, **overrides)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    steps = args.steps if args.steps is not None else (3000 if device.type == "cuda" else 280)
    if steps <= 0:
        raise SystemExit(f"--steps must be positive, got {steps}")
    tokenizer = load_tokenizer(args.tokenizer)
    cfg = _model_config(args)
    if tokenizer.vocab_size > cfg.vocab_size:
        cfg = MambaConfig.from_dict({**cfg.to_dict(), "vocab_size": tokenizer.vocab_size})
    if getattr(tokenizer, "path", None) is None:  # bytes: no special tokens (0 would be NUL)
        cfg.extra.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    run_dir = Path(args.runs_dir) / args.name
    if run_dir.exists() and not args.resume and (run_dir / "latest").exists():
        raise SystemExit(
            f"{run_dir} already holds a run: pass --resume to continue it or --name for a new one"
        )
    t0 = time.perf_counter()
    train_rows, val_rows = build_splits(args.data, tokenizer, args.seqlen)
    print(
        f"data: {train_rows.tokens.numel():,} training and {val_rows.tokens.numel():,} "
        f"validation tokens ({tokenizer.name} tokenizer), {len(train_rows):,} rows of "
        f"{args.seqlen} ({time.perf_counter() - t0:.1f} s)"
    )
    tcfg = TrainConfig(
        steps=steps,
        batch_size=args.batch_size,
        seqlen=args.seqlen,
        tbptt_len=args.tbptt_len,
        tbptt_grad_chunks=args.tbptt_grad_chunks,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup_steps=min(args.warmup_steps, steps),
        weight_decay=args.weight_decay,
        precision=args.precision,
        device=str(device),
        cuda_graph=False if args.no_cuda_graph else (True if args.cuda_graph else "auto"),
        compile=args.compile,
        deterministic=args.deterministic,
        seed=args.seed,
        eval_every=args.eval_every,
        ckpt_every=args.ckpt_every,
        max_seconds=args.max_minutes * 60 if args.max_minutes else None,
        run_dir=str(run_dir),
    )
    torch.manual_seed(args.seed)
    model = MambaLM(cfg)
    trainer = Trainer(
        model,
        tcfg,
        RowBatches(train_rows, args.batch_size, seed=args.seed),
        eval_batches(val_rows, args.batch_size, tcfg.eval_batches),
    )
    if args.resume:
        if trainer.resume():
            print(f"resumed {run_dir} at step {trainer.step}")
        else:
            print(f"no checkpoint in {run_dir}: starting fresh")
    print(
        f"model: {args.preset} ({model.num_parameters() / 1e6:.2f}M parameters), device {device}, "
        f"precision {trainer.precision}, {steps} steps of {args.batch_size}x{args.seqlen} tokens"
    )
    t0 = time.perf_counter()
    last = trainer.fit(progress=not args.no_progress)
    minutes = (time.perf_counter() - t0) / 60
    ckpt = run_dir / (run_dir / "latest").read_text().strip()
    _save_tokenizer(tokenizer, ckpt)
    _save_tokenizer(tokenizer, run_dir)  # beside every checkpoint of the run, too
    png = plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png", f"{args.name}: {args.preset}")
    val = last.get("val_loss")
    print(
        f"done: step {trainer.step}, train loss {last.get('loss', float('nan')):.3f}, "
        f"validation loss {val if val is None else round(val, 3)} nats/token, {minutes:.1f} min"
    )
    print(f"checkpoint: {ckpt}   metrics: {run_dir / 'metrics.jsonl'}   plot: {png}")
    if args.sample_tokens > 0:
        _print_sample(model, tokenizer, device, args.sample_tokens, args.seed)
    return 0


def _save_tokenizer(tokenizer, ckpt: Path) -> None:
    if getattr(tokenizer, "path", None) is not None:
        shutil.copyfile(tokenizer.path, ckpt / "tokenizer.json")
    else:
        (ckpt / "tokenizer.txt").write_text("byte\n")


def _print_sample(model, tokenizer, device, n_tokens: int, seed: int) -> None:
    prompt = "def "
    ids = torch.tensor([tokenizer.encode(prompt)], device=device)
    model.eval()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n_tokens, temperature=0.8, top_k=40, seed=seed)
    print("sample:\n" + "-" * 60 + "\n" + tokenizer.decode(out[0].tolist()) + "\n" + "-" * 60)
