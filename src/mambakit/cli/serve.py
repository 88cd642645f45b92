"""`mambakit serve`: an OpenAI-compatible HTTP server over a local checkpoint.

--model takes a checkpoint folder (Hugging Face `config.json` + weights, a state-spaces
folder) or a training run folder `runs/<name>/`. Requests are batched continuously over
--max-batch state slots; prompt prefixes' states are cached on the device within
--cache-gib. The server binds 127.0.0.1 unless --host says otherwise; --api-key (or
$MAMBAKIT_API_KEY) makes every /v1 route require `Authorization: Bearer KEY`. SIGTERM
lets the running requests finish (up to --drain-timeout seconds) and exits 0.
Needs the serve extra: pip install -e ".[serve]".
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from ._common import UsageError, add_threads_flag

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

API_KEY_ENV = "MAMBAKIT_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", required=True, help="checkpoint folder or runs/<name>/ folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--max-batch", type=int, default=64, help="state slots (running choices)")
    p.add_argument("--max-queue", type=int, default=1024, help="requests waiting at most (429)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *_DTYPES],
        help="weights dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--cache-gib", type=float, default=1.0, help="prefix-state cache (0: off)")
    p.add_argument("--block-size", type=int, default=256, help="prefix-cache block in tokens")
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=None,
        help="prompt tokens in one prefill launch (default: 16384 on CUDA, 2048 elsewhere)",
    )
    p.add_argument(
        "--prefill-hold",
        default="auto",
        metavar="auto|none|TOKENS,MS",
        help="while decode steps run, a prefill launch waits for more prompts: 'auto' (by a "
        "forward's measured fixed cost, at most 100 ms), 'none' (launch every iteration), or "
        "until TOKENS prompt tokens wait or the first has waited MS milliseconds",
    )
    p.add_argument(
        "--packed-prefill",
        default="auto",
        choices=["auto", "on", "off"],
        help="Mamba-1: prompts packed end to end into rows, many rows to a prefill forward "
        "(on), or left-padded into groups (auto, off: the default)",
    )
    p.add_argument("--max-prompt-tokens", type=int, default=32768, help="longer prompts: 413")
    p.add_argument("--max-tokens", type=int, default=4096, help="the largest max_tokens allowed")
    p.add_argument("--api-key", default=None, help=f"require this key (default: ${API_KEY_ENV})")
    p.add_argument("--served-model-name", default=None, help="model id (default: folder name)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' or a tokenizer.json / its folder (default: found in the checkpoint; "
        "none found: token-id prompts only)",
    )
    p.add_argument(
        "--eos-token-id",
        type=int,
        default=None,
        help="end choices at this token (default: the checkpoint's; -1: never)",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to drain on exit")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    add_threads_flag(p)
    p.set_defaults(run=run)


def _check_args(args) -> None:
    for flag, v, lo in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 1),
                        ("--block-size", args.block_size, 1),
                        ("--prefill-tokens", args.prefill_tokens or 1, 1),
                        ("--max-prompt-tokens", args.max_prompt_tokens, 1),
                        ("--max-tokens", args.max_tokens, 1)):  # fmt: skip
        if v < lo:
            raise UsageError(f"{flag} must be at least {lo}, got {v}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must lie in [0, 65535], got {args.port}")
    if not (args.cache_gib >= 0 and math.isfinite(args.cache_gib)):
        raise UsageError(f"--cache-gib must be a finite number >= 0, got {args.cache_gib}")
    if not (args.drain_timeout >= 0 and math.isfinite(args.drain_timeout)):
        raise UsageError(f"--drain-timeout must be a finite number >= 0, got {args.drain_timeout}")
    if isinstance(args.prefill_hold, str):
        args.prefill_hold = prefill_hold(args.prefill_hold)


def prefill_hold(text: str) -> tuple[int, float] | str | None:
    """`--prefill-hold` as `Engine.prefill_hold` takes it: "auto", None or (tokens, s)."""
    text = text.strip().lower()
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    tokens, _, ms = text.partition(",")
    try:
        hold = (int(tokens), float(ms) / 1e3)
    except ValueError:
        hold = None
    if hold is None or hold[0] < 0 or not (hold[1] >= 0 and math.isfinite(hold[1])):
        raise UsageError(
            "--prefill-hold must be auto, none or TOKENS,MS (TOKENS an integer >= 0, MS a "
            f"finite number >= 0), got {text!r}"
        )
    return hold


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"mambakit serve needs the serve extra ({e}): "
                         "pip install -e \".[serve]\"") from None  # fmt: skip
    from ..serve import Engine
    from ..serve.chat import ChatTemplate
    from ..serve.server import create_app, serve
    from .generate import end_tokens, find_tokenizer, load_model

    model, ckpt, device = load_model(args)
    vocab = model.config.vocab_size
    try:
        tokenizer = find_tokenizer(args.tokenizer, ckpt, vocab)
    except UsageError:
        if args.tokenizer is not None:
            raise
        tokenizer = None
        print("mambakit serve: no tokenizer found: prompts must be token ids", file=sys.stderr)
    eos = end_tokens(args, model)
    try:
        chat = ChatTemplate.from_folder(ckpt)
    except ImportError:
        chat = None
    except ValueError as e:  # a template Jinja cannot parse: completions still serve
        chat = None
        print(f"mambakit serve: no chat endpoint: {e}", file=sys.stderr)
    engine = Engine(
        model,
        tokenizer=tokenizer,
        eos_token_id=eos,
        max_batch=args.max_batch,
        block_size=args.block_size,
        prefill_tokens=args.prefill_tokens,
        cache_bytes=int(args.cache_gib * (1 << 30)),
        max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        cuda_graph=False if args.no_cuda_graph else "auto",
    )
    engine.prefill_hold = args.prefill_hold
    if args.packed_prefill != "auto":
        try:
            engine.packed = args.packed_prefill == "on"
        except ValueError as e:
            raise UsageError(f"--packed-prefill on: {e}") from None
    engine.warmup()  # on CUDA: the prefill graphs, captured before the first request
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    name = args.served_model_name or ckpt.resolve().name
    app = create_app(engine, model_name=name, tokenizer=tokenizer, chat_template=chat,
                     api_key=api_key, max_tokens_limit=args.max_tokens,
                     drain_timeout=args.drain_timeout)  # fmt: skip
    where = f"http://{args.host}:{args.port}"
    dtype = next(model.parameters()).dtype
    print(f"mambakit serve: {name} on {device} ({dtype}), {args.max_batch} slots, "
          f"{where}/v1{' (API key required)' if api_key else ''}", file=sys.stderr)  # fmt: skip
    serve(app, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
    return 0
