"""Prompts for generate / stream: the input forms they accept, their checks, one padded batch.

B batch, T prompt length (the longest), L_b the prompt length of row b.

A [B, T] tensor of full prompts, a right-padded one with `prompt_lengths`, or a
list of 1-d prompts of any lengths: each becomes one `Prompts` batch
left-aligned to the end (row b's prompt in ids[b, T - L_b:] behind filler), the
layout of the ragged prefill (generate.py says why), and the result goes back
in the form it came in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class Prompts:
    """Prompts as one left-padded batch: ids [B, T], lengths L_b, and how to return them."""

    def __init__(self, ids: torch.Tensor, lengths: list[int], as_list: bool) -> None:
        self.ids = ids  # [B, T] int64, row b's prompt in ids[b, T - L_b:]
        self.lengths = lengths
        self.as_list = as_list  # return a list of 1-d tensors (ragged input)
        self.ragged = len(set(lengths)) > 1

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def bucket(self) -> int:
        """T rounded up to a power of two, at least 16: the few lengths a padded prefill has."""
        return max(16, 1 << math.ceil(math.log2(self.ids.shape[1])))

    def row(self, b: int) -> torch.Tensor:
        return self.ids[b, self.ids.shape[1] - self.lengths[b] :]

    def starts(self, width: int | None = None) -> torch.Tensor:
        """[B] where each prompt starts when the batch is left-padded to `width` (default T)."""
        width = self.ids.shape[1] if width is None else width
        return torch.tensor([width - n for n in self.lengths], device=self.ids.device)

    def mask(self, width: int | None = None) -> torch.Tensor:
        """[B, width] bool, True at prompt tokens and False at filler (left-padded to width)."""
        width = self.ids.shape[1] if width is None else width
        pos = torch.arange(width, device=self.ids.device)
        return pos[None, :] >= self.starts(width)[:, None]


def _check_ids_tensor(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"{name} must hold integer token ids (int64 or int32), got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-d tensor, got shape {list(t.shape)}")


def parse_prompts(input_ids, prompt_lengths, device: torch.device, vocab: int) -> Prompts:
    """Check `input_ids` (and `prompt_lengths`) as `generate` takes them; one batch on device."""
    if isinstance(input_ids, torch.Tensor):
        _check_ids_tensor("input_ids", input_ids, 2)
        Bsz, T = input_ids.shape
        if Bsz == 0 or T == 0:
            raise ValueError(f"input_ids must have at least one row and token, got {[Bsz, T]}")
        ids = input_ids.to(device=device, dtype=torch.int64)
        if prompt_lengths is None:
            lengths, as_list = [T] * Bsz, False
        else:
            if isinstance(prompt_lengths, torch.Tensor):
                prompt_lengths = prompt_lengths.tolist()
            if not isinstance(prompt_lengths, Sequence) or len(prompt_lengths) != Bsz:
                raise ValueError(f"prompt_lengths must hold {Bsz} lengths (one per row)")
            lengths = []
            for n in prompt_lengths:
                if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= T:
                    raise ValueError(f"prompt_lengths must be ints in [1, {T}], got {n!r}")
                lengths.append(n)
            as_list = True
            # the padding past the longest prompt dropped first: with every prompt of one
            # length shorter than T, the rows would otherwise start behind filler that no
            # document boundary cuts off (the batch is not ragged)
            T = max(lengths)
            ids = ids[:, :T]
            # right-padded in, left-padded inside: shift each row's prompt to the end
            pos = torch.arange(T, device=device)
            shift = torch.tensor([T - n for n in lengths], device=device)
            src = (pos[None, :] - shift[:, None]).clamp(min=0)  # [B, T]
            ids = ids.gather(1, src)
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, str):
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths goes with a padded [B, T] tensor, not with a list")
        if len(input_ids) == 0:
            raise ValueError("input_ids must hold at least one prompt")
        rows = []
        for i, r in enumerate(input_ids):
            if isinstance(r, torch.Tensor):
                _check_ids_tensor(f"input_ids[{i}]", r, 1)
            elif isinstance(r, Sequence) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in r
            ):
                r = torch.tensor(list(r), dtype=torch.int64)
            else:
                raise TypeError(f"input_ids[{i}] must be a 1-d tensor or a list of ints")
            if r.numel() == 0:
                raise ValueError(f"input_ids[{i}] is empty: every prompt needs a token")
            rows.append(r.to(device=device, dtype=torch.int64))
        lengths = [r.numel() for r in rows]
        T = max(lengths)
        ids = torch.zeros(len(rows), T, dtype=torch.int64, device=device)
        for b, r in enumerate(rows):
            ids[b, T - r.numel() :] = r
        as_list = True
    else:
        raise TypeError(
            "input_ids must be a [B, T] tensor of token ids or a list of 1-d prompts, "
            f"got {type(input_ids).__name__}"
        )
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}), got values in [{lo}, {hi}]")
    return Prompts(ids, lengths, as_list)
