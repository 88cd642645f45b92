"""The whole-stack decode step of the reference backend (`ops.mamba_stack_step`'s body,
ops/mamba_step/stack.py) against the float64 op
chain (`mamba_layer_step_reference` per block, then the final norm): the hidden state and
the advanced conv and SSM states over several steps, with and without biases, at batch 1
and above; the cached weights follow parameter updates; the output is a normal tensor."""

from __future__ import annotations

import copy

import pytest
import torch

from mambakit import MambaBackbone, MambaState
from mambakit.ops import decode as decode_ops  # `ops.mamba_stack_step` looks its body up there
from mambakit.ops.mamba_step.reference import mamba_layer_step_reference
from mambakit.ops.rms_norm.reference import rms_norm_reference

STEPS = 6
RTOL = 1e-5  # relative error of f32 against f64, measured over a whole tensor


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


def op_chain_step(bb64: MambaBackbone, x: torch.Tensor, state: MambaState) -> torch.Tensor:
    """One float64 step through the op chain, the state advanced in place."""
    h, residual = bb64.embed(x), None
    for block, conv, ssm in zip(bb64.layers, state.conv.unbind(0), state.ssm.unbind(0)):
        h, residual = mamba_layer_step_reference(h, residual, block.decode_weights(), conv, ssm)
    return rms_norm_reference(h, bb64.norm_f.weight, bb64.norm_f.eps, residual)[0]


pytestmark = pytest.mark.usefixtures("torch_bodies")  # the compiled bodies: test_cpu_jit*.py


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Counts the backbone's calls of the fused decode, so a test knows it ran."""
    calls = []
    fused = decode_ops.decode_layers

    def counted(*args):
        calls.append(1)
        return fused(*args)

    monkeypatch.setattr(decode_ops, "decode_layers", counted)
    return calls


def setup(tiny_config, randomize, batch, **cfg):
    bb = randomize(MambaBackbone(tiny_config(**cfg))).eval()
    bb64 = copy.deepcopy(bb).double()
    s = bb.init_state(batch)
    state = MambaState(torch.randn_like(s.conv), torch.randn_like(s.ssm) * 0.5)
    state64 = MambaState(state.conv.double(), state.ssm.double())
    return bb, bb64, state, state64


def assert_step_matches(bb, bb64, state, state64, x, t):
    got, _ = bb.step(x, state)
    want = op_chain_step(bb64, x.double(), state64)
    for name, a, b in (
        ("hidden", got, want),
        ("conv state", state.conv, state64.conv),
        ("ssm state", state.ssm, state64.ssm),
    ):
        err = rel_err(a, b)
        assert err < RTOL, f"step {t}: {name} relative error {err:.2e} >= {RTOL:.0e}"


@pytest.mark.parametrize(
    "batch, bias, conv_bias, eps",
    [(1, False, True, 1e-5), (3, False, True, 0.5), (2, True, False, 1e-5)],
    ids=["B1", "B3-eps0.5", "B2-biases-no_conv_bias"],
)
def test_fused_step_matches_f64_op_chain(
    seed, tiny_config, randomize, fused_calls, batch, bias, conv_bias, eps
):
    """A large eps (0.5) weighs the norm's constant column as much as the activations."""
    cfg = dict(n_layers=3, bias=bias, conv_bias=conv_bias, rms_norm_eps=eps)
    bb, bb64, state, state64 = setup(tiny_config, randomize, batch, **cfg)
    with torch.no_grad():
        for t in range(STEPS):
            assert_step_matches(bb, bb64, state, state64, torch.randn(batch, 12), t)
    assert len(fused_calls) == STEPS


def test_fused_step_follows_parameter_updates(seed, tiny_config, randomize, fused_calls):
    """An in-place update (an optimizer step), a replaced parameter and a `.data` swap each
    invalidate the cached weights."""
    bb, bb64, state, state64 = setup(tiny_config, randomize, 2)
    with torch.no_grad():
        assert_step_matches(bb, bb64, state, state64, torch.randn(2, 12), 0)
        for p, p64 in zip(bb.parameters(), bb64.parameters()):
            delta = torch.randn_like(p) * 0.1
            p.add_(delta)
            p64.add_(delta.double())
        assert_step_matches(bb, bb64, state, state64, torch.randn(2, 12), 1)
        mixer, mixer64 = bb.layers[1].mixer, bb64.layers[1].mixer
        mixer.A_log = torch.nn.Parameter(mixer.A_log + 0.3)
        mixer64.A_log = torch.nn.Parameter(mixer64.A_log + 0.3)
        assert_step_matches(bb, bb64, state, state64, torch.randn(2, 12), 2)
        w = bb.layers[0].mixer.out_proj.weight
        w.data = w.data * 1.5
        bb64.layers[0].mixer.out_proj.weight.mul_(1.5)
        assert_step_matches(bb, bb64, state, state64, torch.randn(2, 12), 3)
    assert len(fused_calls) == 4


def test_norms_with_different_eps_take_the_op_chain(seed, tiny_config, randomize, fused_calls):
    """The constant column of the fused step holds one eps; blocks that differ run the
    op chain, with the same result as the f64 reference."""
    bb, bb64, state, state64 = setup(tiny_config, randomize, 1)
    bb.layers[1].norm.eps = bb64.layers[1].norm.eps = 1e-2
    with torch.no_grad():
        assert_step_matches(bb, bb64, state, state64, torch.randn(1, 12), 0)
    assert fused_calls == []


def test_fused_step_returns_a_normal_tensor(seed, tiny_config, randomize, fused_calls):
    """The blocks run under inference mode; the hidden state that comes back can still
    enter an autograd graph (an RL loss on stored observations)."""
    bb, _, state, _ = setup(tiny_config, randomize, 2)
    with torch.no_grad():
        hidden, _ = bb.step(torch.randn(2, 12), state)
    assert not hidden.is_inference() and not state.ssm.is_inference()
    w = torch.randn(12, requires_grad=True)
    (hidden * w).sum().backward()
    torch.testing.assert_close(w.grad, hidden.sum(0))
    assert fused_calls == [1]
