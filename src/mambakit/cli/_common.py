"""What the subcommands share: the user-error type, device and thread-count choices."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch

THREADS_ENV = "MAMBAKIT_NUM_THREADS"


class UsageError(ValueError):
    """A mistake in the command line or a file it names: reported in one line, exit 2."""


# TrainConfig fields whose flag is not the field's name with dashes
_FLAGS = {"ckpt_every_minutes": "--ckpt-minutes", "max_seconds": "--max-minutes (x 60)"}


def flag_names(message: str) -> str:
    """`TrainConfig.batch_size must ...` -> `--batch-size must ...` (what the user typed)."""
    return re.sub(
        r"TrainConfig\.(\w+)",
        lambda m: _FLAGS.get(m[1], "--" + m[1].replace("_", "-")),
        message,
    )


def check_device(spec: str, flag: str = "--device") -> torch.device:
    """The device `spec` names ('auto': CUDA when present), refusing one that is absent."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as e:
        raise UsageError(f"{flag} {spec!r}: not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU"
            raise UsageError(f"{flag} {spec}: CUDA is not available ({why}); use {flag} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"{flag} {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif dev.type not in ("cpu", "mps"):
        raise UsageError(f"{flag} {spec}: mambakit runs on cpu or cuda")
    return dev


def physical_cores(cpus: set[int]) -> int:
    """Distinct (package, core) pairs among `cpus`, from /proc/cpuinfo; len(cpus) if unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return len(cpus)
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in block.splitlines())
        )
        if "processor" not in fields or int(fields["processor"]) not in cpus:
            continue
        if "core id" not in fields:
            return len(cpus)
        cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or len(cpus)


def busy_cores(interval: float = 0.25) -> float | None:
    """Cores kept busy by other work now: the machine's non-idle share of CPU time over
    `interval` seconds (this process sleeps meanwhile), from /proc/stat; None if unknown."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(interval)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def auto_threads(available: int, physical: int, load: float) -> int:
    """Threads for torch's CPU ops: the physical cores when the machine is idle; when
    `load` (cores busy with other work) says others are busy, the cores they leave free
    and at most the physical cores minus one: torch's threads spin-wait on each other,
    so one thread that shares a core slows all of them."""
    busy = int(load + 0.5)
    if busy == 0:
        return max(1, physical)
    return max(1, min(physical - 1, available - busy))


def choose_threads(flag: int | None) -> tuple[int, str]:
    """(thread count, where it came from): the flag, else MAMBAKIT_NUM_THREADS, else
    OMP_NUM_THREADS, else `auto_threads` from the cores this process may use."""
    if flag is not None:
        if flag < 1:
            raise UsageError(f"--threads must be at least 1, got {flag}")
        return flag, "--threads"
    for env in (THREADS_ENV, "OMP_NUM_THREADS"):
        value = os.environ.get(env, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"{env}={value!r}: must be a whole number >= 1")
            return int(value), env
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cpus = cpus or set(range(os.cpu_count() or 1))
    load = busy_cores()
    if load is None:  # no /proc/stat: the 1-minute load average (lags behind)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    physical = physical_cores(cpus)
    n = auto_threads(len(cpus), physical, load)
    return n, f"auto: {len(cpus)} cpus, {physical} cores, {load:.1f} busy with other work"


def set_threads(flag: int | None) -> str:
    """Set torch's intra-op thread count (see choose_threads); returns a line to print."""
    n, source = choose_threads(flag)
    torch.set_num_threads(n)
    return f"threads: {n} ({source})"


def add_threads_flag(p) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"CPU threads for torch (none: ${THREADS_ENV}, else $OMP_NUM_THREADS, else "
        "the free physical cores: all of them on an idle machine, fewer when others are busy)",
    )
