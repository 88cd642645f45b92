"""`Mamba` (one mixer layer) against an independent float64 loop of DESIGN.md section 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mambakit import Mamba, Mamba2
from mambakit.layers.mamba3 import Mamba3


def oracle(mixer, x, conv_state=None, ssm_state=None, seq_idx=None):
    """DESIGN.md section 1, one timestep at a time, from the module's parameters.

    x [B, T, d]; conv_state [B, K-1, D] oldest first; ssm_state [B, D, N].
    Returns y [B, T, d], final conv state, final ssm state.
    """
    p = {k: v.detach().double() for k, v in mixer.named_parameters()}
    x = x.double()
    b, t, _ = x.shape
    w_conv = p["conv1d.weight"][:, 0, :]  # [D, K]
    d_inner, k = w_conv.shape
    n = p["A_log"].shape[1]
    rank = p["dt_proj.weight"].shape[1]
    xz = x @ p["in_proj.weight"].T
    if "in_proj.bias" in p:
        xz = xz + p["in_proj.bias"]
    x_in, z = xz[..., :d_inner], xz[..., d_inner:]
    A = -torch.exp(p["A_log"])
    ys, conv_out, ssm_out = [], [], []
    for bi in range(b):
        hist = [
            (conv_state[bi, j].double() if conv_state is not None else torch.zeros(d_inner))
            for j in range(k - 1)
        ]
        h = ssm_state[bi].double() if ssm_state is not None else torch.zeros(d_inner, n)
        h = h.to(torch.float64)
        hist = [v.to(torch.float64) for v in hist]
        rows = []
        for ti in range(t):
            if seq_idx is not None and ti > 0 and seq_idx[bi, ti] != seq_idx[bi, ti - 1]:
                hist = [torch.zeros(d_inner, dtype=torch.float64) for _ in range(k - 1)]
                h = torch.zeros(d_inner, n, dtype=torch.float64)
            window = hist + [x_in[bi, ti]]  # K inputs, oldest first
            c = sum(w_conv[:, j] * window[j] for j in range(k))
            if "conv1d.bias" in p:
                c = c + p["conv1d.bias"]
            hist = window[1:]
            u = F.silu(c)
            proj = p["x_proj.weight"] @ u
            dt_r, Bt, Ct = proj[:rank], proj[rank : rank + n], proj[rank + n :]
            delta = F.softplus(p["dt_proj.weight"] @ dt_r + p["dt_proj.bias"])
            h = torch.exp(delta[:, None] * A) * h + (delta * u)[:, None] * Bt[None, :]
            y = h @ Ct + p["D"] * u
            out = (y * F.silu(z[bi, ti])) @ p["out_proj.weight"].T
            if "out_proj.bias" in p:
                out = out + p["out_proj.bias"]
            rows.append(out)
        ys.append(torch.stack(rows))
        conv_out.append(torch.stack(hist))
        ssm_out.append(h)
    return torch.stack(ys), torch.stack(conv_out), torch.stack(ssm_out)


def make_mixer(randomize, dtype=torch.float64, **kw):
    args = dict(d_model=10, d_state=3, d_conv=3, expand=2)
    args.update(kw)
    return randomize(Mamba(**args, dtype=dtype))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(d_conv=4, d_state=5, bias=True, conv_bias=False),
        dict(d_conv=2, expand=1, dt_rank=3),
    ],
    ids=["K3-N3", "K4-N5-bias-noconvbias", "K2-E1-R3"],
)
@pytest.mark.parametrize("with_state", [False, True], ids=["h0none", "h0rand"])
def test_forward_matches_loop_oracle(seed, randomize, kw, with_state):
    mixer = make_mixer(randomize, **kw)
    K, D, N = mixer.conv1d.weight.shape[-1], mixer.A_log.shape[0], mixer.A_log.shape[1]
    x = torch.randn(2, 9, 10, dtype=torch.float64)
    conv0 = torch.randn(2, K - 1, D, dtype=torch.float64) if with_state else None
    ssm0 = torch.randn(2, D, N, dtype=torch.float64) if with_state else None
    y, (conv, ssm) = mixer(x, conv_state=conv0, ssm_state=ssm0, return_state=True)
    y_ref, conv_ref, ssm_ref = oracle(mixer, x, conv0, ssm0)
    assert y.shape == (2, 9, 10)
    assert conv.shape == (2, K - 1, D) and ssm.shape == (2, D, N)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(conv.double(), conv_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ssm.double(), ssm_ref, rtol=1e-9, atol=1e-10)
    if not with_state:
        torch.testing.assert_close(mixer(x), y, rtol=0, atol=0)


def test_long_sequence_matches_oracle(seed, randomize):
    """Long enough to cross any internal chunk boundary of the parallel scan."""
    mixer = make_mixer(randomize, d_model=6, d_state=2, d_conv=3, expand=1)
    with torch.no_grad():
        mixer.dt_proj.bias.fill_(-4.0)  # small delta: the state carries far back in time
    x = torch.randn(1, 301, 6, dtype=torch.float64)
    ssm0 = torch.randn(1, 6, 2, dtype=torch.float64)
    y, (conv, ssm) = mixer(x, ssm_state=ssm0, return_state=True)
    y_ref, conv_ref, ssm_ref = oracle(mixer, x, None, ssm0)
    torch.testing.assert_close(y, y_ref, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(ssm.double(), ssm_ref, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(conv.double(), conv_ref, rtol=1e-8, atol=1e-10)


def test_seq_idx_matches_oracle(seed, randomize):
    mixer = make_mixer(randomize, d_conv=4)
    K, D, N = 4, mixer.A_log.shape[0], mixer.A_log.shape[1]
    x = torch.randn(2, 11, 10, dtype=torch.float64)
    seq_idx = torch.tensor(
        [[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 5], [3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4]], dtype=torch.int32
    )
    conv0 = torch.randn(2, K - 1, D, dtype=torch.float64)
    ssm0 = torch.randn(2, D, N, dtype=torch.float64)
    y, (conv, ssm) = mixer(x, conv_state=conv0, ssm_state=ssm0, seq_idx=seq_idx, return_state=True)
    y_ref, conv_ref, ssm_ref = oracle(mixer, x, conv0, ssm0, seq_idx)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(conv.double(), conv_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ssm.double(), ssm_ref, rtol=1e-9, atol=1e-10)


def test_float32_close_to_float64_oracle(seed, randomize):
    mixer = make_mixer(randomize, dtype=torch.float32)
    x = torch.randn(3, 8, 10)
    y, (conv, ssm) = mixer(x, return_state=True)
    y_ref, conv_ref, ssm_ref = oracle(mixer, x)
    assert y.dtype == torch.float32
    assert ssm.dtype == torch.float32 and conv.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ssm.double(), ssm_ref, rtol=1e-4, atol=1e-5)


def test_parameter_names_and_shapes_match_mamba_ssm():
    m = Mamba(d_model=40, d_state=7, d_conv=3, expand=3)
    D, R = 120, math.ceil(40 / 16)
    shapes = {k: tuple(v.shape) for k, v in m.named_parameters()}
    assert shapes == {
        "in_proj.weight": (2 * D, 40),
        "conv1d.weight": (D, 1, 3),
        "conv1d.bias": (D,),
        "x_proj.weight": (R + 2 * 7, D),
        "dt_proj.weight": (D, R),
        "dt_proj.bias": (D,),
        "A_log": (D, 7),
        "D": (D,),
        "out_proj.weight": (40, D),
    }
    assert all(v.dtype == torch.float32 for v in m.parameters())
    with_bias = Mamba(d_model=40, bias=True, conv_bias=False, dt_rank=5)
    names = dict(with_bias.named_parameters())
    assert "in_proj.bias" in names and "out_proj.bias" in names
    assert "conv1d.bias" not in names
    assert names["dt_proj.weight"].shape == (80, 5)


def test_init_follows_mamba_ssm(seed):
    m = Mamba(d_model=64, d_state=6, dt_min=0.002, dt_max=0.05)
    A = torch.arange(1, 7, dtype=torch.float32).expand(128, 6)
    torch.testing.assert_close(m.A_log.detach(), torch.log(A))
    torch.testing.assert_close(m.D.detach(), torch.ones(128))
    dt = F.softplus(m.dt_proj.bias.detach().double())
    assert dt.min() >= 0.002 * (1 - 1e-4) and dt.max() <= 0.05 * (1 + 1e-4)
    # log-uniform: the median of log(dt) sits near the middle of [log dt_min, log dt_max]
    mid = (math.log(0.002) + math.log(0.05)) / 2
    assert abs(dt.log().median().item() - mid) < 0.6
    std = m.dt_proj.weight.shape[1] ** -0.5
    assert m.dt_proj.weight.abs().max() <= std + 1e-6
    c = Mamba(d_model=64, dt_init="constant", dt_scale=2.0)
    torch.testing.assert_close(
        c.dt_proj.weight.detach(), torch.full_like(c.dt_proj.weight, 2.0 * 4**-0.5)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: Mamba(d_model=8, dt_init_floor=math.nan),
        lambda: Mamba2(d_model=8, headdim=4, dt_init_floor=math.nan),
        lambda: Mamba3(d_model=8, headdim=4, dt_init_floor=math.nan),
        lambda: Mamba3(d_model=8, headdim=4, A_floor=math.nan),
    ],
    ids=["mamba1", "mamba2", "mamba3", "mamba3-A_floor"],
)
def test_nan_floors_raise(make):
    # a NaN floor passed the `<= 0` checks and made every dt bias NaN (every output NaN)
    with pytest.raises(ValueError, match="floor"):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: Mamba(d_model=8, dt_max=math.inf),
        lambda: Mamba2(d_model=8, headdim=4, dt_max=math.inf),
        lambda: Mamba3(d_model=8, headdim=4, dt_max=math.inf),
    ],
    ids=["mamba1", "mamba2", "mamba3"],
)
def test_infinite_dt_max_raises(make):
    # passed `dt_min <= dt_max`: every dt bias was inf and every output NaN
    with pytest.raises(ValueError, match="dt_max"):
        make()


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: Mamba(d_model=8, dt_scale=-1.0), "dt_scale"),
        (lambda: Mamba(d_model=8, dt_scale=math.nan), "dt_scale"),
        (lambda: Mamba2(d_model=8, headdim=4, conv_init=-0.5), "conv_init"),
        (lambda: Mamba2(d_model=8, headdim=4, A_init_range=(1.0, math.inf)), "A_init_range"),
    ],
    ids=["dt_scale-negative", "dt_scale-nan", "conv_init-negative", "A_init_range-inf"],
)
def test_bad_init_scales_raise_naming_them(make, name):
    # they failed inside uniform_ ("from is out of bounds for float"), naming no argument
    with pytest.raises(ValueError, match=name):
        make()


@pytest.mark.parametrize("name", ["d_model", "d_state", "expand", "dt_rank"])
def test_bool_sizes_raise_naming_them(name):
    # True is an int to isinstance: d_state=True built a layer of one state, d_model=True
    # failed inside torch.empty naming no argument (Mamba2 and Mamba3 refuse bools)
    kw = {"d_model": 8, name: True}
    with pytest.raises(ValueError, match=name):
        Mamba(**kw)


def test_return_state_defaults_and_dtype_args():
    m = Mamba(d_model=8, d_state=4, d_conv=3, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in m.parameters())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    y = m(x)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    out = m(x, return_state=True)
    assert isinstance(out, tuple) and len(out) == 2
    y2, (conv, ssm) = out
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    assert conv.shape == (2, 2, 16) and ssm.shape == (2, 16, 4)


def test_gradcheck_mixer_inputs_and_state(seed, randomize):
    mixer = make_mixer(randomize, d_model=3, d_state=2, d_conv=2, expand=1)
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    conv0 = torch.randn(2, 1, 3, dtype=torch.float64, requires_grad=True)
    ssm0 = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)

    def f(x, conv0, ssm0):
        y, (conv, ssm) = mixer(x, conv_state=conv0, ssm_state=ssm0, return_state=True)
        return y, conv, ssm

    assert torch.autograd.gradcheck(f, (x, conv0, ssm0), eps=1e-6, atol=1e-5)


def test_gradcheck_mixer_parameters_through_final_state(seed, randomize):
    """The final state is differentiable w.r.t. A_log, dt bias and the conv weight."""
    mixer = make_mixer(randomize, d_model=3, d_state=2, d_conv=2, expand=1)
    x = torch.randn(1, 5, 3, dtype=torch.float64)
    ssm0 = torch.randn(1, 3, 2, dtype=torch.float64)
    names = ["A_log", "dt_proj.bias", "conv1d.weight", "D"]
    params = {k: v.detach().clone().requires_grad_(True) for k, v in mixer.named_parameters()}

    def f(*ps):
        sub = dict(params)
        sub.update(dict(zip(names, ps)))
        y, (conv, ssm) = torch.func.functional_call(
            mixer, sub, (x,), dict(ssm_state=ssm0, return_state=True)
        )
        return y, ssm

    assert torch.autograd.gradcheck(f, tuple(params[k] for k in names), eps=1e-6, atol=1e-5)


def test_step_with_autograd_equals_forward_values_and_gradients(seed, randomize):
    # with a gradient recorded the step ran in place over the states autograd had saved, so
    # backward raised (Mamba2's and Mamba3's steps run as the forward over one step there)
    m = make_mixer(randomize, d_model=6, d_state=3, d_conv=3, expand=2)
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    conv0 = torch.randn(2, 2, 12, dtype=torch.float64, requires_grad=True)
    ssm0 = torch.randn(2, 12, 3, dtype=torch.float64, requires_grad=True)
    leaves = [x, conv0, ssm0, *m.parameters()]

    out, (conv, ssm) = m(x, conv0, ssm0, return_state=True)
    want = torch.autograd.grad(out.sum() + conv.pow(2).sum() + ssm.pow(2).sum(), leaves)

    conv_s, ssm_s = conv0.clone(), ssm0.clone()
    ys = torch.stack([m.step(x[:, t], conv_s, ssm_s) for t in range(4)], 1)
    torch.testing.assert_close(ys, out)
    torch.testing.assert_close(conv_s, conv)
    torch.testing.assert_close(ssm_s, ssm)
    got = torch.autograd.grad(ys.sum() + conv_s.pow(2).sum() + ssm_s.pow(2).sum(), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
