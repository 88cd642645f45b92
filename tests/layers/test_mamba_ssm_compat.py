"""`mambakit.Mamba` as a drop-in for mamba_ssm's `Mamba` (mamba_simple.py).

CPU: the constructor takes mamba_ssm's arguments with its defaults and initialisation;
a state dict with mamba_ssm's names and shapes (written from its constructor, not from
ours) loads with strict=True; the inference-cache protocol (prefill with
`inference_params`, then one token per call) equals one forward over the whole
sequence, and the cache holds mamba_ssm's layouts ([B, D, K]: the last K conv inputs).
GPU (-m gpu, the peer wheel): the same weights in both modules give the same forward,
gradients and a 32-token step loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from mambakit import Mamba


@dataclass
class InferenceParams:
    """mamba_ssm's `InferenceParams` (utils/generation.py): the fields a layer reads."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)


def upstream_state_dict(d_model, d_state=16, d_conv=4, expand=2, bias=False, conv_bias=True):
    """Names and shapes as mamba_ssm's Mamba.__init__ makes them."""
    d_inner, dt_rank = expand * d_model, math.ceil(d_model / 16)
    sd = {
        "in_proj.weight": torch.randn(2 * d_inner, d_model),
        "conv1d.weight": torch.randn(d_inner, 1, d_conv),
        "x_proj.weight": torch.randn(dt_rank + 2 * d_state, d_inner),
        "dt_proj.weight": torch.randn(d_inner, dt_rank),
        "dt_proj.bias": torch.randn(d_inner),
        "A_log": torch.randn(d_inner, d_state),
        "D": torch.randn(d_inner),
        "out_proj.weight": torch.randn(d_model, d_inner),
    }
    if conv_bias:
        sd["conv1d.bias"] = torch.randn(d_inner)
    if bias:
        sd["in_proj.bias"] = torch.randn(2 * d_inner)
        sd["out_proj.bias"] = torch.randn(d_model)
    return sd


def test_constructor_takes_mamba_ssm_arguments_and_initialisation():
    torch.manual_seed(0)
    m = Mamba(
        d_model=48, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1,
        dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True, bias=False,
        use_fast_path=True, layer_idx=3, device="cpu", dtype=torch.float32,
    )  # fmt: skip
    assert (m.d_inner, m.dt_rank, m.layer_idx, m.use_fast_path) == (96, 3, 3, True)
    assert Mamba(48, use_fast_path=False).use_fast_path is False  # accepted either way
    # S4D-real A, D = 1, softplus(dt bias) in [dt_min, dt_max], dt_proj ~ U(-std, std)
    torch.testing.assert_close(m.A_log, torch.log(torch.arange(1.0, 17.0)).expand(96, 16))
    torch.testing.assert_close(m.D, torch.ones(96))
    dt = F.softplus(m.dt_proj.bias)
    assert dt.min() >= 0.001 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    std = 3**-0.5
    assert m.dt_proj.weight.abs().max() <= std and m.dt_proj.weight.std() > 0.4 * std
    c = Mamba(48, dt_init="constant", dt_scale=2.0)
    torch.testing.assert_close(c.dt_proj.weight, torch.full((96, 3), 2 * std))
    assert m.in_proj.bias is None and m.out_proj.bias is None and m.conv1d.bias is not None
    with pytest.raises(ValueError, match="dt_init"):
        Mamba(48, dt_init="normal")


@pytest.mark.parametrize("bias, conv_bias", [(False, True), (True, False)])
def test_mamba_ssm_state_dict_loads_strictly(bias, conv_bias):
    sd = upstream_state_dict(40, bias=bias, conv_bias=conv_bias)
    m = Mamba(40, bias=bias, conv_bias=conv_bias)
    m.load_state_dict(sd, strict=True)
    for k, v in sd.items():
        assert torch.equal(m.state_dict()[k], v), k


def test_inference_params_prefill_then_steps_equal_one_forward():
    torch.manual_seed(1)
    m = Mamba(32, d_state=8, layer_idx=0, bias=True)
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        full = m(x)
        params = InferenceParams(max_seqlen=16, max_batch_size=2)
        outs = [m(x[:, :6], params)]  # positional, as mamba_ssm's blocks may pass it
        conv, ssm = params.key_value_memory_dict[0]
        assert conv.shape == (2, 64, 4) and ssm.shape == (2, 64, 8)
        # mamba_ssm's conv cache: the last K = 4 inputs of the conv, the newest last
        x_in = F.linear(x[:, :6], m.in_proj.weight[:64], m.in_proj.bias[:64])
        torch.testing.assert_close(conv, x_in[:, 2:6].mT)
        for t in range(6, 11):
            params.seqlen_offset = t
            outs.append(m(x[:, t : t + 1], inference_params=params))
        x_in = F.linear(x, m.in_proj.weight[:64], m.in_proj.bias[:64])
        torch.testing.assert_close(conv, x_in[:, 7:11].mT)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-6)


def test_short_prefill_pads_the_conv_cache_with_zeros():
    m = Mamba(16, d_state=4, layer_idx=2)
    params = InferenceParams(max_seqlen=8, max_batch_size=1)
    x = torch.randn(1, 2, 16)
    with torch.no_grad():
        m(x, inference_params=params)
    conv, _ = params.key_value_memory_dict[2]
    x_in = F.linear(x, m.in_proj.weight[:32])
    torch.testing.assert_close(conv[..., :2], torch.zeros(1, 32, 2))
    torch.testing.assert_close(conv[..., 2:], x_in.mT)


