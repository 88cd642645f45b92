"""MambaBackbone on float inputs (with and without input_dim): the same invariances as
the LM, plus the structure of the block (pre-norm residual) and the init rescale."""

from __future__ import annotations

import math

import pytest
import torch

from mambakit import MambaBackbone, MambaConfig, MambaState

CASES = [(torch.float64, None), (torch.float64, 7), (torch.float32, None), (torch.float32, 7)]
CASE_IDS = ["f64-d_model", "f64-input_dim7", "f32-d_model", "f32-input_dim7"]


def tol(dtype):
    if dtype == torch.float64:
        return dict(rtol=1e-9, atol=1e-10)
    return dict(rtol=2e-4, atol=2e-5)


def make(tiny_config, randomize, dtype, input_dim, **kw):
    bb = randomize(MambaBackbone(tiny_config(input_dim=input_dim, **kw)))
    return bb.to(dtype)


def inputs(input_dim, b, t, dtype):
    return torch.randn(b, t, input_dim or 12, dtype=dtype)  # tiny_config has d_model 12


def random_state(bb, batch):
    s = bb.init_state(batch)
    return MambaState(torch.randn_like(s.conv), torch.randn_like(s.ssm) * 0.5)


def assert_state_close(a, b, **t):
    torch.testing.assert_close(a.conv, b.conv, **t)
    torch.testing.assert_close(a.ssm, b.ssm, **t)


def test_shapes_and_input_proj(tiny_config):
    bb = MambaBackbone(tiny_config(input_dim=5))
    x = torch.randn(2, 6, 5)
    hidden, state = bb(x)
    assert hidden.shape == (2, 6, 12) and hidden.dtype == torch.float32
    assert isinstance(state, MambaState) and state.ssm.shape == (2, 2, 24, 3)
    assert bb.input_proj.weight.shape == (12, 5)
    plain = MambaBackbone(tiny_config())
    hidden, _ = plain(torch.randn(2, 6, 12))
    assert hidden.shape == (2, 6, 12)
    assert getattr(plain, "input_proj", None) is None or isinstance(
        plain.input_proj, torch.nn.Identity
    )


def test_block_structure_matches_design(seed, tiny_config, randomize):
    """r_{l+1} = r_l + mixer_l(rmsnorm_l(r_l)); out = rmsnorm_f(r_L), built from the parts."""
    bb = make(tiny_config, randomize, torch.float64, None)
    x = torch.randn(2, 5, 12, dtype=torch.float64)

    def rms(v, w, eps):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    eps = 1e-5
    r = x
    for layer in bb.layers:
        r = r + layer.mixer(rms(r, layer.norm.weight, eps))
    ref = rms(r, bb.norm_f.weight, eps)
    hidden, _ = bb(x)
    torch.testing.assert_close(hidden, ref, rtol=1e-10, atol=1e-12)


def test_out_proj_residual_rescale(seed):
    """mamba_ssm init: out_proj ~ kaiming-uniform bound 1/sqrt(fan_in), scaled by 1/sqrt(L)."""
    from mambakit import MambaConfig

    cfg = MambaConfig(d_model=64, n_layers=9, vocab_size=16)
    bb = MambaBackbone(cfg)
    w = bb.layers[0].mixer.out_proj.weight
    bound = 1 / math.sqrt(128) / math.sqrt(9)
    assert w.abs().max() <= bound * (1 + 1e-5)
    assert w.abs().max() >= 0.9 * bound
    no = MambaBackbone(
        MambaConfig(d_model=64, n_layers=9, vocab_size=16, rescale_prenorm_residual=False)
    )
    assert no.layers[0].mixer.out_proj.weight.abs().max() >= 0.9 * bound * 3


@pytest.mark.parametrize("dtype, input_dim", CASES, ids=CASE_IDS)
def test_chunks_equal_full_sequence(seed, tiny_config, randomize, dtype, input_dim):
    bb = make(tiny_config, randomize, dtype, input_dim, d_conv=4)
    x = inputs(input_dim, 2, 12, dtype)
    s0 = random_state(bb, 2)
    w = torch.randn(2, 12, 12, dtype=dtype)
    wc, ws = torch.randn_like(s0.conv), torch.randn_like(s0.ssm)

    bb.zero_grad()
    full, full_state = bb(x, state=s0.clone())
    ((full * w).sum() + (full_state.conv * wc).sum() + (full_state.ssm * ws).sum()).backward()
    g_full = {k: p.grad.clone() for k, p in bb.named_parameters()}

    bb.zero_grad()
    state, outs = s0.clone(), []
    for a, b in [(0, 4), (4, 5), (5, 12)]:
        h, state = bb(x[:, a:b], state=state)
        outs.append(h)
    hidden = torch.cat(outs, dim=1)
    ((hidden * w).sum() + (state.conv * wc).sum() + (state.ssm * ws).sum()).backward()

    torch.testing.assert_close(hidden, full, **tol(dtype))
    assert_state_close(state, full_state, **tol(dtype))
    gt = dict(rtol=1e-8, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-3, atol=1e-4)
    for k, p in bb.named_parameters():
        torch.testing.assert_close(p.grad, g_full[k], **gt, msg=k)


