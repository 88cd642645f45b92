"""MambaLM: token ids -> logits, the backbone (`backbone.py`) with token embeddings and a
(tied) LM head; its loss, decode step, generation and Hugging Face checkpoints.

B batch, T time, M = d_model, V = vocab. Forwards take and return the state as the
backbone's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .backbone import MambaBackbone
from .config import MambaConfig
from .inference.cpu_step import compiled_rows, head_rows
from .inference.cuda_graph import use_cuda_graph
from .inference.step_graph import graphed_step
from .layers.block import RMSNorm
from .layers.init import no_decay_marks_kept
from .layers.plain import plain
from .ops import linear_cross_entropy
from .ops._checks import check_positions, state_dtype
from .ops.decode import _norm_linear
from .state import ModelState
from .targets import next_token_targets

_LOAD_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # from_pretrained's


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
        logits = logits.flatten(0, 1).to(state_dtype(logits))  # f32 (f64 for a float64 model)
        return F.cross_entropy(logits, targets.flatten(), ignore_index=-100, reduction="sum")

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
        return self._rows_head(h, residual, cdt, backend), state

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
        return self._logits_at(h, residual, positions, cdt, backend), out

    def stops_rows(self) -> bool:
        """Whether `_last_at` can stop each row of a forward at a step of its own: Mamba-1
        (`states_at`), and Mamba-2 and Mamba-3 whose layers can freeze their state past the
        stop (`stops_rows()`)."""
        if self.config.mixer == "mamba1":
            return True
        mixers = [block.mixer for block in self.backbone.layers]
        return all(getattr(m, "stops_rows", lambda: False)() for m in mixers)

    def _last_at(self, input_ids, stop, state=None):
        """(logits [B, V] at step stop[b] of each row b, the state after it) from one
        forward over right-padded rows [B, T] (`stop` [B] int64, not checked: the serve
        engine's captured forward): what `last_logits(input_ids[b:b+1, :stop[b]+1])` gives
        (up to the rounding of f32 sums). The steps past a row's stop are filler; their
        outputs are not the model's. Where `stops_rows()`."""
        if self.config.mixer == "mamba1":
            logits, out = self._states_at(input_ids, stop[:, None], state)
            return logits[:, 0], out
        bb = self.backbone
        h, residual, cdt, backend, out = bb._forward_layers(input_ids, state, None, stop=stop)
        return self._logits_at(h, residual, stop[:, None], cdt, backend)[:, 0], out

    def _logits_at(self, h, residual, positions, cdt, backend) -> torch.Tensor:
        """Logits [B, k, V] at the steps `positions` [B, k] of a forward's last block output
        h and residual [B, T, M]."""
        Bsz, k = positions.shape
        index = positions[..., None].expand(Bsz, k, h.shape[-1])
        h = torch.gather(h, 1, index).flatten(0, 1)
        residual = torch.gather(residual, 1, index).flatten(0, 1)
        logits = self._rows_head(h, residual, cdt, backend)
        return logits.view(Bsz, k, logits.shape[-1])

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
        if bb._step_records_grad(state) or self._head_records_grad():
            # (a trainable head over a frozen backbone: the backbone steps in place, the
            # head is called, not fused into a kernel or a graph that records nothing)
            hidden, state = bb.step(input_ids, state, cuda_graph=cuda_graph)
            return self.lm_head(hidden), state
        out = graphed_step(self, bb, self._step_logits, input_ids, state, cuda_graph,
                           self.lm_head)  # fmt: skip
        if out is None:
            out = self._step_logits(input_ids, state)
        return out, state

    def _head_records_grad(self) -> bool:
        """Whether grad mode is on and a parameter of the LM head requires a gradient (an
        untied head trained over a frozen backbone)."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.lm_head.parameters())

    def _step_logits(self, input_ids: torch.Tensor, state: ModelState) -> torch.Tensor:
        """The no-grad step's logits [B, V], the state advanced in place: on the CPU the
        rows under the head compiled end to end where they can be (`inference.cpu_step`)."""
        bb = self.backbone
        if input_ids.device.type == "cpu":
            rows = compiled_rows(bb, input_ids, state, bb._stack_weights)
            if rows is not None:
                return head_rows(self.lm_head, rows)
        rows = bb._hooked_step(input_ids, state)
        if rows is not None:
            return self.lm_head(rows)
        h, residual, cdt, backend = bb._decode_layers(input_ids, state)
        return self._head(h, residual, cdt, backend, fuse=True)

    def _rows_head(self, h, residual, cdt, backend) -> torch.Tensor:
        """`_head` of rows taken out of a forward (a prompt's last position, given steps),
        fused where no gradient is needed."""
        bb = self.backbone
        grads = torch.is_grad_enabled() and any(
            t.requires_grad for t in (h, residual, self.lm_head.weight, bb._param)
        )
        return self._head(h, residual, cdt, backend, fuse=not grads)

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
        cls, path: str | Path, device=None, dtype: torch.dtype | str | None = None
    ) -> MambaLM:
        """Load a Hugging Face (`model.safetensors`, sharded or not) or state-spaces
        (`pytorch_model.bin`) checkpoint directory. Every tensor is checked (missing,
        unexpected, misshaped, not floating point) before the model is materialised.
        `dtype`: a floating torch dtype or its name ("bfloat16"), "auto" for the one the
        checkpoint's tensors are stored in (the most of them), None for float32."""
        from .hf import CheckpointError, read_pretrained, stored_dtype

        given = dtype
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if given is not None and given != "auto" and dtype not in _LOAD_DTYPES:
            raise ValueError(
                "dtype must be torch.float32, float64, float16 or bfloat16, its name, or "
                f"'auto', got {given!r}"
            )
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
            if not isinstance(sd[k], torch.Tensor):
                raise CheckpointError(f"{k!r} is a {type(sd[k]).__name__}, not a tensor")
            if tuple(sd[k].shape) != shape:
                raise CheckpointError(
                    f"tensor {k!r} has shape {list(sd[k].shape)}, expected {list(shape)}"
                )
            if not sd[k].is_floating_point():
                raise CheckpointError(f"tensor {k!r} has non-float dtype {sd[k].dtype}")
        if dtype == "auto":
            dtype = stored_dtype(sd.values())
        dtype = dtype or torch.float32
        with no_decay_marks_kept(model):  # to_empty makes the parameters anew
            model = model.to(dtype=dtype).to_empty(device=device or "cpu")  # not through f32
            with torch.no_grad():
                for k, p in model.state_dict(keep_vars=True).items():
                    if k in sd:
                        p.copy_(sd[k].to(dtype))
            if cfg.tie_embeddings:  # to_empty keeps the tie only by identity; re-tie it
                model.lm_head.weight = model.backbone.embeddings.weight
            model = model.to(dtype=dtype)
        return model

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
