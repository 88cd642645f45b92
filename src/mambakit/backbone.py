"""MambaBackbone: float inputs or token ids -> hidden states, through the blocks and norm_f.

B batch, T time, M = d_model. Every forward takes the recurrent state of all layers
(`ModelState`, or None for zeros) and returns the final one, differentiable w.r.t. the
parameters and the state passed in. `step()` advances one timestep: in place when no
gradient is being recorded (decode, RL acting), functionally (a new state, the old one
untouched) when one is. On CUDA it replays a graph the library captured
(`inference.step_graph`); on the CPU small float32 stacks step through the compiled body
(`inference.cpu_step`).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import MambaConfig
from .inference.cpu_step import compiled_rows
from .inference.cuda_graph import use_cuda_graph
from .inference.plan import derived as derived_plan
from .inference.step_graph import graphed_step
from .layers.block import MambaBlock, RMSNorm
from .layers.init import init_model_weights
from .layers.plain import own_tensor, plain
from .ops import mamba_stack_step, resolve_backend
from .ops._checks import check_seq_idx, check_tensor, state_dtype
from .ops._dispatch import traced
from .ops.mamba3.layers_compiled import Ends, mamba3_layers_compiled
from .ops.mamba3.reference import scan_compiles
from .ops.mamba_step.stack import stack_weights
from .state import Mamba3ModelState, ModelState, check_state, init_state, state_class


def _own(module: nn.Module, ref: torch.Tensor, *optional: str) -> bool:
    """Whether `module`'s weight (and each of `optional`, where not None) is a tensor a
    fused path may read as it is (`layers.plain.own_tensor`)."""
    own = module._parameters
    return all(
        (name in optional and name in own and own[name] is None) or own_tensor(own.get(name), ref)
        for name in ("weight", *optional)
    )


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
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
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
        # x of another float dtype than the projection's weights, or the model's without one
        # (f64 observations into an f32 model, f32 ones into a float64 model): cast, so the
        # first norm and the residual stream run in the model's precision; autocast casts
        # the others itself, but never a float64
        proj = self.input_proj
        dtype = (self._param if proj is None else next(proj.parameters())).dtype
        autocast = torch.is_autocast_enabled(x.device.type)
        if x.dtype != dtype and (not autocast or x.dtype == torch.float64):
            x = x.to(dtype)
        return x if proj is None else proj(x)

    def forward(
        self,
        x: torch.Tensor,  # [B, T] ids or [B, T, input_dim or M] floats
        state: ModelState | None = None,
        seq_idx: torch.Tensor | None = None,  # [B, T] int32
    ) -> tuple[torch.Tensor, ModelState]:
        """(hidden [B, T, M] in the compute dtype, final MambaState)."""
        h, residual, cdt, backend, state = self._forward_layers(x, state, seq_idx, norm=True)
        if residual is None:  # the blocks ran as one compiled node, norm_f in it
            return h, state
        out, _ = self.norm_f(h, residual, cdt, backend=backend)
        return out, state

    def _forward_layers(
        self, x, state, seq_idx, last: bool = False, at=None, stop=None, norm: bool = False
    ) -> tuple:
        """`forward` up to norm_f: (the last block's output, the residual stream [B, T, M]
        f32, compute dtype, backend, final state). `norm`: the caller applies norm_f next,
        which a compiled window (`_window`) may take in: it then gives norm_f's output and
        None for the residual. `last`: only the last step's output is
        read; the last block may give that step's alone ([B, 1, M], `MambaBlock.forward`).
        `at` [B, k] int64 (Mamba-1 layers, checked by the caller): the state is instead the
        states after those steps, B * k rows (row b * k + j: after step at[b, j] of row b).
        `stop` [B] int64 (Mamba-2 and Mamba-3 layers that `stops_rows()`): the state is each
        row's after its step stop[b]; the steps past it are filler."""
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
        h = None
        if norm and seq_idx is None and at is None and stop is None and not last:
            h, window = self._window(x, state)
            if window is not None:  # the blocks as one node (a small model's training window)
                *out, final = mamba3_layers_compiled(h, window[0], window[1], state, window[2])
                h, residual = out if len(out) == 2 else (out[0], None)
                return h, residual, self._param.dtype, "reference", final
        if h is None:
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
            if stop is not None:
                h, residual, final = layer(
                    h, residual, cdt, layer_state, None, backend, derived, stop=stop
                )
            elif at is None:
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

    def _window(self, x: torch.Tensor, state) -> tuple:
        """(the compiled node's input, its arguments: the blocks' weights and constants and
        `Ends`) where `forward`'s blocks run as one node (`ops.mamba3.layers_compiled`): on
        the CPU, autograd recording (a training window), every block a plain Mamba-3 one
        (`MambaBlock.window_weights`) in the model's float32 or float64, no tracer, numba
        there and the scan's kept states within its bound. The input projection and norm_f
        go in with them where plain (`layers/plain.py`), else they are called. Otherwise
        (the embedded input where it was computed, or None; None)."""
        f, mods, ref = self._param.dtype, self._modules, self._param
        if self.config.mixer != "mamba3":
            return None, None
        if x.device.type != "cpu" or f not in (torch.float32, torch.float64):
            return None, None
        if not torch.is_grad_enabled() or traced((x,)) or compute_dtype(f, x.device) != f:
            return None, None
        if resolve_backend("auto", ref) != "reference":
            return None, None
        if state is not None and (
            type(state) is not Mamba3ModelState or any(t.dtype != f for t in state._tensors())
        ):
            return None, None
        layers = mods["layers"]  # (exactly blocks: a subclass's or a wrapper's forward runs)
        if not len(layers) or any(type(b) is not MambaBlock for b in layers):
            return None, None
        blocks = [b.window_weights(ref) for b in layers]
        if any(b is None for b in blocks):
            return None, None
        weights, consts = [w for w, _ in blocks], [c for _, c in blocks]
        E, N = consts[0][4][:2]
        if not scan_compiles(x, f, N, x.shape[0] * x.shape[1] * E, True):
            return None, None
        ends, proj, norm = Ends(), mods.get("input_proj"), mods["norm_f"]
        own_embed = type(self).embed is MambaBackbone.embed  # (a subclass's runs)
        if (
            proj is not None
            and own_embed
            and plain(proj)
            and x.dtype == f
            and _own(proj, ref, "bias")
        ):
            check_tensor("x", x, (*x.shape[:-1], self.config.input_dim))
            ends, h = Ends(proj.weight, proj.bias), x
        else:
            h = self.embed(x)
            if type(h) is not torch.Tensor or h.dtype != f:
                return h, None
        if plain(norm, RMSNorm) and _own(norm, ref):
            ends = ends._replace(norm_w=norm.weight, norm_eps=norm.eps)
        tensors = (h, *(t for w in weights for t in w), ends.in_w, ends.in_b, ends.norm_w)
        if not any(t is not None and t.requires_grad for t in tensors):
            if state is None or not state.requires_grad:  # (nothing to record: the
                return (None if h is x else h), None  # inference path, with its plans)
        return h, (weights, consts, ends)

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
        if self._step_records_grad(state, x):
            out, new_state = self.forward(x.unsqueeze(1), state)
            return out[:, 0], new_state
        out = graphed_step(self, self, self._step_rows, x, state, cuda_graph)
        if out is None:
            out = self._step_rows(x, state)
        return out, state

    def _hooked_step(self, x: torch.Tensor, state: ModelState) -> torch.Tensor | None:
        """Where a hook watches a block or a mixer (`MambaBlock.hooked`), the no-grad step as
        the forward over one token, which calls them, the state overwritten in place: the
        hidden rows [B, M]; else None."""
        if not any(b.hooked() for b in self._modules["layers"]):
            return None
        out, new = self.forward(x.unsqueeze(1), state)
        state.copy_(new)
        return out[:, 0]

    def _step_rows(self, x: torch.Tensor, state: ModelState) -> torch.Tensor:
        """The no-grad step's hidden rows [B, M], the state advanced in place: on the CPU
        compiled end to end where it can be (`inference.cpu_step`)."""
        if x.device.type == "cpu":
            rows = compiled_rows(self, x, state, self._stack_weights)
            if rows is not None:
                return rows
        rows = self._hooked_step(x, state)
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
        if state is None:  # a step advances a state in place: there must be one
            raise TypeError("step: state must be a state (init_state(batch) gives a zero one), "
                            "got None")  # fmt: skip
        check_state(state, self.config, x.shape[0], x.device)
        for name, t in state._items():  # a step writes the state in place, row by row
            st = t.stride()
            if 0 in st and any(s == 0 and n > 1 for s, n in zip(st, t.shape)):
                raise ValueError(
                    f"step: state.{name} shares memory between its elements (expanded?): a "
                    "step writes the state in place; pass a copy (state.clone())"
                )

    def _step_records_grad(self, state, x: torch.Tensor | None = None) -> bool:
        """Whether a step must record a gradient (then it runs functionally, the forward over
        one step): grad mode on and any parameter (an adapter's, when the base weights are
        frozen), the state or the input (an encoder's output in front) requiring one."""
        if not torch.is_grad_enabled():
            return False
        if self._param.requires_grad or state.requires_grad:
            return True
        if x is not None and x.requires_grad:
            return True
        return any(p.requires_grad for p in self.parameters())

    def _decode_plan(self) -> list:
        """Every block's decode weights (`MambaBlock.decode_weights`: `ops.StepWeights`,
        `ops.mamba2.Mamba2StepWeights` or `ops.mamba3.Mamba3StepWeights`), derived from the
        parameters once and kept until one changes (`inference.plan`): what decode steps
        read, and CUDA graphs captured on them. (No-grad forwards read a plan of their own,
        `_forward_plan`.)"""
        return derived_plan(self, "step", _step_plan, _plan_key, in_place=True)

    def kernel_constants(self) -> tuple:
        """The numbers the step's and the forward's kernels take from the modules rather
        than from parameters: the decode plans' key (the blocks' norm eps, each mixer's
        `plan_constants`) and norm_f's eps. A CUDA graph replays the ones it was captured
        with (`inference.cuda_graph.params_signature`)."""
        return tuple(_plan_key(self)), self._modules["norm_f"].eps

    def _stack_weights(self):
        """The reference bodies' whole-stack decode weights (`_stack_plan`), kept until a
        parameter changes."""
        return derived_plan(self, "stack", _stack_plan, _plan_key)

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


def _plan_key(backbone: MambaBackbone) -> list:
    """What the decode plans read besides the parameters: each block's norm eps and its
    mixer's `plan_constants()` (its own norms' eps, Mamba-2's dt_limit, Mamba-3's
    A_floor), so a plan is derived again when one changes."""
    return [(block._modules["norm"].eps, block._modules["mixer"].plan_constants())
            for block in backbone._modules["layers"]._modules.values()]  # fmt: skip
