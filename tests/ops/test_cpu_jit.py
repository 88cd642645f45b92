"""The compiled (numba) whole-stack decode step of Mamba-1 (`ops/cpu_jit/mamba1.py`)
against the op-by-op reference step of the same stack op (`stack=None`: the add and
norm, F.linear, the reference step and F.linear per block), the oracle: the residual
stream and every state field over several steps, in float64 and float32, at batch 1 and
3, each row from a different state. Also: the compiled body only where it applies (numba
there and on, float32/float64 on the CPU, few rows), and the PyTorch body it replaces
still equal to the oracle with numba off; and the sampler's compiled noise against the
tensor hash it replaces. The model's step on it: tests/inference/test_cpu_step.py."""

from __future__ import annotations

import pytest
import torch
from stack_helpers import STEPS, assert_close, random_stack, stream_and_states

from mambakit.ops import cpu_jit, mamba_stack_step
from mambakit.ops.mamba_step import stack as m1_stack

pytest.importorskip("numba")
from mambakit.ops.cpu_jit import mamba1 as jit1  # noqa: E402

CONFIGS = {
    "default": dict(),
    "biases-no_conv_bias-d_state8-dt_rank3": dict(
        bias=True, conv_bias=False, d_state=8, dt_rank=3
    ),  # fmt: skip
    "d_conv2": dict(d_conv=2),
}


def steps_against_oracle(bb, state, dtype, batch, weights):
    oracle = state.clone()
    plan = bb._decode_plan()
    with torch.no_grad():
        for t in range(STEPS):
            h = bb.embed(torch.randn(batch, bb.config.input_dim, dtype=dtype))
            got, none = mamba_stack_step(h, plan, state.conv, state.ssm, dtype, "reference",
                                         lambda: weights)  # fmt: skip
            out, residual = mamba_stack_step(h, plan, oracle.conv, oracle.ssm, dtype,
                                             "reference")  # fmt: skip
            assert none is None and not got.requires_grad
            assert_close(t, dtype, stream_and_states(got, out, residual, state, oracle))


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_mamba1_stack_matches_op_by_op_step(name, dtype, batch, numba_on, monkeypatch):
    bb, state = random_stack(CONFIGS[name], dtype, batch)
    weights = m1_stack.stack_weights(bb._decode_plan())
    assert isinstance(weights.compiled, jit1.Packed)
    ran = []
    run = jit1.Packed.__call__
    monkeypatch.setattr(jit1.Packed, "__call__",
                        lambda self, *a: ran.append(1) or run(self, *a))  # fmt: skip
    steps_against_oracle(bb, state, dtype, batch, weights)
    assert len(ran) == STEPS  # the compiled body ran every step


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_torch_body_without_numba_matches_op_by_op_step(dtype, numba_on, monkeypatch):
    """MAMBAKIT_NUMBA=0: no compiled weights; the PyTorch whole-stack body runs and equals
    the oracle; above the compiled stack's `rows_max` rows the PyTorch body runs with numba
    on too."""
    numba_on(False)
    bb, state = random_stack(CONFIGS["default"], dtype, 3)
    weights = m1_stack.stack_weights(bb._decode_plan())
    assert weights.compiled is None
    steps_against_oracle(bb, state, dtype, 3, weights)
    numba_on(True)
    weights = m1_stack.stack_weights(bb._decode_plan())
    assert weights.compiled is not None
    weights.compiled.rows_max = 2
    monkeypatch.setattr(jit1.Packed, "__call__", None)  # it must not be called
    steps_against_oracle(bb, state, dtype, 3, weights)


def test_compiled_step_needs_float_cpu_weights(numba_on):
    """bf16 weights (or numba off) give no compiled body."""
    bb, _ = random_stack(CONFIGS["default"], torch.bfloat16, 1)
    assert m1_stack.stack_weights(bb._decode_plan()).compiled is None
    assert not cpu_jit.compiles(torch.zeros(1, dtype=torch.bfloat16))
    assert cpu_jit.compiles(torch.zeros(1))
    numba_on(False)
    assert not cpu_jit.compiles(torch.zeros(1))