@pytest.mark.parametrize("dtype, input_dim", CASES, ids=CASE_IDS)
def test_step_equals_forward(seed, tiny_config, randomize, dtype, input_dim):
    bb = make(tiny_config, randomize, dtype, input_dim)
    x = inputs(input_dim, 3, 7, dtype)
    s0 = random_state(bb, 3)
    with torch.no_grad():
        full, full_state = bb(x, state=s0.clone())
        state, outs = s0.clone(), []
        ptr = state.ssm.data_ptr()
        for t in range(7):
            h, state = bb.step(x[:, t], state)
            assert h.shape == (3, 12)
            outs.append(h)
        assert state.ssm.data_ptr() == ptr
    torch.testing.assert_close(torch.stack(outs, dim=1), full, **tol(dtype))
    assert_state_close(state, full_state, **tol(dtype))


@pytest.mark.parametrize("dtype, input_dim", CASES, ids=CASE_IDS)
def test_seq_idx_packing_equals_documents_one_by_one(
    seed, tiny_config, randomize, dtype, input_dim
):
    bb = make(tiny_config, randomize, dtype, input_dim, d_conv=4)
    lens = [[2, 5, 3], [10]]
    x = inputs(input_dim, 2, 10, dtype)
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 2, 2, 2], [4] * 10], dtype=torch.int32)
    s0 = random_state(bb, 2)
    with torch.no_grad():
        packed, packed_state = bb(x, state=s0.clone(), seq_idx=seq_idx)
        for r, row in enumerate(lens):
            start = 0
            for j, n in enumerate(row):
                rs = None
                if j == 0:
                    rs = MambaState(s0.conv[:, r : r + 1].clone(), s0.ssm[:, r : r + 1].clone())
                h, st = bb(x[r : r + 1, start : start + n], state=rs)
                torch.testing.assert_close(packed[r : r + 1, start : start + n], h, **tol(dtype))
                start += n
            torch.testing.assert_close(packed_state.ssm[:, r : r + 1], st.ssm, **tol(dtype))
            torch.testing.assert_close(packed_state.conv[:, r : r + 1], st.conv, **tol(dtype))


@pytest.mark.parametrize("dtype, input_dim", CASES, ids=CASE_IDS)
def test_row_alone_equals_row_in_batch(seed, tiny_config, randomize, dtype, input_dim):
    bb = make(tiny_config, randomize, dtype, input_dim)
    x = inputs(input_dim, 3, 6, dtype)
    s0 = random_state(bb, 3)
    with torch.no_grad():
        batch, bstate = bb(x, state=s0.clone())
        for r in range(3):
            rs = MambaState(s0.conv[:, r : r + 1].clone(), s0.ssm[:, r : r + 1].clone())
            h, st = bb(x[r : r + 1], state=rs)
            torch.testing.assert_close(batch[r : r + 1], h, **tol(dtype))
            torch.testing.assert_close(bstate.ssm[:, r : r + 1], st.ssm, **tol(dtype))


def test_reset_between_episodes_equals_fresh_start(seed, tiny_config, randomize):
    """RL use: reset_(done) before the next step == that row starting from zeros."""
    bb = make(tiny_config, randomize, torch.float64, 7)
    x = inputs(7, 3, 6, torch.float64)
    with torch.no_grad():
        _, state = bb(x[:, :4])
        state.reset_(torch.tensor([False, True, False]))
        h, state = bb.step(x[:, 4], state)
        fresh, _ = bb(x[1:2, 4:5])
        torch.testing.assert_close(h[1:2], fresh[:, 0], rtol=1e-9, atol=1e-10)
        cont, _ = bb(x[0:1, :5])
        torch.testing.assert_close(h[0:1], cont[:, 4], rtol=1e-9, atol=1e-10)


