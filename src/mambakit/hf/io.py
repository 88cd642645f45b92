"""Read and write checkpoint directories (CHECKPOINTS.md): Hugging Face and state-spaces.

Module attribute names equal the checkpoint keys, so loading is an identity map
plus the original format's `backbone.embedding` -> `backbone.embeddings`.
Every tensor is checked (missing, unexpected, misshaped) before the model is
touched; saving writes temporary files and renames them into place.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import CheckpointError, config_from_json, config_to_hf_json

_KEY_ALIASES = {"backbone.embedding.weight": "backbone.embeddings.weight"}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
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
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index.name}: missing 'weight_map'")
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


def load_pretrained(cls, path, device=None, dtype: torch.dtype | None = None):
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: missing config.json")
    cfg, _fmt = config_from_json(_read_json(path / "config.json"))
    sd = read_state_dict(path)
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


def _atomic_write(files: dict[Path, Callable[[str], None]]) -> None:
    """Write every file through `write(tmp_path)` to a temporary name beside it; only when
    all are complete, rename them into place (a failed write leaves the old files)."""
    tmps: dict[Path, str] = {}
    try:
        for target, write in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            tmps[target] = tmp
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
    except BaseException:
        for tmp in tmps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    for target, tmp in tmps.items():
        os.replace(tmp, target)


def save_pretrained(model, path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """config.json + model.safetensors of `model`, or of `state_dict` when given (the full
    tensors of a model whose parameters are sharded, as FSDP2 leaves them)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    sd = state_dict if state_dict is not None else model.state_dict()
    sd = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)  # transformers writes tied checkpoints without it
    cfg_json = json.dumps(config_to_hf_json(cfg), indent=2) + "\n"
    _atomic_write(
        {
            path / "model.safetensors": lambda tmp: save_file(sd, tmp, metadata={"format": "pt"}),
            path / "config.json": lambda tmp: Path(tmp).write_text(cfg_json),
        }
    )
