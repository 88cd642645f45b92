"""The recurrent state of every mixer: one layer's, and a whole model's stacked over layers.

A model's state is a dataclass of f32 buffers (f64 for a float64 model), one per field
of its mixer's layer state, each [L, B, ...] for L layers and B rows:

    Mamba-1  MambaState(conv, ssm)             K = d_conv, D = d_inner, N = d_state
        conv: [L, B, K-1, D]  the last K-1 conv inputs x_in, oldest first
        ssm:  [L, B, D, N]    the SSM state h
    Mamba-2  Mamba2ModelState(conv, ssm)      C = conv_dim = d_ssm + 2 G N, H heads of P
        conv: [L, B, K-1, C]     the last K-1 conv inputs (x, B, C rows), oldest first
        ssm:  [L, B, H, P, N]    the SSM state h per head
    Mamba-3  Mamba3ModelState(angle, ssm, k, x)   H heads of P values, S rotary angles
        angle: [L, B, H, S]     cumulative rotation angles, in [0, 2 pi)
        ssm:   [L, B, H, P, N]  the SSM state S
        k:     [L, B, H, N]     the last token's turned, biased key
        x:     [L, B, H, P]     the last token's value

`layer(i)` gives layer i's state as views: a `MambaLayerState`, `Mamba2State` or
`Mamba3State` (the same fields without L). `expected_shapes(config, batch)` is the one
table of these shapes; `check` compares a state with it at the model's entry points.
The buffers keep their addresses under `reset_`, `copy_`, `zero_` and `step()`, so a
CUDA graph captured on a state stays valid. The classes are pytree nodes, so `torch.export` and
`torch.compile` see their tensors.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch


class MambaLayerState(NamedTuple):
    """One Mamba-1 layer's state."""

    conv: torch.Tensor  # [B, K-1, D]
    ssm: torch.Tensor  # [B, D, N]


class Mamba2State(NamedTuple):
    """One Mamba-2 layer's state (f32, or f64 on the oracle path)."""

    conv: torch.Tensor  # [B, K-1, C] the last K-1 conv inputs, oldest first
    ssm: torch.Tensor  # [B, H, P, N]

    @staticmethod
    def shapes(batch, d_conv, conv_dim, nheads, headdim, d_state) -> dict[str, tuple[int, ...]]:
        """The shape of each field: the one Mamba-2 shape table (`expected_shapes` stacks it
        over layers, the layer checks its state against it)."""
        B, K, C, H, P, N = batch, d_conv, conv_dim, nheads, headdim, d_state
        return dict(conv=(B, K - 1, C), ssm=(B, H, P, N))

    @classmethod
    def zeros(cls, batch, d_conv, conv_dim, nheads, headdim, d_state, device=None,
              dtype=torch.float32):  # fmt: skip
        shapes = cls.shapes(batch, d_conv, conv_dim, nheads, headdim, d_state)
        return cls(**{k: torch.zeros(v, device=device, dtype=dtype) for k, v in shapes.items()})


class Mamba3State(NamedTuple):
    """One Mamba-3 layer's state (f32, or f64 on the oracle path)."""

    angle: torch.Tensor  # [B, H, S] cumulative rotation angles, in [0, 2 pi)
    ssm: torch.Tensor  # [B, H, P, N]
    k: torch.Tensor  # [B, H, N] the last token's turned, biased key
    x: torch.Tensor  # [B, H, P] the last token's value

    @staticmethod
    def shapes(batch, nheads, headdim, d_state, n_angles) -> dict[str, tuple[int, ...]]:
        """The shape of each field: the one Mamba-3 shape table (`expected_shapes` stacks it
        over layers, `ops.mamba3` checks a layer's state against it)."""
        B, H, P, N, S = batch, nheads, headdim, d_state, n_angles
        return dict(angle=(B, H, S), ssm=(B, H, P, N), k=(B, H, N), x=(B, H, P))

    @classmethod
    def zeros(cls, batch, nheads, headdim, d_state, n_angles, device=None, dtype=torch.float32):
        shapes = cls.shapes(batch, nheads, headdim, d_state, n_angles)
        return cls(**{k: torch.zeros(v, device=device, dtype=dtype) for k, v in shapes.items()})


