"""Bad inputs raise ValueError/TypeError naming the argument."""

from __future__ import annotations

import pytest
import torch

from mambakit import Mamba, MambaBackbone, MambaConfig, MambaLM, MambaState

ERRORS = (ValueError, TypeError)


@pytest.fixture
def lm(tiny_config):
    return MambaLM(tiny_config())  # d_model 12, n_layers 2, vocab 24, N 3, K 3, D 24


@pytest.fixture
def bb(tiny_config):
    return MambaBackbone(tiny_config(input_dim=5))


def state(n_layers=2, batch=2, d_inner=24, d_state=3, d_conv=3, dtype=torch.float32):
    return MambaState.zeros(n_layers, batch, d_inner, d_state, d_conv, dtype=dtype)


# ---------------------------------------------------------------- MambaLM


@pytest.mark.parametrize(
    "ids",
    [
        torch.zeros(2, 5),  # float ids
        torch.zeros(5, dtype=torch.long),  # 1-d
        torch.zeros(2, 5, 1, dtype=torch.long),  # 3-d
    ],
    ids=["float", "1d", "3d"],
)
def test_lm_bad_input_ids(lm, ids):
    with pytest.raises(ERRORS, match="input_ids"):
        lm(ids)


def test_lm_input_on_wrong_device(lm):
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    with pytest.raises(ERRORS, match="input_ids"):
        lm(ids)


@pytest.mark.parametrize(
    "bad",
    [
        dict(batch=3),
        dict(n_layers=3),
        dict(d_state=4),
        dict(d_conv=4),
        dict(d_inner=20),
    ],
    ids=["batch", "layers", "d_state", "d_conv", "d_inner"],
)
def test_lm_forward_bad_state(lm, bad):
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ERRORS, match="state"):
        lm(ids, state=state(**bad))


def test_lm_forward_state_of_wrong_type(lm):
    with pytest.raises(ERRORS, match="state"):
        lm(torch.zeros(2, 5, dtype=torch.long), state=(torch.zeros(1), torch.zeros(1)))


@pytest.mark.parametrize(
    "seq_idx",
    [
        torch.zeros(2, 4, dtype=torch.int32),  # wrong length
        torch.zeros(2, 5, dtype=torch.float32),  # wrong dtype
        torch.zeros(5, dtype=torch.int32),  # 1-d
    ],
    ids=["len", "dtype", "1d"],
)
def test_lm_bad_seq_idx(lm, seq_idx):
    with pytest.raises(ERRORS, match="seq_idx"):
        lm(torch.zeros(2, 5, dtype=torch.long), seq_idx=seq_idx)


def test_lm_bad_labels(lm):
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ERRORS, match="labels"):
        lm(ids, labels=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ERRORS, match="labels"):
        lm(ids, labels=torch.zeros(2, 5))


def test_lm_step_bad_inputs(lm):
    with pytest.raises(ERRORS, match="state"):
        lm.step(torch.zeros(2, dtype=torch.long), state(batch=3))
    with pytest.raises(ERRORS, match="state"):
        lm.step(torch.zeros(2, dtype=torch.long), state(n_layers=1))
    with pytest.raises(ERRORS, match="ids"):
        lm.step(torch.zeros(2), state())
    with pytest.raises(ERRORS, match="ids"):
        lm.step(torch.zeros(2, 3, 4, dtype=torch.long), state())
    with pytest.raises(TypeError, match=r"state must be a state \(init_state"):  # not "or None"
        lm.step(torch.zeros(2, dtype=torch.long), None)


def test_lm_init_state_bad_batch(lm):
    for bad in (0, -1):
        with pytest.raises(ERRORS, match="batch"):
            lm.init_state(bad)


# ---------------------------------------------------------------- MambaBackbone


@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(2, 5, 12),  # d_model wide but input_dim is 5
        torch.zeros(2, 5),  # 2-d
        torch.zeros(2, 5, 5, dtype=torch.long),  # integer
    ],
    ids=["width", "2d", "long"],
)
def test_backbone_bad_x(bb, x):
    with pytest.raises(ERRORS, match=r"\bx\b"):
        bb(x)


def test_backbone_x_on_wrong_device(bb):
    with pytest.raises(ERRORS, match=r"\bx\b"):
        bb(torch.zeros(2, 5, 5, device="meta"))


