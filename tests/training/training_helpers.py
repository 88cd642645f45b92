"""What the training tests share: tiny models and configs, list-backed data with a
checkpointable cursor, random batches, snapshots of weights and gradients. (A module beside
the tests, imported by name: pytest puts this folder on the path.)"""

from __future__ import annotations

import torch

from mambakit import MambaConfig, MambaLM
from mambakit.training import TrainConfig

V = 32  # vocabulary of the synthetic streams


def tiny_cfg(vocab: int = V, **kw) -> MambaConfig:
    fields = dict(d_model=16, n_layers=2, vocab_size=vocab, d_state=4, pad_vocab_size_multiple=1)
    fields.update(kw)
    return MambaConfig(**fields)


def tiny_lm(seed: int = 0, double: bool = False, **kw) -> MambaLM:
    torch.manual_seed(seed)
    model = MambaLM(tiny_cfg(**kw))
    return model.double() if double else model


def tcfg(**kw) -> TrainConfig:
    fields = dict(steps=10, batch_size=2, seqlen=32, warmup_steps=0, log_every=1, device="cpu")
    fields.update(kw)
    return TrainConfig(**fields)


class ListData:
    """Batches from a list, cycled; a cursor that checkpoints like RowBatches."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches, self.pos = batches, 0

    def next(self) -> dict[str, torch.Tensor]:
        b = self.batches[self.pos % len(self.batches)]
        self.pos += 1
        return {k: v.clone() for k, v in b.items()}

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


def random_batch(B: int = 2, T: int = 32, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "targets": ids[:, 1:].contiguous()}


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def weights_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}
