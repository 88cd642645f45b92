"""MambaConfig: every size and init choice of a Mamba model, validated at construction.

`mixer` picks the layer: "mamba1" (the selective SSM of Gu & Dao 2023: conv, d_state
per channel, dt_rank), "mamba2" (SSD, Dao & Gu 2024: a scalar A per head of `headdim`,
`ngroups` B/C groups, a conv over x, B and C, the gated RMSNorm) or "mamba3" (Mamba-3
SISO, Lahoti et al. 2026: heads of `headdim`, `ngroups` B/C groups, rotary angles, no
conv). Fields of the other mixers are ignored."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import atomic_write

# d_model / n_layers of the released state-spaces/mamba checkpoints
# (all with d_state 16, d_conv 4, expand 2).
MIXERS = ("mamba1", "mamba2", "mamba3")

_RELEASED = {
    "130m": (768, 24),
    "370m": (1024, 48),
    "790m": (1536, 48),
    "1.4b": (2048, 48),
    "2.8b": (2560, 64),
}


# d_model / n_layers of the released state-spaces/mamba2 checkpoints (d_state 128, headdim
# 64, ngroups 1, d_conv 4, expand 2, chunk_size 256, vocab 50277 padded to 50288)
_RELEASED_MAMBA2 = {
    "130m-mamba2": (768, 24),
    "370m-mamba2": (1024, 48),
    "780m-mamba2": (1536, 48),
    "1.3b-mamba2": (2048, 48),
    "2.7b-mamba2": (2560, 64),
}


def auto_dt_rank(d_model: int) -> int:
    """dt_rank "auto": ceil(d_model / 16), mamba_ssm's rule (config, layer and checkpoints)."""
    return math.ceil(d_model / 16)


