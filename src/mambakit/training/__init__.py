"""Training: TrainConfig + Trainer (mixed precision, TBPTT, CUDA graphs, exact resume), data."""

from ..text import ByteTokenizer, HFTokenizer, load_tokenizer  # here too, as before text.py
from .data import (
    PackedRows,
    RowBatches,
    build_splits,
    default_corpus_files,
    eval_batches,
    read_documents,
)
from .trainer import TrainConfig, Trainer, count_targets, lm_loss, split_time

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "PackedRows",
    "RowBatches",
    "TrainConfig",
    "Trainer",
    "build_splits",
    "count_targets",
    "default_corpus_files",
    "eval_batches",
    "lm_loss",
    "load_tokenizer",
    "read_documents",
    "split_time",
]
