"""config.json <-> MambaConfig, for the Hugging Face and the original state-spaces formats
(Mamba-2's mapping: mamba2.py; the formats: docs/checkpoints.md)."""

from __future__ import annotations

from typing import Any

from ..config import MambaConfig
from . import mamba2
from .errors import CheckpointError

# transformers has no Mamba-3 class: mambakit writes its own model_type and field names
MAMBA3_TYPE = "mambakit_mamba3"
_MAMBA3_FIELDS = {  # config.json key -> MambaConfig field
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "state_size": "d_state",
    "expand": "expand",
    "head_dim": "headdim",
    "n_groups": "ngroups",
    "rope_fraction": "rope_fraction",
    "A_floor": "A_floor",
    "chunk_size": "chunk_size",
    "layer_norm_epsilon": "rms_norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "time_step_min": "dt_min",
    "time_step_max": "dt_max",
    "time_step_floor": "dt_init_floor",
    "initializer_range": "initializer_range",
}


_SSM_LAYERS = ("Mamba1", "Mamba2")  # mamba_ssm's ssm_cfg["layer"] values mambakit runs


def _decode_floats(obj: Any) -> Any:
    """transformers (5.x) writes inf and nan as {"__float__": "Infinity"}; older writers as
    the bare `Infinity` that json reads by itself."""
    if isinstance(obj, dict):
        tag = obj.get("__float__") if len(obj) == 1 else None
        if tag in ("Infinity", "-Infinity", "NaN"):
            return float(tag.lower().replace("infinity", "inf"))
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def _refuse_relatives(cfg: dict[str, Any]) -> None:
    model_type = cfg.get("model_type")
    if model_type == "falcon_mamba":
        raise CheckpointError(
            "config.json: model_type 'falcon_mamba' (FalconMamba adds RMSNorms on B, C and dt "
            "inside the mixer) is not supported; loading it as Mamba-1 would be silently wrong"
        )
    if model_type not in (None, "mamba", mamba2.HF_TYPE, MAMBA3_TYPE):
        raise CheckpointError(
            f"config.json: model_type {model_type!r} is not a Mamba-1, Mamba-2 or Mamba-3 model"
        )
    ssm_cfg = cfg.get("ssm_cfg")
    if ssm_cfg is not None and not isinstance(ssm_cfg, dict):
        raise CheckpointError(f"config.json: ssm_cfg must be an object, got {ssm_cfg!r}")
    layer = (ssm_cfg or {}).get("layer", "Mamba1")
    if layer not in _SSM_LAYERS:
        raise CheckpointError(
            f"config.json: ssm_cfg.layer {layer!r} is not supported (mambakit reads "
            f"{' and '.join(_SSM_LAYERS)} state-spaces checkpoints)"
        )
    if cfg.get("attn_layer_idx"):
        raise CheckpointError(
            "config.json: attn_layer_idx lists attention layers (a hybrid model); "
            "mambakit supports pure Mamba stacks only"
        )
    if cfg.get("d_intermediate"):
        raise CheckpointError(
            "config.json: d_intermediate > 0 adds MLP layers; mambakit supports pure Mamba stacks"
        )
    if "d_model" in cfg and not cfg.get("rms_norm", True):
        raise CheckpointError("config.json: rms_norm false (LayerNorm) is not supported")


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise CheckpointError(f"config.json: missing field {key!r}")
    return cfg[key]


