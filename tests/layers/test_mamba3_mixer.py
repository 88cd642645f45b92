"""The Mamba-3 SISO mixer layer: upstream's parameter layout, step == forward, carried state."""

import math

import pytest
import torch

from mambakit.layers.mamba3 import Mamba3, heavy_tail
from mambakit.ops.mamba3 import Mamba3State


def layer(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    cfg = dict(d_model=16, d_state=8, expand=2, headdim=8, ngroups=2, chunk_size=4)
    m = Mamba3(**{**cfg, **kw}).to(dtype)
    with torch.no_grad():  # away from the initial values, so every term matters
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def test_parameters_follow_the_upstream_module():
    m = Mamba3(d_model=768, d_state=128, headdim=64)
    H, N, E = 24, 128, 1536
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "dt_bias": (H,),
        "B_bias": (H, 1, N),
        "C_bias": (H, 1, N),
        "D": (H,),
        "in_proj.weight": (2 * E + 2 * N + 3 * H + 32, 768),  # 3432: 32 rotary angles
        "B_norm.weight": (N,),
        "C_norm.weight": (N,),
        "out_proj.weight": (768, E),
    }
    assert torch.equal(m.B_bias, torch.ones_like(m.B_bias)) and torch.equal(m.D, torch.ones(H))
    dt = torch.nn.functional.softplus(m.dt_bias.detach())  # inverse softplus: in [dt_min, dt_max]
    assert float(dt.min()) >= 1e-3 * (1 - 1e-5) and float(dt.max()) <= 0.1 * (1 + 1e-5)
    assert all(p.dtype == torch.float32 for p in (m.dt_bias, m.B_bias, m.C_bias, m.D))


def test_heavy_tail_closed_form():
    u = torch.tensor([-3.0, -1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(heavy_tail(u), torch.tensor([0.25, 0.5, 1.0, 1.5, 3.0]).double())


def test_step_loop_equals_forward_with_state_in_and_out():
    m = layer()
    u = torch.randn(2, 11, 16, dtype=torch.float64)
    st = m.init_state(2)
    st = Mamba3State(*(t + 0.3 * torch.randn_like(t) for t in st))
    y, final = m(u, st, return_state=True)
    s = st
    outs = []
    for t in range(u.shape[1]):
        o, s = m.step(u[:, t], s)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), y, rtol=1e-10, atol=1e-10)
    for name in Mamba3State._fields:
        torch.testing.assert_close(getattr(s, name), getattr(final, name), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("projection", ["biased", "hooked"])
def test_no_grad_step_with_projections_not_plain_calls_them_and_fuses_the_rest(
    projection, monkeypatch
):
    """A no-grad step whose in_proj has a bias, or whose out_proj a hook watches: the
    projections are called (the bias and the hook act), the rest of the step is still the
    fused one (`ops.mamba3_step_raw`), and it equals the forward over one token."""
    import mambakit.layers.mamba3 as mamba3_module

    m = layer()
    if projection == "biased":
        lin = torch.nn.Linear(16, m.in_proj.out_features, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(m.in_proj.weight)
        m.in_proj = lin
    else:
        m.out_proj.register_forward_hook(lambda mod, args, out: out * 2)
    fused = []
    real = mamba3_module.mamba3_step_raw
    monkeypatch.setattr(mamba3_module, "mamba3_step_raw", lambda *a: fused.append(1) or real(*a))
    u = torch.randn(3, 1, 16, dtype=torch.float64)
    st = m.init_state(3)
    with torch.no_grad():
        y, final = m(u, st, return_state=True)
        out, stepped = m.step(u[:, 0], m.init_state(3))
    assert fused == [1]
    torch.testing.assert_close(out, y[:, 0], rtol=1e-10, atol=1e-10)
    for name in Mamba3State._fields:
        torch.testing.assert_close(getattr(stepped, name), getattr(final, name), rtol=1e-10,
                                   atol=1e-10)  # fmt: skip


def test_chunks_with_carried_state_equal_the_whole_values_and_gradients():
    m = layer()
    u = torch.randn(2, 14, 16, dtype=torch.float64)
    y = m(u)
    y.pow(2).sum().backward()
    whole = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert all(g.abs().sum() > 0 for g in whole.values()), "a parameter gets no gradient"
    m.zero_grad()
    y1, st = m(u[:, :5], return_state=True)
    y2 = m(u[:, 5:], st)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-10, atol=1e-10)
    torch.cat([y1, y2], 1).pow(2).sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, whole[n], rtol=1e-9, atol=1e-11, msg=n)


def test_packed_rows_equal_documents_alone():
    m = layer()
    u = torch.randn(1, 12, 16, dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)
    y = m(u, seq_idx=seq_idx)
    torch.testing.assert_close(y[:, :5], m(u[:, :5]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y[:, 5:], m(u[:, 5:]), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="seq_idx"):
        m(u, seq_idx=seq_idx[:, :-1])


def test_f32_layer_is_close_to_float64():
    m64 = layer()
    m32 = layer(torch.float32)
    m32.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    u = torch.randn(2, 20, 16, dtype=torch.float64)
    torch.testing.assert_close(m32(u.float()).double(), m64(u), rtol=1e-4, atol=1e-5)


def test_A_never_rises_above_minus_A_floor():
    m = layer(A_floor=0.05)
    u = 10 * torch.randn(3, 7, 16, dtype=torch.float64)
    with torch.no_grad():
        _, _, _, delta, A, _, _, _ = m._inputs(u)
    assert float(A.max()) <= -0.05 and float(delta.min()) > 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="headdim"):
        Mamba3(d_model=10, headdim=8)
    with pytest.raises(ValueError, match="rope_fraction"):
        Mamba3(d_model=16, headdim=8, rope_fraction=0.25)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba3(d_model=16, headdim=8, ngroups=3)
    m = layer()
    u = torch.randn(2, 3, 16, dtype=torch.float64)
    st = m.init_state(2)
    with pytest.raises(ValueError, match="state.ssm"):
        m(u, st._replace(ssm=st.ssm[:, :, :, :-1]))
    with pytest.raises(TypeError, match="Mamba3State"):
        m(u, tuple(st))
    with pytest.raises(ValueError, match="u must have shape"):
        m(torch.randn(2, 3, 15, dtype=torch.float64))
    assert math.isfinite(float(m(u).detach().sum()))
