"""Reporting a run: the progress bar while it trains, the loss-curve PNG after."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: Path, png_path: Path, title: str = "") -> Path | None:
    """Train and validation loss against step; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.2, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


class ProgressBar:
    """tqdm when installed, else a line per update."""

    def __init__(self, total: int, start: int) -> None:
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, dynamic_ncols=True, unit="step")
        except ImportError:
            self._bar = None
        self._pos = start

    def update(self, r: dict[str, Any]) -> None:
        parts = []
        if "loss" in r:
            parts.append(f"loss {r['loss']:.3f}")
        if "val_loss" in r:
            parts.append(f"val {r['val_loss']:.3f}")
        if "tokens_per_s" in r:
            parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
        if self._bar is not None:
            self._bar.update(r["step"] - self._pos)
            self._bar.set_postfix_str(", ".join(parts))
        else:
            print(f"step {r['step']}: " + ", ".join(parts), flush=True)
        self._pos = r["step"]

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
