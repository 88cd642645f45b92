"""The language-model loss's targets: next tokens, with document boundaries masked (a data
rule: training rows and `MambaLM.forward(labels=)` both apply it).

The loss itself is `mambakit.ops.linear_cross_entropy` (chunked: the [tokens, vocab]
logits are never whole in memory).
"""

from __future__ import annotations

import torch


def next_token_targets(tokens: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
    """The targets of tokens[:, :-1]: tokens[:, 1:] (int64), -100 where the next token
    opens another document (docs [B, T]: document ids, non-decreasing along T). The one
    place the document-boundary rule is written: training rows and `forward(labels=)`."""
    targets = tokens[:, 1:].long()  # a copy when tokens are int32, a view otherwise
    if docs is None:
        return targets
    return targets.masked_fill(docs[:, 1:] != docs[:, :-1], -100)
