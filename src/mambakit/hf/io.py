"""Read and write checkpoint directories (docs/checkpoints.md): Hugging Face and state-spaces.

Module attribute names equal the checkpoint keys, so loading is an identity map
plus the original format's `backbone.embedding` -> `backbone.embeddings`. This
module deals in (config, state dict) pairs and never builds a model: the model
checks the tensors against its own (missing, unexpected, misshaped) before
anything is written to it (`MambaLM.from_pretrained`). Saving writes temporary
files and renames them into place; what it writes is Hugging Face's format, except a
Mamba-3 model (mambakit's own `model_type`) and a Mamba-2 model transformers cannot run
(mamba_ssm's config.json, tensors under mamba_ssm's names in model.safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import MambaConfig
from ..files import atomic_write
from .config import CheckpointError, checkpoint_json, config_from_json

_KEY_ALIASES = {"backbone.embedding.weight": "backbone.embeddings.weight"}  # state-spaces name


def _read_json(path: Path) -> Any:
    try:  # bytes: JSON's own encoding (UTF-8, or the UTF-16/32 json detects), not the locale's
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name}: not valid JSON ({e})") from e


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from e


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, with keys in mambakit's (= HF's) names."""
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        sd = _load_safetensors(path / "model.safetensors")
    elif index.is_file():
        meta = _read_json(index)
        weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index.name}: missing 'weight_map'")
        bad = sorted(k for k, v in weight_map.items() if not isinstance(v, str))
        if bad:
            raise CheckpointError(f"{index.name}: 'weight_map' names no shard file for {bad}")
        sd = {}
        for shard in sorted(set(weight_map.values())):
            part = _load_safetensors(path / shard)
            sd.update(part)
        missing = sorted(set(weight_map) - set(sd))
        if missing:
            raise CheckpointError(f"{index.name}: tensors listed but absent in shards: {missing}")
    elif (path / "pytorch_model.bin").is_file():
        try:
            sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # any unpickling failure: refuse with the file named
            raise CheckpointError(f"pytorch_model.bin: cannot be loaded safely ({e})") from e
        if not isinstance(sd, dict):
            raise CheckpointError("pytorch_model.bin: does not hold a state dict")
    else:
        raise CheckpointError(
            f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
        )
    return {_KEY_ALIASES.get(k, k): v for k, v in sd.items()}


def stored_dtype(tensors) -> torch.dtype | None:
    """The dtype most of the floating tensors' elements are in (None: there are none)."""
    count: dict[torch.dtype, int] = {}
    for v in tensors:
        if v.is_floating_point():
            count[v.dtype] = count.get(v.dtype, 0) + v.numel()
    return max(count, key=count.get) if count else None


def read_config(path) -> MambaConfig:
    """The MambaConfig of a checkpoint directory's config.json (CheckpointError where it
    does not parse or describe a model)."""
    cfg, _fmt = config_from_json(_read_json(Path(path) / "config.json"))
    return cfg


def read_pretrained(path) -> tuple[MambaConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a Hugging Face (`model.safetensors`, sharded or not) or
    state-spaces (`pytorch_model.bin`) checkpoint directory, tensors as stored; the model
    checks them against its own (`MambaLM.from_pretrained`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: missing config.json")
    return read_config(path), read_state_dict(path)


def write_pretrained(path, cfg: MambaConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors, written atomically (both files or neither); a config
    no format runs faithfully raises CheckpointError before anything is written."""
    meta, fmt = checkpoint_json(cfg)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    dtype = stored_dtype(sd.values())
    if "torch_dtype" in meta and dtype is not None:  # the weights' own
        meta["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg_json = json.dumps(meta, indent=2) + "\n"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)  # transformers writes tied checkpoints without it
    if fmt == "state-spaces":
        names = {v: k for k, v in _KEY_ALIASES.items()}
        sd = {names.get(k, k): v for k, v in sd.items()}
    atomic_write(
        {
            path / "model.safetensors": lambda tmp: save_file(sd, tmp, metadata={"format": "pt"}),
            path / "config.json": lambda tmp: Path(tmp).write_text(cfg_json),
        }
    )
