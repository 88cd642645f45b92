"""MambaBackbone (float inputs or token ids -> hidden states) and MambaLM (tied LM head).

B batch, T time, M = d_model, V = vocab. Every forward takes the recurrent state
of all layers (`MambaState`, or None for zeros) and returns the final one,
differentiable w.r.t. the parameters and the state passed in. `step()` advances
one timestep: in place when no gradient is being recorded (decode, RL acting),
functionally (a new state, the old one untouched) when one is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import MambaConfig
from .inference.cpu_step import compiled_rows
from .inference.cuda_graph import use_cuda_graph
from .inference.plan import derived as derived_plan
from .inference.step_graph import graphed_step
from .layers.block import MambaBlock, RMSNorm
from .layers.init import init_model_weights
from .layers.plain import plain
from .ops import linear_cross_entropy, mamba_stack_step, resolve_backend
from .ops._checks import check_positions, check_seq_idx, check_tensor, state_dtype
from .ops.decode import _norm_linear
from .ops.mamba_step.stack import stack_weights
from .state import ModelState, check_state, init_state, state_class
from .targets import next_token_targets


def compute_dtype(param_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of GEMM inputs and stored activations: autocast's when it is on."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return param_dtype


class MambaBackbone(nn.Module):
    """Input (ids via `embeddings`, or floats via the optional `input_proj`) -> layers -> norm_f."""

    def __init__(self, cfg: MambaConfig, embeddings: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(cfg, MambaConfig):
            raise TypeError(f"cfg must be a MambaConfig, got {type(cfg).__name__}")
        self.config = cfg
        fk = {"device": device, "dtype": dtype}
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, **fk) if embeddings else None
        self.input_proj = (
            nn.Linear(cfg.input_dim, cfg.d_model, **fk)
            if cfg.input_dim is not None and not embeddings
            else None
        )
        self.layers = nn.ModuleList(MambaBlock(cfg, i, **fk) for i in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **fk)
        init_model_weights(self, cfg.n_layers, cfg.initializer_range, cfg.rescale_prenorm_residual)

    @property
    def _param(self) -> torch.Tensor:
        """norm_f's weight: where the model's device and dtype are read (dict lookups
        first: a batch-1 step reads it on every call)."""
        norm = self._modules["norm_f"]
        weight = norm._parameters.get("weight")
        return weight if weight is not None else norm.weight

    def init_state(self, batch_size: int, device=None) -> ModelState:
        """Zero state for `batch_size` rows: f32 (f64 for a float64 model) on the model device;
        a MambaState, or a Mamba3ModelState when the mixer is Mamba-3 (state.py)."""
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        p = self._param
        return init_state(self.config, batch_size, device or p.device, state_dtype(p))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """r_0: embeddings(ids), input_proj(x) or x itself."""
        cfg = self.config
        if self.embeddings is not None:
            if x.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"input_ids must be an int64 or int32 tensor, got {x.dtype}")
            # a check of the values (a host sync on a GPU, a data-dependent guard for tracers:
            # torch.export and torch.compile see fake tensors) on real CPU tensors only
            if (
                type(x) is torch.Tensor
                and not x.is_cuda
                and not torch.compiler.is_compiling()
                and x.numel()
                and (x.min() < 0 or x.max() >= cfg.vocab_size)
            ):
                raise ValueError(
                    f"input_ids must lie in [0, {cfg.vocab_size}), got values in "
                    f"[{int(x.min())}, {int(x.max())}]"
                )
            return self.embeddings(x)
        width = cfg.input_dim if self.input_proj is not None else cfg.d_model
        check_tensor("x", x, (*x.shape[:-1], width), device=self._param.device)
        return self.input_proj(x) if self.input_proj is not None else x

    def forward(
        self,
        x: torch.Tensor,  # [B, T] ids or [B, T, input_dim or M] floats
        state: ModelState | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32
    ) -> tuple[torch.Tensor, ModelState]:
        """(hidden [B, T, M] in the compute dtype, final MambaState)."""
        h, residual, cdt, backend, state = self._forward_layers(x, state, seq_idx)
        out, _ = self.norm_f(h, residual, cdt, backend=backend)
        return out, state

    def _forward_layers(self, x, state, seq_idx, last: bool = False, at=None) -> tuple:
        """`forward` up to norm_f: (the last block's output, the residual stream [B, T, M]
        f32, compute dtype, backend, final state). `last`: only the last step's output is
        read; the last block may give that step's alone ([B, 1, M], `MambaBlock.forward`).
        `at` [B, k] int64 (Mamba-1 layers, checked by the caller): the state is instead the
        states after those steps, B * k rows (row b * k + j: after step at[b, j] of row b)."""
        want_dim = 2 if self.embeddings is not None else 3
        name = "input_ids" if self.embeddings is not None else "x"
        if not isinstance(x, torch.Tensor) or x.dim() != want_dim:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name} must be a {want_dim}-d tensor [B, T{', F' * (want_dim == 3)}], got {got}"
            )
        if x.device != self._param.device:
            raise ValueError(f"{name} is on {x.device} but the model is on {self._param.device}")
        Bsz, T = x.shape[:2]
        if T == 0:
            raise ValueError(f"{name} must have at least one timestep")
        if state is not None:
            check_state(state, self.config, Bsz, x.device)
        if seq_idx is not None:
            check_seq_idx(seq_idx, Bsz, T, x.device)
        h = self.embed(x)
        cdt = compute_dtype(self._param.dtype, x.device)
        backend = resolve_backend("auto", h)  # once per call, for every layer's ops
        plan = (
            None  # without autograd, what the mixers derive from their weights (`inference.plan`)
        )
        if (
            not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            # under FSDP2 the blocks hold shards (DTensors) until each one's forward
            # gathers its parameters: the layers derive from those
            and not hasattr(getattr(self.layers[0].mixer.in_proj, "weight", None), "full_tensor")
        ):
            plan = derived_plan(self, "forward", _forward_plan)
        residual = None
        finals = []
        for i, layer in enumerate(self.layers):
            layer_state = None if state is None else state.layer(i)
            derived = None if plan is None else plan[i]
            end = last and i == len(self.layers) - 1
            if at is None:
                h, residual, final = layer(
                    h, residual, cdt, layer_state, seq_idx, backend, derived, end
                )
            else:
                h, residual, _, states = layer(
                    h, residual, cdt, layer_state, seq_idx, backend, derived, at=at
                )
                final = tuple(t.flatten(0, 1) for t in states)
            finals.append(final)
        return h, residual, cdt, backend, state_class(self.config).stack(finals)

    def step(
        self, x: torch.Tensor, state: ModelState, *, cuda_graph: bool | str = "auto"
    ) -> tuple[torch.Tensor, ModelState]:
        """One timestep: x [B] ids or [B, input_dim or M] -> (hidden [B, M], state).

        Without autograd on a CUDA device the step is replayed from a CUDA graph captured
        for the input's shape and dtype and this state's tensors, from the third such call
        on (`inference.step_graph`; `cuda_graph=False`: never; True: from the first call);
        `inference.step_graph_status(model)` says why a step ran eagerly."""
        self._check_step(x, state)
        use_cuda_graph(cuda_graph, x.device)  # checks the argument
        if self._step_records_grad(state):
            out, new_state = self.forward(x.unsqueeze(1), state)
            return out[:, 0], new_state
        out = graphed_step(self, self, self._step_rows, x, state, cuda_graph)
        if out is None:
            out = self._step_rows(x, state)
        return out, state

    def _step_rows(self, x: torch.Tensor, state: ModelState) -> torch.Tensor:
        """The no-grad step's hidden rows [B, M], the state advanced in place: on the CPU
        compiled end to end where it can be (`inference.cpu_step`)."""
        if x.device.type == "cpu":
            rows = compiled_rows(self, x, state, self._stack_weights)
            if rows is not None:
                return rows
        h, residual, cdt, backend = self._decode_layers(x, state)
        return self.norm_f.rows(h, residual, cdt, backend)[0]

    def _check_step(self, x: torch.Tensor, state: ModelState) -> None:
        want_dim = 1 if self.embeddings is not None else 2
        if not isinstance(x, torch.Tensor) or x.dim() != want_dim:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            name = "input_ids" if self.embeddings is not None else "x"
            shape = "[B]" if want_dim == 1 else "[B, F]"
            raise ValueError(f"step: {name} must be a {want_dim}-d tensor {shape}, got {got}")
        if x.device != self._param.device:
            raise ValueError(f"step: input is on {x.device} but the model on {self._param.device}")
        check_state(state, self.config, x.shape[0], x.device)

    def _step_records_grad(self, state) -> bool:
        """Whether a step must record a gradient (then it runs functionally, the forward over
        one step): grad mode on and any parameter (an adapter's, when the base weights are
        frozen) or the state requiring one."""
        if not torch.is_grad_enabled():
            return False
        if self._param.requires_grad or state.requires_grad:
            return True
        return any(p.requires_grad for p in self.parameters())

    def _decode_plan(self) -> list:
        """Every block's decode weights (`MambaBlock.decode_weights`: `ops.StepWeights`,
        `ops.mamba2.Mamba2StepWeights` or `ops.mamba3.Mamba3StepWeights`), derived from the
        parameters once and kept until one changes (`inference.plan`): what decode steps
        read, and CUDA graphs captured on them. (No-grad forwards read a plan of their own,
        `_forward_plan`.)"""
        return derived_plan(self, "step", _step_plan, _norm_eps)

    def _stack_weights(self):
        """The reference bodies' whole-stack decode weights (`_stack_plan`), kept until a
        parameter changes."""
        return derived_plan(self, "stack", _stack_plan, _norm_eps)

    def _decode_layers(
        self, x: torch.Tensor, state: ModelState
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype, str]:
        """The layers of one decode step, the state in place: (the last block's output,
        the residual stream before norm_f (None where the output is the residual stream),
        compute dtype, backend).

        When every block is plain (`fusable`), outside torch.compile (which traces the
        parameters themselves: cached tensors as extra graph inputs would cost it guards and
        alias handling), the blocks run as their mixer's stack op on the decode plan
        (`ops.mamba_stack_step`, `ops.mamba2.mamba2_stack_step`,
        `ops.mamba3.mamba3_stack_step`, which choose the bodies);
        otherwise each block's `step` calls its modules. A batch-1 CPU step is bound by
        per-call overhead, so the backend is resolved once here, not once per op."""
        h = self.embed(x)
        cdt = compute_dtype(self._param.dtype, x.device)
        backend = resolve_backend("auto", h)
        layers = self._modules["layers"]
        if not torch.compiler.is_compiling() and all(b.fusable() for b in layers):
            stack = getattr(type(layers[0].mixer), "stack_step", None)
            lean = self._stack_weights
            if stack is not None:  # the mixer's stack op (Mamba-2, Mamba-3)
                states = [state.layer(i) for i in range(len(layers))]
                return (*stack(h, self._decode_plan, states, cdt, backend, lean), cdt, backend)
            h, residual = mamba_stack_step(
                h, self._decode_plan, state.conv, state.ssm, cdt, backend, lean
            )  # fmt: skip
            return h, residual, cdt, backend
        residual = None
        for i, layer in enumerate(layers):
            h, residual = layer.step(h, residual, cdt, state.layer(i), backend)
        return h, residual, cdt, backend


# the backbone's plans (`inference.plan`): what its decode steps and no-grad forwards read
def _step_plan(backbone: MambaBackbone) -> list:
    return [block.decode_weights() for block in backbone.layers]


def _stack_plan(backbone: MambaBackbone):
    """The reference body's whole-stack weights, from the decode plan: the mixer's
    `stack_weights` (Mamba-2, Mamba-3), else Mamba-1's (`ops.mamba_step.stack`)."""
    derive = getattr(type(backbone.layers[0].mixer), "stack_weights", stack_weights)
    return derive(backbone._decode_plan())


