"""Training data for the Trainer, the accuracy metric, and evaluation at long lengths.

B batch, T sequence length, c chunk length, V vocabulary. Accuracy counts only scored
positions (targets != -100): the share of them whose argmax logit is the target.
`evaluate_lengths` runs the model chunk by chunk with its recurrent state carried
(`MambaLM.backbone(ids, state)`), generating each chunk on the device as it goes, so
memory is bounded by B * c whatever T is (2^20 on a GPU).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from .generators import IGNORE, Task, TaskStream, _positive_int

_MASK64 = (1 << 64) - 1


def stream_seed(*parts: int) -> int:
    """A 63-bit seed mixed from ints (splitmix64 over the parts): distinct parts give
    unrelated streams (training batch i, evaluation length T batch j, ...)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 29
    return x >> 1


SPLIT_TRAIN, SPLIT_VAL, SPLIT_TEST = 0, 1, 2
TARGETS = ("answers", "all")  # what training scores (TaskBatches)


class TaskBatches:
    """Batches of a task for the `Trainer` (`next()` -> {"input_ids", "targets"} [B, T]).

    Batch i is the stream seeded with stream_seed(split, seed, i), so `state_dict` (the
    next i) is the whole data cursor and a resumed run draws the batches it would have.
    `device` "cpu" by default: the Trainer counts targets on the host and copies the
    batch into its captured CUDA graph, and a [B, T] batch at training length is small.

    `targets`: "answers" scores the task's answers only (as the test does); "all" also
    asks for the next input token at every other position (a language-model loss over
    the whole row, as HazyResearch/safari trains its induction heads), the answers
    unchanged where they are scored."""

    def __init__(
        self,
        task: Task,
        batch_size: int,
        seqlen: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
        split: int = SPLIT_TRAIN,
        targets: str = "answers",
    ) -> None:
        if targets not in TARGETS:
            raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
        self.task = task
        self.batch_size = _positive_int("batch_size", batch_size)
        self.seqlen = task.check_seqlen(seqlen)
        self.seed, self.device, self.split = int(seed), torch.device(device), split
        self.targets = targets
        self.index = 0

    def next(self) -> dict[str, torch.Tensor]:
        seed = stream_seed(self.split, self.seed, self.index)
        ids, targets = TaskStream(
            self.task, self.batch_size, self.seqlen, seed, self.device
        ).whole()
        if self.targets == "all":  # the next input where no answer is scored
            nxt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1)
            targets = torch.where(targets != IGNORE, targets, nxt)
        self.index += 1
        return {"input_ids": ids, "targets": targets}

    def take(self, n: int) -> list[dict[str, torch.Tensor]]:
        """The next n batches (validation batches for the Trainer)."""
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index, self.seed = int(sd["index"]), int(sd["seed"])


def count_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, scored) as 0-d int64 tensors: scored positions (targets != -100) and those
    whose argmax over the last dim of logits [..., V] equals targets [...]. No host sync."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {list(logits.shape)} and targets {list(targets.shape)} disagree: logits "
            "must be targets' shape plus a vocabulary dim"
        )
    scored = targets != IGNORE
    correct = (logits.argmax(-1) == targets) & scored
    return correct.sum(), scored.sum()


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of scored positions predicted right (NaN when none is scored)."""
    correct, scored = count_correct(logits, targets)
    return float(correct) / int(scored) if int(scored) else float("nan")


@dataclass
class LengthResult:
    seqlen: int
    accuracy: float  # share of scored positions predicted right
    correct: int
    scored: int
    seconds: float


@torch.inference_mode()
def evaluate_length(
    model,
    task: Task,
    seqlen: int,
    rows: int = 64,
    batch_size: int = 16,
    chunk_len: int = 4096,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> LengthResult:
    """Accuracy of a MambaLM on `rows` fresh rows of length `seqlen`, batch_size rows at a
    time, each row generated and run chunk_len steps at a time with the state carried."""
    task.check_seqlen(seqlen)
    _positive_int("rows", rows)
    _positive_int("batch_size", batch_size)
    _positive_int("chunk_len", chunk_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    cast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    correct = torch.zeros((), dtype=torch.long, device=device)
    scored = torch.zeros((), dtype=torch.long, device=device)
    t0 = time.perf_counter()
    try:
        for j, start in enumerate(range(0, rows, batch_size)):
            B = min(batch_size, rows - start)
            stream = TaskStream(task, B, seqlen, stream_seed(SPLIT_TEST, seed, seqlen, j), device)
            state = None
            for ids, targets in stream.chunks(chunk_len):
                with cast:
                    hidden, state = model.backbone(ids, state)
                    logits = model.lm_head(hidden)  # [B, c, V]
                c, s = count_correct(logits, targets)
                correct += c
                scored += s
    finally:
        model.train(was_training)
    n_correct, n_scored = int(correct), int(scored)
    return LengthResult(
        seqlen=seqlen,
        accuracy=n_correct / n_scored if n_scored else float("nan"),
        correct=n_correct,
        scored=n_scored,
        seconds=time.perf_counter() - t0,
    )


def evaluate_lengths(model, task: Task, lengths: list[int], **kwargs) -> list[LengthResult]:
    """`evaluate_length` at each of `lengths` (keyword arguments as there)."""
    return [evaluate_length(model, task, T, **kwargs) for T in lengths]


def powers_of_two(min_len: int, max_len: int) -> list[int]:
    """Every power of two from min_len to max_len (both powers of two)."""
    for name, v in (("min_len", min_len), ("max_len", max_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v!r}")
    if min_len > max_len:
        raise ValueError(f"min_len {min_len} exceeds max_len {max_len}")
    return [1 << k for k in range(min_len.bit_length() - 1, max_len.bit_length())]


def format_table(results: list[LengthResult], train_len: int | None = None, title: str = "") -> str:
    """The accuracy-by-length table: one line per length, '*' at the training length."""
    lines = [title] if title else []
    lines.append(f"{'length':>9} {'':>6} {'accuracy':>9} {'correct':>14} {'seconds':>8}")
    for r in results:
        mark = "*" if r.seqlen == train_len else ""
        k = r.seqlen.bit_length() - 1
        label = f"2^{k}" if r.seqlen == 1 << k else ""
        lines.append(
            f"{r.seqlen:>9} {label:>5}{mark:1} {100 * r.accuracy:>8.1f}% "
            f"{f'{r.correct}/{r.scored}':>14} {r.seconds:>8.1f}"
        )
    if train_len is not None and any(r.seqlen == train_len for r in results):
        lines.append("* the training length")
    return "\n".join(lines)
