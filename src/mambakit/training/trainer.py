"""Trainer: one engine for language models and small recurrent models.

The Trainer is built from parts, one concern each:

- `config.py`: `TrainConfig`, validated; `PRECISIONS`; the errors a run stops with;
- `step.py`: `train_step`, one optimizer step (TBPTT chunks, gradient accumulation,
  clipping, the non-finite guard), eager or replayed from a CUDA graph;
- `resume.py`: `trainer_state`, `save` and `resume` (the files are `checkpoint.py`'s);
- `process.py`: the process-wide state a call borrows (RNG stream, determinism flags)
  and the signals `fit` takes;

and this module builds it (`Trainer.__init__`), evaluates, and runs the loop (`fit`).

Precision follows DESIGN.md section 4: f32 master weights, autocast to bf16 or f16 for
GEMMs and activations, `torch.amp.GradScaler` for f16 (an overflow skips the step and is
counted). On CUDA the step is captured in a CUDA graph and replayed (`cuda_graph="auto"`,
the default): an eager step of a small model is bound by the host's kernel launches, a
replay is one launch. What cannot be captured (f16 loss scaling, `compile=True`, a loss
that syncs the host) trains eagerly, with the reason logged once.

`fit` survives what happens to long runs: SIGINT / SIGTERM finish the current step, write
a checkpoint and return (`interrupted` names the signal; a second signal interrupts at
once); a checkpoint is also written every `ckpt_every_minutes` of wall time;
`max_skipped_steps` consecutive skipped steps stop the run with `TrainingDiverged` (read
on CUDA only when a metric line is logged, so the steps never wait for the GPU), and
weights that are not finite are never saved. The run folder is locked (`RunLock`) while
`fit` runs. Building a Trainer changes no process-wide state: `fit`, `train_step`,
`evaluate`, `trainer_state` and `resume` install the run's (its RNG stream, seeded with
`seed` and kept in checkpoints; PyTorch's deterministic algorithms with `deterministic`)
for the call and put the caller's back.

With `distributed="ddp"` or `"fsdp"` (launched by torchrun: distributed.py) every rank
runs this loop on its rows of the global batch; the loss is divided by the global token
count, gradients are reduced by DDP or FSDP2, only rank 0 logs, prints and writes
checkpoints (full tensors, so N ranks resume on M), and decisions taken on the host
(a signal, the time-based checkpoint, max_seconds) are agreed by all ranks at log steps.
DDP steps are captured in a CUDA graph as one process's are (the all-reduces are graph
nodes); FSDP2 steps run eagerly; neither runs under torch.compile.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..threads import apply_threads
from . import distributed as dist_
from .checkpoint import RunLock, clean_stale_temps
from .config import (
    PRECISIONS,
    CheckpointUnreadable,
    TrainConfig,
    TrainingDiverged,
    resolve_device,
)
from .optim import make_optimizer
from .process import ProcessMixin, in_process_state, seeded_rng_state
from .report import ProgressBar, json_line, read_metrics
from .resume import CheckpointMixin
from .step import Batch, LossFn, StepMixin, count_targets, lm_loss, split_time

__all__ = [
    "PRECISIONS",
    "Batch",
    "CheckpointUnreadable",
    "LossFn",
    "TrainConfig",
    "Trainer",
    "TrainingDiverged",
    "count_targets",
    "lm_loss",
    "split_time",
]


def _quiet(*args, **kwargs) -> None:
    """The log of ranks other than 0."""


class Trainer(StepMixin, CheckpointMixin, ProcessMixin):
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
        self._rng = seeded_rng_state(config.seed, self.device)
        self._in_process_state = False
        self.model = model.to(self.device)
        self.train_data = train_data
        self.val_batches = val_batches or []
        self.loss_fn = loss_fn
        self.forward_model = self.model
        self._compiled: tuple = (None, None)  # (loss_fn, its compiled form): `_step_loss`
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
        # the clip rides in a fused AdamW, which divides each gradient by `grad_scale` as it
        # reads it: one pass over the gradients fewer than scaling them first
        # (`_clip_and_step`). For float32 parameters (the kernel takes a float32 scale, which
        # would round a float64 model's clip), without f16 (GradScaler sets grad_scale) or
        # FSDP2 (sharded gradients), and with PyTorch's get_total_norm (2.6 on)
        self._grad_scale = None
        fold = (
            all(g.get("fused") for g in self.optimizer.param_groups)
            and all(p.dtype == torch.float32 for p in self.params)
            and config.grad_clip > 0
            and not self.scaler.is_enabled()
            and self.dist.mode != "fsdp"
            and hasattr(nn.utils, "get_total_norm")
        )
        if fold:
            self._grad_scale = torch.ones((), dtype=torch.float32, device=self.device)
            self.optimizer.grad_scale = self._grad_scale
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

    # -- evaluation and the loop ------------------------------------------------------------

    @in_process_state
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

    @in_process_state
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
        stop = False  # no step left (a finished run resumed, fit called again): none runs
        try:
            with self._signals_stop_training():
                while self.step < cfg.steps:
                    loss, norm = self.train_step()
                    now = time.perf_counter()
                    elapsed = now - t_start
                    stop, out_of_time, by_time = self._clock_decisions(elapsed, now - t_ckpt)
                    done = stop or self.step >= cfg.steps or out_of_time
                    logging = self.step % cfg.log_every == 0 or done
                    streak = None
                    if cfg.max_skipped_steps and (logging or streak_on_host):
                        streak = self.consecutive_skipped_steps
                    diverged = streak is not None and streak >= cfg.max_skipped_steps
                    record: dict[str, Any] = {}
                    if logging or diverged:
                        rate = (self.tokens_seen - tok_log) / max(now - t_log, 1e-9)
                        record = self._metric_record(loss, norm, rate, elapsed)
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

    def _clock_decisions(self, elapsed: float, since_ckpt: float) -> tuple[bool, bool, bool]:
        """After a step: (a signal arrived, max_seconds is up, a checkpoint is due by wall
        time). Distributed, what the ranks agree on at log steps (nothing between them)."""
        cfg = self.cfg
        stop = self._stop_signal is not None
        out_of_time = cfg.max_seconds is not None and elapsed >= cfg.max_seconds
        by_time = (
            self.run_dir is not None
            and cfg.ckpt_every_minutes
            and since_ckpt >= 60 * cfg.ckpt_every_minutes
        )
        if self.dist.active:  # the ranks agree on what their clocks decide
            agree = self.step % cfg.log_every == 0 or self.step >= cfg.steps
            stop = agree and dist_.any_rank(stop, self.dist, self.device)
            out_of_time = agree and dist_.any_rank(out_of_time, self.dist, self.device)
            by_time = agree and dist_.any_rank(by_time, self.dist, self.device)
        return stop, out_of_time, by_time

    def _metric_record(
        self, loss: torch.Tensor, norm: torch.Tensor, tokens_per_s: float, elapsed: float
    ) -> dict[str, Any]:
        """The metric line of the step just run (reading loss and norm syncs the host)."""
        record = {
            "step": self.step,
            "loss": float(loss),
            "grad_norm": float(norm),
            "lr": self.last_lr,
            "tokens_per_s": tokens_per_s,
            "tokens": self.tokens_seen,
            "elapsed_s": elapsed,
            "skipped_steps": self.skipped_steps,
        }
        if self.device.type == "cuda":  # the caching allocator's peak
            peak = torch.cuda.max_memory_allocated(self.device)
            record["max_memory_gib"] = peak / 2**30
        return record