def test_step_in_mamba_ssm_layout_equals_mambakit_step():
    torch.manual_seed(2)
    m = Mamba(24, d_state=6, d_conv=3)
    conv, ssm = m.allocate_inference_cache(3, max_seqlen=10)
    assert conv.shape == (3, 48, 3) and ssm.shape == (3, 48, 6)
    assert conv.dtype == m.conv1d.weight.dtype and ssm.dtype == m.dt_proj.weight.dtype
    assert m.allocate_inference_cache(3, 10, dtype=torch.float64)[1].dtype == torch.float64
    own_conv, own_ssm = torch.zeros(3, 2, 48), torch.zeros(3, 48, 6)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 24)
            out, c2, s2 = m.step(x[:, None], conv, ssm)
            assert c2 is conv and s2 is ssm  # advanced in place, as mamba_ssm's
            want = m.step(x, own_conv, own_ssm)
            torch.testing.assert_close(out[:, 0], want)
            torch.testing.assert_close(conv[..., 1:].mT, own_conv)
            torch.testing.assert_close(ssm, own_ssm)
    with pytest.raises(ValueError, match=r"\[B, 1, M\]"):
        m.step(torch.randn(3, 2, 24), conv, ssm)
    with pytest.raises(ValueError, match="conv_state must be mamba_ssm's"):
        m.step(torch.randn(3, 1, 24), own_conv, ssm)


def test_float64_layer_steps_in_float64():
    """A float64 layer's caches are float64 and its mamba_ssm-form steps compute in float64,
    as its own step does: prefill + steps equal one forward to float64 rounding."""
    torch.manual_seed(4)
    m = Mamba(16, d_state=4, layer_idx=0).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
        params = InferenceParams(max_seqlen=9, max_batch_size=2)
        outs = [m(x[:, :3], params)]
        assert params.key_value_memory_dict[0][0].dtype == torch.float64
        for t in range(3, 9):
            params.seqlen_offset = t
            outs.append(m(x[:, t : t + 1], params))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-12, atol=1e-13)


def test_a_new_prefill_may_change_the_batch_size():
    """One InferenceParams reused (mamba_ssm's `reset`: seqlen_offset back to 0) for a batch of
    another size: the prefill overwrites the whole cache, so it takes the new size; a step of
    a batch the cache does not hold is refused naming the state."""
    torch.manual_seed(5)
    m = Mamba(16, d_state=4, layer_idx=1)
    params = InferenceParams(max_seqlen=8, max_batch_size=3)
    with torch.no_grad():
        m(torch.randn(2, 5, 16), params)
        for batch in (3, 1):
            x = torch.randn(batch, 7, 16)
            full = m(x)
            params.seqlen_offset = 0
            outs = [m(x[:, :4], params)]
            for t in range(4, 7):
                params.seqlen_offset = t
                outs.append(m(x[:, t : t + 1], params))
            torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-6)
        conv, ssm = m.allocate_inference_cache(2, 8)
        with pytest.raises(ValueError, match="ssm_state must be"):
            m.step(torch.randn(2, 1, 16), conv, ssm[:1])


def test_inference_params_need_a_layer_idx():
    m = Mamba(16)
    with pytest.raises(ValueError, match="layer_idx"):
        m(torch.randn(1, 3, 16), InferenceParams(8, 1))


# --- GPU: the same weights in mamba_ssm's module ------------------------------------------


@pytest.mark.gpu
def test_matches_mamba_ssm_forward_gradients_and_steps():
    """mamba_ssm.modules.mamba_simple.Mamba (the peer wheel) and mambakit.Mamba with the
    same weights, f32: forward, every gradient, and 32 tokens through each one's `step`
    with its own cache (mambakit's in mamba_ssm's layouts)."""
    upstream = pytest.importorskip("mamba_ssm.modules.mamba_simple")
    torch.manual_seed(0)
    theirs = upstream.Mamba(d_model=256, layer_idx=0, device="cuda", dtype=torch.float32)
    ours = Mamba(d_model=256, layer_idx=0, device="cuda", dtype=torch.float32)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 128, 256, device="cuda", requires_grad=True)
    y_t = theirs(x)
    gy = torch.randn_like(y_t)
    (g_t,) = torch.autograd.grad(y_t, x, gy)
    grads_t = torch.autograd.grad(theirs(x), list(theirs.parameters()), gy)
    y_o = ours(x)
    (g_o,) = torch.autograd.grad(y_o, x, gy)
    grads_o = torch.autograd.grad(ours(x), list(ours.parameters()), gy)

    worst: dict[str, tuple[float, float]] = {}  # what -> (relative norm, max abs difference)

    def rel(a, b, what):
        r, m = ((a - b).norm() / b.norm()).item(), (a - b).abs().max().item()
        worst[what] = max(worst.get(what, (0.0, 0.0)), (r, m))
        return r

    assert rel(y_o, y_t, "forward") < 1e-4, worst
    assert rel(g_o, g_t, "grad x") < 1e-4, worst
    for (name, _), a, b in zip(ours.named_parameters(), grads_o, grads_t):
        assert rel(a, b, f"grad {name}") < 1e-3, (name, worst)
    c_t, s_t = theirs.allocate_inference_cache(2, 32)
    c_o, s_o = ours.allocate_inference_cache(2, 32)
    with torch.no_grad():
        for t in range(32):
            h = x[:, t : t + 1].detach()
            o_t = theirs.step(h, c_t, s_t)[0]
            o_o = ours.step(h, c_o, s_o)[0]
            assert rel(o_o, o_t, "step out") < 1e-4, (t, worst)
    assert rel(c_o, c_t, "conv_state") < 1e-5 and rel(s_o, s_t, "ssm_state") < 1e-4, worst
    for what, (r, m) in worst.items():
        print(f"{what}: relative {r:.2e}, max abs {m:.2e}")
