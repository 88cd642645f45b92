"""config.json <-> MambaConfig for Mamba-2: transformers' `Mamba2ForCausalLM` and the
state-spaces (mamba_ssm `MambaLMHeadModel` with `ssm_cfg.layer == "Mamba2"`) format.

The tensors need no renaming beyond the state-spaces `backbone.embedding` (io.py): the
layer's parameters are named and shaped as both formats store them.

What transformers' Mamba2 runs is a subset of mamba_ssm's: the gated RMSNorm always on and
applied after the gate, D per head, every channel in the SSM (d_ssm = d_inner), one eps for
the block norms and the gated norm (`layer_norm_epsilon`). mambakit's model uses
`rms_norm_eps` for all of them too, so an HF file maps field for field. mamba_ssm fixes the
gated norm's eps at 1e-5 and its block norms default to 1e-5 as well: a state-spaces file is
read with `rms_norm_eps` 1e-5, and a config with another eps is written only as HF.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import MambaConfig
from .errors import CheckpointError

HF_TYPE = "mamba2"
MAMBA_SSM_EPS = 1e-5  # mamba_ssm's block norms (MixerModel's default) and its gated norm

# mamba_ssm's Mamba2 keyword arguments a config.json may carry in ssm_cfg, with mamba_ssm's
# defaults, all MambaConfig fields of the same name (the mixer's constructor is mamba_ssm's)
SSM_DEFAULTS: dict[str, Any] = {
    "d_state": 128,
    "d_conv": 4,
    "conv_init": None,
    "expand": 2,
    "headdim": 64,
    "d_ssm": None,
    "ngroups": 1,
    "A_init_range": (1.0, 16.0),
    "D_has_hdim": False,
    "rmsnorm": True,
    "norm_before_gate": False,
    "dt_min": 0.001,
    "dt_max": 0.1,
    "dt_init_floor": 1e-4,
    "dt_limit": (0.0, math.inf),
    "bias": False,
    "conv_bias": True,
    "chunk_size": 256,
}
# kernel-path and tensor-parallel switches of mamba_ssm's Mamba2: no effect on the result
_SSM_IGNORED = {"use_mem_eff_path", "sequence_parallel", "process_group"}

# transformers' Mamba2Config key -> MambaConfig field, with transformers' defaults (a key
# missing from config.json means what transformers would read)
HF_FIELDS: dict[str, tuple[str, Any]] = {
    "state_size": ("d_state", 128),
    "conv_kernel": ("d_conv", 4),
    "expand": ("expand", 2),
    "head_dim": ("headdim", 64),
    "n_groups": ("ngroups", 8),
    "chunk_size": ("chunk_size", 256),
    "layer_norm_epsilon": ("rms_norm_eps", 1e-5),
    "use_bias": ("bias", False),
    "use_conv_bias": ("conv_bias", True),
    "tie_word_embeddings": ("tie_embeddings", False),
    "time_step_min": ("dt_min", 0.001),
    "time_step_max": ("dt_max", 0.1),
    "time_step_floor": ("dt_init_floor", 1e-4),
    "time_step_limit": ("dt_limit", (0.0, math.inf)),
    "initializer_range": ("initializer_range", 0.1),
    "rescale_prenorm_residual": ("rescale_prenorm_residual", False),
}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _build(what: str, **fields: Any) -> MambaConfig:
    try:
        return MambaConfig(mixer="mamba2", **fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json ({what}): {e}") from e


def _require(cfg: dict[str, Any], key: str, what: str) -> Any:
    if key not in cfg:
        raise CheckpointError(f"config.json ({what}): missing field {key!r}")
    return cfg[key]


def from_hf(cfg: dict[str, Any]) -> MambaConfig:
    """A transformers `Mamba2ForCausalLM` config.json (`model_type: "mamba2"`)."""
    what = "Mamba-2, transformers format"
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"config.json ({what}): hidden_act {cfg['hidden_act']!r} is not supported (silu only)"
        )
    # fields older files carry and current transformers ignores; one that says otherwise
    # describes a model transformers (and so the file's weights) would not run as meant
    if cfg.get("rms_norm", True) is not True:
        raise CheckpointError(
            f"config.json ({what}): rms_norm {cfg['rms_norm']!r}: transformers' Mamba2 always "
            "applies the gated RMSNorm, so this file is ambiguous; not loaded"
        )
    if cfg.get("norm_before_gate", False) is not False:
        raise CheckpointError(
            f"config.json ({what}): norm_before_gate {cfg['norm_before_gate']!r}: transformers' "
            "Mamba2 gates before the norm; not loaded"
        )
    out = _build(
        what,
        d_model=_require(cfg, "hidden_size", what),
        n_layers=_require(cfg, "num_hidden_layers", what),
        vocab_size=_require(cfg, "vocab_size", what),
        pad_vocab_size_multiple=1,
        extra={k: cfg[k] for k in _TOKEN_IDS if k in cfg},
        **{f: cfg.get(k, default) for k, (f, default) in HF_FIELDS.items()},
    )
    nheads = cfg.get("num_heads", 128)
    if nheads != out.nheads:  # transformers requires num_heads * head_dim == d_inner
        raise CheckpointError(
            f"config.json ({what}): num_heads {nheads} * head_dim {out.headdim} must equal "
            f"expand {out.expand} * hidden_size {out.d_model} = {out.d_inner}"
        )
    return out


def from_state_spaces(cfg: dict[str, Any]) -> MambaConfig:
    """A mamba_ssm `MambaLMHeadModel` config.json whose `ssm_cfg.layer` is "Mamba2" (the
    caller has refused MLPs, attention layers and LayerNorm)."""
    what = "Mamba-2, state-spaces format"
    ssm = {k: v for k, v in cfg["ssm_cfg"].items() if k != "layer"}
    unknown = sorted(set(ssm) - set(SSM_DEFAULTS) - _SSM_IGNORED)
    if unknown:
        raise CheckpointError(
            f"config.json ({what}): ssm_cfg has Mamba2 arguments mambakit does not know: "
            f"{unknown}; known: {sorted(SSM_DEFAULTS)}"
        )
    eps = cfg.get("norm_epsilon", MAMBA_SSM_EPS)
    if eps != MAMBA_SSM_EPS:
        raise CheckpointError(
            f"config.json ({what}): norm_epsilon {eps} differs from mamba_ssm's gated-norm eps "
            f"{MAMBA_SSM_EPS}; mambakit uses one eps for both"
        )
    fields = {k: ssm.get(k, default) for k, default in SSM_DEFAULTS.items()}
    return _build(
        what,
        d_model=cfg["d_model"],
        n_layers=_require(cfg, "n_layer", what),
        vocab_size=_require(cfg, "vocab_size", what),
        pad_vocab_size_multiple=cfg.get("pad_vocab_size_multiple", 8),
        tie_embeddings=cfg.get("tie_embeddings", True),
        rms_norm_eps=eps,
        **fields,
    )


def hf_unsupported(cfg: MambaConfig) -> list[str]:
    """The settings of a Mamba-2 config that transformers' Mamba2 cannot run (empty: the
    transformers format expresses it)."""
    out = []
    if cfg.d_ssm is not None and cfg.d_ssm != cfg.d_inner:
        out.append(f"d_ssm={cfg.d_ssm} (transformers runs the SSM on all {cfg.d_inner} channels)")
    if cfg.D_has_hdim:
        out.append("D_has_hdim=True (transformers keeps D per head)")
    if not cfg.rmsnorm:
        out.append("rmsnorm=False (transformers always applies the gated RMSNorm)")
    if cfg.norm_before_gate:
        out.append("norm_before_gate=True (transformers gates before the norm)")
    return out


def to_json(cfg: MambaConfig) -> tuple[dict[str, Any], str]:
    """(config.json, format): transformers' format ("hf") when it expresses the model, else
    mamba_ssm's (`state-spaces`), which expresses every Mamba-2 layer but one eps, 1e-5."""
    if not hf_unsupported(cfg):
        return to_hf_json(cfg), "hf"
    if cfg.rms_norm_eps != MAMBA_SSM_EPS:
        raise CheckpointError(
            f"cannot save this Mamba-2 model: {'; '.join(hf_unsupported(cfg))} needs mamba_ssm's "
            f"format, whose norms all use eps {MAMBA_SSM_EPS}, but rms_norm_eps is "
            f"{cfg.rms_norm_eps}"
        )
    return to_state_spaces_json(cfg), "state-spaces"


