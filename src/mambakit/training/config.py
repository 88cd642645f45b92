"""TrainConfig: what a training run is asked to do, each field validated at construction
(a `ValueError` names the field); the compute dtypes a run may use (`PRECISIONS`) and the
errors that stop a run (`TrainingDiverged`, `CheckpointUnreadable`)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from . import distributed as dist_

PRECISIONS = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


class TrainingDiverged(RuntimeError):
    """The run stopped: too many consecutive skipped steps, or weights not finite."""


class CheckpointUnreadable(ValueError):
    """A checkpoint's files exist but cannot be read (truncated, corrupt)."""


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    batch_size: int = 8  # rows per micro-batch
    seqlen: int = 256  # timesteps per row
    tbptt_len: int | None = None  # chunk length for truncated BPTT (None: the whole row)
    tbptt_grad_chunks: int = 1  # chunks per backward; 0 keeps the graph across all chunks
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine reaches min_lr_ratio * lr at `steps` (after the last)
    warmup_steps: int = 50
    weight_decay: float = 0.1  # not applied to norms, biases, A_log, D, dt bias
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping (0: off)
    precision: str = "auto"  # bf16 | f16 | f32 | auto (bf16 on CUDA, f32 on CPU)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    cuda_graph: bool | str = "auto"  # capture the whole step and replay it: auto | True | False
    compile: bool = False  # torch.compile the model
    deterministic: bool = False  # bit-reproducible runs (DESIGN.md section 5)
    seed: int = 0
    log_every: int = 10  # steps between metric lines
    eval_every: int = 100  # steps between validation losses (0: only at the end)
    eval_batches: int = 8
    ckpt_every: int = 0  # steps between checkpoints (0: only at the end)
    ckpt_every_minutes: float = 5.0  # also checkpoint after this much wall time (0: off)
    max_skipped_steps: int = 10  # stop after this many consecutive skipped steps (0: never)
    keep_last: int = 2  # checkpoints kept on disk
    max_seconds: float | None = None  # stop (and checkpoint) after this much training time
    run_dir: str | None = None  # where checkpoints and metrics go (None: nowhere)
    distributed: str = "none"  # none | ddp | fsdp (under torchrun: distributed.py)
    threads: int | None = None  # CPU threads on a CPU device (None: mambakit.threads' policy)

    def __post_init__(self) -> None:
        positive = (
            "steps",
            "batch_size",
            "seqlen",
            "grad_accum",
            "log_every",
            "eval_batches",
            "keep_last",
        )
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {v!r}")
        for name in (
            "tbptt_grad_chunks",
            "warmup_steps",
            "eval_every",
            "ckpt_every",
            "max_skipped_steps",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {v!r}")
        if self.tbptt_len is not None and (
            isinstance(self.tbptt_len, bool)
            or not isinstance(self.tbptt_len, int)
            or self.tbptt_len <= 0
        ):
            raise ValueError(
                f"TrainConfig.tbptt_len must be a positive int or None, got {self.tbptt_len!r}"
            )
        if not (_number(self.lr) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
        b = self.betas
        if not (isinstance(b, (tuple, list, np.ndarray)) and len(b) == 2
                and all(_number(x) and 0 <= x < 1 for x in b)):  # fmt: skip
            raise ValueError(f"TrainConfig.betas must be two numbers in [0, 1), got {b!r}")
        if (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                or not 0 <= self.seed < (1 << 63) - 1):  # fmt: skip
            # (a seed of generate's range: the samples drawn after training take it)
            raise ValueError(f"TrainConfig.seed must be an int in [0, 2**63 - 1), got "
                             f"{self.seed!r}")  # fmt: skip
        for name in ("compile", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainConfig.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")  # fmt: skip
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(
                    f"TrainConfig.device: {self.device!r} is not a device ({e})"
                ) from None
        if not (_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("weight_decay", "grad_clip", "eps"):
            v = getattr(self, name)
            if not (_number(v) and math.isfinite(v) and v >= 0):
                raise ValueError(f"TrainConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.precision not in ("auto", *PRECISIONS):
            raise ValueError(
                f"TrainConfig.precision must be auto, bf16, f16 or f32, got {self.precision!r}"
            )
        if not (isinstance(self.cuda_graph, bool) or self.cuda_graph == "auto"):  # (0 == False)
            raise ValueError(
                f"TrainConfig.cuda_graph must be 'auto', True or False, got {self.cuda_graph!r}"
            )
        v = self.max_seconds
        if v is not None and not (_number(v) and v > 0):  # (inf: no limit, as None; NaN: no)
            raise ValueError(f"TrainConfig.max_seconds must be a number > 0, got {v!r}")
        v = self.ckpt_every_minutes
        if not (_number(v) and math.isfinite(v) and v >= 0):
            raise ValueError(f"TrainConfig.ckpt_every_minutes must be a number >= 0, got {v!r}")
        if self.distributed not in dist_.MODES:
            raise ValueError(
                f"TrainConfig.distributed must be one of {dist_.MODES}, got {self.distributed!r}"
            )
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(
                f"TrainConfig.threads must be an int >= 1 or None, got {self.threads!r}"
            )
        if self.distributed != "none" and self.compile:
            raise ValueError("TrainConfig.compile is not supported with distributed training")
        # plain Python numbers from here on: numpy's (np.logspace's lrs, say) would reach the
        # checkpoint's trainer state, which torch.load(weights_only=True) refuses to read back
        for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "eps"):
            setattr(self, name, float(getattr(self, name)))
        self.betas = (float(b[0]), float(b[1]))
        self.seed = int(self.seed)
        self.ckpt_every_minutes = float(self.ckpt_every_minutes)
        if self.max_seconds is not None:
            self.max_seconds = float(self.max_seconds)


def _number(v) -> bool:
    """A real number (numpy's too), not a bool (True would read as 1)."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def resolve_device(spec: str) -> torch.device:
    """TrainConfig.device's value as a device, refusing CUDA where there is none."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device is {spec!r} but no CUDA device is available")
    return dev
