"""MambaState: layout, zeros, detach, clone, reset_, to; init_state of the models."""

from __future__ import annotations

import pytest
import torch

from mambakit import MambaBackbone, MambaLM, MambaState


def test_zeros_layout():
    s = MambaState.zeros(n_layers=3, batch_size=2, d_inner=10, d_state=4, d_conv=3)
    assert s.conv.shape == (3, 2, 2, 10)
    assert s.ssm.shape == (3, 2, 10, 4)
    assert s.conv.dtype == torch.float32 and s.ssm.dtype == torch.float32
    assert s.conv.abs().sum() == 0 and s.ssm.abs().sum() == 0
    assert (s.n_layers, s.batch_size) == (3, 2)
    conv1, ssm1 = s.layer(1)
    assert conv1.shape == (2, 2, 10) and ssm1.shape == (2, 10, 4)
    conv1.fill_(1.0)  # layer() returns views
    assert s.conv[1].eq(1).all() and s.conv[0].eq(0).all()


@pytest.mark.parametrize("model_cls", [MambaLM, MambaBackbone])
def test_init_state_shapes_dtype(tiny_config, model_cls):
    cfg = tiny_config(d_model=12, n_layers=3, d_state=5, d_conv=4, expand=2)
    model = model_cls(cfg)
    s = model.init_state(4)
    assert isinstance(s, MambaState)
    assert s.conv.shape == (3, 4, 3, 24) and s.ssm.shape == (3, 4, 24, 5)
    assert s.dtype == torch.float32 and s.conv.dtype == torch.float32
    assert s.conv.abs().sum() == 0 and s.ssm.abs().sum() == 0
    assert s.device == next(model.parameters()).device
    s64 = model.double().init_state(2)
    assert s64.conv.dtype == torch.float64 and s64.ssm.dtype == torch.float64


def test_invalid_construction_names_the_problem():
    with pytest.raises(ValueError, match="4-d"):
        MambaState(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, 5))
    with pytest.raises(ValueError, match="disagree"):
        MambaState(torch.zeros(2, 3, 1, 4), torch.zeros(2, 2, 4, 5))
    with pytest.raises(ValueError, match="disagree"):
        MambaState(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 6, 5))


def test_fields_of_another_dtype_are_refused_naming_the_field(tiny_config):
    """A state's fields are floating tensors (an int32 conv field was taken and its values
    truncated by the step), and a model takes f32 or f64 ones in every field (a bf16 field
    broke the compiled CPU step); f32 and f64 may mix."""
    with pytest.raises(TypeError, match=r"MambaState.conv must be a floating tensor"):
        MambaState(torch.zeros(2, 3, 1, 4, dtype=torch.int32), torch.zeros(2, 3, 4, 5))
    model = MambaBackbone(tiny_config(d_model=8, n_layers=2, d_state=4, expand=2)).eval()
    s = model.init_state(3)
    with pytest.raises(TypeError, match=r"state.conv must be float32 \(or float64\), got "):
        model.step(torch.randn(3, 8), MambaState(s.conv.bfloat16(), s.ssm))
    with torch.no_grad():
        model.step(torch.randn(3, 8), MambaState(s.conv.double(), s.ssm))


def test_copy_takes_a_state_of_the_same_kind_and_shapes():
    """copy_ refuses a state whose fields would broadcast (torch's copy_ put a 1-layer,
    1-row state into every layer and row) and one of another kind."""
    s = MambaState.zeros(n_layers=2, batch_size=4, d_inner=10, d_state=4, d_conv=3)
    small = MambaState.zeros(n_layers=1, batch_size=1, d_inner=10, d_state=4, d_conv=3)
    with pytest.raises(ValueError, match=r"MambaState.copy_: conv has shape \[1, 1, 2, 10\]"):
        s.copy_(small)
    with pytest.raises(TypeError, match="copy_ takes a MambaState"):
        s.copy_((s.conv, s.ssm))
    other = MambaState(torch.randn(2, 4, 2, 10), torch.randn(2, 4, 10, 4))
    assert s.copy_(other) is s and torch.equal(s.ssm, other.ssm)


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "mamba3"])
def test_step_refuses_an_expanded_state_and_keeps_the_inputs_gradient(tiny_config, mixer):
    """step() writes the state in place: an expanded one (one initial state broadcast over
    the rows) is refused naming the field, where the compiled CPU step wrote every row
    into the same memory. An input that requires grad (an encoder in front of a frozen
    backbone) keeps its gradient through step, as through the forward."""
    kw = {} if mixer == "mamba1" else dict(headdim=8, d_state=8)
    cfg = tiny_config(d_model=16, n_layers=2, input_dim=5, mixer=mixer, **kw)
    torch.manual_seed(0)
    bb = MambaBackbone(cfg).eval().requires_grad_(False)
    one = bb.init_state(1)
    shared = type(one)(*(t.expand(-1, 3, *t.shape[2:]) for t in one._tensors()))
    with pytest.raises(ValueError, match=r"step: state\.\w+ shares memory"):
        bb.step(torch.randn(3, 5), shared)
    x = torch.randn(3, 5, requires_grad=True)
    out, _ = bb.step(x, shared.clone())
    assert out.grad_fn is not None
    (g,) = torch.autograd.grad(out.square().sum(), x)
    ref, _ = bb(x[:, None], bb.init_state(3))
    (want,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_x_of_another_float_dtype_is_cast_to_the_input_projection(tiny_config):
    """f64 observations into an f32 model with an input projection: cast, as without one
    (nn.Linear raised 'mat1 and mat2 must have the same dtype')."""
    torch.manual_seed(0)
    bb = MambaBackbone(tiny_config(d_model=16, n_layers=1, input_dim=5)).eval()
    x = torch.randn(2, 4, 5)
    with torch.no_grad():
        want, _ = bb(x)
        got, _ = bb(x.double())
        step, _ = bb.step(x[:, 0].double(), bb.init_state(2))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(step, want[:, 0], rtol=1e-5, atol=1e-6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # never casts a float64
        want, _ = bb(x)
        got, _ = bb(x.double())
    torch.testing.assert_close(got, want)


def test_clone_is_independent():
    s = MambaState(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 4, 5))
    c = s.clone()
    torch.testing.assert_close(c.conv, s.conv)
    torch.testing.assert_close(c.ssm, s.ssm)
    c.conv.zero_()
    c.ssm.zero_()
    assert s.conv.abs().sum() > 0 and s.ssm.abs().sum() > 0


def test_to_dtype():
    s = MambaState(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 3, 2))
    d = s.to(torch.float64)
    assert d.conv.dtype == torch.float64 and d.ssm.dtype == torch.float64
    torch.testing.assert_close(d.ssm.float(), s.ssm)


