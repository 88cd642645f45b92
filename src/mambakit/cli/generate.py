"""`mambakit generate`: continue a prompt with a local checkpoint, streaming text as it comes.

--model takes a checkpoint folder (Hugging Face `config.json` + weights, a
state-spaces folder) or a training run folder `runs/<name>/`, whose `latest`
file names the newest `step_XXXXXXX/` checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..inference.sampling import SamplingConfig
from ..model import MambaLM
from ..text import ByteTokenizer, HFTokenizer, TextStream, load_tokenizer
from ._common import UsageError, add_threads_flag, check_device, check_seed, set_threads

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="checkpoint folder or runs/<name>/ folder")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off")
    p.add_argument("--min-p", type=float, default=0.0, help="0: off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    p.add_argument(
        "--eos-token-id",
        type=int,
        default=None,
        help="stop at this token (default: the checkpoint's eos_token_id if any; -1: never)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    add_threads_flag(p)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *_DTYPES],
        help="weights dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' or a tokenizer.json / its folder (default: found in the checkpoint)",
    )
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    p.set_defaults(run=run)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, following a run folder's `latest` file."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"--model {str(path)!r} is not a folder")
    latest = path / "latest"
    if latest.is_file() and not (path / "config.json").is_file():
        ckpt = path / latest.read_text().strip()
        if not ckpt.is_dir():
            raise UsageError(f"--model: {latest} names {ckpt.name!r}, which does not exist")
        return ckpt
    return path


def find_tokenizer(spec: str | None, ckpt: Path, vocab_size: int):
    """--tokenizer; else tokenizer.json or tokenizer.txt ('byte') in the checkpoint or its
    run folder; else bytes when the vocabulary is 256."""
    if spec is not None:
        try:
            return load_tokenizer(spec)
        except (ValueError, OSError, ImportError) as e:
            raise UsageError(f"--tokenizer {spec}: {e}") from None
    for folder in (ckpt, ckpt.parent):
        if (folder / "tokenizer.json").is_file():
            return HFTokenizer(folder / "tokenizer.json")
        txt = folder / "tokenizer.txt"
        if txt.is_file():
            name = txt.read_text().strip()
            if name != "byte":
                raise UsageError(f"{txt} names tokenizer {name!r}; only 'byte' is known")
            return ByteTokenizer()
    if vocab_size == 256:
        return ByteTokenizer()
    raise UsageError(
        f"no tokenizer.json or tokenizer.txt in {str(ckpt)!r} and the vocabulary "
        f"({vocab_size}) is not bytes; pass --tokenizer PATH/tokenizer.json (or 'byte')"
    )


def _check_args(args: argparse.Namespace) -> None:
    """The sampling flags' values, refused before the model loads."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.eos_token_id is not None and args.eos_token_id < -1:
        raise UsageError(f"--eos-token-id must be >= 0, or -1 for never, got {args.eos_token_id}")
    check_seed(args.seed)
    try:
        SamplingConfig(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
        )
    except ValueError as e:  # "top_p must lie in ..." -> "--top-p must lie in ..."
        name, _, rest = str(e).partition(" ")
        raise UsageError(f"--{name.replace('_', '-')} {rest}") from None


def load_model(args: argparse.Namespace) -> tuple[MambaLM, Path, torch.device]:
    """(the model of --model on --device in --dtype, its checkpoint folder, the device), with
    --threads set: what `generate` and `serve` load."""
    device = check_device(args.device)
    set_threads(args.threads)
    dtype = _DTYPES.get(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    ckpt = resolve_checkpoint(args.model)
    return MambaLM.from_pretrained(ckpt, device=device, dtype=dtype).eval(), ckpt, device


def end_tokens(args: argparse.Namespace, model: MambaLM) -> list[int]:
    """--eos-token-id, else the checkpoint's (every one of a list: a chat model's end of
    turn beside its end of text), those inside the vocabulary; none for -1."""
    eos = args.eos_token_id
    vocab = model.config.vocab_size
    if eos is not None and not -1 <= eos < vocab:  # what the user asked for, not a default
        raise UsageError(
            f"--eos-token-id must lie in [0, {vocab}) (the vocabulary), or be -1 for never, "
            f"got {eos}"
        )
    if eos is None:
        eos = model.config.extra.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [t for t in ids if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab]


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    model, ckpt, device = load_model(args)
    vocab = model.config.vocab_size
    tokenizer = find_tokenizer(args.tokenizer, ckpt, vocab)
    ends = end_tokens(args, model)  # the stream stops at the first; the loop at any
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise UsageError("--prompt encodes to no tokens")
    if max(prompt_ids) >= vocab:
        raise UsageError(
            f"--prompt: the tokenizer gives ids up to {max(prompt_ids)} but the model's "
            f"vocabulary is {vocab}: pass the checkpoint's tokenizer with --tokenizer"
        )
    ids = torch.tensor([prompt_ids], device=device)
    tokens = model.stream(
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        eos_token_id=ends[0] if ends else None,
        seed=args.seed,
        cuda_graph=False if args.no_cuda_graph else "auto",
    )
    out = TextStream(tokenizer, prompt_ids)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    n = 0
    t0 = time.perf_counter()
    t_first = None
    for tok in tokens:
        token = int(tok[0])
        if t_first is None:
            t_first = time.perf_counter()
        n += 1
        if token in ends:
            break
        sys.stdout.write(out.push(token))
        sys.stdout.flush()
    sys.stdout.write(out.flush() + "\n")
    sys.stdout.flush()
    t1 = time.perf_counter()
    if n:
        decode = t1 - t_first
        rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
        print(
            f"[{n} tokens in {t1 - t0:.2f} s: prefill + first token {(t_first - t0) * 1e3:.0f} ms"
            f" ({len(prompt_ids)} prompt tokens), then {rate:,.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0