def test_large_stacks_keep_the_torch_body(numba_on, monkeypatch):
    """Weights past COMPILED_MAX_BYTES are not copied into compiled arrays: the PyTorch
    body runs them (and still equals the oracle)."""
    bb, state = random_stack(CONFIGS["default"], torch.float32, 1)
    blocks = m1_stack.stack_weights(bb._decode_plan()).blocks
    nbytes = sum(t.numel() * t.element_size() for b in blocks for t in b
                 if isinstance(t, torch.Tensor))  # fmt: skip
    monkeypatch.setattr(cpu_jit, "COMPILED_MAX_BYTES", nbytes)
    assert m1_stack.stack_weights(bb._decode_plan()).compiled is not None
    monkeypatch.setattr(cpu_jit, "COMPILED_MAX_BYTES", nbytes - 1)
    weights = m1_stack.stack_weights(bb._decode_plan())
    assert weights.compiled is None
    steps_against_oracle(bb, state, torch.float32, 1, weights)


@pytest.mark.parametrize("ids_shape", ["vocabulary [C]", "candidates [B, C]"])
def test_compiled_sampling_noise_is_the_tensor_hash_bit_for_bit(ids_shape, numba_on, monkeypatch):
    """The sampler's Gumbel noise on the CPU (`sampling._noise`: the integer hash compiled,
    `ops/cpu_jit/noise.py`) against the tensor ops it replaces, `gumbel_noise(row_keys(...))`:
    every bit equal, for seeds of either sign, early and late token numbers (one for the
    batch, or each row's own), the whole vocabulary or each row's own top-k candidates."""
    from mambakit.inference.sampling import _noise, gumbel_noise, row_keys
    from mambakit.ops.cpu_jit import noise

    numba_on(True)
    calls = []
    compiled = noise.uniforms
    monkeypatch.setattr(noise, "uniforms", lambda *a: calls.append(1) or compiled(*a))
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.tensor([0, -1, 2**63 - 1]), torch.randint(-2**62, 2**62, (5,),
                                                                         generator=g)])  # fmt: skip
    C, V = 37, 50257
    ids = (torch.randint(0, V, (C,), generator=g) if ids_shape.startswith("vocabulary")
           else torch.randint(0, V, (len(seeds), C), generator=g))  # fmt: skip
    steps = torch.randint(0, 5000, (len(seeds),), generator=g)  # each row its own (the server)
    for step in (torch.tensor([0]), torch.tensor([1]), torch.tensor([2**40]), steps):
        got = _noise(seeds, step, ids)
        want = gumbel_noise(row_keys(seeds, step), ids)
        assert got.shape == want.shape == (len(seeds), C)
        assert torch.equal(got, want), step
    assert len(calls) == 4  # the compiled hash ran each time


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_softplus_against_torch(dtype):
    """The compiled bodies' softplus (float32: a polynomial; float64: libm) against
    PyTorch's in float64 over [-87, 30], within 4e-7 relative (float32) or 1e-15
    (float64); x itself above the threshold 20, NaN for NaN, inf for inf."""
    from numba import njit

    from mambakit.ops.cpu_jit.common import JIT, softplus

    @njit(fastmath=JIT["fastmath"], error_model=JIT["error_model"])
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = softplus(x[i])

    x = torch.cat([torch.linspace(-87, 30, 200_001, dtype=torch.float64),
                   torch.tensor([20.0, 20.000002, 19.999998, -0.0, 0.0])]).to(dtype)  # fmt: skip
    out = torch.empty_like(x)
    run(x.numpy(), out.numpy())
    want = torch.nn.functional.softplus(x.double())
    rel = ((out.double() - want).abs() / want).max().item()
    assert rel < (4e-7 if dtype == torch.float32 else 1e-15)
    above = x > 20
    assert torch.equal(out[above], x[above])
    special = torch.tensor([float("nan"), float("inf")], dtype=dtype)
    got = torch.empty_like(special)
    run(special.numpy(), got.numpy())
    assert got[0].isnan() and got[1] == float("inf")
