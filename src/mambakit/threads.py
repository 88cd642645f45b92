"""How many CPU threads torch's ops use: one policy, applied by the Trainer, `generate` and
the CLI alike (on the CPU; a GPU run leaves torch's count alone).

torch starts with one thread per physical core, and its threads spin-wait on each other:
when other work keeps a core busy, the thread that shares it slows all the others (the
README's tiny training step on a 2-core machine with one core busy: 40 s a step with 2
threads, 5.6 s with 1). The count, first that applies:

1. the one the caller passes (`TrainConfig.threads`, `--threads`);
2. the environment: MAMBAKIT_NUM_THREADS, else OMP_NUM_THREADS;
3. the count torch has, when someone else chose it (`torch.set_num_threads`): it differs
   from the count this policy set last, or, before it set one, from torch's own default
   (one thread per physical core);
4. automatic: every physical core the process may use on an idle machine; when other work
   keeps cores busy, the cores it leaves free and at most the physical cores minus one.
   The load is measured once per process (over 0.25 s) and the choice kept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

THREADS_ENV = "MAMBAKIT_NUM_THREADS"

_applied: int | None = None  # the count apply_threads set last
_auto: tuple[int, str] | None = None  # the automatic choice, made once per process
_TORCH = "torch.set_num_threads"  # the source of a count someone set on torch


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
    """Threads for `available` cpus of `physical` cores while `load` cores are busy with other
    work: the physical cores when idle; else the cores left free, at most physical - 1."""
    busy = int(load + 0.5)
    if busy == 0:
        return max(1, physical)
    return max(1, min(physical - 1, available - busy))


def _cpus() -> set[int]:
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return cpus or set(range(os.cpu_count() or 1))


def _measure() -> tuple[int, str]:
    cpus = _cpus()
    load = busy_cores()
    if load is None:  # no /proc/stat: the 1-minute load average (lags behind)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    physical = physical_cores(cpus)
    n = auto_threads(len(cpus), physical, load)
    return n, f"auto: {len(cpus)} cpus, {physical} cores, {load:.1f} busy with other work"


def choose_threads(threads: int | None = None, name: str = "threads") -> tuple[int, str]:
    """(thread count, where it came from) by the module's policy; `name` is the argument's
    name in error messages."""
    global _auto
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {threads!r}")
        return threads, name
    for env in (THREADS_ENV, "OMP_NUM_THREADS"):
        value = os.environ.get(env, "").strip()
        if value:
            if not (value.isascii() and value.isdigit()) or int(value) < 1:
                raise ValueError(f"{env}={value!r}: must be a whole number >= 1")
            return int(value), env
    current = torch.get_num_threads()
    ours = _applied if _applied is not None else physical_cores(_cpus())
    if current != ours:
        return current, _TORCH
    if _auto is None:
        _auto = _measure()
    return _auto


def apply_threads(threads: int | None = None, name: str = "threads") -> str:
    """Set torch's intra-op thread count by the policy; returns a line saying the choice."""
    global _applied
    n, source = choose_threads(threads, name)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if source != _TORCH:  # a count set on torch stays the user's: not recorded as ours
        _applied = n
    return f"threads: {n} ({source})"