def to_hf_json(cfg: MambaConfig) -> dict[str, Any]:
    """The config.json transformers' `Mamba2ForCausalLM` reads, every field written."""
    out: dict[str, Any] = {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": HF_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_heads": cfg.nheads,
        "hidden_act": "silu",
        "time_step_rank": cfg.dt_rank,  # read by transformers, used by nothing
        "residual_in_fp32": True,  # mambakit's residual stream is f32
        "use_cache": True,
        "torch_dtype": "float32",
        # none unless the model was given them: transformers' defaults (pad 1, bos 0,
        # eos 2) are not this model's tokens
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    for key, (name, _default) in HF_FIELDS.items():
        value = getattr(cfg, name)
        out[key] = list(value) if isinstance(value, tuple) else value
    # an init-time flag: transformers applies it again to loaded weights, so never write true
    out["rescale_prenorm_residual"] = False
    out.update({k: v for k, v in cfg.extra.items() if k in _TOKEN_IDS})
    return out


def to_state_spaces_json(cfg: MambaConfig) -> dict[str, Any]:
    """mamba_ssm's `MambaConfig` (its fields only: `MambaConfig(**json)` builds it), the
    Mamba2 layer's arguments in `ssm_cfg`."""
    ssm: dict[str, Any] = {"layer": "Mamba2"}
    for name in SSM_DEFAULTS:
        value = getattr(cfg, name)
        ssm[name] = list(value) if isinstance(value, tuple) else value
    return {
        "d_model": cfg.d_model,
        "d_intermediate": 0,
        "n_layer": cfg.n_layers,
        "vocab_size": cfg.vocab_size,
        "ssm_cfg": ssm,
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple,
        "tie_embeddings": cfg.tie_embeddings,
    }