@dataclass
class MambaConfig:
    d_model: int = 768  # width of the residual stream
    n_layers: int = 24  # number of Mamba blocks
    vocab_size: int = 50280  # LM vocabulary (after padding); unused by MambaBackbone
    d_state: int = 16  # N: SSM state size per channel
    d_conv: int = 4  # K: depthwise causal conv width
    expand: int = 2  # d_inner = expand * d_model
    dt_rank: int | None = None  # rank of the delta projection; None -> ceil(d_model / 16)
    input_dim: int | None = None  # MambaBackbone: float input width (None: inputs are d_model wide)
    rms_norm_eps: float = 1e-5  # epsilon of every RMSNorm
    conv_bias: bool = True  # bias on the depthwise conv
    bias: bool = False  # bias on in_proj and out_proj
    tie_embeddings: bool = True  # lm_head shares the embedding matrix
    pad_vocab_size_multiple: int = 8  # vocab_size is rounded up to a multiple of this
    # Initialisation (as mamba_ssm): dt ~ log-uniform in [dt_min, dt_max], floored at dt_init_floor.
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_scale: float = 1.0  # scale of the dt_proj weight init
    dt_init: str = "random"  # "random" or "constant" dt_proj weight init
    initializer_range: float = 0.02  # std of the embedding init
    rescale_prenorm_residual: bool = True  # out_proj weights scaled by 1/sqrt(n_layers)
    mixer: str = "mamba1"  # "mamba1", "mamba2" or "mamba3"
    # Mamba-2 and Mamba-3: heads of headdim values, B/C groups, the chunk length of the
    # reference scan (the result does not depend on it).
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 64
    # Mamba-3 only: rotary share of d_state, A's floor.
    rope_fraction: float = 0.5
    A_floor: float = 1e-4
    # Mamba-2 only, as mamba_ssm's Mamba2: channels the SSM runs on (None: d_inner; the rest
    # is a gated MLP), D per channel instead of per head, the gated RMSNorm (False: y *
    # silu(z)) and its order, delta's clamp after softplus, A's init range, the conv's init.
    d_ssm: int | None = None
    D_has_hdim: bool = False
    rmsnorm: bool = True
    norm_before_gate: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    A_init_range: tuple[float, float] = (1.0, 16.0)
    conv_init: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # unknown keys kept on load

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "vocab_size", "d_state", "d_conv", "expand"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MambaConfig.{name} must be a positive int, got {value!r}")
        if self.d_conv < 2:
            raise ValueError(f"MambaConfig.d_conv must be at least 2, got {self.d_conv}")
        if self.dt_rank is None or self.dt_rank == "auto":
            self.dt_rank = auto_dt_rank(self.d_model)
        for name in ("dt_rank", "input_dim", "pad_vocab_size_multiple"):
            value = getattr(self, name)
            if value is None and name == "input_dim":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MambaConfig.{name} must be a positive int, got {value!r}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"MambaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (0 < self.dt_min <= self.dt_max):
            raise ValueError(
                f"MambaConfig.dt_min/dt_max must satisfy 0 < dt_min <= dt_max, "
                f"got {self.dt_min}, {self.dt_max}"
            )
        if self.dt_init_floor <= 0:
            raise ValueError(f"MambaConfig.dt_init_floor must be > 0, got {self.dt_init_floor}")
        # the init scales: the model's constructor would fail on them naming neither
        for name in ("dt_scale", "initializer_range"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"MambaConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.dt_init not in ("random", "constant"):
            raise ValueError(
                f"MambaConfig.dt_init must be 'random' or 'constant', got {self.dt_init!r}"
            )
        if self.d_state > 256:
            raise ValueError(f"MambaConfig.d_state must be at most 256, got {self.d_state}")
        if self.mixer not in MIXERS:
            raise ValueError(f"MambaConfig.mixer must be one of {MIXERS}, got {self.mixer!r}")
        if self.mixer in ("mamba2", "mamba3"):
            for name in ("headdim", "ngroups", "chunk_size"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"MambaConfig.{name} must be a positive int, got {value!r}")
        for name in ("dt_limit", "A_init_range"):  # pairs, tuples after a JSON round trip too
            v = getattr(self, name)
            if (
                not isinstance(v, (tuple, list))
                or len(v) != 2
                or not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v)
            ):
                raise ValueError(f"MambaConfig.{name} must be a pair of numbers (low, high), "
                                 f"got {v!r}")  # fmt: skip
            setattr(self, name, (float(v[0]), float(v[1])))
        for name in ("conv_bias", "bias", "tie_embeddings", "rescale_prenorm_residual",
                     "D_has_hdim", "rmsnorm", "norm_before_gate"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"MambaConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.mixer == "mamba2":
            self._check_mamba2()
        if self.mixer in ("mamba2", "mamba3"):
            if self.ssm_dim % self.headdim:
                what = "d_ssm" if self.mixer == "mamba2" and self.d_ssm else "expand * d_model"
                raise ValueError(
                    f"MambaConfig.headdim {self.headdim} does not divide {what} = {self.ssm_dim}"
                )
            if self.nheads % self.ngroups:
                raise ValueError(
                    f"MambaConfig.ngroups {self.ngroups} does not divide the {self.nheads} heads"
                    f" ({'d_ssm' if self.d_ssm else 'expand * d_model'} / headdim)"
                )
        if self.mixer == "mamba3":
            if self.rope_fraction not in (0.5, 1.0):
                raise ValueError(
                    f"MambaConfig.rope_fraction must be 0.5 or 1.0, got {self.rope_fraction!r}"
                )
            if self.n_angles <= 0:
                raise ValueError(f"MambaConfig.d_state={self.d_state} leaves no rotary pair")
            if not self.A_floor > 0:
                raise ValueError(f"MambaConfig.A_floor must be > 0, got {self.A_floor}")
            if self.bias:  # a shared field, not another mixer's: asked for, it would be lost
                raise ValueError(
                    "MambaConfig.bias=True: the mamba3 mixer's in_proj and out_proj have no "
                    "bias (as mamba_ssm's Mamba3)"
                )
        if self.vocab_size % self.pad_vocab_size_multiple:
            m = self.pad_vocab_size_multiple
            self.vocab_size += m - self.vocab_size % m

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    def _check_mamba2(self) -> None:
        if self.d_ssm is not None:
            d = self.d_ssm
            if isinstance(d, bool) or not isinstance(d, int) or not 0 < d <= self.d_inner:
                raise ValueError(
                    f"MambaConfig.d_ssm must be None or an int in (0, expand * d_model = "
                    f"{self.d_inner}], got {d!r}"
                )
        lo, hi = self.dt_limit
        if not (0 <= lo < hi):
            raise ValueError(f"MambaConfig.dt_limit must satisfy 0 <= low < high, got {(lo, hi)}")
        a0, a1 = self.A_init_range
        if not (0 < a0 <= a1):
            raise ValueError(
                f"MambaConfig.A_init_range must satisfy 0 < low <= high, got {(a0, a1)}"
            )
        if self.conv_init is not None and not self.conv_init > 0:
            raise ValueError(f"MambaConfig.conv_init must be None or > 0, got {self.conv_init}")

    @property
    def ssm_dim(self) -> int:
        """Mamba-2 and Mamba-3: the channels the SSM runs on (Mamba-2's d_ssm, else d_inner)."""
        return self.d_ssm if self.mixer == "mamba2" and self.d_ssm else self.d_inner

    @property
    def nheads(self) -> int:
        """Mamba-2 and Mamba-3: heads of headdim values."""
        return self.ssm_dim // self.headdim

    @property
    def conv_dim(self) -> int:
        """Mamba-2: the conv's channels, x, B and C (d_ssm + 2 ngroups d_state)."""
        return self.ssm_dim + 2 * self.ngroups * self.d_state

    @property
    def n_angles(self) -> int:
        """Mamba-3: rotary angles per token (pairs of state dims turned), as mamba_ssm counts."""
        pairs = int(self.d_state * self.rope_fraction)
        return (pairs - pairs % 2) // 2

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MambaConfig:
        """`tiny` (about 1M parameters, byte vocab) or a released size: 130m ... 2.8b;
        `tiny-mamba2` and the state-spaces mamba2 sizes `130m-mamba2` ... `2.7b-mamba2`
        (d_state 32 / 128, headdim 32 / 64, chunk_size 256); `tiny-mamba3` and `130m-mamba3`
        are the Mamba-3 SISO ones (d_state 32 / 128, headdim 32 / 64)."""
        m3 = dict(mixer="mamba3", d_state=128, headdim=64)
        m2 = dict(mixer="mamba2", d_state=128, headdim=64, chunk_size=256)
        if name == "tiny":
            base: dict[str, Any] = dict(d_model=192, n_layers=4, vocab_size=256)
        elif name == "tiny-mamba3":
            base = dict(d_model=192, n_layers=4, vocab_size=256, **{**m3, "d_state": 32,
                                                                     "headdim": 32})  # fmt: skip
        elif name == "tiny-mamba2":
            base = dict(d_model=192, n_layers=4, vocab_size=256, **{**m2, "d_state": 32,
                                                                     "headdim": 32})  # fmt: skip
        elif name in _RELEASED_MAMBA2:
            d_model, n_layers = _RELEASED_MAMBA2[name]
            base = dict(d_model=d_model, n_layers=n_layers, vocab_size=50277,
                        pad_vocab_size_multiple=16, **m2)  # fmt: skip
        elif name == "130m-mamba3":
            base = dict(d_model=768, n_layers=24, vocab_size=50280, **m3)
        elif name in _RELEASED:
            d_model, n_layers = _RELEASED[name]
            base = dict(d_model=d_model, n_layers=n_layers, vocab_size=50280)
        else:
            names = ", ".join(["tiny", *_RELEASED, "tiny-mamba2", *_RELEASED_MAMBA2, "tiny-mamba3",
                               "130m-mamba3"])  # fmt: skip
            raise ValueError(f"unknown preset {name!r}; choose one of {names}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(
                f"unknown MambaConfig field(s) {', '.join(map(repr, unknown))}{hint}; the fields "
                f"are {', '.join(sorted(fields - {'extra'}))}"
            )
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MambaConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    def save(self, path: str | Path) -> None:
        """The fields and the `extra` keys (token ids, ...), which `load` puts back in `extra`;
        written to a temporary file and renamed into place, as checkpoints are."""
        text = json.dumps({**self.extra, **self.to_dict()}, indent=2) + "\n"
        atomic_write({Path(path): lambda tmp: Path(tmp).write_text(text)})

    @classmethod
    def load(cls, path: str | Path) -> MambaConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