def expected_shapes(config, batch: int) -> dict[str, tuple[int, ...]]:
    """The shape of each field of a model state for `config` (a MambaConfig) and `batch`
    rows, by the config's mixer: the one table every check and `init_state` read."""
    L, B = config.n_layers, batch
    if config.mixer == "mamba3":
        sizes = (config.nheads, config.headdim, config.d_state, config.n_angles)
        return {k: (L, *v) for k, v in Mamba3State.shapes(B, *sizes).items()}
    if config.mixer == "mamba2":
        sizes = (config.d_conv, config.conv_dim, config.nheads, config.headdim, config.d_state)
        return {k: (L, *v) for k, v in Mamba2State.shapes(B, *sizes).items()}
    D = config.d_inner
    return dict(conv=(L, B, config.d_conv - 1, D), ssm=(L, B, D, config.d_state))


def state_class(config) -> type[ModelState]:
    """The model state class of `config`'s mixer."""
    return _STATE_CLASSES.get(config.mixer, MambaState)


def init_state(config, batch: int, device=None, dtype=torch.float32) -> ModelState:
    """Zeros of `config`'s model state for `batch` rows."""
    shapes = expected_shapes(config, batch)
    return state_class(config)(
        **{name: torch.zeros(shape, device=device, dtype=dtype) for name, shape in shapes.items()}
    )


# (id(config), batch) -> (config, its fields' shapes)
_SHAPES: dict[tuple[int, int], tuple[Any, tuple]] = {}


def _expected(config, batch: int) -> tuple:
    """The fields' shapes for `config` and `batch`, in the fields' order, kept per config
    object (a step checks its state every call)."""
    hit = _SHAPES.get((id(config), batch))
    if hit is not None and hit[0] is config:
        return hit[1]
    shapes = expected_shapes(config, batch)
    found = tuple(shapes.values())
    if len(_SHAPES) >= 256:
        _SHAPES.clear()
    _SHAPES[(id(config), batch)] = (config, found)
    return found


def check_state(state, config, batch: int, device: torch.device) -> None:
    """Raise, naming the field, unless `state` is `config`'s model state for `batch` rows on
    `device`, in f32 (or f64): what the model checks at its entry points (a batch-1 step
    pays it per call: the common case is one comparison of shapes)."""
    shapes = _expected(config, batch)
    cls = _STATE_CLASSES.get(config.mixer, MambaState)
    if type(state) is cls and not torch.compiler.is_compiling():  # dynamo: the checks below
        tensors = state._tensors()
        if (
            tuple(map(_shape, tensors)) == shapes
            and state.ssm.device == device
            and all(t.dtype in _STATE_DTYPES for t in tensors)
        ):
            return
    if not isinstance(state, cls):
        raise TypeError(f"state must be a {cls.__name__} or None, got {type(state).__name__}")
    for (name, t), want in zip(state._items(), shapes):
        if tuple(t.shape) != want:
            raise ValueError(f"state.{name} must have shape {list(want)}, got {list(t.shape)}")
    if state.device != device:
        raise ValueError(f"state is on {state.device} but the input is on {device}")
    for name, t in state._items():  # every field: a bf16 one broke the compiled CPU step
        if t.dtype not in _STATE_DTYPES:
            raise TypeError(f"state.{name} must be float32 (or float64), got {t.dtype}")


_STATE_DTYPES = (torch.float32, torch.float64)
_shape = operator.attrgetter("shape")


