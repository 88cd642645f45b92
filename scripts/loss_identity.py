"""Fingerprint of the 130m model on the CPU reference path: loss, logits and gradients.

A behaviour-preserving change must leave every line of the output unchanged:

    PYTHONPATH=src python scripts/loss_identity.py > before.txt   # on the old commit
    PYTHONPATH=src python scripts/loss_identity.py | diff before.txt -

The model is the 130m preset with seeded random weights (f32, CPU), one batch of 2 x 64
seeded tokens with a document boundary; printed: the loss as a float hex, and SHA-256 of the
logits and of every parameter's gradient (in name order).
"""

from __future__ import annotations

import hashlib

import torch

from mambakit import MambaConfig, MambaLM


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    torch.manual_seed(0)
    model = MambaLM(MambaConfig.preset("130m"))
    ids = torch.randint(0, model.config.vocab_size, (2, 64))
    seq_idx = torch.zeros(2, 64, dtype=torch.int32)
    seq_idx[1, 40:] = 1
    out = model(ids, labels=ids, seq_idx=seq_idx)  # CPU: the reference backend
    out.loss.backward()
    print("loss", out.loss.item().hex())
    print("logits", digest(out.logits))
    grads = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        grads.update(name.encode())
        grads.update(p.grad.contiguous().numpy().tobytes())
    print("grads", grads.hexdigest()[:16])


if __name__ == "__main__":
    main()
