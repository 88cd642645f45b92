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
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import MambaConfig
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


def umask() -> int:
    """The process's umask: from /proc/self/status where Linux gives it (reading it by
    setting it and setting it back would give another thread's new files 0o022's modes
    for that moment), else that way."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic_write(files: dict[Path, Callable[[str], None]]) -> None:
    """Write every file through `write(tmp_path)` to a temporary name beside it, with the
    modes a plain new file gets (mkstemp's are 0600); only when all are complete, rename
    them into place. A failed write leaves the old files; so does an exception between the
    renames (Ctrl-C): each old file is kept under a second name (a hard link) until every
    new one is in place, and put back if one is not."""
    tmps: dict[Path, str] = {}
    mode = 0o666 & ~umask()
    try:
        for target, write in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            tmps[target] = tmp
            write(tmp)
            os.chmod(tmp, mode)  # after the write: a writer may make the file anew
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
    except BaseException:
        _remove(tmps.values())
        raise
    # target -> (whether it existed, the second name its old file is kept under, or None)
    kept: dict[Path, tuple[bool, str | None]] = {}
    try:
        for target in tmps:
            old = tmps[target] + ".old"
            kept[target] = (target.exists(), old)
            if kept[target][0]:
                try:
                    os.link(target, old)  # the old file stays in place meanwhile
                except OSError:  # no hard links here: moved aside instead
                    os.replace(target, old)
        for target, tmp in tmps.items():
            os.replace(tmp, target)
    except BaseException:
        for target, (existed, old) in kept.items():  # the old files back, the new ones gone
            if existed and os.path.exists(old):
                os.replace(old, target)
            elif not existed and not os.path.exists(tmps[target]) and target.exists():
                target.unlink()  # new here, and renamed into place before the failure
        _remove([*tmps.values(), *(old for _, old in kept.values())])
        raise
    _remove(old for _, old in kept.values())
    fsync_dir(next(iter(tmps)).parent)


def _remove(paths) -> None:
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


def fsync_dir(path: Path) -> None:
    """The folder's entries (renames, new files) on disk, where the platform allows it (a
    folder that cannot be opened or synced is left as it is)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    _atomic_write(
        {
            path / "model.safetensors": lambda tmp: save_file(sd, tmp, metadata={"format": "pt"}),
            path / "config.json": lambda tmp: Path(tmp).write_text(cfg_json),
        }
    )