def test_reset_zeros_only_masked_rows_in_place():
    s = MambaState(torch.randn(2, 4, 2, 3) + 5, torch.randn(2, 4, 3, 2) + 5)
    before = s.clone()
    ptrs = (s.conv.data_ptr(), s.ssm.data_ptr())
    mask = torch.tensor([True, False, False, True])
    out = s.reset_(mask)
    assert out is s
    assert (s.conv.data_ptr(), s.ssm.data_ptr()) == ptrs
    for b in range(4):
        if mask[b]:
            assert s.conv[:, b].eq(0).all() and s.ssm[:, b].eq(0).all()
        else:
            torch.testing.assert_close(s.conv[:, b], before.conv[:, b], rtol=0, atol=0)
            torch.testing.assert_close(s.ssm[:, b], before.ssm[:, b], rtol=0, atol=0)
    with pytest.raises(ValueError, match="mask"):
        s.reset_(torch.tensor([True, False]))


def test_reset_with_grad_keeps_gradient_of_unmasked_rows():
    conv = torch.randn(1, 3, 1, 2, requires_grad=True)
    ssm = torch.randn(1, 3, 2, 2, requires_grad=True)
    s = MambaState(conv * 1.0, ssm * 1.0)
    s.reset_(torch.tensor([False, True, False]))
    (s.conv.sum() + s.ssm.sum()).backward()
    assert conv.grad[:, 1].eq(0).all() and ssm.grad[:, 1].eq(0).all()
    assert conv.grad[:, [0, 2]].eq(1).all() and ssm.grad[:, [0, 2]].eq(1).all()


def test_detach_cuts_the_graph(seed, tiny_config):
    model = MambaLM(tiny_config())
    ids = torch.randint(0, 24, (2, 6))
    out = model(ids)
    assert out.state.ssm.requires_grad and out.state.conv.requires_grad
    d = out.state.detach()
    assert not d.ssm.requires_grad and not d.conv.requires_grad
    torch.testing.assert_close(d.ssm, out.state.ssm.detach(), rtol=0, atol=0)

    # a loss on the next chunk fed with the detached state: gradients come from that
    # chunk alone, the same as when the state is a fresh constant tensor
    ids2 = torch.randint(0, 24, (2, 5))
    model.zero_grad()
    model(ids2, state=d).logits.pow(2).sum().backward()
    g_detached = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    const = MambaState(out.state.conv.detach().clone(), out.state.ssm.detach().clone())
    model(ids2, state=const).logits.pow(2).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(g_detached[k], p.grad, rtol=0, atol=0, msg=k)

    # without detaching, the first chunk's weights see the second chunk's loss
    model.zero_grad()
    out = model(ids)
    model(ids2, state=out.state).logits.pow(2).sum().backward()
    differs = [k for k, p in model.named_parameters() if not torch.allclose(p.grad, g_detached[k])]
    assert differs


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "mamba3"])
def test_a_saved_state_loads_with_weights_only_and_carries_on(tmp_path, tiny_config, mixer):
    """torch.save of a model state (a prompt's prefix, an RL episode's) and torch.load with
    weights_only=True (torch's default from 2.6): the same class and tensors, and the
    sequence carried on from the loaded state equals the full forward. Layer states
    (`state.layer(i)`) load too. (The classes were not allowed: UnpicklingError.)"""
    kw = {} if mixer == "mamba1" else dict(headdim=8, d_state=8)
    torch.manual_seed(0)
    model = MambaLM(tiny_config(d_model=16, mixer=mixer, **kw)).eval()
    ids = torch.randint(0, 24, (2, 7))
    with torch.no_grad():
        full = model(ids).logits
        state = model(ids[:, :4]).state
    torch.save({"state": state, "layer": state.layer(1)}, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    got = loaded["state"]
    assert type(got) is type(state) and type(loaded["layer"]) is type(state.layer(1))
    for a, b in zip(got._tensors(), state._tensors()):
        assert torch.equal(a, b)
    for a, b in zip(loaded["layer"], state.layer(1)):
        assert torch.equal(a, b)
    with torch.no_grad():
        rest = model(ids[:, 4:], state=got).logits
    torch.testing.assert_close(rest, full[:, 4:], rtol=1e-5, atol=1e-6)


def test_bad_reset_masks_and_batch_sizes_are_refused_naming_the_argument(tiny_config):
    """reset_ with a list (AttributeError: 'list' object has no attribute 'dim') and
    init_state(True) (a state of one row) are refused, naming the argument."""
    s = MambaState(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 4, 5))
    with pytest.raises(TypeError, match="reset_ mask must be a tensor"):
        s.reset_([True, False, True])
    model = MambaLM(tiny_config())
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        model.init_state(True)
