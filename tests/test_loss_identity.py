"""The loss, logits and every gradient of a whole model on the CPU reference path.

Per mixer (the `tiny` and `tiny-mamba3` presets, seeded random weights), one batch of 2 x 64
seeded tokens with a document boundary in the second row: two f32 runs are bit-identical, and
f32 equals the same model in float64 (the oracle) to a relative error of 1e-4 in the loss,
the logits and each parameter's gradient.

A behaviour-preserving change (a refactor) must also leave the f32 bits unchanged. The
fingerprint (the loss as a float hex, SHA-256 of the logits and of every gradient in name
order) prints when the file runs as a program, or with `pytest -s`; compare it across the
change on the same machine and torch:

    PYTHONPATH=src python tests/test_loss_identity.py > before.txt   # on the old commit
    PYTHONPATH=src python tests/test_loss_identity.py | diff before.txt -
"""

from __future__ import annotations

import copy
import hashlib
import os

import pytest
import torch

from mambakit import MambaConfig, MambaLM

PRESETS = ["tiny", "tiny-mamba3"]
B, T, BOUNDARY = 2, 64, 40  # row 1 starts a second document at BOUNDARY


def model_and_batch(preset: str) -> tuple[MambaLM, torch.Tensor, torch.Tensor]:
    """The seeded f32 model (every parameter off its init value) and its batch."""
    torch.manual_seed(0)
    model = MambaLM(MambaConfig.preset(preset))
    with torch.no_grad():  # init values (A_log = log 1..N, D = 1, norms 1) hide wrong terms
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1 * p.abs().mean().clamp(min=0.05))
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    seq_idx = torch.zeros(B, T, dtype=torch.int32)
    seq_idx[1, BOUNDARY:] = 1
    return model, ids, seq_idx


def loss_logits_grads(model: MambaLM, ids: torch.Tensor, seq_idx: torch.Tensor):
    """One forward with the LM loss and its backward: (loss, logits, {name: gradient})."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, seq_idx=seq_idx)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in sorted(model.named_parameters())}
    return out.loss.detach(), out.logits.detach(), grads


def fingerprint(preset: str) -> list[str]:
    loss, logits, grads = loss_logits_grads(*model_and_batch(preset))
    h = hashlib.sha256()
    for name, g in grads.items():
        h.update(name.encode())
        h.update(g.contiguous().numpy().tobytes())
    logits_digest = hashlib.sha256(logits.contiguous().numpy().tobytes()).hexdigest()[:16]
    return [
        f"{preset} loss {loss.item().hex()}",
        f"{preset} logits {logits_digest}",
        f"{preset} grads {h.hexdigest()[:16]}",
    ]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("MAMBAKIT_BACKEND", "reference")


@pytest.mark.parametrize("preset", PRESETS)
def test_two_runs_are_bit_identical(preset):
    model, ids, seq_idx = model_and_batch(preset)
    loss_a, logits_a, grads_a = loss_logits_grads(model, ids, seq_idx)
    loss_b, logits_b, grads_b = loss_logits_grads(model, ids, seq_idx)
    assert loss_a.item().hex() == loss_b.item().hex()
    assert torch.equal(logits_a, logits_b)
    differ = [name for name in grads_a if not torch.equal(grads_a[name], grads_b[name])]
    assert not differ, f"gradients differ between two runs: {differ}"
    print("\n" + "\n".join(fingerprint(preset)))  # shown with -s


@pytest.mark.parametrize("preset", PRESETS)
def test_f32_equals_float64(preset):
    model, ids, seq_idx = model_and_batch(preset)
    loss, logits, grads = loss_logits_grads(model, ids, seq_idx)
    loss64, logits64, grads64 = loss_logits_grads(copy.deepcopy(model).double(), ids, seq_idx)
    assert logits64.dtype == torch.float64
    assert rel_err(loss, loss64) < 1e-4
    assert rel_err(logits, logits64) < 1e-4
    assert grads.keys() == grads64.keys()
    errors = {name: rel_err(grads[name], grads64[name]) for name in grads}
    bad = {name: err for name, err in errors.items() if not err < 1e-4}
    assert not bad, f"gradients off the float64 oracle: {bad}"
    assert all(g.abs().sum() > 0 for g in grads64.values()), "a parameter gets no gradient"


if __name__ == "__main__":
    os.environ["MAMBAKIT_BACKEND"] = "reference"
    torch.set_num_threads(1)  # as under pytest (conftest.py): the bits depend on it
    for preset in PRESETS:
        print("\n".join(fingerprint(preset)))
