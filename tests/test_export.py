"""Models trace: `torch.export` of a MambaLM (the reference path, CPU) gives a program that
computes what the eager model does, for every mixer, with the state in and out and the
loss; no check of the inputs' values stops the tracer. (`torch.onnx.export(dynamo=True)`
and AOTInductor start from such a program.) A trace runs the PyTorch bodies, so the eager
model here runs them too (`torch_bodies`: not the compiled CPU bodies numba gives, the
same math in another order of float operations)."""

from __future__ import annotations

import pytest
import torch

from mambakit import MambaConfig, MambaLM

PRESETS = {
    "mamba1": MambaConfig.preset("tiny", d_model=32, n_layers=2),
    "mamba3": MambaConfig.preset("tiny-mamba3", d_model=64, n_layers=2),
}


@pytest.mark.parametrize("mixer", list(PRESETS))
def test_exported_program_equals_eager(mixer, monkeypatch, torch_bodies):
    monkeypatch.setenv("MAMBAKIT_BACKEND", "reference")
    torch.manual_seed(0)
    model = MambaLM(PRESETS[mixer]).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        state = model(ids[:, :5]).state  # a state to carry in
    program = torch.export.export(model, (ids[:, 5:],), {"state": state, "labels": ids[:, 5:]})
    got = program.module()(ids[:, 5:], state=state, labels=ids[:, 5:])
    with torch.no_grad():
        want = model(ids[:, 5:], state=state, labels=ids[:, 5:])
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    assert type(got.state) is type(want.state)
    for a, b in zip(got.state._tensors(), want.state._tensors()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
