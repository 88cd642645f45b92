"""`mambakit train`: train a Mamba LM on text; defaults: the tiny preset on the embedded corpus.

The run folder RUNS/NAME/ is locked while training. Ctrl-C (or SIGTERM) finishes the
step, writes a checkpoint, prints the command that resumes it and exits with 130; a
checkpoint is also written every --ckpt-minutes so a crash loses little.

On several GPUs (or CPU processes), under torchrun:

    torchrun --nproc_per_node 2 -m mambakit train --distributed ddp --preset 130m ...

every process trains --batch-size rows of each step's global batch (DDP, or FSDP2 with
--distributed fsdp); rank 0 prints, logs and writes the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from ..config import MambaConfig
from ..model import MambaLM
from ..text import load_tokenizer
from ..training import RowBatches, TrainConfig, Trainer, build_splits, eval_batches
from ..training import distributed as dist_
from ..training.checkpoint import RunLock
from ..training.report import plot_loss
from ..training.trainer import TrainingDiverged
from ._common import (
    UsageError,
    add_threads_flag,
    check_device,
    check_run_folder,
    check_seed,
    flag_names,
    set_threads,
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--preset",
        default="tiny",
        help="model preset (tiny, 130m, ..., 2.8b; tiny-mamba2, 130m-mamba2, ..., 2.7b-mamba2; "
        "tiny-mamba3, 130m-mamba3)",
    )
    p.add_argument("--config", help="JSON file of MambaConfig fields (overrides the preset)")
    p.add_argument(
        "--data", nargs="*", help="text files or folders (none: the embedded stdlib corpus)"
    )
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json / its folder")
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "f16", "f32"],
        help="compute dtype (auto: bf16 on CUDA, f32 on CPU)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="rows per micro-batch (per process)")
    p.add_argument("--seqlen", type=int, default=256, help="tokens per row")
    p.add_argument(
        "--tbptt-len", type=int, default=None, help="chunk length of truncated BPTT (none: off)"
    )
    p.add_argument(
        "--tbptt-grad-chunks",
        type=int,
        default=1,
        help="chunks per backward with --tbptt-len (0: all of them, exact BPTT)",
    )
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (none: 400 on CPU, 3000 on GPU)"
    )
    p.add_argument(
        "--max-minutes", type=float, default=None, help="stop (and checkpoint) after this long"
    )
    p.add_argument("--lr", type=float, default=4e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=30, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    add_threads_flag(p)
    p.add_argument("--seed", type=int, default=0, help="seed of weights, data order and sample")
    p.add_argument(
        "--eval-every", type=int, default=50, help="steps between validation losses (0: at the end)"
    )
    p.add_argument(
        "--ckpt-every", type=int, default=0, help="steps between checkpoints (0: by time only)"
    )
    p.add_argument(
        "--ckpt-minutes",
        type=float,
        default=5.0,
        help="minutes of wall time between checkpoints (0: off)",
    )
    p.add_argument(
        "--max-skipped-steps",
        type=int,
        default=10,
        help="stop after this many consecutive steps skipped for a non-finite loss (0: never)",
    )
    p.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="train eagerly (default on CUDA: the whole step is captured and replayed)",
    )
    p.add_argument(
        "--cuda-graph", action="store_true", help="require the CUDA graph (error if impossible)"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--deterministic", action="store_true", help="bit-reproducible runs (slower on GPU)"
    )
    p.add_argument("--name", default="tiny-stdlib", help="run name: files go to RUNS/NAME/")
    p.add_argument("--runs-dir", default="runs", help="folder of the runs (RUNS)")
    p.add_argument("--resume", action="store_true", help="continue RUNS/NAME from its latest")
    p.add_argument("--sample-tokens", type=int, default=300, help="sample length at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--distributed",
        default="none",
        choices=list(dist_.MODES),
        help="under torchrun: ddp (replicated model) or fsdp (FSDP2, sharded); each process "
        "trains --batch-size rows of every step's global batch",
    )
    p.set_defaults(run=run)


def _model_config(args) -> MambaConfig:
    overrides = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise UsageError(f"--config {args.config}: no such file")
        try:
            overrides = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UsageError(f"--config {args.config}: not valid JSON ({e})") from None
        if not isinstance(overrides, dict):
            raise UsageError(
                f"--config {args.config}: must hold a JSON object of MambaConfig fields"
            )
    try:
        return MambaConfig.preset(args.preset, **overrides)
    except (ValueError, TypeError) as e:
        where = f"--config {args.config}" if args.config else f"--preset {args.preset}"
        raise UsageError(f"{where}: {e}") from None


def _check_args(args) -> None:
    for flag in ("batch_size", "grad_accum"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    check_seed(args.seed)  # generate's range: the sample after training
    if args.seqlen < 2:  # a row needs a token to predict from and one to predict
        raise UsageError(f"--seqlen must be at least 2, got {args.seqlen}")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise UsageError(
            f"--max-minutes must be more than 0, got {args.max_minutes:g} (leave it out for "
            "no time limit)"
        )
    if args.ckpt_minutes < 0:
        raise UsageError(f"--ckpt-minutes must be >= 0, got {args.ckpt_minutes:g}")
    if args.sample_tokens < 0:
        raise UsageError(f"--sample-tokens must be >= 0, got {args.sample_tokens}")
    if args.cuda_graph and args.no_cuda_graph:
        raise UsageError("--cuda-graph and --no-cuda-graph contradict each other: pass one")


def _resume_command(args) -> str:
    argv = list(args.argv)
    if "--resume" not in argv:
        argv.append("--resume")
    return "mambakit " + shlex.join(argv)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    device = check_device(args.device)
    try:
        d, device = dist_.setup(args.distributed, device)
    except ValueError as e:
        raise UsageError(f"--distributed {args.distributed}: {e}") from None
    if not d.main:  # rank 0 prints; the others train silently
        sys.stdout = open(os.devnull, "w")
    try:
        rc = _run(args, d, device)
        if d.active:  # every rank done before the group goes (no rank left mid-operation)
            torch.distributed.barrier()
        return rc
    finally:
        if d.active:
            torch.distributed.destroy_process_group()


def _run(args: argparse.Namespace, d: dist_.Dist, device: torch.device) -> int:
    print(set_threads(args.threads))
    steps = args.steps if args.steps is not None else (3000 if device.type == "cuda" else 400)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (ValueError, OSError, ImportError) as e:
        raise UsageError(f"--tokenizer {args.tokenizer}: {e}") from None
    cfg = _model_config(args)
    if tokenizer.vocab_size > cfg.vocab_size:
        cfg = MambaConfig.from_dict({**cfg.to_dict(), "vocab_size": tokenizer.vocab_size})
    if getattr(tokenizer, "path", None) is None:  # bytes: no special tokens (0 would be NUL)
        cfg.extra.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    run_dir = Path(args.runs_dir) / args.name
    check_run_folder(run_dir, args.resume)
    try:
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
            ckpt_every_minutes=args.ckpt_minutes,
            max_skipped_steps=args.max_skipped_steps,
            max_seconds=args.max_minutes * 60 if args.max_minutes else None,
            run_dir=str(run_dir),
            distributed=args.distributed,
            threads=args.threads,
        )
    except ValueError as e:
        raise UsageError(flag_names(str(e))) from None
    if not d.main:
        return _train(args, tcfg, cfg, tokenizer, device, run_dir, d)
    with RunLock(run_dir):  # rank 0 holds the run for all
        return _train(args, tcfg, cfg, tokenizer, device, run_dir, d)


def _train(
    args, tcfg: TrainConfig, cfg: MambaConfig, tokenizer, device, run_dir: Path, d: dist_.Dist
) -> int:
    t0 = time.perf_counter()
    try:
        train_rows, val_rows = build_splits(args.data, tokenizer, args.seqlen)
    except (ValueError, OSError) as e:
        raise UsageError(f"--data: {str(e).removeprefix('data: ')}") from None
    print(
        f"data: {train_rows.tokens.numel():,} training and {val_rows.tokens.numel():,} "
        f"validation tokens ({tokenizer.name} tokenizer), {len(train_rows):,} rows of "
        f"{args.seqlen} ({time.perf_counter() - t0:.1f} s); {val_rows.note}"
    )
    torch.manual_seed(args.seed)
    model = MambaLM(cfg)
    try:  # the global batch: the Trainer keeps this process's rows of it
        batches = RowBatches(train_rows, args.batch_size * d.world, seed=args.seed)
    except ValueError as e:
        raise UsageError(f"--batch-size {args.batch_size}: {e}") from None
    # validation: the first rows of as many global batches, whatever the processes (each
    # process runs them all in batches of its own size), so its loss compares across runs
    val = eval_batches(val_rows, args.batch_size, tcfg.eval_batches * d.world)
    trainer = Trainer(model, tcfg, batches, val)
    if args.resume:
        if not trainer.resume():  # check_run_folder saw one: it went while we started
            raise UsageError(f"--resume: {run_dir} holds no checkpoint")
        print(f"resumed {run_dir} at step {trainer.step}")
    print(
        f"model: {args.preset} ({model.num_parameters() / 1e6:.2f}M parameters), device {device}, "
        f"precision {trainer.precision}, {tcfg.steps} steps of {args.batch_size}x{args.seqlen} "
        "tokens" + (f" on each of {d.world} processes ({d.mode})" if d.active else "")
    )
    t0 = time.perf_counter()
    try:
        last = trainer.fit(progress=not args.no_progress)
    except TrainingDiverged as e:  # exit status 1 (2 is a mistake in the input)
        print(f"mambakit train: {flag_names(str(e))}", file=sys.stderr, flush=True)
        return 1
    minutes = (time.perf_counter() - t0) / 60
    if not d.main:
        return 130 if trainer.interrupted else 0
    ckpt = run_dir / (run_dir / "latest").read_text().strip()
    _save_tokenizer(tokenizer, ckpt)
    _save_tokenizer(tokenizer, run_dir)  # beside every checkpoint of the run, too
    if trainer.interrupted:
        print(
            f"{trainer.interrupted}: stopped at step {trainer.step} of {tcfg.steps}; "
            f"checkpoint: {ckpt}\nresume with: {_resume_command(args)}",
            flush=True,
        )
        return 130
    png = plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png", f"{args.name}: {args.preset}")
    loss, val = last.get("loss"), last.get("val_loss")
    print(
        f"done: step {trainer.step}, train loss {_num(loss)}, validation loss {_num(val)} "
        f"nats/token, {minutes:.1f} min"
    )
    print(f"checkpoint: {ckpt}   metrics: {run_dir / 'metrics.jsonl'}   plot: {png}")
    if args.sample_tokens > 0:
        if d.mode == "fsdp":  # the weights are sharded over the ranks: sample from the checkpoint
            model = MambaLM.from_pretrained(ckpt, device=device)
        _print_sample(model, tokenizer, device, args.sample_tokens, args.seed)
    return 0


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


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