class ModelState:
    """What every model state shares: its fields are floating tensors [L, B, ...] of one
    device (a model takes f32 or f64 ones, `check_state`); `layer_type` is the per-layer
    state they stack."""

    layer_type: ClassVar[type]

    def __post_init__(self) -> None:
        name = type(self).__name__
        tensors = self._tensors()
        for f, t in zip(self.layer_type._fields, tensors):
            if not isinstance(t, torch.Tensor) or t.dim() < 3:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}.{f} must be a tensor [L, B, ...], got {got}")
        first = tensors[0]
        for f, t in zip(self.layer_type._fields, tensors):
            if t.shape[:2] != first.shape[:2]:
                raise ValueError(
                    f"{name} fields disagree on n_layers and batch: "
                    + ", ".join(f"{g} {tuple(u.shape)}" for g, u in self._items())
                )
            if t.device != first.device:
                raise ValueError(f"{name}.{f} is on {t.device} but the rest on {first.device}")
            if not t.is_floating_point():  # an int field's values would be truncated
                raise TypeError(f"{name}.{f} must be a floating tensor, got {t.dtype}")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        layer_type = cls.__dict__.get("layer_type")
        if layer_type is None:  # a class between this one and the states: nothing to read
            return
        get = operator.attrgetter(*layer_type._fields)
        one = len(layer_type._fields) == 1  # attrgetter of one name returns the value alone
        cls._fields_of = staticmethod((lambda s: (get(s),)) if one else get)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        if torch.compiler.is_compiling():  # dynamo does not trace an attrgetter
            return tuple(getattr(self, f) for f in self.layer_type._fields)
        return self._fields_of(self)

    def _items(self):
        return zip(self.layer_type._fields, self._tensors())

    def _new(self, tensors) -> Any:
        return type(self)(*tensors)

    @property
    def n_layers(self) -> int:
        return self.ssm.shape[0]

    @property
    def batch_size(self) -> int:
        return self.ssm.shape[1]

    @property
    def device(self) -> torch.device:
        return self.ssm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.ssm.dtype

    @property
    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self._tensors())

    @classmethod
    def stack(cls, layers: list) -> Any:
        """From one layer state per layer."""
        return cls(*(torch.stack(ts) for ts in zip(*layers)))

    def layer(self, i: int):
        """Layer i's state, as views."""
        return self.layer_type(*(t[i] for t in self._tensors()))

    def detach(self) -> Any:
        """The same values cut from the autograd graph (the TBPTT boundary)."""
        return self._new(t.detach() for t in self._tensors())

    def clone(self) -> Any:
        return self._new(t.clone() for t in self._tensors())

    def to(self, *args, **kwargs) -> Any:
        return self._new(t.to(*args, **kwargs) for t in self._tensors())

    def copy_(self, other) -> Any:
        """Overwrite in place (keeps addresses for CUDA graphs) with a state of the same kind
        and shapes (torch's copy_ would broadcast a smaller one over every layer and row)."""
        name = type(self).__name__
        if type(other) is not type(self):
            raise TypeError(f"{name}.copy_ takes a {name}, got {type(other).__name__}")
        for (f, a), b in zip(self._items(), other._tensors()):
            if a.shape != b.shape:
                raise ValueError(
                    f"{name}.copy_: {f} has shape {list(b.shape)}, this state's {list(a.shape)}"
                )
        for a, b in zip(self._tensors(), other._tensors()):
            a.copy_(b)
        return self

    def zero_(self) -> Any:
        for t in self._tensors():
            t.zero_()
        return self

    def reset_(self, mask: torch.Tensor) -> Any:
        """Zero the rows where `mask` [B] is True (episode ends), without a host sync.

        In place when the state carries no gradient (buffers keep their addresses);
        when it does, the buffers are replaced by masked copies so autograd stays exact.
        """
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"reset_ mask must be a tensor [B] of bools, got {type(mask).__name__}")
        if mask.dim() != 1 or mask.shape[0] != self.batch_size:
            raise ValueError(
                f"reset_ mask must have shape [{self.batch_size}], got {tuple(mask.shape)}"
            )
        m = mask.to(device=self.device, dtype=torch.bool)
        grad = self.requires_grad
        for f, t in self._items():
            mf = m.view(1, -1, *([1] * (t.dim() - 2)))
            if grad:
                setattr(self, f, t.masked_fill(mf, 0.0))
            else:
                t.masked_fill_(mf, 0.0)
        return self

    def check(self, config, batch: int, device: torch.device) -> None:
        """`check_state(self, ...)`."""
        check_state(self, config, batch, device)


