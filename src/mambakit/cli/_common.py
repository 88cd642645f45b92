"""What the subcommands share: the user-error type, device and thread-count choices."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .. import threads


class UsageError(ValueError):
    """A mistake in the command line or a file it names: reported in one line, exit 2."""


def check_run_folder(run_dir: Path, resume: bool) -> None:
    """Refuse to start a fresh run over a run's checkpoints, and --resume without one (a typo
    in --name would otherwise start a fresh run), naming the runs that do exist."""
    has_checkpoint = (run_dir / "latest").is_file() or any(run_dir.glob("step_*"))
    if has_checkpoint and not resume:
        raise UsageError(
            f"{run_dir} already holds a run: pass --resume to continue it or --name for a new one"
        )
    if resume and not has_checkpoint:
        runs = sorted(
            p.name
            for p in run_dir.parent.glob("*")
            if p.is_dir() and ((p / "latest").is_file() or any(p.glob("step_*")))
        )
        where = "does not exist" if not run_dir.exists() else "holds no checkpoint"
        known = f"runs in {run_dir.parent}: {', '.join(runs)}"
        if not runs:
            known = f"{run_dir.parent} holds no runs"
        raise UsageError(f"--resume: {run_dir} {where}; {known}")


# TrainConfig fields whose flag is not the field's name with dashes
_FLAGS = {"ckpt_every_minutes": "--ckpt-minutes", "max_seconds": "--max-minutes (x 60)"}


def check_seed(seed: int | None) -> None:
    """A --seed every generator here takes (torch's, numpy's, the sampler's): [0, 2**63 - 1)."""
    if seed is not None and not 0 <= seed < (1 << 63) - 1:
        raise UsageError(f"--seed must be an int in [0, 2**63 - 1), got {seed}")


def flag_names(message: str) -> str:
    """`TrainConfig.batch_size must ...` -> `--batch-size must ...` (what the user typed); the
    same for MambaConfig fields that are flags (`task`'s --d-model, --headdim, ...)."""
    return re.sub(
        r"(?:TrainConfig|MambaConfig)\.(\w+)",
        lambda m: _FLAGS.get(m[1], "--" + m[1].replace("_", "-")),
        message,
    )


def check_device(spec: str, flag: str = "--device") -> torch.device:
    """The device `spec` names ('auto': CUDA when present), refusing one that is absent."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as e:
        raise UsageError(f"{flag} {spec!r}: not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU"
            raise UsageError(f"{flag} {spec}: CUDA is not available ({why}); use {flag} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"{flag} {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif dev.type not in ("cpu", "mps"):
        raise UsageError(f"{flag} {spec}: mambakit runs on cpu or cuda")
    return dev


def choose_threads(flag: int | None) -> tuple[int, str]:
    """(thread count, where it came from) by the library's policy (mambakit.threads), with
    the flag's name in errors."""
    try:
        return threads.choose_threads(flag, name="--threads")
    except ValueError as e:
        raise UsageError(str(e)) from None


def set_threads(flag: int | None) -> str:
    """Apply the library's thread policy (mambakit.threads); returns a line to print."""
    try:
        return threads.apply_threads(flag, name="--threads")
    except ValueError as e:
        raise UsageError(str(e)) from None


def add_threads_flag(p) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"CPU threads for torch (none: ${threads.THREADS_ENV}, else $OMP_NUM_THREADS, "
        "else the free physical cores: all of them on an idle machine, fewer when others are "
        "busy)",
    )
