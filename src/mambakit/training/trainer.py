"""TrainConfig and Trainer: one engine for language models and small recurrent models.

A step draws `grad_accum` batches; each batch (dict of [B, T, ...] tensors) is
cut along time into chunks of `tbptt_len`. The final MambaState of a chunk is
the initial state of the next; the graph is kept across `tbptt_grad_chunks`
chunks (0: across all of them, which is full BPTT) and the state is detached
after each backward. The loss is a sum over tokens divided by the step's
token count, so a chunked step has the same gradient as the unchunked one.

Precision follows DESIGN.md section 4: f32 master weights, autocast to bf16 or
f16 for GEMMs and activations, `torch.amp.GradScaler` for f16 (an overflow
skips the step and is counted).

On CUDA the whole step (forward, loss, backward, clipping, optimizer) is
captured in one CUDA graph and replayed (`cuda_graph="auto"`, the default): an
eager step of a small model is bound by the host's kernel launches, a replay is
one launch. What cannot be captured (f16 loss scaling, `compile=True`, a loss
that syncs the host) trains eagerly, with the reason logged once; a batch whose
shapes differ from the captured ones runs eagerly for that step. The step skips
the update when the loss or the gradient norm is not finite; on CUDA that
decision stays on the device (the fused AdamW's `found_inf`), so neither path
waits for the GPU.

`fit` survives what happens to long runs: SIGINT / SIGTERM finish the current
step, write a checkpoint and return (`interrupted` names the signal; a second
signal interrupts at once); a checkpoint is also written every
`ckpt_every_minutes` of wall time; `max_skipped_steps` consecutive skipped
steps stop the run with `TrainingDiverged` (read on CUDA only when a metric
line is logged, so the steps never wait for the GPU), and weights that are not
finite are never saved. The run folder is locked (`RunLock`) while `fit` runs.
Building a Trainer changes no process-wide state: `fit`, `train_step`, `evaluate`,
`trainer_state` and `resume` install the run's (its RNG stream, seeded with `seed` and kept
in checkpoints; PyTorch's deterministic algorithms with `deterministic`) for the call and
put the caller's back.

With `distributed="ddp"` or `"fsdp"` (launched by torchrun: distributed.py) every rank
runs this loop on its rows of the global batch; the loss is divided by the global token
count, gradients are reduced by DDP or FSDP2, only rank 0 logs, prints and writes
checkpoints (full tensors, so N ranks resume on M), and decisions taken on the host
(a signal, the time-based checkpoint, max_seconds) are agreed by all ranks at log steps.
DDP steps are captured in a CUDA graph as one process's are (the all-reduces are graph
nodes); FSDP2 steps run eagerly; neither runs under torch.compile.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pickle
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import increment_version

from ..device import graph_capture, resolve_device
from ..hf import CheckpointError, read_state_dict
from ..state import MambaState
from ..threads import apply_threads
from . import distributed as dist_
from .checkpoint import (
    RunLock,
    checkpoint_candidates,
    checkpoint_step,
    clean_stale_temps,
    load_trainer_state,
    point_latest,
    save_checkpoint,
    set_aside,
)
from .optim import WarmupCosine, make_optimizer
from .report import ProgressBar, json_line, read_metrics

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch, MambaState | None], tuple[torch.Tensor, MambaState]]
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
    min_lr_ratio: float = 0.1  # final lr = min_lr_ratio * lr (cosine)
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
            not isinstance(self.tbptt_len, int) or self.tbptt_len <= 0
        ):
            raise ValueError(
                f"TrainConfig.tbptt_len must be a positive int or None, got {self.tbptt_len!r}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("weight_decay", "grad_clip", "eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"TrainConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.precision not in ("auto", *PRECISIONS):
            raise ValueError(
                f"TrainConfig.precision must be auto, bf16, f16 or f32, got {self.precision!r}"
            )
        if self.cuda_graph not in ("auto", True, False):
            raise ValueError(
                f"TrainConfig.cuda_graph must be 'auto', True or False, got {self.cuda_graph!r}"
            )
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"TrainConfig.max_seconds must be > 0, got {self.max_seconds}")
        v = self.ckpt_every_minutes
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
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


def _quiet(*args, **kwargs) -> None:
    """The log of ranks other than 0."""


def _in_process_state(method):
    """Run a Trainer method under its run's process-wide state (`Trainer._process_state`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._process_state():
            return method(self, *args, **kwargs)

    return run


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    """increment_version over a list: one call from torch 2.5, one per tensor before."""
    if _VERSIONS_OF_A_LIST:
        increment_version(tensors)
    else:
        for t in tensors:
            increment_version(t)