def _forward_plan(backbone: MambaBackbone) -> list:
    """What each mixer's no-grad forward reads ready-made (Mamba-1: A, D and the dt bias;
    Mamba-3: nothing): a plan of its own, so that a forward keeps no view of the weights
    alive."""
    return [getattr(block.mixer, "_ssm_params", tuple)() for block in backbone.layers]


def _norm_eps(backbone: MambaBackbone) -> list:
    """What the decode plans read besides the parameters: each block's norm eps, and a
    mixer's own norm's (Mamba-2's gated norm), so a plan is rebuilt when one changes."""
    return [(block._modules["norm"].eps, getattr(block._modules["mixer"]._modules.get("norm"),
                                                 "eps", None))
            for block in backbone._modules["layers"]._modules.values()]  # fmt: skip


@dataclass
class MambaLMOutput:
    logits: torch.Tensor  # [B, T, V] in the compute dtype
    # mean next-token cross-entropy (f32) over the predicted labels when labels are given;
    # 0 (with zero gradients) when there is none to predict: every label -100, T = 1, B = 0
    loss: torch.Tensor | None = None
    state: ModelState | None = None  # final state of every layer


torch.export.register_dataclass(MambaLMOutput, serialized_type_name="mambakit.MambaLMOutput")


class MambaLM(nn.Module):
    """Mamba language model: backbone with token embeddings and a (tied) LM head."""

    def __init__(self, cfg: MambaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = MambaBackbone(cfg, embeddings=True, device=device, dtype=dtype)
        self.lm_head = nn.Linear(
            cfg.d_model, cfg.vocab_size, bias=False, device=device, dtype=dtype
        )
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def init_state(self, batch_size: int, device=None) -> ModelState:
        return self.backbone.init_state(batch_size, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        state: ModelState | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32
        labels: torch.Tensor | None = None,  # [B, T], -100 ignored
    ) -> MambaLMOutput:
        """Labels are shifted inside: logits at t predict labels at t+1. With `seq_idx`,
        the first token of a document is not predicted from the previous document. The loss
        is the mean over the labels predicted; with none (every label -100, T = 1, an empty
        batch) it is 0 rather than NaN, so such a batch changes nothing. It is computed from
        the hidden states chunk by chunk (`loss_sum`'s cross-entropy), not from `logits`:
        only the compute-dtype logits returned are held whole."""
        hidden, state = self.backbone(input_ids, state, seq_idx)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
                got = list(labels.shape) if isinstance(labels, torch.Tensor) else labels
                raise ValueError(f"labels must have shape {list(input_ids.shape)}, got {got}")
            if labels.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"labels must be an int64 or int32 tensor, got {labels.dtype}")
            if labels.device != input_ids.device:
                raise ValueError(
                    f"labels are on {labels.device} but input_ids on {input_ids.device}"
                )
            # the target of position t is labels[t + 1]; the last position predicts nothing
            last = torch.full_like(labels[:, :1], -100, dtype=torch.long)
            target = torch.cat([next_token_targets(labels, seq_idx), last], 1)
            total = self._loss(hidden, target, logits)
            loss = total / (target != -100).sum().clamp(min=1)  # no host sync
        return MambaLMOutput(logits=logits, loss=loss, state=state)

    def loss_sum(
        self,
        input_ids: torch.Tensor,  # [B, T]
        targets: torch.Tensor,  # [B, T], already shifted (-100 ignored)
        state: ModelState | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ModelState]:
        """(summed next-token cross-entropy, final state) without materialising the logits:
        the head's logits are computed and dropped chunk by chunk (training)."""
        hidden, state = self.backbone(input_ids, state, seq_idx)
        return self._loss(hidden, targets), state

    def _loss(self, hidden, targets, logits=None) -> torch.Tensor:
        """Summed cross-entropy of the head's logits against `targets` (-100 ignored):
        chunked from the head's weight when it is plain (no f32 copy of [B, T, V] logits
        nor of their gradient), else from the head module's logits."""
        if plain(self.lm_head):
            return linear_cross_entropy(hidden, self.lm_head.weight, targets)
        logits = self.lm_head(hidden) if logits is None else logits
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
        )

    def last_logits(
        self,
        input_ids: torch.Tensor,  # [B, T]
        state: ModelState | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32
    ) -> tuple[torch.Tensor, ModelState]:
        """(logits at the last position [B, V], final state): a prompt's prefill.

        The same values as `forward(...).logits[:, -1]`, but only the last position goes
        through the final norm and the head; without autograd, on the Triton backend, both
        are one matrix-vector kernel (`ops.norm_linear`), as in `step`, and the last block's
        scan and out_proj give the last position alone (`scan_last`)."""
        bb = self.backbone
        h, residual, cdt, backend, state = bb._forward_layers(input_ids, state, seq_idx, True)
        h, residual = h[:, -1], residual[:, -1]
        grads = torch.is_grad_enabled() and any(
            t.requires_grad for t in (h, residual, self.lm_head.weight, bb._param)
        )
        return self._head(h, residual, cdt, backend, fuse=not grads), state

    def states_at(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, k] int64, distinct steps within a row
        state: ModelState | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32
    ) -> tuple[torch.Tensor, ModelState]:
        """(logits [B, k, V] at each step of `positions`, the states after them: B * k rows,
        row b * k + j after step positions[b, j] of row b), from one forward: for each step
        p, what `last_logits(input_ids[b:b+1, :p+1], ...)` gives (up to the rounding of f32
        sums). A packed row of prompts (`seq_idx` numbering them) gives every prompt's end
        state and logits, and the states at block boundaries for a prefix cache, at once
        (the server's prefill). Mamba-1 mixers."""
        cfg = self.config
        if cfg.mixer != "mamba1":
            raise NotImplementedError(
                f"states_at: the {cfg.mixer} mixer does not give states at given steps yet"
            )
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a 2-d tensor [B, T] of token ids")
        check_positions(positions, input_ids.shape[0], input_ids.shape[1], input_ids.device)
        return self._states_at(input_ids, positions, state, seq_idx)

    def _states_at(self, input_ids, positions, state=None, seq_idx=None):
        """`states_at` without its checks of `positions` (a sync): the serve engine's
        captured forward, whose steps it builds itself."""
        bb = self.backbone
        h, residual, cdt, backend, out = bb._forward_layers(input_ids, state, seq_idx, at=positions)
        Bsz, k = positions.shape
        M = h.shape[-1]
        index = positions[..., None].expand(Bsz, k, M)
        h = torch.gather(h, 1, index).flatten(0, 1)
        residual = torch.gather(residual, 1, index).flatten(0, 1)
        grads = torch.is_grad_enabled() and any(
            t.requires_grad for t in (h, residual, self.lm_head.weight, bb._param)
        )
        logits = self._head(h, residual, cdt, backend, fuse=not grads)
        return logits.view(Bsz, k, logits.shape[-1]), out

    def step(
        self, input_ids: torch.Tensor, state: ModelState, *, cuda_graph: bool | str = "auto"
    ) -> tuple[torch.Tensor, ModelState]:
        """ids [B] -> (logits [B, V], state advanced one token).

        On the Triton backend the final norm is fused into the LM head's
        matrix-vector kernel (`ops.norm_linear`), which streams the head once. Without
        autograd on a CUDA device the step replays a CUDA graph as `MambaBackbone.step`'s
        does (`cuda_graph`)."""
        bb = self.backbone
        bb._check_step(input_ids, state)
        use_cuda_graph(cuda_graph, input_ids.device)  # checks the argument
        if bb._step_records_grad(state):
            hidden, state = bb.step(input_ids, state)
            return self.lm_head(hidden), state
        out = graphed_step(self, bb, self._step_logits, input_ids, state, cuda_graph,
                           self.lm_head)  # fmt: skip
        if out is None:
            out = self._step_logits(input_ids, state)
        return out, state

    def _step_logits(self, input_ids: torch.Tensor, state: ModelState) -> torch.Tensor:
        """The no-grad step's logits [B, V], the state advanced in place."""
        h, residual, cdt, backend = self.backbone._decode_layers(input_ids, state)
        return self._head(h, residual, cdt, backend, fuse=True)

    def _head(self, h, residual, cdt, backend, fuse: bool) -> torch.Tensor:
        """Logits [B, V] of rows h [B, M] (+ residual): norm_f, then the LM head. With `fuse`
        (no autograd needed), on the Triton backend with the head in the compute dtype, both
        are one matrix-vector kernel (`ops.norm_linear`) that streams the head once."""
        bb, head = self.backbone, self.lm_head
        if (
            fuse
            and plain(head)
            and plain(bb.norm_f, RMSNorm)
            and head.weight.dtype == cdt
            and not torch.compiler.is_compiling()
        ):
            return _norm_linear(h, head.weight, head.bias, residual, bb._param, bb.norm_f.eps,
                                backend)  # fmt: skip
        return head(bb.norm_f.rows(h, residual, cdt, backend)[0])

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 64, **kwargs) -> torch.Tensor:
        """Prefill the prompt in parallel, then decode with step(); see mambakit.inference."""
        from .inference import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int = 64, **kwargs):
        """Like generate, but yields each new token [B] as it is produced."""
        from .inference import stream

        return stream(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device=None, dtype: torch.dtype | None = None
    ) -> MambaLM:
        """Load a Hugging Face (`model.safetensors`, sharded or not) or state-spaces
        (`pytorch_model.bin`) checkpoint directory. Every tensor is checked (missing,
        unexpected, misshaped, not floating point) before the model is materialised."""
        from .hf import CheckpointError, read_pretrained

        cfg, sd = read_pretrained(path)
        model = cls(cfg, device="meta")
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if cfg.tie_embeddings:
            sd.pop("lm_head.weight", None)  # tied: the embedding is the head
            expected.pop("lm_head.weight", None)
        missing = sorted(set(expected) - set(sd))
        extra = sorted(set(sd) - set(expected))
        if missing:
            raise CheckpointError(f"checkpoint {path} is missing tensors: {missing}")
        if extra:
            raise CheckpointError(f"checkpoint {path} has unexpected tensors: {extra}")
        for k, shape in expected.items():
            if tuple(sd[k].shape) != shape:
                raise CheckpointError(
                    f"tensor {k!r} has shape {list(sd[k].shape)}, expected {list(shape)}"
                )
            if not sd[k].is_floating_point():
                raise CheckpointError(f"tensor {k!r} has non-float dtype {sd[k].dtype}")
        dtype = dtype or torch.float32
        model = model.to_empty(device=device or "cpu")
        with torch.no_grad():
            for k, p in model.state_dict(keep_vars=True).items():
                if k in sd:
                    p.copy_(sd[k].to(dtype))
        if cfg.tie_embeddings:  # to_empty keeps the tie only by identity; re-tie explicitly
            model.lm_head.weight = model.backbone.embeddings.weight
        return model.to(dtype=dtype)

    def save_pretrained(
        self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Write the Hugging Face format (config.json + model.safetensors), atomically; the
        tensors of `state_dict` when given (FSDP2's gathered full tensors)."""
        from .hf import write_pretrained

        sd = state_dict if state_dict is not None else self.state_dict()
        write_pretrained(path, self.config, sd)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
