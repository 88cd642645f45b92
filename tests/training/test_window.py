"""`training.WindowStep`: a TBPTT window (forward from the carried state, loss, backward,
clipping, optimizer step) per call. The oracle is the same loop written out by hand; on
the GPU, the windows replayed from the captured CUDA graph equal the eager ones."""

from __future__ import annotations

import copy

import pytest
import torch

from mambakit import MambaBackbone, MambaConfig
from mambakit.inference import step_graph_status
from mambakit.training import WindowStep


def policy(mixer="mamba1", device="cpu"):
    torch.manual_seed(0)
    kw = {} if mixer == "mamba1" else dict(headdim=16, d_state=16)
    m = MambaBackbone(MambaConfig(d_model=32, n_layers=2, input_dim=6, mixer=mixer, **kw))
    head = torch.nn.Linear(32, 3)
    return torch.nn.ModuleDict({"body": m, "head": head}).to(device)


class Policy(torch.nn.Module):
    """A backbone and a head, with init_state (what WindowStep needs)."""

    def __init__(self, mixer="mamba1", device="cpu"):
        super().__init__()
        self.parts = policy(mixer, device)

    def init_state(self, batch):
        return self.parts["body"].init_state(batch)

    def forward(self, x, state):
        out, state = self.parts["body"](x, state)
        return self.parts["head"](out), state

    def step(self, x, state):
        h, state = self.parts["body"].step(x, state)
        return self.parts["head"](h), state


def loss_fn(model, inputs, state):
    pred, final = model(inputs["x"], state)
    return (pred.float() - inputs["y"]).square().mean(), final


def windows(n, B=4, T=8, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(B, T, 6, generator=g).to(device),
         "y": torch.randn(B, T, 3, generator=g).to(device)}
        for _ in range(n)
    ]  # fmt: skip


def by_hand(model, opt, wins, resets, clip):
    """The oracle: the window loop written out."""
    state, losses = model.init_state(4), []
    for w, r in zip(wins, resets):
        opt.zero_grad()
        loss, final = loss_fn(model, w, state)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        state = final.detach()
        if r is not None:
            state.reset_(r)
        losses.append(loss.detach())
    return losses, state


@pytest.mark.parametrize("mixer", ["mamba1", "mamba3"])
def test_windows_equal_the_loop_by_hand(mixer):
    model = Policy(mixer)
    ref = copy.deepcopy(model)
    wins = windows(5)
    resets = [None, torch.tensor([True, False, False, True]), None, None, None]
    step = WindowStep(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, 4,
                      grad_clip=0.5)  # fmt: skip
    losses = []
    for w, r in zip(wins, resets):
        losses.append(step(w))
        if r is not None:
            step.state.reset_(r)
    want, state = by_hand(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), wins, resets, 0.5)
    for a, b in zip(losses, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(step.state._tensors(), state._tensors()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert step.graph_reason == "not on a CUDA device"


class DataSGD(torch.optim.Optimizer):
    """SGD writing through `p.data`, as some third-party optimizers do: no version moves."""

    def __init__(self, params, lr: float):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize(
    "mixer, optimizer",
    [("mamba1", "fused"), ("mamba2", "fused"), ("mamba3", "fused"), ("mamba1", "p.data")],
)
def test_acting_after_windows_of_a_fused_optimizer_reads_the_new_weights(mixer, optimizer):
    """A fused AdamW, or an optimizer writing through `p.data`, updates the weights behind
    autograd's back: after the windows, step() (whose decode weights are derived from the
    parameters and kept until one changes) acts on the new weights, as a fresh copy of the
    trained model does."""
    model = Policy(mixer)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.step(x, model.init_state(4))  # the decode weights derived before training
    if optimizer == "fused":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = DataSGD(model.parameters(), lr=1e-1)
    step = WindowStep(model, opt, loss_fn, 4, grad_clip=1.0)
    for w in windows(3):
        step(w)
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        got, _ = model.step(x, model.init_state(4))
        want, _ = fresh.step(x, fresh.init_state(4))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_arguments():
    model = Policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="batch_size"):
        WindowStep(model, opt, loss_fn, 0)
    with pytest.raises(ValueError, match="grad_clip"):
        WindowStep(model, opt, loss_fn, 2, grad_clip=0.0)
    with pytest.raises(TypeError, match="optimizer"):
        WindowStep(model, "adam", loss_fn, 2)
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
        WindowStep(model, opt, loss_fn, 2, cuda_graph=True)
    step = WindowStep(model, opt, loss_fn, 4)
    with pytest.raises(TypeError, match="dict of tensors"):
        step([torch.zeros(1)])
    with pytest.raises(ValueError, match="scalar loss"):
        WindowStep(model, opt, lambda m, i, s: (torch.zeros(2), s), 4)(windows(1)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "mamba3"])
def test_gpu_replayed_windows_equal_eager_ones_and_acting_follows(mixer):
    model = Policy(mixer, "cuda")
    ref = copy.deepcopy(model)
    kw = dict(lr=1e-2, capturable=True)
    step = WindowStep(model, torch.optim.AdamW(model.parameters(), **kw), loss_fn, 4,
                      grad_clip=0.5, autocast=torch.bfloat16)  # fmt: skip
    eager = WindowStep(ref, torch.optim.AdamW(ref.parameters(), **kw), loss_fn, 4,
                       grad_clip=0.5, autocast=torch.bfloat16, cuda_graph=False)  # fmt: skip
    done = torch.tensor([True, False, True, False], device="cuda")
    for i, w in enumerate(windows(6, device="cuda")):
        torch.testing.assert_close(step(w), eager(w), rtol=1e-5, atol=1e-6)
        if i == 3:
            step.state.reset_(done)
            eager.state.reset_(done)
    assert step.graph_reason is None and step._graph is not None
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # acting after the replayed updates: the step graph reads the new weights
    body, ref_body = model.parts["body"], ref.parts["body"]
    s, s_ref = body.init_state(4), ref_body.init_state(4)
    x = torch.randn(6, 4, 6, device="cuda")

    def act(steps):
        with torch.no_grad():
            for t in range(steps):
                got = body.step(x[t], s)[0]
                want = ref_body.step(x[t], s_ref, cuda_graph=False)[0]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    act(6)
    w = windows(1, device="cuda")[0]
    step(w)  # one more update, then act again
    eager(w)
    act(3)
    assert step_graph_status(body)["replays"] > 0
