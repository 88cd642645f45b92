"""Training checkpoints: everything needed to continue a run bit for bit.

A checkpoint is a folder `step_XXXXXXX/` with the model in the Hugging Face
format (config.json + model.safetensors, loadable by `MambaLM.from_pretrained`)
and `trainer_state.pt` (optimizer, schedule, scaler, RNG, data cursor, step),
written as tensors and plain values and read back with
`torch.load(weights_only=True)`. The folder is written under a temporary name
and renamed when complete; the file `latest` then names it (replaced
atomically). An interrupted write therefore leaves the previous checkpoint as
the one `latest` names.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path, step: int, model, trainer_state: dict[str, Any], keep_last: int = 2
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=run_dir))
    try:
        model.save_pretrained(tmp)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        _fsync_dir(tmp)
        final = run_dir / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fd, tmp_latest = tempfile.mkstemp(prefix=".latest.", dir=run_dir)
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_latest, run_dir / LATEST)
    _fsync_dir(run_dir)
    old = sorted(p for p in run_dir.glob("step_*") if p.is_dir() and p.name != name)
    for p in old[: max(0, len(old) - (keep_last - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return None
    path = run_dir / pointer.read_text().strip()
    if not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"resume: {pointer} names {path}, which is incomplete")
    return path


def load_trainer_state(path: Path, device: torch.device) -> dict[str, Any]:
    return torch.load(path / "trainer_state.pt", map_location=device, weights_only=True)