def test_gradcheck_backbone_wrt_state_input_and_parameter(seed, tiny_config, randomize):
    cfg = dict(d_model=4, n_layers=2, d_state=2, d_conv=2, expand=1)
    bb = make(tiny_config, randomize, torch.float64, 3, **cfg)
    x = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    s = random_state(bb, 2)
    conv0 = s.conv.clone().requires_grad_(True)
    ssm0 = s.ssm.clone().requires_grad_(True)
    name = "layers.1.mixer.A_log"
    a_log = dict(bb.named_parameters())[name].detach().clone().requires_grad_(True)

    def f(x, conv0, ssm0, a_log):
        h, st = torch.func.functional_call(
            bb, {name: a_log}, (x,), dict(state=MambaState(conv0, ssm0))
        )
        return h, st.conv, st.ssm

    assert torch.autograd.gradcheck(f, (x, conv0, ssm0, a_log), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("mixer", ["mamba1", "mamba3"])
def test_forward_and_step_with_a_state_trace_whole(seed, mixer):
    """torch.compile(fullgraph=True) traces a forward and a step that take a state (the
    state's checks and field reads included): no graph break, the values of the eager
    calls."""
    kw = {} if mixer == "mamba1" else dict(headdim=4, d_state=8)
    bb = MambaBackbone(MambaConfig(d_model=16, n_layers=2, input_dim=6, mixer=mixer, **kw))
    x = torch.randn(2, 5, 6)
    s0 = bb.init_state(2)
    for t in s0._tensors():
        t.normal_()
    forward = torch.compile(lambda x, s: bb(x, s), backend="eager", fullgraph=True)
    step = torch.compile(lambda x, s: bb.step(x, s, cuda_graph=False), backend="eager",
                         fullgraph=True)  # fmt: skip
    with torch.no_grad():
        out, s1 = forward(x, s0.clone())
        want, w1 = bb(x, s0.clone())
        torch.testing.assert_close(out, want)
        s, w = s0.clone(), s0.clone()
        got_step = step(x[:, 0], s)[0]
        want_step = bb.step(x[:, 0], w, cuda_graph=False)[0]
    torch.testing.assert_close(got_step, want_step)
    for a, b in zip((*s1._tensors(), *s._tensors()), (*w1._tensors(), *w._tensors())):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("when", ["swapped in", "given after steps"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "mamba3"])
def test_a_projection_given_a_bias_is_in_the_step(mixer, dtype, when, compiled, numba_on):
    """A bias on a mixer's in_proj and out_proj (which the fused steps read without one):
    a plain nn.Linear with one put in their place, or a bias given to the model's own
    projections after it has stepped (its decode plans made without one). The step, the
    compiled CPU one or the PyTorch bodies', still computes what the modules say: the
    forward over that one step (the same model's)."""
    numba_on(compiled)
    torch.manual_seed(0)
    kw = {} if mixer == "mamba1" else {"headdim": 8}
    cfg = MambaConfig(d_model=32, n_layers=2, input_dim=6, mixer=mixer, d_state=8, **kw)
    model = MambaBackbone(cfg).to(dtype)
    x = torch.randn(3, 1, 6, dtype=dtype)
    if when == "given after steps":
        with torch.no_grad():
            for _ in range(3):
                model.step(x[:, 0], model.init_state(3))
    for block in model.layers:
        for name in ("in_proj", "out_proj"):
            old = getattr(block.mixer, name)
            if when == "given after steps":
                old.bias = torch.nn.Parameter(torch.randn(old.out_features, dtype=dtype))
                continue
            new = torch.nn.Linear(old.in_features, old.out_features, dtype=dtype)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.normal_()
            setattr(block.mixer, name, new)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        want, want_state = model(x, model.init_state(3))
        got, got_state = model.step(x[:, 0], model.init_state(3))
    torch.testing.assert_close(got, want[:, 0], **tol)
    for a, b in zip(got_state._tensors(), want_state._tensors()):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "mamba3"])
def test_f32_input_into_a_float64_model_without_input_proj_runs_in_float64(
    seed, tiny_config, mixer
):
    """Without input_proj, x went into the first block as it came: f32 observations into a
    float64 model ran the first norm in f32 (5e-8 off the f64 result), f64 ones into an f32
    model kept the residual stream in f64. x is cast to the model's dtype, as with one."""
    kw = dict(mixer=mixer, headdim=4, chunk_size=4, d_state=8) if mixer != "mamba1" else {}
    bb = MambaBackbone(tiny_config(**kw)).double()
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        want, want_state = bb(x.double())
        got, state = bb(x)
        step, _ = bb.step(x[:, 0], bb.init_state(2))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    for a, b in zip(state._tensors(), want_state._tensors()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(step, want[:, 0], rtol=1e-12, atol=1e-13)