def test_backbone_step_bad_inputs(bb):
    with pytest.raises(ERRORS, match="state"):
        bb.step(torch.zeros(2, 5), state(batch=4))
    with pytest.raises(ERRORS, match=r"\bx(_t)?\b"):
        bb.step(torch.zeros(2, 12), state())


def test_backbone_forward_bad_state(bb):
    with pytest.raises(ERRORS, match="state"):
        bb(torch.zeros(2, 5, 5), state=state(batch=1))


# ---------------------------------------------------------------- Mamba mixer


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(d_model=-1), "d_model"),
        (dict(d_model=0), "d_model"),
        (dict(d_state=-2), "d_state"),
        (dict(d_conv=0), "d_conv"),
        (dict(expand=-1), "expand"),
        (dict(dt_rank=-3), "dt_rank"),
        (dict(dt_min=0.5, dt_max=0.1), "dt_m"),
    ],
)
def test_mixer_bad_constructor(kw, field):
    args = dict(d_model=8)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        Mamba(**args)


def test_mixer_bad_inputs():
    m = Mamba(d_model=8, d_state=4, d_conv=3)  # D 16
    x = torch.zeros(2, 5, 8)
    with pytest.raises(ERRORS, match=r"\bx\b"):
        m(torch.zeros(2, 5, 7))
    with pytest.raises(ERRORS, match=r"\bx\b"):
        m(torch.zeros(2, 5, 8, dtype=torch.long))
    with pytest.raises(ERRORS, match="conv_state"):
        m(x, conv_state=torch.zeros(2, 3, 16), return_state=True)
    with pytest.raises(ERRORS, match="conv_state"):
        m(x, conv_state=torch.zeros(3, 2, 16), return_state=True)
    with pytest.raises(ERRORS, match="ssm_state"):
        m(x, ssm_state=torch.zeros(2, 16, 5), return_state=True)
    with pytest.raises(ERRORS, match="seq_idx"):
        m(x, seq_idx=torch.zeros(2, 6, dtype=torch.int32))


def test_mamba_inner_op_bad_inputs():
    """ops.mamba_inner checks what it is given (the layer calls its unchecked twin, having
    checked), and its output equals the layer's own call on good inputs."""
    from mambakit.ops import mamba_inner

    m = Mamba(d_model=8, d_state=4, d_conv=3)  # D 16, R 1
    A, D, dt_bias = m._ssm_params()
    w = dict(
        conv_weight=m.conv1d.weight.detach().squeeze(1), conv_bias=m.conv1d.bias.detach(),
        x_proj_weight=m.x_proj.weight.detach(), dt_proj_weight=m.dt_proj.weight.detach(),
        A=A, D=D, dt_bias=dt_bias,
    )  # fmt: skip
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        xz = m.in_proj(x)
        y, conv, ssm = mamba_inner(xz, **w)
        out, (conv_l, ssm_l) = m(x, return_state=True)
    assert torch.equal(m.out_proj(y), out) and torch.equal(conv, conv_l)
    assert torch.equal(ssm, ssm_l)
    bad = [
        ("xz", dict(xz=xz[..., :31])),
        ("conv_weight", dict(conv_weight=w["conv_weight"][:15])),
        ("dt_proj_weight", dict(dt_proj_weight=w["dt_proj_weight"][:15])),
        ("x_proj_weight", dict(x_proj_weight=w["x_proj_weight"][:, :15])),
        ("dt_bias", dict(dt_bias=dt_bias[:15])),
        ("conv_state", dict(conv_state=torch.zeros(2, 3, 16))),
        ("ssm_state", dict(ssm_state=torch.zeros(3, 16, 4))),
        ("seq_idx", dict(seq_idx=torch.zeros(2, 6, dtype=torch.int32))),
        ("A must", dict(A=A[None])),
        ("conv_weight", dict(conv_weight=w["conv_weight"][:, :1], conv_state=None)),  # K = 1
    ]
    for name, change in bad:
        kw = {"xz": xz, **w, **change}
        with pytest.raises(ERRORS, match=name):
            mamba_inner(kw.pop("xz"), **kw)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("field", ["d_model", "n_layers", "d_state", "d_conv", "expand"])
def test_negative_sizes_in_models(field):
    with pytest.raises(ValueError, match=field):
        MambaLM(MambaConfig(**{"d_model": 8, "n_layers": 1, "vocab_size": 16, field: -2}))
