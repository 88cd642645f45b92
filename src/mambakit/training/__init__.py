"""Training: TrainConfig + Trainer (mixed precision, TBPTT, CUDA graphs, exact resume), data."""

from .data import (
    ByteTokenizer,
    HFTokenizer,
    PackedRows,
    RowBatches,
    build_splits,
    default_corpus_files,
    eval_batches,
    load_tokenizer,
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
