"""MambaConfig: every size and init choice of a Mamba model, validated at construction.

`mixer` picks the layer: "mamba1" (the selective SSM of Gu & Dao 2023: conv, d_state
per channel, dt_rank) or "mamba3" (Mamba-3 SISO, Lahoti et al. 2026: heads of
`headdim`, `ngroups` B/C groups, rotary angles, no conv). Fields of the other mixer
are ignored."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# d_model / n_layers of the released state-spaces/mamba checkpoints
# (all with d_state 16, d_conv 4, expand 2).
MIXERS = ("mamba1", "mamba3")

_RELEASED = {
    "130m": (768, 24),
    "370m": (1024, 48),
    "790m": (1536, 48),
    "1.4b": (2048, 48),
    "2.8b": (2560, 64),
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
    mixer: str = "mamba1"  # "mamba1" or "mamba3"
    # Mamba-3 only: heads of headdim values, B/C groups, rotary share of d_state, A's floor,
    # the chunk length of the reference scan.
    headdim: int = 64
    ngroups: int = 1
    rope_fraction: float = 0.5
    A_floor: float = 1e-4
    chunk_size: int = 64
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
        if self.dt_init not in ("random", "constant"):
            raise ValueError(
                f"MambaConfig.dt_init must be 'random' or 'constant', got {self.dt_init!r}"
            )
        if self.d_state > 256:
            raise ValueError(f"MambaConfig.d_state must be at most 256, got {self.d_state}")
        if self.mixer not in MIXERS:
            raise ValueError(f"MambaConfig.mixer must be one of {MIXERS}, got {self.mixer!r}")
        if self.mixer == "mamba3":
            for name in ("headdim", "ngroups", "chunk_size"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"MambaConfig.{name} must be a positive int, got {value!r}")
            if self.d_inner % self.headdim:
                raise ValueError(
                    f"MambaConfig.headdim {self.headdim} does not divide expand * d_model = "
                    f"{self.d_inner}"
                )
            if (self.d_inner // self.headdim) % self.ngroups:
                raise ValueError(
                    f"MambaConfig.ngroups {self.ngroups} does not divide the "
                    f"{self.d_inner // self.headdim} heads (expand * d_model / headdim)"
                )
            if self.rope_fraction not in (0.5, 1.0):
                raise ValueError(
                    f"MambaConfig.rope_fraction must be 0.5 or 1.0, got {self.rope_fraction!r}"
                )
            if self.n_angles <= 0:
                raise ValueError(f"MambaConfig.d_state={self.d_state} leaves no rotary pair")
            if not self.A_floor > 0:
                raise ValueError(f"MambaConfig.A_floor must be > 0, got {self.A_floor}")
        if self.vocab_size % self.pad_vocab_size_multiple:
            m = self.pad_vocab_size_multiple
            self.vocab_size += m - self.vocab_size % m

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        """Mamba-3: heads of headdim values."""
        return self.d_inner // self.headdim

    @property
    def n_angles(self) -> int:
        """Mamba-3: rotary angles per token (pairs of state dims turned), as mamba_ssm counts."""
        pairs = int(self.d_state * self.rope_fraction)
        return (pairs - pairs % 2) // 2

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MambaConfig:
        """`tiny` (about 1M parameters, byte vocab) or a released size: 130m ... 2.8b;
        `tiny-mamba3` and `130m-mamba3` are the Mamba-3 SISO ones (d_state 32 / 128, headdim
        32 / 64)."""
        m3 = dict(mixer="mamba3", d_state=128, headdim=64)
        if name == "tiny":
            base: dict[str, Any] = dict(d_model=192, n_layers=4, vocab_size=256)
        elif name == "tiny-mamba3":
            base = dict(d_model=192, n_layers=4, vocab_size=256, **{**m3, "d_state": 32,
                                                                     "headdim": 32})  # fmt: skip
        elif name == "130m-mamba3":
            base = dict(d_model=768, n_layers=24, vocab_size=50280, **m3)
        elif name in _RELEASED:
            d_model, n_layers = _RELEASED[name]
            base = dict(d_model=d_model, n_layers=n_layers, vocab_size=50280)
        else:
            names = ", ".join(["tiny", *_RELEASED, "tiny-mamba3", "130m-mamba3"])
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
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> MambaConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
