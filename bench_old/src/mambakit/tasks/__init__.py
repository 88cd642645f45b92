"""Synthetic tasks of the Mamba paper (Gu & Dao 2023): selective copying (Table 1),
induction heads (Table 2 / Table 11), and MQAR (Zoology); generators, Trainer data,
accuracy, and evaluation at long lengths with the state carried. generators.py states
each task's conventions."""

from .evaluate import (
    LengthResult,
    TaskBatches,
    accuracy,
    count_correct,
    evaluate_length,
    evaluate_lengths,
    format_table,
    powers_of_two,
    stream_seed,
)
from .generators import (
    MQAR,
    TASKS,
    InductionHeads,
    SelectiveCopying,
    Task,
    TaskStream,
    distinct_sorted,
    make_task,
)

__all__ = [
    "MQAR",
    "TASKS",
    "InductionHeads",
    "LengthResult",
    "SelectiveCopying",
    "Task",
    "TaskBatches",
    "TaskStream",
    "accuracy",
    "count_correct",
    "distinct_sorted",
    "evaluate_length",
    "evaluate_lengths",
    "format_table",
    "make_task",
    "powers_of_two",
    "stream_seed",
]
