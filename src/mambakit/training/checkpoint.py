"""Training checkpoints: everything needed to continue a run bit for bit.

A checkpoint is a folder `step_XXXXXXX/` with the model in the Hugging Face
format (config.json + model.safetensors, loadable by `MambaLM.from_pretrained`)
and `trainer_state.pt` (optimizer, schedule, scaler, RNG, data cursor, step),
written as tensors and plain values and read back with
`torch.load(weights_only=True)`. The folder is written under a temporary name
and renamed when complete; the file `latest` then names it (replaced
atomically). An interrupted write therefore leaves the previous checkpoint as
the one `latest` names, plus a hidden temporary (`.step_*`, `.latest.*`) that
the next run holding the lock removes.

Files and folders get the modes the process umask gives any new file (the
temporary names are created private and opened up before the rename).

One process at a time trains in a run folder: `RunLock` holds an exclusive
`flock` on `RUN/.lock`, which also records the holder's pid for the message
a second process gets.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"
LOCK = ".lock"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _open_up(path: Path) -> None:
    """Give `path` (a folder: everything in it too) the modes a plain new file gets."""
    mask = _umask()
    if path.is_dir():
        for sub, _, files in os.walk(path):
            os.chmod(sub, 0o777 & ~mask)
            for f in files:
                os.chmod(os.path.join(sub, f), 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    trainer_state: dict[str, Any],
    keep_last: int = 2,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `step_XXXXXXX/` (the model, or `weights` as its tensors, and the trainer state)
    and point `latest` at it; older checkpoints beyond `keep_last` are removed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=run_dir))
    try:
        if weights is None:
            model.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict=weights)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        _open_up(tmp)
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
    _open_up(Path(tmp_latest))
    os.replace(tmp_latest, run_dir / LATEST)
    _fsync_dir(run_dir)
    old = sorted(p for p in run_dir.glob("step_*") if p.is_dir() and p.name != name)
    for p in old[: max(0, len(old) - (keep_last - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names (None when there is no `latest`)."""
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return None
    return run_dir / pointer.read_text().strip()


def checkpoint_candidates(run_dir: Path) -> list[Path]:
    """Checkpoints to resume from, best first: the one `latest` names, then every other
    `step_*` folder, newest first."""
    latest = latest_checkpoint(run_dir)
    found = sorted((p for p in run_dir.glob("step_*") if p.is_dir()), reverse=True)
    first = [latest] if latest is not None else []
    return first + [p for p in found if p != latest]


def load_trainer_state(path: Path, device: torch.device) -> dict[str, Any]:
    return torch.load(path / "trainer_state.pt", map_location=device, weights_only=True)


def clean_stale_temps(run_dir: Path) -> list[Path]:
    """Remove the hidden temporaries of saves that were killed half-way (`.step_*.xxxx/`,
    `.latest.xxxx`, `.*.tmp`). Only safe while holding the run's lock. Returns them."""
    removed = []
    if not run_dir.is_dir():
        return removed
    for p in run_dir.iterdir():
        n = p.name
        if not (n.startswith((".step_", ".latest.")) or (n[:1] == "." and n.endswith(".tmp"))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


class RunLockedError(RuntimeError):
    """Another process trains in this run folder."""


# run folders this process holds: path -> (fd, depth), so nested holders (the CLI and
# the Trainer it drives) share one lock instead of blocking on themselves
_HELD: dict[str, list[int]] = {}


class RunLock:
    """Exclusive lock on a run folder (`flock` on RUN/.lock, released when the process
    ends, however it ends). Re-entrant within one process."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._key = str(self.run_dir.resolve())

    def acquire(self) -> None:
        held = _HELD.get(self._key)
        if held is not None:
            held[1] += 1
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLockedError(
                f"{self.run_dir} is in use by another training process (pid {holder}, "
                f"from {path}): wait for it to finish, stop it, or choose another run name"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[self._key] = [fd, 1]

    def release(self) -> None:
        held = _HELD.get(self._key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[self._key]
            os.close(held[0])  # closing the descriptor drops the flock

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
