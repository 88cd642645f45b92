"""Reporting a run: the metrics log, the progress bar while it trains, the loss-curve PNG after.

metrics.jsonl holds one JSON object per line; values that are not finite are
written as null (bare NaN is not JSON), and a reader skips lines it cannot
parse (a crash can cut the last one short), saying how many and where.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def json_line(record: dict[str, Any]) -> str:
    """One metrics line: strict JSON, non-finite floats as null."""
    clean = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    return json.dumps(clean, allow_nan=False) + "\n"


def read_metrics(path: Path, warn: Callable[[str], None] | None = print) -> list[dict]:
    """The records of a metrics.jsonl; lines that are not a JSON object are skipped and
    reported through `warn` (with the file and their line numbers)."""
    rows, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad.append(i)
    if bad and warn is not None:
        where = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        warn(f"{path}: skipped {len(bad)} unreadable line(s) (line {where})")
    return rows


def _finite(r: dict, key: str) -> bool:
    v = r.get(key)
    return isinstance(v, (int, float)) and math.isfinite(v)


def plot_loss(metrics_path: Path, png_path: Path, title: str = "") -> Path | None:
    """Train and validation loss against step; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "step" in r and _finite(r, "loss")]
    val = [(r["step"], r["val_loss"]) for r in rows if "step" in r and _finite(r, "val_loss")]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.2, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def _fmt(v: Any, spec: str) -> str:
    return "nan" if v is None else format(v, spec)


class ProgressBar:
    """tqdm when installed, else a line at the first step and one per metric record.

    The rate and the time left are the average over the steps after the first one: the
    first step pays the warm-up (allocations, a CUDA graph's capture), and an average over
    the whole run, validation passes included, does not swing with one slow step or one
    busy moment of the machine the way a recent-steps estimate does."""

    def __init__(self, total: int, start: int) -> None:
        self._total = total
        self._bar = self._tqdm(start, leave=False)  # until the first step is done
        self._pos = start
        self._t0 = time.perf_counter()
        self._start = start
        self._warm = False  # the first step is done: the average starts after it

    def _tqdm(self, initial: int, leave: bool = True):
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(
            total=self._total,
            initial=initial,
            dynamic_ncols=True,
            unit="step",
            smoothing=0,  # the average since the bar began
            leave=leave,
        )

    def advance(self, step: int, record: dict[str, Any] | None = None) -> None:
        """The run is at `step`; `record` (may be empty) is what was just logged."""
        parts = []
        if record:
            if "loss" in record:
                parts.append(f"loss {_fmt(record['loss'], '.3f')}")
            if "val_loss" in record:
                parts.append(f"val {_fmt(record['val_loss'], '.3f')}")
            if "tokens_per_s" in record:
                parts.append(f"{_fmt(record['tokens_per_s'], ',.0f')} tok/s")
        if self._bar is not None:
            if self._warm:
                self._bar.update(step - self._pos)
            else:  # a new bar from here: its rate leaves out the first step
                self._bar.close()
                self._bar = self._tqdm(step)
            if parts:
                self._bar.set_postfix_str(", ".join(parts), refresh=False)
        elif parts or self._pos == self._start:  # a line per record, and the first step
            done = step - (self._start + 1 if self._warm else self._start)
            rate = done / max(time.perf_counter() - self._t0, 1e-9)
            print(f"step {step}: " + ", ".join(parts) + f", {rate:.2f} steps/s", flush=True)
        if not self._warm:
            self._warm, self._t0 = True, time.perf_counter()
        self._pos = step

    def update(self, record: dict[str, Any]) -> None:
        self.advance(record["step"], record)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