_VERSIONS_OF_A_LIST = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 5)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t`, which is a DTensor when computed from FSDP2's sharded grads."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _named(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict with its parameters named (`names[i]` for number i)."""
    return {
        "state": {names[i]: v for i, v in sd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]
        ],
    }


def count_targets(batch: Batch) -> torch.Tensor:
    """Tokens a batch's loss averages over: valid targets, else every (row, timestep)."""
    if "targets" in batch:
        return (batch["targets"] != -100).sum()
    first = next(iter(batch.values()))
    # a fill, not a host-to-device copy: this runs inside CUDA-graph capture too
    return torch.full((), first.shape[0] * first.shape[1], device=first.device)


def lm_loss(model: nn.Module, batch: Batch, state: MambaState | None):
    """Summed next-token cross-entropy of a MambaLM; targets are already shifted."""
    loss_sum = getattr(model, "loss_sum", None)
    if loss_sum is not None:  # a MambaLM: the logits are never held whole
        return loss_sum(batch["input_ids"], batch["targets"], state, batch.get("seq_idx"))
    out = model(batch["input_ids"], state=state, seq_idx=batch.get("seq_idx"))
    logits = out.logits.flatten(0, 1)
    loss = F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)),
        batch["targets"].flatten(),
        ignore_index=-100,
        reduction="sum",
    )
    return loss, out.state


def split_time(batch: Batch, chunk: int | None) -> list[Batch]:
    T = next(iter(batch.values())).shape[1]
    if chunk is None or chunk >= T:
        return [batch]
    return [{k: v[:, t : t + chunk] for k, v in batch.items()} for t in range(0, T, chunk)]


class Trainer:
    """Train `model` on batches from `train_data` (an object with `next()` -> Batch and,
    to be checkpointed, `state_dict()` / `load_state_dict()`), with `loss_fn`
    (default: `lm_loss`) returning (summed loss, final state)."""

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        train_data,
        val_batches: list[Batch] | None = None,
        loss_fn: LossFn = lm_loss,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cfg = config
        self.dist, self.device = dist_.setup(config.distributed, resolve_device(config.device))
        prec = config.precision
        if prec == "auto":
            prec = "bf16" if self.device.type == "cuda" else "f32"
        self.precision = prec
        self.log = log if self.dist.main else _quiet
        if self.device.type == "cpu":
            apply_threads(config.threads, name="TrainConfig.threads")
        blocker = self._graph_blocker()
        if config.cuda_graph is True and blocker is not None:
            raise ValueError(f"TrainConfig.cuda_graph=True cannot be honoured: {blocker}")
        self.use_graph = config.cuda_graph is not False and blocker is None
        self.graph_off_reason = blocker if config.cuda_graph is not False else "cuda_graph=False"
        if config.cuda_graph == "auto" and blocker and self.device.type == "cuda":
            log(f"cuda graph off: {blocker}; training eagerly")
        # the run's RNG stream, seeded here but installed only by `_process_state`
        gens = {"rng_cpu": torch.Generator()}
        if self.device.type == "cuda":
            gens["rng_cuda"] = torch.Generator(self.device)
        self._rng = {k: g.manual_seed(config.seed).get_state() for k, g in gens.items()}
        self._in_process_state = False
        self.model = model.to(self.device)
        self.train_data = train_data
        self.val_batches = val_batches or []
        self.loss_fn = loss_fn
        self.forward_model = torch.compile(self.model) if config.compile else self.model
        # distributed: the engine's module around model + loss (FSDP2 shards the model here,
        # so the optimizer is built after it, on the sharded parameters)
        self.module = dist_.wrap(self.model, loss_fn, self.dist, self.device)
        self.optimizer = make_optimizer(
            self.model,
            config.lr,
            config.weight_decay,
            config.betas,
            config.eps,
            capturable=True,  # on CUDA lr is a device tensor, the same for both paths
        )
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.schedule = self._lr_schedule(0)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=prec == "f16")
        # fused CUDA AdamW skips a step whose `found_inf` is set, without a host sync
        self._found_inf = None
        self._skipped_dev = None
        self._streak_dev = None  # consecutive skipped steps, counted on the device
        if self.device.type == "cuda" and not self.scaler.is_enabled():
            self._found_inf = torch.zeros((), device=self.device)  # shaped like the steps
            self._skipped_dev = torch.zeros((), dtype=torch.int64, device=self.device)
            self._streak_dev = torch.zeros((), dtype=torch.int64, device=self.device)
            self.optimizer.found_inf = self._found_inf
        self.step = 0
        self._skipped_host = 0
        self._streak_host = 0
        self.interrupted: str | None = None  # the signal that stopped the last fit
        self._stop_signal: int | None = None
        self._saved_step: int | None = None  # the step of the last checkpoint written
        self.tokens_seen = 0
        self.run_dir = Path(config.run_dir) if config.run_dir else None
        self._graph = None
        self._static: dict[str, Any] = {}
        self._warned_shapes = False

    def _graph_blocker(self) -> str | None:
        """Why this configuration cannot be captured in a CUDA graph (None: it can)."""
        if self.dist.mode == "fsdp":
            return "FSDP2 gathers and frees parameters per block: its steps run eagerly"
        if self.device.type != "cuda":
            return f"the device is {self.device}, not CUDA"
        if self.precision == "f16":
            return "f16 dynamic loss scaling reads the scale on the host (use bf16)"
        if self.cfg.compile:
            return "compile=True (torch.compile is not captured here)"
        return None

    def graph_status(self) -> str:
        """ "cuda graph" while steps replay a captured graph, else "eager (<why>)"."""
        return "cuda graph" if self.use_graph else f"eager ({self.graph_off_reason})"

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped (non-finite loss or gradients, f16 overflow)."""
        on_device = int(self._skipped_dev) if self._skipped_dev is not None else 0
        return self._skipped_host + on_device

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_host = value
        if self._skipped_dev is not None:
            self._skipped_dev.zero_()

    @property
    def consecutive_skipped_steps(self) -> int:
        """Skipped steps since the last applied one (on CUDA this reads the device)."""
        if self._streak_dev is not None:
            return int(self._streak_dev)
        return self._streak_host

    # -- process-wide state, the lr schedule ----------------------------------------------

    def _rng_state(self) -> dict[str, torch.Tensor]:
        """The global RNG states a run uses: the CPU's, and its GPU's on CUDA."""
        state = {"rng_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the global RNG states from `_rng_state`'s dict (a GPU's is ignored on CPU)."""
        torch.set_rng_state(state["rng_cpu"].cpu())
        if "rng_cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"].cpu(), self.device)

    @contextlib.contextmanager
    def _process_state(self):
        """Install the run's process-wide state for a call and put the caller's back after it:
        the run's RNG stream (seeded with `cfg.seed`, carried from call to call and in
        checkpoints) and, with `cfg.deterministic`, deterministic algorithms with cuBLAS's
        fixed workspace (DESIGN.md section 5). Re-entrant: `fit` runs `train_step`."""
        if self._in_process_state:
            yield
            return
        outer_rng = self._rng_state()
        flags = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        flip = self.cfg.deterministic and flags != (True, False)  # setting it costs ~0.4 ms
        self._load_rng_state(self._rng)
        self._in_process_state = True
        try:
            if self.cfg.deterministic:
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            if flip:
                torch.use_deterministic_algorithms(True)
            yield
        finally:
            self._rng = self._rng_state()
            self._in_process_state = False
            self._load_rng_state(outer_rng)
            if flip:
                torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
            if self.cfg.deterministic and workspace is None:
                os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)

    def _lr_schedule(self, step: int) -> torch.optim.lr_scheduler.LambdaLR:
        """The config's warmup + cosine schedule at `step`, which sets the optimizer's lr to
        the one that step uses. Its base lr is a host float: each lr is then computed on the
        host and filled into the device tensor without a sync (a tensor would be read back)."""
        groups = self.optimizer.param_groups
        if step:  # built past step 0, LambdaLR starts from each group's `initial_lr`
            for g in groups:
                g["initial_lr"] = float(self.cfg.lr)
        fn = WarmupCosine(self.cfg.warmup_steps, self.cfg.steps, self.cfg.min_lr_ratio)
        schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, fn, last_epoch=step - 1)
        schedule.base_lrs = [float(self.cfg.lr) for _ in groups]
        return schedule

    # -- one optimizer step -------------------------------------------------------------

    def _autocast(self):
        if self.precision == "f32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=PRECISIONS[self.precision])

    def _loss(self, batch: Batch, state: MambaState | None):
        """(summed loss, final state) of one chunk, through the engine's module when
        distributed."""
        if self.dist.active:
            return self.module(batch, state)
        return self.loss_fn(self.forward_model, batch, state)

    def _grad_sync(self, last: bool):
        """Distributed: gradients are reduced over the ranks only by the step's last backward
        (DDP decides at the forward before it: earlier forwards and backwards run without)."""
        if not self.dist.active or last:
            if self.dist.mode == "fsdp":
                self.module.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.dist.mode == "ddp":
            return self.module.no_sync()
        self.module.set_requires_gradient_sync(False)
        return contextlib.nullcontext()

    def _forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """Accumulate gradients of the step's mean loss; returns the loss (a tensor).

        Distributed: every token of the global batch weighs 1 (the count is summed over the
        ranks), and each rank's loss is scaled by the world size because the engines
        average gradients over the ranks; the returned loss is the global mean."""
        k = self.cfg.tbptt_grad_chunks
        total = torch.zeros((), device=self.device)
        n_total = dist_.all_sum(sum(count_targets(b) for b in batches), self.dist).clamp(min=1)
        scale = self.dist.world
        for j, batch in enumerate(batches):
            chunks = split_time(batch, self.cfg.tbptt_len)
            state, acc = None, None
            for i, chunk in enumerate(chunks):
                if state is not None and "seq_idx" in chunk:
                    # a document that starts exactly at the chunk boundary gets no carried state
                    state.reset_(chunk["seq_idx"][:, 0] != chunks[i - 1]["seq_idx"][:, -1])
                last = j == len(batches) - 1 and i == len(chunks) - 1
                with self._grad_sync(last):  # the step's final forward and backward reduce
                    with self._autocast():
                        loss_sum, state = self._loss(chunk, state)
                    part = loss_sum / n_total
                    acc = part if acc is None else acc + part
                    if (k and (i + 1) % k == 0) or i == len(chunks) - 1:
                        self.scaler.scale(acc * scale if scale > 1 else acc).backward()
                        total = total + acc.detach()
                        acc = None
                        state = state.detach() if state is not None else None
        return dist_.all_sum(total, self.dist)

    def _clip_and_step(self, loss: torch.Tensor) -> torch.Tensor:
        """Clip the gradients to `grad_clip` and apply them unless the loss or their norm is
        not finite (with f16: unless GradScaler finds an overflow, which lowers its scale);
        count a skipped step. Returns the norm before clipping. The eager step and the
        captured one both run this: on CUDA the decision stays on the device."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)  # clip the true gradients
        norm = _full(nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True))
        if self._found_inf is not None:  # decided on the device: no sync, capturable
            self._found_inf.copy_(~(torch.isfinite(norm) & torch.isfinite(loss)))
            self.optimizer.step()  # reads optimizer.found_inf: a skip changes no state
            # the fused AdamW writes the parameters without moving their version counters:
            # move them, or the decode plan keyed on them (`inference.plan`: A = -exp(A_log),
            # D and dt bias, the decode weights) would keep serving the old values (a replay
            # runs no Python: `_graph_step` does this after it)
            _increment_versions(self.params)
            skipped = self._found_inf.to(torch.int64)
            self._skipped_dev += skipped
            self._streak_dev.add_(1).mul_(skipped)  # +1 on a skip, 0 on an applied step
            return norm
        if self.scaler.is_enabled():
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before
        else:  # decided on the host
            skipped = not bool(torch.isfinite(norm) & torch.isfinite(loss))
            if not skipped:
                self.optimizer.step()
        _increment_versions(self.params)  # as above (a fused optimizer)
        self._skipped_host += skipped
        self._streak_host = self._streak_host + 1 if skipped else 0
        return norm

    def _step_body(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step, as run eagerly and as captured: (loss, grad norm)."""
        loss = self._forward_backward(batches)
        return loss, self._clip_and_step(loss)

    def _eager_step(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        loss, norm = self._step_body(batches)
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def _fits_graph(self, batches: list[Batch]) -> bool:
        static = self._static["batches"]
        return len(batches) == len(static) and all(
            b.keys() == s.keys()
            and all(b[k].shape == s[k].shape and b[k].dtype == s[k].dtype for k in b)
            for b, s in zip(batches, static)
        )

    def _graph_step(self, host: list[Batch]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Replay the captured step on `host` batches; None when it must run eagerly."""
        if self._graph is None:
            batches = [{k: v.to(self.device) for k, v in b.items()} for b in host]
            if not self._capture(batches):
                return None
        if not self._fits_graph(host):
            if not self._warned_shapes:
                self.log("cuda graph: a batch's shapes differ from the captured ones; eager step")
                self._warned_shapes = True
            return None
        for src, dst in zip(host, self._static["batches"]):
            for key, v in src.items():
                dst[key].copy_(v, non_blocking=True)
        self._graph.replay()
        # the replay updated the parameters in place behind PyTorch's back: move their
        # version counters, as `_clip_and_step` does on the eager path
        _increment_versions(self.params)
        # copies: the graph's outputs are overwritten by the next replay
        return self._static["loss"].clone(), self._static["norm"].clone()

    def _snapshot(self) -> tuple:
        with torch.no_grad():
            params = [p.detach().clone() for p in self.params]
            opt = {
                id(p): {k: v.clone() for k, v in self.optimizer.state[p].items()}
                for p in self.params
                if p in self.optimizer.state
            }
        return params, opt, self._skipped_dev.clone(), self._streak_dev.clone()

    def _restore(self, snapshot: tuple) -> None:
        params, opt, skipped, streak = snapshot
        with torch.no_grad():
            for p, saved in zip(self.params, params):
                p.copy_(saved)
            for p in self.params:
                for k, v in self.optimizer.state.get(p, {}).items():
                    if id(p) in opt:
                        v.copy_(opt[id(p)][k])
                    else:
                        v.zero_()
            self._skipped_dev.copy_(skipped)
            self._streak_dev.copy_(streak)

    def _capture(self, batches: list[Batch]) -> bool:
        """Warm up on a side stream (kernels compiled, workspaces allocated), put weights
        and optimizer state back, capture one step. False (and eager from now on) when
        the step cannot be captured and cuda_graph is "auto"."""
        static = [{k: v.clone() for k, v in b.items()} for b in batches]
        snapshot = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                # DDP settles its buckets over its first iterations (PyTorch's CUDA-graph
                # notes ask for 11 before a capture)
                for _ in range(11 if self.dist.mode == "ddp" else 2):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._step_body(static)
            torch.cuda.current_stream().wait_stream(side)
        finally:
            torch.cuda.synchronize()
            self._restore(snapshot)  # the warm-up steps must not count
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with graph_capture(graph):  # a failed capture leaves the stream and RNG usable
                loss, norm = self._step_body(static)
        except Exception as e:
            if self.cfg.cuda_graph is True:
                raise
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            self._restore(snapshot)
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.use_graph = False
            self.graph_off_reason = f"the step could not be captured: {type(e).__name__}: {why}"
            self.log(f"cuda graph off: {self.graph_off_reason}; training eagerly")
            return False
        self._graph = graph
        self._static = {"batches": static, "loss": loss, "norm": norm}
        return True

    @_in_process_state
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on fresh batches; returns (loss, grad norm) as tensors."""
        self.model.train()
        host = [self.train_data.next() for _ in range(self.cfg.grad_accum)]
        n_tokens = sum(int(count_targets(b)) for b in host)  # counted on the host: no sync
        host = [dist_.shard_rows(b, self.dist) for b in host]  # this rank's rows
        # the lr this step uses, on the host (with cuda_graph the group's lr is a device tensor)
        self.last_lr = self.cfg.lr * self.schedule.lr_lambdas[0](self.schedule.last_epoch)
        out = self._graph_step(host) if self.use_graph else None
        if out is None:
            batches = [
                {k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in host
            ]
            out = self._eager_step(batches)
        with warnings.catch_warnings():
            # a skipped (non-finite) first step never calls optimizer.step(): the schedule
            # still advances, as intended, so PyTorch's call-order warning does not apply
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
            self.schedule.step()
        self.step += 1
        self.tokens_seen += n_tokens
        return out

    # -- evaluation, checkpoints, the loop ---------------------------------------------------

    @_in_process_state
    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.val_batches:
            return None
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.val_batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self._autocast():  # one process: the model itself, not a compiled one
                if self.dist.active:
                    loss_sum, _ = self.module(batch, None)
                else:
                    loss_sum, _ = self.loss_fn(self.model, batch, None)
            total += float(loss_sum)
            count += int(count_targets(batch))
        self.model.train()
        return total / max(count, 1)

    @_in_process_state
    def trainer_state(self) -> dict[str, Any]:
        state = {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "tokens_seen": self.tokens_seen,
            "optimizer": self._optimizer_state(),
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            **self._rng_state(),  # the run's stream: the global one under _process_state
            "train_config": {k: v for k, v in asdict(self.cfg).items() if k != "betas"},
        }
        if hasattr(self.train_data, "state_dict"):
            state["data"] = self.train_data.state_dict()
        return state

    def weights_finite(self) -> bool:
        """Whether every parameter is finite (one host sync; every rank's shards)."""
        with torch.no_grad():
            local = [getattr(p, "_local_tensor", p) for p in self.params]
            ok = torch.stack([p.isfinite().all() for p in local]).all()
        return not dist_.any_rank(not bool(ok), self.dist, self.device)

    def save(self) -> Path:
        """Write a checkpoint of this step and point `latest` at it. Refuses (with
        `TrainingDiverged`) weights that are not finite: `latest` keeps naming the last
        good checkpoint."""
        if self.run_dir is None:
            raise ValueError("TrainConfig.run_dir is not set: nowhere to save a checkpoint")
        if not self.weights_finite():
            latest = checkpoint_candidates(self.run_dir)
            kept = f"; {latest[0]} is the newest checkpoint" if latest else ""
            raise TrainingDiverged(
                f"training diverged: the weights are not finite at step {self.step}, so no "
                f"checkpoint was written{kept} (lower the learning rate, TrainConfig.lr "
                f"{self.cfg.lr:g})"
            )
        weights = self._full_weights()  # FSDP2: gathered by every rank, written by rank 0
        state = self.trainer_state()
        path = self.run_dir / f"step_{self.step:07d}"
        if self.dist.main:
            path = save_checkpoint(
                self.run_dir, self.step, self.model, state, self.cfg.keep_last, weights
            )
        dist_.barrier(self.dist)  # no rank goes on before the checkpoint is complete
        self._saved_step = self.step
        return path

    def _full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole model's tensors under FSDP2 (None: `save_pretrained` reads the model)."""
        if self.dist.mode != "fsdp":
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)

    def _param_names(self) -> list[str]:
        """The model's name of each parameter, in the optimizer's order."""
        name = {id(p): n for n, p in self.model.named_parameters()}
        return [name[id(p)] for p in self.params]

    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state dict with parameters named (not numbered) and full tensors,
        so that it loads into any number of ranks and any engine."""
        if self.dist.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        return _named(self.optimizer.state_dict(), self._param_names())

    def _load_optimizer_state(self, sd: dict[str, Any]) -> None:
        """Load `_optimizer_state`'s format (or the numbered one of older checkpoints)."""
        names = self._param_names()
        index = {n: i for i, n in enumerate(names)}
        named = all(isinstance(p, str) for g in sd["param_groups"] for p in g["params"])
        if self.dist.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            if not named:
                sd = _named(sd, names)
            opts = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(self.model, self.optimizer, sd, options=opts)
            return
        if named:  # numbered; load_state_dict pairs each group's parameters by position
            numbered, start = [], 0  # self.params lists the groups' parameters in order
            for g, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
                own = names[start : start + len(g["params"])]
                start += len(g["params"])
                if set(own) != set(saved["params"]):
                    raise ValueError(
                        "resume: the checkpoint's optimizer state does not fit this model: "
                        f"{sorted(set(own) ^ set(saved['params']))}"
                    )
                numbered.append({**saved, "params": [index[n] for n in own]})
            sd = {"state": {index[n]: v for n, v in sd["state"].items()}, "param_groups": numbered}
        self.optimizer.load_state_dict(sd)

    def _read_checkpoint(self, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(weights, trainer state) of a checkpoint folder; read errors propagate."""
        if not path.is_dir():
            raise FileNotFoundError(f"{path} does not exist")
        for name in ("model.safetensors", "trainer_state.pt"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path} is incomplete: {name} is missing")
        try:
            weights = read_state_dict(path)  # the one reader of model files (hf/io.py)
        except CheckpointError as e:
            raise CheckpointUnreadable(str(e)) from e
        try:
            st = load_trainer_state(path, self.device)
        except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as e:
            raise CheckpointUnreadable(f"{path / 'trainer_state.pt'}: {e}") from e
        return weights, st

    @_in_process_state
    def resume(self, path: str | Path | None = None) -> bool:
        """Continue from a checkpoint folder, or else the one run_dir's `latest` names;
        when that one cannot be read, from the newest readable `step_XXXXXXX` folder (each
        skipped one is logged with the reason, then renamed to `step_XXXXXXX.corrupt` and
        `latest` pointed at the one resumed from). False when run_dir holds none."""
        skipped: list[tuple[Path, str]] = []  # run_dir's checkpoints that failed to load
        if path is not None:
            path = Path(path)
            weights, st = self._read_checkpoint(path)
        else:
            if self.run_dir is None:
                raise ValueError("resume: no path given and TrainConfig.run_dir is not set")
            candidates = checkpoint_candidates(self.run_dir)
            if not candidates:
                return False
            for path in candidates:
                try:
                    weights, st = self._read_checkpoint(path)
                    break
                except (FileNotFoundError, CheckpointUnreadable) as e:
                    skipped.append((path, str(e).splitlines()[0]))
                    self.log(f"resume: skipped checkpoint {path.name}: {skipped[-1][1]}")
            else:  # nothing set aside: the run folder stays as the user may want to repair it
                raise CheckpointUnreadable(
                    f"resume: no readable checkpoint in {self.run_dir}: "
                    + "; ".join(why for _, why in skipped)
                )
            if skipped:
                self.log(f"resume: continuing from {path}")
        own = self.model.state_dict()
        tied = getattr(getattr(self.model, "config", None), "tie_embeddings", False)
        expected = {k for k in own if not (tied and k == "lm_head.weight")}
        extra, missing = sorted(set(weights) - set(own)), sorted(expected - set(weights))
        if extra or missing:
            raise ValueError(
                f"resume: checkpoint {path} does not fit the model: tensors not in the model "
                f"{extra}, model tensors missing from it {missing}"
            )
        for k, v in weights.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(
                    f"resume: tensor {k!r} has shape {list(v.shape)} in {path}, "
                    f"the model has {list(own[k].shape)}"
                )
        if skipped and self.dist.main:  # the rank that writes checkpoints tidies run_dir
            # out of the fallback and rotation's count for good: a later save must not keep
            # an unreadable checkpoint in place of the one this run resumed from
            with RunLock(self.run_dir):
                for bad, why in skipped:
                    if bad.is_dir() and checkpoint_step(bad) is not None:
                        aside = set_aside(bad)
                        self.log(f"resume: renamed unreadable {bad.name} to {aside.name} ({why})")
                point_latest(self.run_dir, path.name)
        if self.dist.mode == "fsdp":  # every rank holds the full tensors and keeps its shards
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            full = dict(weights)
            if tied and "lm_head.weight" not in full:  # written once, as the embedding
                full["lm_head.weight"] = full["backbone.embeddings.weight"]
            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
        else:
            with torch.no_grad():
                for k, v in weights.items():
                    own[k].copy_(v)
        # the groups' lr as make_optimizer sets it (a tensor for graphs), then the schedule of
        # this run's config at the step (a resumed run may extend steps or change lr)
        lr_tensor = isinstance(self.optimizer.param_groups[0]["lr"], torch.Tensor)
        self._load_optimizer_state(st["optimizer"])
        for g in self.optimizer.param_groups:
            g["lr"] = torch.tensor(self.cfg.lr, device=self.device) if lr_tensor else self.cfg.lr
            g.pop("initial_lr", None)
        self.schedule = self._lr_schedule(int(st["step"]))
        self.scaler.load_state_dict(st["scaler"])
        self._load_rng_state(st)
        if "data" in st and hasattr(self.train_data, "load_state_dict"):
            self.train_data.load_state_dict(st["data"])
        self.step = int(st["step"])
        self.skipped_steps = int(st["skipped_steps"])  # zeroes the on-device count too
        self._streak_host = 0
        if self._streak_dev is not None:
            self._streak_dev.zero_()
        self.tokens_seen = int(st["tokens_seen"])
        self._saved_step = self.step
        self._graph = None
        return True

    def _open_metrics(self):
        """metrics.jsonl for appending: a fresh run starts a fresh file; a resumed one keeps
        the lines up to its step (a crash after the checkpoint logged steps that are about
        to run again) and drops unreadable ones."""
        path = self.run_dir / "metrics.jsonl"
        if self.step == 0 or not path.is_file():
            return open(path, "w")
        rows = read_metrics(path, warn=self.log)
        keep = [r for r in rows if not isinstance(r.get("step"), int) or r["step"] <= self.step]
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json_line(r) for r in keep))
        os.replace(tmp, path)
        return open(path, "a")

    def _on_signal(self, signum, frame) -> None:
        # only a flag: printing here could re-enter a write the signal interrupted
        if self._stop_signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum

    @contextlib.contextmanager
    def _signals_stop_training(self):
        """SIGINT / SIGTERM set a flag the loop reads after each step (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    @_in_process_state
    def fit(self, progress: bool = True) -> dict[str, Any]:
        """Train to `cfg.steps` (or `max_seconds`, or a SIGINT / SIGTERM); log, evaluate and
        checkpoint on the way. Returns the last logged values."""
        if self.run_dir is None or not self.dist.main:  # rank 0 holds the run's lock
            return self._fit(progress and self.dist.main)
        with RunLock(self.run_dir):
            for p in clean_stale_temps(self.run_dir):
                self.log(f"removed {p}, left by a save that was interrupted")
            return self._fit(progress)

    def _fit(self, progress: bool) -> dict[str, Any]:
        cfg = self.cfg
        self.interrupted, self._stop_signal = None, None
        metrics_file = None
        if self.run_dir is not None and self.dist.main:
            metrics_file = self._open_metrics()
        bar = ProgressBar(cfg.steps, self.step) if progress else None
        t_start = time.perf_counter()
        t_log, tok_log, t_ckpt = t_start, self.tokens_seen, t_start
        # on CUDA the skip streak lives on the device: read it only with a metric line
        streak_on_host = self._streak_dev is None
        last: dict[str, Any] = {}
        try:
            with self._signals_stop_training():
                while self.step < cfg.steps:
                    loss, norm = self.train_step()
                    now = time.perf_counter()
                    elapsed = now - t_start
                    stop = self._stop_signal is not None
                    out_of_time = cfg.max_seconds is not None and elapsed >= cfg.max_seconds
                    by_time = (
                        self.run_dir is not None
                        and cfg.ckpt_every_minutes
                        and now - t_ckpt >= 60 * cfg.ckpt_every_minutes
                    )
                    if self.dist.active:  # the ranks agree on what their clocks decide
                        agree = self.step % cfg.log_every == 0 or self.step >= cfg.steps
                        stop = agree and dist_.any_rank(stop, self.dist, self.device)
                        out_of_time = agree and dist_.any_rank(out_of_time, self.dist, self.device)
                        by_time = agree and dist_.any_rank(by_time, self.dist, self.device)
                    done = stop or self.step >= cfg.steps or out_of_time
                    logging = self.step % cfg.log_every == 0 or done
                    streak = None
                    if cfg.max_skipped_steps and (logging or streak_on_host):
                        streak = self.consecutive_skipped_steps
                    diverged = streak is not None and streak >= cfg.max_skipped_steps
                    record: dict[str, Any] = {}
                    if logging or diverged:
                        record = {
                            "step": self.step,
                            "loss": float(loss),
                            "grad_norm": float(norm),
                            "lr": self.last_lr,
                            "tokens_per_s": (self.tokens_seen - tok_log) / max(now - t_log, 1e-9),
                            "tokens": self.tokens_seen,
                            "elapsed_s": elapsed,
                            "skipped_steps": self.skipped_steps,
                        }
                        if self.device.type == "cuda":  # the caching allocator's peak
                            peak = torch.cuda.max_memory_allocated(self.device)
                            record["max_memory_gib"] = peak / 2**30
                        t_log, tok_log = now, self.tokens_seen
                    evaluate = (cfg.eval_every and self.step % cfg.eval_every == 0) or done
                    if evaluate and not stop and not diverged:
                        val = self.evaluate()
                        if val is not None:
                            record = record or {"step": self.step, "elapsed_s": elapsed}
                            record["val_loss"] = val
                    if record:
                        last.update(record)
                        if metrics_file:
                            metrics_file.write(json_line(record))
                            metrics_file.flush()
                    if bar is not None:
                        bar.advance(self.step, record)
                    if diverged:
                        raise TrainingDiverged(
                            f"training diverged: {streak} consecutive steps skipped (loss or "
                            f"gradients not finite) up to step {self.step}, so it stopped "
                            f"(lower the learning rate, TrainConfig.lr {cfg.lr:g}; the limit is "
                            f"TrainConfig.max_skipped_steps {cfg.max_skipped_steps})"
                        )
                    if self.run_dir is not None and not done:
                        by_steps = cfg.ckpt_every and self.step % cfg.ckpt_every == 0
                        if by_steps or by_time:
                            self.save()
                            t_ckpt = time.perf_counter()
                    if done:
                        break
                if stop:
                    self.interrupted = signal.Signals(self._stop_signal or signal.SIGTERM).name
                    self.log(
                        f"\n{self.interrupted}: stopped after step {self.step}; saving a "
                        "checkpoint (send it again to stop at once)"
                    )
                if self.run_dir is not None and self._saved_step != self.step:
                    self.save()
        finally:
            if bar is not None:
                bar.close()
            if metrics_file:
                metrics_file.close()
        return last
