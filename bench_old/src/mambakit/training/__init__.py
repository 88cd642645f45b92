"""Training: TrainConfig + Trainer (mixed precision, TBPTT, CUDA graphs, exact resume), data."""

from .config import TrainConfig
from .data import (
    PackedRows,
    RowBatches,
    build_splits,
    default_corpus_files,
    eval_batches,
    read_documents,
)
from .step import count_targets, lm_loss, split_time
from .trainer import Trainer
from .window import WindowStep

__all__ = [
    "PackedRows",
    "RowBatches",
    "TrainConfig",
    "Trainer",
    "WindowStep",
    "build_splits",
    "count_targets",
    "default_corpus_files",
    "eval_batches",
    "lm_loss",
    "read_documents",
    "split_time",
]
