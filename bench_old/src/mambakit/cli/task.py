"""`mambakit task`: train a small Mamba on a synthetic task of the Mamba paper, then test it
at every power of two from --min-len to --max-len (the paper's Tables 1, 2 and 11).

Tasks: selective-copying (Table 1: length 4096, 16 tokens to copy), induction-heads
(Table 11: trained at 256, tested from 2^6 to 2^20), mqar (Zoology's associative recall).
Training runs through the Trainer on fresh batches every step (progress bar,
RUNS/NAME/metrics.jsonl, a checkpoint). The test runs each length chunk by chunk with
the recurrent state carried (--chunk-len), generating the rows on the device as it goes,
so 2^20 steps take the memory of one chunk. It prints the table and writes
RUNS/NAME/accuracy.json and, when matplotlib is installed, accuracy.png.

Defaults: on CUDA the paper's model and lengths (2 layers, d_model 64, trained at 256 /
4096, tested to 2^20) with the batch and learning rate that learned them on an H200:
induction heads at batch 32, lr 5e-3, 60,000 steps, tested on 256 rows per length (one
answer per row): 100% at every length from 2^6 to 2^20 for seeds 0 and 1. The step count
matters: the loss is 0 from step 1,000 but length generalisation drifts as the training
goes on (the same run tested at 30,000 steps: 93% at 2^20; at 174,000: 89%). The paper's
own setting, batch 8 at lr 1e-3, stayed at chance here (60,000 steps; 97,000 at lr 5e-3),
and weight decay 0.1 never learns. Selective copying at batch 16, lr 1e-3, 50,000 steps
(99.5% at 4096 after 48,766). MQAR keeps batch 8, lr 1e-3 (not measured). All in f32: a
67k-parameter model gains nothing from bf16. docs/tasks.md has the tables. On a CPU a
short version (300 steps of 32 rows of 32 tokens for induction heads, tested to 2^12) that
takes a few minutes. --mixer mamba2 or mamba3 trains a Mamba-2 (SSD) or Mamba-3 SISO model
of the same width instead.

Example, the GPU defaults for induction heads with a shorter run:

  mambakit task induction-heads --device cuda --steps 20000 --max-len 1048576
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..config import MIXERS, MambaConfig
from ..model import MambaLM
from ..tasks import TASKS, TaskBatches, evaluate_length, format_table, make_task, powers_of_two
from ..tasks.evaluate import SPLIT_VAL
from ..training import TrainConfig, Trainer
from ..training.checkpoint import RunLock
from ..training.report import plot_loss
from ..training.trainer import PRECISIONS, TrainingDiverged
from ._common import (
    UsageError,
    add_threads_flag,
    check_device,
    check_run_folder,
    flag_names,
    set_threads,
)

# defaults per device and task: on CUDA the paper's model and lengths (Tables 1 and 11:
# trained at 4096 for selective copying, 256 for induction heads), with the batch and lr that
# learned them on the H200 (see the docstring); on a CPU a short version that learns induction
# heads in a few minutes (shorter rows, more of them, a higher lr)
GPU_DEFAULTS = {
    "seqlen": {"selective-copying": 4096, "induction-heads": 256, "mqar": 256},
    "batch_size": {"selective-copying": 16, "induction-heads": 32, "mqar": 8},
    "steps": {"selective-copying": 50000, "induction-heads": 60000, "mqar": 20000},
    "lr": {"selective-copying": 1e-3, "induction-heads": 5e-3, "mqar": 1e-3},
    "max_len": 1 << 20,
    # one scored answer per induction-heads row: 256 rows resolve 99% from 100%
    "eval_rows": {"selective-copying": 64, "induction-heads": 256, "mqar": 64},
}
CPU_DEFAULTS = {
    "seqlen": {"selective-copying": 64, "induction-heads": 32, "mqar": 64},
    "batch_size": 32,
    "steps": 300,
    "lr": 5e-3,
    "max_len": 4096,
    "eval_rows": 64,
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "task",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", choices=list(TASKS), help="which task")
    p.add_argument(
        "--vocab",
        type=int,
        default=16,
        help="data tokens (the paper: 16; mqar: keys, and as many values)",
    )
    p.add_argument(
        "--n-tokens", type=int, default=16, help="selective-copying: tokens to copy (paper: 16)"
    )
    p.add_argument("--n-pairs", type=int, default=8, help="mqar: key-value pairs per row")
    p.add_argument("--d-model", type=int, default=64, help="model width (the paper: 64)")
    p.add_argument("--n-layers", type=int, default=2, help="Mamba blocks (the paper: 2)")
    p.add_argument("--d-state", type=int, default=16, help="SSM state size per channel")
    p.add_argument(
        "--mixer", default="mamba1", choices=list(MIXERS), help="the blocks' mixer layer"
    )
    p.add_argument(
        "--headdim",
        type=int,
        default=32,
        help="mamba2, mamba3: values per head (d_model * 2 / headdim heads)",
    )
    p.add_argument(
        "--seqlen",
        type=int,
        default=None,
        help="training length (default on CUDA: 4096 selective-copying, 256 the others; "
        "on CPU: 64, and 32 induction-heads)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per step (default CUDA: 16 selective-copying, 32 induction-heads, 8 mqar; "
        "CPU: 32)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps (default CUDA: 50000 selective-copying, 60000 induction-heads, "
        "20000 mqar; CPU: 300)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default CUDA: 5e-3 induction-heads, 1e-3 the others; CPU: 5e-3)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop training after this many minutes even before --steps, then test",
    )
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warmup steps")
    p.add_argument(
        "--min-lr-ratio",
        type=float,
        default=1.0,
        help="final lr / lr of the cosine decay (1: constant lr, as the paper)",
    )
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument(
        "--train-targets",
        default="answers",
        choices=["answers", "all"],
        help="what training scores: the answers only (as the test), or also the next token "
        "everywhere else (an LM loss over the row, as safari trains induction heads)",
    )
    p.add_argument(
        "--precision",
        default="f32",
        choices=["auto", "bf16", "f16", "f32"],
        help="compute dtype of training and test (default f32; auto: bf16 on CUDA, f32 on CPU)",
    )
    p.add_argument("--min-len", type=int, default=64, help="shortest test length (power of two)")
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="longest test length, a power of two (default: 1048576 CUDA, 4096 CPU)",
    )
    p.add_argument(
        "--eval-rows",
        type=int,
        default=None,
        help="test rows per length (default: 256 induction-heads on CUDA, else 64)",
    )
    p.add_argument("--eval-batch-size", type=int, default=16, help="test rows run at once")
    p.add_argument(
        "--chunk-len", type=int, default=4096, help="steps per chunk of the test's forward"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    add_threads_flag(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument(
        "--eval-every", type=int, default=100, help="steps between validation losses (0: end)"
    )
    p.add_argument("--no-cuda-graph", action="store_true", help="train eagerly on CUDA")
    p.add_argument("--name", default=None, help="run name: files go to RUNS/NAME/ (default: task)")
    p.add_argument("--runs-dir", default="runs", help="folder of the runs (RUNS)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue RUNS/NAME from its latest checkpoint (the same flags; a higher --steps "
        "trains on, the same --steps only tests again)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _check_args(args) -> None:
    ints = ("vocab", "n_tokens", "n_pairs", "d_model", "n_layers", "d_state", "batch_size")
    for flag in (*ints, "eval_rows", "eval_batch_size", "chunk_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.vocab < 2:
        raise UsageError(f"--vocab must be at least 2, got {args.vocab}")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise UsageError(f"--max-minutes must be positive, got {args.max_minutes:g}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio:g}")


def _task(args):
    kwargs = {"vocab": args.vocab}
    if args.task == "selective-copying":
        kwargs["n_tokens"] = args.n_tokens
    elif args.task == "mqar":
        kwargs = {"n_pairs": args.n_pairs, "n_keys": args.vocab, "n_values": args.vocab}
    try:
        return make_task(args.task, **kwargs)
    except ValueError as e:
        msg = str(e)
        for name in ("n_keys", "n_values"):  # mqar's keys and values are --vocab
            msg = msg.replace(name, "vocab")
        raise UsageError(f"--{msg.replace('_', '-')}") from None


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    device = check_device(args.device)
    print(set_threads(args.threads))
    task = _task(args)
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    for flag in ("batch_size", "steps", "lr", "max_len", "eval_rows"):
        if getattr(args, flag) is None:
            value = defaults[flag]
            setattr(args, flag, value[args.task] if isinstance(value, dict) else value)
    seqlen = args.seqlen if args.seqlen is not None else defaults["seqlen"][args.task]
    if seqlen < task.min_seqlen():
        raise UsageError(f"--seqlen must be at least {task.min_seqlen()} for {args.task}")
    steps, max_len = args.steps, args.max_len
    try:
        lengths = powers_of_two(args.min_len, max_len)
    except ValueError as e:
        msg = str(e).replace("min_len", "--min-len").replace("max_len", "--max-len")
        raise UsageError(msg) from None
    if lengths[0] < task.min_seqlen():
        raise UsageError(
            f"--min-len {args.min_len} is shorter than {args.task} allows ({task.min_seqlen()})"
        )
    cfg = _model_config(args, task)
    run_dir = Path(args.runs_dir) / (args.name or args.task)
    check_run_folder(run_dir, args.resume)
    try:
        tcfg = TrainConfig(
            steps=steps,
            batch_size=args.batch_size,
            seqlen=seqlen,
            lr=args.lr,
            min_lr_ratio=args.min_lr_ratio,
            warmup_steps=min(args.warmup_steps, steps),
            weight_decay=args.weight_decay,
            precision=args.precision,
            device=str(device),
            cuda_graph=False if args.no_cuda_graph else "auto",
            seed=args.seed,
            eval_every=args.eval_every,
            eval_batches=4,
            ckpt_every_minutes=0,
            max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
            run_dir=str(run_dir),
            threads=args.threads,
        )
    except ValueError as e:
        raise UsageError(flag_names(str(e))) from None
    with RunLock(run_dir):
        return _train_and_test(args, task, cfg, tcfg, lengths, device, run_dir)


def _model_config(args, task) -> MambaConfig:
    try:
        return MambaConfig(
            d_model=args.d_model,
            n_layers=args.n_layers,
            d_state=args.d_state,
            vocab_size=task.vocab_size,
            mixer=args.mixer,
            headdim=args.headdim,
        )
    except ValueError as e:  # "MambaConfig.d_state must ..." -> "--d-state must ..."
        raise UsageError(flag_names(str(e)).replace("MambaConfig: ", "")) from None


def _train_and_test(
    args, task, cfg: MambaConfig, tcfg: TrainConfig, lengths, device, run_dir: Path
) -> int:
    torch.manual_seed(args.seed)
    model = MambaLM(cfg)
    train = TaskBatches(
        task, tcfg.batch_size, tcfg.seqlen, seed=args.seed, targets=args.train_targets
    )
    val = TaskBatches(task, tcfg.batch_size, tcfg.seqlen, seed=args.seed, split=SPLIT_VAL)
    trainer = Trainer(model, tcfg, train, val.take(tcfg.eval_batches))
    if args.resume:
        if not trainer.resume():  # check_run_folder saw one: it went while we started
            raise UsageError(f"--resume: {run_dir} holds no checkpoint")
        print(f"resumed {run_dir} at step {trainer.step}")
    print(
        f"{task.name}: {model.num_parameters() / 1e6:.3f}M parameters ({args.mixer}, "
        f"{args.n_layers} layers, "
        f"d_model {args.d_model}), device {device}, precision {trainer.precision}, "
        f"{tcfg.steps} steps of {tcfg.batch_size}x{tcfg.seqlen}"
    )
    t0 = time.perf_counter()
    try:
        last = trainer.fit(progress=not args.no_progress)
    except TrainingDiverged as e:
        print(f"mambakit task: {flag_names(str(e))}", flush=True)
        return 1
    if trainer.interrupted:
        print(f"{trainer.interrupted}: stopped at step {trainer.step}; no test run", flush=True)
        return 130
    print(
        f"trained: step {trainer.step}, loss {last.get('loss', float('nan')):.3f}, "
        f"{(time.perf_counter() - t0) / 60:.1f} min"
    )
    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png", f"{task.name}: training loss")
    dtype = PRECISIONS[trainer.precision] if trainer.precision != "f32" else None
    results = []
    for T in lengths:
        r = evaluate_length(
            model,
            task,
            T,
            rows=args.eval_rows,
            batch_size=args.eval_batch_size,
            chunk_len=args.chunk_len,
            seed=args.seed,
            autocast_dtype=dtype,
        )
        results.append(r)
        print(f"  length {T}: accuracy {100 * r.accuracy:.1f}% ({r.seconds:.1f} s)", flush=True)
    title = (
        f"{task.name}: accuracy by test length (trained at {tcfg.seqlen}; "
        f"chance {100 / task.n_data:.1f}%)"
    )
    print(format_table(results, tcfg.seqlen, title))
    record = {
        "task": task.name,
        "train_seqlen": tcfg.seqlen,
        "steps": trainer.step,
        "chance": 1 / task.n_data,
        "model": {"d_model": args.d_model, "n_layers": args.n_layers, "d_state": args.d_state},
        "results": [r.__dict__ for r in results],
    }
    (run_dir / "accuracy.json").write_text(json.dumps(record, indent=1) + "\n")
    png = plot_accuracy(results, run_dir / "accuracy.png", tcfg.seqlen, 1 / task.n_data, title)
    print(f"table: {run_dir / 'accuracy.json'}" + (f"   plot: {png}" if png else ""))
    return 0


def plot_accuracy(results, png_path: Path, train_len: int, chance: float, title: str):
    """Accuracy against test length (log scale); None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r.seqlen for r in results], [100 * r.accuracy for r in results], "o-", label="Mamba")
    ax.axhline(100 * chance, color="gray", ls=":", label="chance")
    ax.axvline(train_len, color="gray", ls="--", lw=0.8, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 102)
    ax.set_xlabel("test sequence length")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