def config_from_json(cfg: dict[str, Any]) -> tuple[MambaConfig, str]:
    """(MambaConfig, format) where format is "hf", "state-spaces" or "mambakit-mamba3" (a
    Mamba-2 model is "hf" or "state-spaces" too: `config.mixer` tells them apart)."""
    if not isinstance(cfg, dict):
        raise CheckpointError("config.json must hold a JSON object")
    cfg = _decode_floats(cfg)
    _refuse_relatives(cfg)
    if cfg.get("model_type") == mamba2.HF_TYPE:
        return mamba2.from_hf(cfg), "hf"
    if "d_model" in cfg and (cfg.get("ssm_cfg") or {}).get("layer") == "Mamba2":
        return mamba2.from_state_spaces(cfg), "state-spaces"
    if cfg.get("model_type") == MAMBA3_TYPE:
        fields = {f: cfg[k] for k, f in _MAMBA3_FIELDS.items() if k in cfg}
        for k in ("vocab_size", "hidden_size", "num_hidden_layers"):
            _require(cfg, k)
        extra = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        try:
            out = MambaConfig(mixer="mamba3", pad_vocab_size_multiple=1, extra=extra, **fields)
        except (ValueError, TypeError) as e:  # TypeError: a field of the wrong type (null)
            raise CheckpointError(f"config.json: {e}") from e
        return out, "mambakit-mamba3"
    if "hidden_size" in cfg:
        if cfg.get("hidden_act", "silu") != "silu":  # mambakit's Mamba-1 gates with silu
            raise CheckpointError(
                f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu only)"
            )
        rank = cfg.get("time_step_rank", "auto")
        out = _build(
            MambaConfig,
            d_model=_require(cfg, "hidden_size"),
            n_layers=_require(cfg, "num_hidden_layers"),
            vocab_size=_require(cfg, "vocab_size"),
            d_state=cfg.get("state_size", 16),
            d_conv=cfg.get("conv_kernel", 4),
            expand=cfg.get("expand", 2),
            dt_rank=rank,  # "auto": MambaConfig's rule
            rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            conv_bias=cfg.get("use_conv_bias", True),
            bias=cfg.get("use_bias", False),
            tie_embeddings=cfg.get("tie_word_embeddings", True),
            pad_vocab_size_multiple=1,
            dt_min=cfg.get("time_step_min", 0.001),
            dt_max=cfg.get("time_step_max", 0.1),
            dt_init_floor=cfg.get("time_step_floor", 1e-4),
            dt_scale=cfg.get("time_step_scale", 1.0),
            dt_init=cfg.get("time_step_init_scheme", "random"),
            initializer_range=cfg.get("initializer_range", 0.02),
            rescale_prenorm_residual=cfg.get("rescale_prenorm_residual", True),
            extra={k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg},
        )
        # after the build: hidden_size and expand are checked ints there (a null or a string
        # would fail the product, or repeat the string)
        inter = cfg.get("intermediate_size")
        if inter is not None and inter != out.d_inner:
            raise CheckpointError(
                f"config.json: intermediate_size {inter} != expand {out.expand} * hidden_size "
                f"{out.d_model}"
            )
        return out, "hf"
    if "d_model" in cfg:
        ssm = cfg.get("ssm_cfg") or {}
        vocab = _require(cfg, "vocab_size")
        mult = cfg.get("pad_vocab_size_multiple", 8)
        out = _build(
            MambaConfig,
            d_model=cfg["d_model"],
            n_layers=_require(cfg, "n_layer"),
            vocab_size=vocab,
            d_state=ssm.get("d_state", 16),
            d_conv=ssm.get("d_conv", 4),
            expand=ssm.get("expand", 2),
            dt_rank=ssm.get("dt_rank", "auto"),
            conv_bias=ssm.get("conv_bias", True),
            bias=ssm.get("bias", False),
            tie_embeddings=cfg.get("tie_embeddings", True),
            pad_vocab_size_multiple=mult,
            dt_min=ssm.get("dt_min", 0.001),
            dt_max=ssm.get("dt_max", 0.1),
            dt_init_floor=ssm.get("dt_init_floor", 1e-4),
            dt_scale=ssm.get("dt_scale", 1.0),
            dt_init=ssm.get("dt_init", "random"),
            rms_norm_eps=cfg.get("norm_epsilon", 1e-5),
        )
        return out, "state-spaces"
    raise CheckpointError(
        "config.json: neither a Hugging Face Mamba config (hidden_size, ...) nor a "
        "state-spaces one (d_model, n_layer, ...)"
    )


def _build(cls, **fields) -> MambaConfig:
    """`cls(**fields)`, a value MambaConfig refuses (or cannot compare: a null, a string
    where a number goes) raised as a CheckpointError that says it came from config.json."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: {e}") from e


def checkpoint_json(cfg: MambaConfig) -> tuple[dict[str, Any], str]:
    """(config.json, format) that `save_pretrained` writes: "hf" (what transformers'
    MambaForCausalLM or Mamba2ForCausalLM reads), "state-spaces" (a Mamba-2 model that
    transformers cannot run: mamba_ssm's config) or "mambakit-mamba3" (mambakit's own
    `model_type`, which transformers does not know)."""
    if cfg.mixer == "mamba2":
        return mamba2.to_json(cfg)
    if cfg.mixer == "mamba3":
        out3: dict[str, Any] = {"model_type": MAMBA3_TYPE, "architectures": ["MambaLM"]}
        out3.update({k: getattr(cfg, f) for k, f in _MAMBA3_FIELDS.items()})
        out3.update({k: v for k, v in cfg.extra.items() if k.endswith("_token_id")})
        return out3, "mambakit-mamba3"
    return _mamba1_hf_json(cfg), "hf"


def config_to_hf_json(cfg: MambaConfig) -> dict[str, Any]:
    """The config.json `save_pretrained` writes (`checkpoint_json` without the format)."""
    return checkpoint_json(cfg)[0]


def _mamba1_hf_json(cfg: MambaConfig) -> dict[str, Any]:
    """The config.json that transformers' MambaForCausalLM reads."""
    out: dict[str, Any] = {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "state_size": cfg.d_state,
        "num_hidden_layers": cfg.n_layers,
        "expand": cfg.expand,
        "intermediate_size": cfg.d_inner,
        "conv_kernel": cfg.d_conv,
        "time_step_rank": cfg.dt_rank,
        "layer_norm_epsilon": cfg.rms_norm_eps,
        "use_bias": cfg.bias,
        "use_conv_bias": cfg.conv_bias,
        "residual_in_fp32": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "time_step_min": cfg.dt_min,
        "time_step_max": cfg.dt_max,
        "time_step_floor": cfg.dt_init_floor,
        "time_step_scale": cfg.dt_scale,
        "time_step_init_scheme": cfg.dt_init,
        "initializer_range": cfg.initializer_range,
        # an init-time flag: transformers applies it again to loaded weights, so never write true
        "rescale_prenorm_residual": False,
        "hidden_act": "silu",
        "use_cache": True,
        "torch_dtype": "float32",
        # none unless the model was given them (a checkpoint read, a tokenizer's): 0 is a real
        # token (the NUL byte of the byte vocabulary), and generation stops at eos_token_id
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    out.update({k: v for k, v in cfg.extra.items() if k.endswith("_token_id")})
    return out
