"""Files written whole or not at all: a temporary file beside the target, synced, then
renamed into place (`atomic_write`, checkpoints and configs), the folder's entries synced
(`fsync_dir`), new files given the modes the process's umask gives (`umask`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


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


def atomic_write(files: dict[Path, Callable[[str], None]]) -> None:
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
        remove(tmps.values())
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
        remove([*tmps.values(), *(old for _, old in kept.values())])
        raise
    remove(old for _, old in kept.values())
    fsync_dir(next(iter(tmps)).parent)


def remove(paths) -> None:
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