@dataclass
class MambaState(ModelState):
    """A Mamba-1 model's state (module docstring)."""

    conv: torch.Tensor  # [L, B, K-1, D]
    ssm: torch.Tensor  # [L, B, D, N]

    layer_type: ClassVar[type] = MambaLayerState

    def __post_init__(self) -> None:
        if self.conv.dim() != 4 or self.ssm.dim() != 4:
            raise ValueError(
                f"MambaState.conv and .ssm must be 4-d, got shapes {tuple(self.conv.shape)} "
                f"and {tuple(self.ssm.shape)}"
            )
        super().__post_init__()
        if self.conv.shape[3] != self.ssm.shape[2]:
            raise ValueError(
                f"MambaState.conv {tuple(self.conv.shape)} and .ssm {tuple(self.ssm.shape)} "
                "disagree on d_inner"
            )

    @classmethod
    def zeros(
        cls,
        n_layers: int,
        batch_size: int,
        d_inner: int,
        d_state: int,
        d_conv: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> MambaState:
        conv = torch.zeros(n_layers, batch_size, d_conv - 1, d_inner, device=device, dtype=dtype)
        ssm = torch.zeros(n_layers, batch_size, d_inner, d_state, device=device, dtype=dtype)
        return cls(conv, ssm)


@dataclass
class Mamba2ModelState(ModelState):
    """A Mamba-2 model's state (module docstring): each `Mamba2State` field stacked."""

    conv: torch.Tensor  # [L, B, K-1, C]
    ssm: torch.Tensor  # [L, B, H, P, N]

    layer_type: ClassVar[type] = Mamba2State

    def __post_init__(self) -> None:
        if self.conv.dim() != 4 or self.ssm.dim() != 5:
            raise ValueError(
                f"Mamba2ModelState.conv must be 4-d and .ssm 5-d, got shapes "
                f"{tuple(self.conv.shape)} and {tuple(self.ssm.shape)}"
            )
        super().__post_init__()


@dataclass
class Mamba3ModelState(ModelState):
    """A Mamba-3 model's state (module docstring): each `Mamba3State` field stacked."""

    angle: torch.Tensor  # [L, B, H, S]
    ssm: torch.Tensor  # [L, B, H, P, N]
    k: torch.Tensor  # [L, B, H, N]
    x: torch.Tensor  # [L, B, H, P]

    layer_type: ClassVar[type] = Mamba3State

    def __post_init__(self) -> None:
        super().__post_init__()
        dims = {"angle": 4, "ssm": 5, "k": 4, "x": 4}
        for name, t in self._items():
            if t.dim() != dims[name] or t.shape[2] != self.ssm.shape[2]:
                raise ValueError(
                    f"Mamba3ModelState.{name} {tuple(t.shape)} and .ssm {tuple(self.ssm.shape)} "
                    f"disagree: {name} must be {dims[name]}-d with the heads of ssm"
                )

    @classmethod
    def zeros(cls, n_layers, batch_size, nheads, headdim, d_state, n_angles, device=None,
              dtype=torch.float32) -> Mamba3ModelState:  # fmt: skip
        z = dict(device=device, dtype=dtype)
        L, B, H = n_layers, batch_size, nheads
        return cls(
            torch.zeros(L, B, H, n_angles, **z),
            torch.zeros(L, B, H, headdim, d_state, **z),
            torch.zeros(L, B, H, d_state, **z),
            torch.zeros(L, B, H, headdim, **z),
        )


for _cls in (MambaState, Mamba2ModelState, Mamba3ModelState):
    torch.export.register_dataclass(_cls, serialized_type_name=f"mambakit.{_cls.__name__}")
del _cls
# a state saved with torch.save loads with torch.load's default weights_only=True (torch 2.6
# on), as the tensors it holds do
torch.serialization.add_safe_globals(
    [MambaState, Mamba2ModelState, Mamba3ModelState, MambaLayerState, Mamba2State, Mamba3State]
)

_STATE_CLASSES = {"mamba2": Mamba2ModelState, "mamba3": Mamba3ModelState}
