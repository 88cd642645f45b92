"""The reference backend's whole-stack decode bodies of Mamba-3 and Mamba-2
(`ops/mamba3/stack.py`, `ops/mamba2/stack.py`) against the op-by-op reference step of
the same stack op (`stack=None`: the add and norm, F.linear, the mixer's reference step
and F.linear per block), the oracle: the residual stream and every state field over
several steps, in float64 and float32, at batch 1 and 3, each row from a different
state."""

from __future__ import annotations

import pytest
import torch
from stack_helpers import STEPS, assert_close, random_stack, stream_and_states

CONFIGS = {
    "mamba3": dict(mixer="mamba3", headdim=32, ngroups=2),
    "mamba2": dict(mixer="mamba2", headdim=32, ngroups=2),
    "mamba2-norm_before_gate-dt_limit-no_conv_bias": dict(
        mixer="mamba2", headdim=32, norm_before_gate=True, dt_limit=(0.01, 0.5), conv_bias=False
    ),
    "mamba2-D_hdim-no_norm-mlp-biases": dict(
        mixer="mamba2", headdim=32, D_has_hdim=True, rmsnorm=False, d_ssm=64, bias=True
    ),
}


pytestmark = pytest.mark.usefixtures("torch_bodies")  # the compiled bodies: test_cpu_jit*.py


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_stack_body_matches_op_by_op_step(name, dtype, batch):
    bb, state = random_stack(CONFIGS[name], dtype, batch)
    mixer = type(bb.layers[0].mixer)
    plan = bb._decode_plan()
    weights = mixer.stack_weights(plan)
    assert weights is not None and weights.blocks[0].in_wT.dtype == dtype
    oracle = state.clone()
    n = len(bb.layers)
    with torch.no_grad():
        for t in range(STEPS):
            h = bb.embed(torch.randn(batch, 24, dtype=dtype))
            got, none = mixer.stack_step(h, plan, [state.layer(i) for i in range(n)], dtype,
                                         "reference", lambda: weights)  # fmt: skip
            out, residual = mixer.stack_step(h, plan, [oracle.layer(i) for i in range(n)], dtype,
                                             "reference")  # fmt: skip
            assert none is None and not got.requires_grad
            assert_close(t, dtype, stream_and_states(got, out, residual, state, oracle))
