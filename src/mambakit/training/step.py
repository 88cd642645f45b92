"""One optimizer step, eager and as a CUDA graph.

A step draws `grad_accum` batches; each batch (dict of [B, T, ...] tensors) is cut along
time into chunks of `tbptt_len`. The final MambaState of a chunk is the initial state of
the next; the graph is kept across `tbptt_grad_chunks` chunks (0: across all of them,
which is full BPTT) and the state is detached after each backward. The loss is a sum over
tokens divided by the step's token count, so a chunked step has the same gradient as the
unchunked one. Then the gradients are clipped and applied, unless the loss or their norm
is not finite (a skipped step, counted); with f16, `torch.amp.GradScaler` scales the loss
and an overflow skips the step.

On CUDA the whole step (forward, loss, backward, clipping, optimizer) is captured in one
CUDA graph and replayed: warmed up on a side stream, the weights and optimizer state put
back (`_snapshot`, `_restore`), captured once on static input buffers; a batch whose
shapes differ from the captured ones runs eagerly for that step. The skip decision stays
on the device there (the fused AdamW's `found_inf`), so neither path waits for the GPU.

`StepMixin` holds these methods of the Trainer; `Trainer.__init__` builds what they use
(`model`, `optimizer`, `params`, `schedule`, `scaler`, the skip counters, `_graph`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..cuda_graphs import graph_capture, increment_versions
from ..state import MambaState
from . import distributed as dist_
from .config import PRECISIONS
from .optim import WarmupCosine, clip_factor
from .process import in_process_state

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch, MambaState | None], tuple[torch.Tensor, MambaState]]


def count_targets(batch: Batch) -> torch.Tensor:
    """Tokens a batch's loss averages over: valid targets, else every (row, timestep)."""
    if "targets" in batch:
        return (batch["targets"] != -100).sum()
    first = next(iter(batch.values()))
    # a fill, not a host-to-device copy: this runs inside CUDA-graph capture too
    return torch.full((), first.shape[0] * first.shape[1], device=first.device)


def check_targets(batch: Batch, vocab: int | None) -> None:
    """A batch's targets are token ids in [0, vocab) or -100 (ignored): anything else would be
    trained as some token (the loss clamps them) rather than refused. Read on the host."""
    t = batch.get("targets")
    if t is None or t.is_floating_point():
        return
    bad = (t < 0) & (t != -100)
    if vocab is not None:
        bad |= t >= vocab
    if bool(bad.any()):
        v = int(t[bad][0])
        where = "[0, vocab)" if vocab is None else f"[0, {vocab})"
        raise ValueError(f"targets must be token ids in {where} or -100 (ignored), got {v}")


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


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t`, which is a DTensor when computed from FSDP2's sharded grads."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class StepMixin:
    """`train_step` and what it runs: the eager step and its CUDA graph."""

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

    @in_process_state
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on fresh batches; returns (loss, grad norm) as tensors."""
        self.model.train()
        host = [self.train_data.next() for _ in range(self.cfg.grad_accum)]
        if self.loss_fn is lm_loss:  # a loss of the user's may read its targets otherwise
            vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
            for b in host:
                check_targets(b, vocab)
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

    # -- the eager step ------------------------------------------------------------------

    def _autocast(self):
        if self.precision == "f32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=PRECISIONS[self.precision])

    def _loss(self, batch: Batch, state: MambaState | None):
        """(summed loss, final state) of one chunk, through the engine's module when
        distributed."""
        if self.dist.active:
            return self.module(batch, state)
        return self._step_loss()(self.forward_model, batch, state)

    def _step_loss(self):
        """`loss_fn`, compiled with the model's forward inside it where the config says so
        (a compiled module's `loss_sum`, which lm_loss calls, would be the module's own
        method, uncompiled); compiled again if loss_fn is replaced."""
        fn = self.loss_fn
        if not self.cfg.compile:
            return fn
        if self._compiled[0] is not fn:
            self._compiled = (fn, torch.compile(fn))
        return self._compiled[1]

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
        if self._grad_scale is not None and getattr(self.optimizer, "grad_scale", None) is (
            self._grad_scale
        ):  # (an optimizer put in the trainer's place afterwards gets clip_grad_norm_)
            # clip_grad_norm_'s factor, applied by the fused AdamW as a division by its
            # inverse while it reads the gradients
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = _full(clip_factor(grads, max_norm, self._grad_scale))
        else:
            norm = _full(nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True))
        if self._found_inf is not None:  # decided on the device: no sync, capturable
            self._found_inf.copy_(~(torch.isfinite(norm) & torch.isfinite(loss)))
            # reads optimizer.found_inf: a skip changes no state. The fused AdamW writes the
            # parameters without moving their version counters; its post-step hook
            # (`inference.plan`) moves those a decode plan watches, and after a replay, which
            # runs no Python, `_graph_step` moves them
            self.optimizer.step()
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

    # -- the CUDA graph of the step ------------------------------------------------------

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
        # the replay updated the parameters in place behind PyTorch's back (and ran no
        # optimizer hook): move their version counters
        increment_versions(self.params)
        # copies: the graph's outputs are overwritten by the next replay
        return self._static["loss"].clone(), self._static["norm"].clone()

    def _snapshot(self) -> tuple:
        """The weights, optimizer state and skip counters, copied to host memory: the warm-up
        steps run beside the snapshot, and a device copy would add every weight's bytes (and
        the optimizer's) to the step's peak (5.1 GiB of f32 weights at 1.4b)."""

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.detach().to("cpu", copy=True) if t is not None else None

        with torch.no_grad():
            params = [host(p) for p in self.params]
            opt = {
                id(p): {k: host(v) for k, v in self.optimizer.state[p].items()}
                for p in self.params
                if p in self.optimizer.state
            }
        return params, opt, host(self._skipped_dev), host(self._streak_dev)

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
            if skipped is not None:  # the device's skip counters (CUDA only)
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
