"""The compiled (numba) whole-stack decode steps of Mamba-2 and Mamba-3
(`ops/cpu_jit/mamba2.py`, `mamba3.py`) against the op-by-op reference step of the same
stack op (`stack=None`: the add and norm, F.linear, the mixer's reference step and
F.linear per block), the oracle: the residual stream and every state field over several
steps, in float64 and float32, at batch 1 and 3, each row from a different state
(Mamba-3's angles anywhere in [0, 2 pi)). Every variant the mixers' `BlockWeights`
encode: Mamba-2's groups, dt_limit, gated norm before or after the gate or none, D per
head or per head-dim, gated MLP and biases; Mamba-3's groups, rotary share and turns of
several times 2 pi. The layers' states as views of stacked tensors (one call for every
layer) and as separate tensors (one call per layer). The model's step on them:
tests/inference/test_cpu_step.py; Mamba-1's: test_cpu_jit.py."""

from __future__ import annotations

import pytest
import torch
from stack_helpers import STEPS, assert_close, random_stack

from mambakit.ops.mamba2 import stack as m2_stack
from mambakit.ops.mamba3 import stack as m3_stack
from mambakit.state import Mamba2State, Mamba3State

pytest.importorskip("numba")
from mambakit.ops.cpu_jit import mamba2 as jit2  # noqa: E402
from mambakit.ops.cpu_jit import mamba3 as jit3  # noqa: E402
from mambakit.ops.cpu_jit.packed import stacked  # noqa: E402

# mixer -> (its stack module, its compiled module, its layer state class)
MIXERS = {"mamba2": (m2_stack, jit2, Mamba2State), "mamba3": (m3_stack, jit3, Mamba3State)}
CONFIGS = {
    "mamba2-ngroups2": dict(mixer="mamba2", headdim=32, ngroups=2),
    "mamba2-ngroups1": dict(mixer="mamba2", headdim=16, ngroups=1),
    "mamba2-norm_before_gate-dt_limit-no_conv_bias": dict(
        mixer="mamba2", headdim=32, norm_before_gate=True, dt_limit=(0.01, 0.5), conv_bias=False
    ),
    "mamba2-D_hdim-no_norm-mlp-biases": dict(
        mixer="mamba2", headdim=32, D_has_hdim=True, rmsnorm=False, d_ssm=64, bias=True
    ),
    "mamba3-ngroups2": dict(mixer="mamba3", headdim=32, ngroups=2),
    "mamba3-rope1-d_state8-ngroups4": dict(
        mixer="mamba3", headdim=16, ngroups=4, d_state=8, rope_fraction=1.0
    ),
    "mamba3-wide_turns": dict(mixer="mamba3", headdim=32, ngroups=2),  # delta ~ 6
}


def setup(name: str, dtype: torch.dtype, batch: int):
    wide = name.endswith("wide_turns")  # turns of several times 2 pi a step
    return random_stack(CONFIGS[name], dtype, batch, dt_shift=6.0 if wide else 0.0)


def steps_against_oracle(bb, state, dtype, batch, weights, states=None):
    """STEPS steps of the stack op on `weights` (the states `states`, else `state`'s
    layers) against the op-by-op step from a clone of `state`; where the compiled body
    runs, also against the Packed called directly on clones of the states (bit for bit)."""
    stack_module, _, layer_state = MIXERS[bb.config.mixer]
    mixer = type(bb.layers[0].mixer)
    plan = bb._decode_plan()
    n = len(bb.layers)
    states = states or [state.layer(i) for i in range(n)]
    oracle = state.clone()
    twin = [layer_state(*(t.clone() for t in s)) for s in states]
    with torch.no_grad():
        for t in range(STEPS):
            h = bb.embed(torch.randn(batch, 24, dtype=dtype))
            got, none = mixer.stack_step(h, plan, states, dtype, "reference",
                                         lambda: weights)  # fmt: skip
            out, residual = mixer.stack_step(h, plan, [oracle.layer(i) for i in range(n)], dtype,
                                             "reference")  # fmt: skip
            assert none is None and not got.requires_grad
            if weights.compiled is not None and batch <= weights.compiled.rows_max:
                # the stack op took the compiled body
                assert torch.equal(got, weights.compiled(h, twin))
                assert all(torch.equal(a, b) for s, u in zip(states, twin) for a, b in zip(s, u))
            fields = [("residual stream", got, out + residual), *(
                (f"state.{f}", torch.stack([getattr(s, f) for s in states]), b)
                for f, b in oracle._items()
            )]  # fmt: skip
            assert_close(t, dtype, fields)
            if bb.config.mixer == "mamba3":
                angle = torch.stack([s.angle for s in states])
                assert 0 <= angle.min() and angle.max() < 6.2832


@pytest.mark.parametrize("layout", ["stacked", "separate"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_stack_matches_op_by_op_step(name, dtype, batch, layout, numba_on):
    bb, state = setup(name, dtype, batch)
    stack_module, jit, layer_state = MIXERS[bb.config.mixer]
    weights = stack_module.stack_weights(bb._decode_plan())
    assert isinstance(weights.compiled, jit.Packed)
    n = len(bb.layers)
    if layout == "stacked":  # the model state's `layer(i)` views: one call runs every layer
        states = [state.layer(i) for i in range(n)]
        assert all(stacked(ts) is not None for ts in zip(*states))
    else:  # each layer's state a tensor of its own: one call per layer
        states = [layer_state(*(t.clone() for t in state.layer(i))) for i in range(n)]
        assert all(stacked(ts) is None for ts in zip(*states))
    steps_against_oracle(bb, state, dtype, batch, weights, states)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_torch_body_without_numba_matches_op_by_op_step(mixer, dtype, numba_on, monkeypatch):
    """MAMBAKIT_NUMBA=0: no compiled weights; the PyTorch whole-stack body runs and equals
    the oracle; above the compiled stack's `rows_max` rows the PyTorch body runs with numba
    on too."""
    stack_module, jit, _ = MIXERS[mixer]
    numba_on(False)
    bb, state = setup(f"{mixer}-ngroups2", dtype, 3)
    weights = stack_module.stack_weights(bb._decode_plan())
    assert weights.compiled is None
    steps_against_oracle(bb, state, dtype, 3, weights)
    numba_on(True)
    weights = stack_module.stack_weights(bb._decode_plan())
    assert weights.compiled is not None
    weights.compiled.rows_max = 2
    monkeypatch.setattr(jit.Packed, "__call__", None)  # it must not be called
    steps_against_oracle(bb, state, dtype, 3, weights)
