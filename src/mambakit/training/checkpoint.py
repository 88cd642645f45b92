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

Only folders named exactly `step_` and digits are checkpoints: resume falls back through
them, newest first, when the one `latest` names cannot be read, and renames each one it
finds unreadable to `step_XXXXXXX.corrupt` (`set_aside`), out of that set but kept for a
look. Rotation (`keep_last`) counts only the checkpoints of steps before the one being
written, so a run resumed from an earlier step keeps the checkpoint it resumed from until
its own saves displace it; folders of later steps (an abandoned future, or one that failed
to load) are left alone until a save reaches their step and replaces them.

Files and folders get the modes the process umask gives any new file (the
temporary names are created private and opened up before the rename).

One process at a time trains in a run folder: `RunLock` holds an exclusive
`flock` on `RUN/.lock`, which also records the holder's pid for the message
a second process gets.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..files import fsync_dir, umask

LATEST = "latest"
LOCK = ".lock"
CHECKPOINT_NAME = re.compile(r"step_(\d+)")  # the whole name; `step_7.corrupt` is not one


def _open_up(path: Path) -> None:
    """Give `path` (a folder: everything in it too) the modes a plain new file gets."""
    mask = umask()
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
    and point `latest` at it; of the checkpoints of earlier steps, all but the newest
    `keep_last - 1` are removed (those of later steps are left alone: module docstring)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=run_dir))
    try:
        if weights is None:
            model.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict=weights)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        # on disk before the rename makes the folder the checkpoint (the model's files are,
        # by their writer)
        with open(tmp / "trainer_state.pt", "rb") as f:
            os.fsync(f.fileno())
        _open_up(tmp)
        fsync_dir(tmp)
        final = run_dir / name
        if final.exists():
            # this step's checkpoint, saved before: kept until the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=run_dir))
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    point_latest(run_dir, name)
    older = [p for p in checkpoint_dirs(run_dir) if checkpoint_step(p) < step]
    for p in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def point_latest(run_dir: Path, name: str) -> None:
    """Make `latest` name the checkpoint folder `name` (the file is replaced atomically)."""
    fd, tmp_latest = tempfile.mkstemp(prefix=".latest.", dir=run_dir)
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    _open_up(Path(tmp_latest))
    os.replace(tmp_latest, run_dir / LATEST)
    fsync_dir(run_dir)


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint folder's name (None: the name is not `step_` and digits)."""
    m = CHECKPOINT_NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders, oldest first."""
    found = [p for p in run_dir.glob("step_*") if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names (None when there is no `latest`)."""
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return None
    return run_dir / pointer.read_text().strip()


def checkpoint_candidates(run_dir: Path) -> list[Path]:
    """Checkpoints to resume from, best first: the one `latest` names (which may be gone),
    then every other checkpoint folder, newest first."""
    latest = latest_checkpoint(run_dir)
    first = [latest] if latest is not None else []
    return first + [p for p in reversed(checkpoint_dirs(run_dir)) if p != latest]


def set_aside(path: Path) -> Path:
    """Rename checkpoint folder `path`, found unreadable, to `NAME.corrupt` (`NAME.corrupt.1`,
    ... when taken): out of what resume and rotation consider, kept for a look. Only safe
    while holding the run's lock. Returns the new path."""
    aside, n = path.with_name(f"{path.name}.corrupt"), 0
    while aside.exists() or aside.is_symlink():  # rename() would replace an empty folder
        n += 1
        aside = path.with_name(f"{path.name}.corrupt.{n}")
    try:
        os.rename(path, aside)
    except OSError as e:
        raise OSError(
            f"cannot rename the unreadable checkpoint {path} to {aside.name} ({e}): move it "
            f"out of {path.parent} (rotation would count it among the kept ones)"
        ) from e
    fsync_dir(path.parent)
    return aside


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


# run folders this process holds: path -> [fd, depth, the folders acquire created], so
# nested holders (the CLI and the Trainer it drives) share one lock instead of blocking
_HELD: dict[str, list] = {}


class RunLock:
    """Exclusive lock on a run folder (`flock` on RUN/.lock, released when the process
    ends, however it ends). Re-entrant within one process. A run folder that the lock
    created and that holds nothing else when it is released (the run failed before writing
    anything: a data error, say) is removed with it, and so are the empty folders above it
    that it created."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._key = str(self.run_dir.resolve())

    def acquire(self) -> None:
        held = _HELD.get(self._key)
        if held is not None:
            held[1] += 1
            return
        created = []  # the folders this lock makes, deepest first
        for folder in (self.run_dir, *self.run_dir.parents):
            if folder.exists():
                break
            created.append(folder)
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
        _HELD[self._key] = [fd, 1, created]

    def release(self) -> None:
        held = _HELD.get(self._key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[self._key]
            fd, _, created = held
            lock = self.run_dir / LOCK
            empty = bool(created) and [p.name for p in self.run_dir.iterdir()] == [LOCK]
            if empty:
                lock.unlink(missing_ok=True)  # still held: nobody else is in the folder
            os.close(fd)  # closing the descriptor drops the flock
            if empty:
                for folder in created:
                    try:
                        folder.rmdir()
                    except OSError:  # something else appeared there meanwhile
                        break

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
