"""The compiled (numba) whole-stack decode step of Mamba-2 (`ops/cpu_jit/mamba2.py`)
against the op-by-op reference step of the same stack op (`stack=None`: the add and
norm, F.linear, the mixer's reference step and F.linear per block), the oracle: the
residual stream and every state field over several steps, in float64 and float32, at
batch 1 and 3, each row from a different state. Every variant `BlockWeights` encodes:
groups, dt_limit, the gated norm before or after the gate or none, D per head or per
head-dim, the gated MLP, the projections' biases. The layers' states as views of stacked
tensors (one call for every layer) and as separate tensors (one call per layer). Also:
the model's step takes the compiled body and equals the PyTorch one it replaces."""

from __future__ import annotations

import pytest
import torch

from mambakit import MambaBackbone, MambaConfig
from mambakit.inference.plan import drop
from mambakit.ops.mamba2 import stack as m2_stack
from mambakit.state import Mamba2State

pytest.importorskip("numba")
from mambakit.ops.cpu_jit import mamba2 as jit2  # noqa: E402

STEPS = 4
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}  # relative error over a whole tensor

CONFIGS = {
    "ngroups2": dict(headdim=32, ngroups=2),
    "ngroups1": dict(headdim=16, ngroups=1),
    "norm_before_gate-dt_limit-no_conv_bias": dict(
        headdim=32, norm_before_gate=True, dt_limit=(0.01, 0.5), conv_bias=False
    ),
    "D_hdim-no_norm-mlp-biases": dict(
        headdim=32, D_has_hdim=True, rmsnorm=False, d_ssm=64, bias=True
    ),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def setup(dtype: torch.dtype, batch: int, name: str = "ngroups2"):
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=64, n_layers=3, input_dim=24, mixer="mamba2", **CONFIGS[name])
    bb = MambaBackbone(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in bb.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = bb.init_state(batch)
    for t in state._tensors():  # every row its own state
        t.copy_(torch.randn_like(t))
    return bb, state


def steps_against_oracle(bb, state, dtype, batch, weights, states=None):
    """STEPS steps of the stack op on `weights` (the states `states`, else `state`'s
    layers) against the op-by-op step from a clone of `state`; where the compiled body
    runs, also against the Packed called directly on clones of the states (bit for bit)."""
    mixer = type(bb.layers[0].mixer)
    plan = bb._decode_plan()
    n = len(bb.layers)
    states = states or [state.layer(i) for i in range(n)]
    oracle = state.clone()
    twin = [Mamba2State(*(t.clone() for t in s)) for s in states]
    with torch.no_grad():
        for t in range(STEPS):
            h = bb.embed(torch.randn(batch, 24, dtype=dtype))
            got, none = mixer.stack_step(h, plan, states, dtype, "reference",
                                         lambda: weights)  # fmt: skip
            out, residual = mixer.stack_step(h, plan, [oracle.layer(i) for i in range(n)], dtype,
                                             "reference")  # fmt: skip
            assert none is None and not got.requires_grad
            if weights.compiled is not None and batch <= m2_stack.COMPILED_MAX_ROWS:
                # the stack op took the compiled body
                assert torch.equal(got, weights.compiled(h, twin))
                assert all(torch.equal(a, b) for s, u in zip(states, twin) for a, b in zip(s, u))
            fields = [("residual stream", got, out + residual), *(
                (f"state.{f}", torch.stack([getattr(s, f) for s in states]), b)
                for f, b in oracle._items()
            )]  # fmt: skip
            for field, a, b in fields:
                err = rel(a, b)
                assert err < TOL[dtype], f"step {t}: {field} relative error {err:.1e}"


@pytest.mark.parametrize("layout", ["stacked", "separate"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_mamba2_stack_matches_op_by_op_step(name, dtype, batch, layout, numba_on):
    bb, state = setup(dtype, batch, name)
    weights = m2_stack.stack_weights(bb._decode_plan())
    assert isinstance(weights.compiled, jit2.Packed)
    n = len(bb.layers)
    if layout == "stacked":  # the model state's `layer(i)` views: one call runs every layer
        states = [state.layer(i) for i in range(n)]
        assert all(jit2.stacked(ts) is not None for ts in zip(*states))
    else:  # each layer's state a tensor of its own: one call per layer
        states = [Mamba2State(*(t.clone() for t in state.layer(i))) for i in range(n)]
        assert all(jit2.stacked(ts) is None for ts in zip(*states))
    steps_against_oracle(bb, state, dtype, batch, weights, states)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_torch_body_without_numba_matches_op_by_op_step(dtype, numba_on, monkeypatch):
    """MAMBAKIT_NUMBA=0: no compiled weights; the PyTorch whole-stack body runs and equals
    the oracle; above COMPILED_MAX_ROWS rows the PyTorch body runs with numba on too."""
    numba_on(False)
    bb, state = setup(dtype, 3)
    weights = m2_stack.stack_weights(bb._decode_plan())
    assert weights.compiled is None
    steps_against_oracle(bb, state, dtype, 3, weights)
    numba_on(True)
    monkeypatch.setattr(m2_stack, "COMPILED_MAX_ROWS", 2)
    weights = m2_stack.stack_weights(bb._decode_plan())
    assert weights.compiled is not None
    monkeypatch.setattr(jit2.Packed, "__call__", None)  # it must not be called
    steps_against_oracle(bb, state, dtype, 3, weights)


def test_model_step_takes_the_compiled_body_and_equals_the_torch_one(numba_on, monkeypatch):
    """`MambaBackbone.step` at the RL shape, batch 1 and 3: with numba on every step runs
    the compiled body (one call of the compiled function for every layer, whichever
    `Packed` method calls it); the outputs and states of a run of steps equal those with it
    off."""
    ran = []
    run = jit2._layers
    monkeypatch.setattr(jit2, "_layers", lambda *a: ran.append(1) or run(*a))
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=128, n_layers=3, input_dim=64, mixer="mamba2", headdim=32)
    bb = MambaBackbone(cfg).eval()
    with torch.no_grad():
        for p in bb.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    for batch in (1, 3):
        xs = torch.randn(6, batch, 64)
        runs = []
        for on in (True, False):
            numba_on(on)
            drop(bb)  # the plan holds the packed weights: derive it again
            state = bb.init_state(batch)
            ran.clear()
            with torch.no_grad():
                outs = [bb.step(x, state)[0] for x in xs]
            assert len(ran) == (len(xs) if on else 0)
            runs.append((outs, state))
        (got, s_got), (want, s_want) = runs
        for a, b in zip(got, want):
            assert rel(a, b) < 1e-5
        for a, b in zip(s_got._tensors(), s_want._tensors()):
            assert rel(a, b) < 1e-5
