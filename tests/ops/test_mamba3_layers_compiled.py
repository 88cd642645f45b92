"""The compiled stack of Mamba-3 blocks (`ops.mamba3.layers_compiled`): a training window's
forward and backward on the CPU as one autograd node. Its oracle is the blocks called one
by one (each tested against the float64 reference: test_mamba3.py, test_cpu_jit_scan3.py),
which it must match bit for bit, values and gradients, and float64 gradcheck; wherever a
block is not plain the model must call the blocks instead."""

import pytest
import torch
from torch import nn

import mambakit.backbone as backbone_module
from mambakit import MambaBackbone, MambaConfig

pytest.importorskip("numba")


def backbone(dtype=torch.float32, seed=0, **kw) -> MambaBackbone:
    torch.manual_seed(seed)
    cfg = dict(d_model=32, n_layers=3, input_dim=6, mixer="mamba3", d_state=8, headdim=8,
               ngroups=2)  # fmt: skip
    model = MambaBackbone(MambaConfig(**{**cfg, **kw})).to(dtype)
    with torch.no_grad():  # off the initial values (norms' and B/C biases' ones, D's ones)
        for p in model.parameters():
            if p.dim() != 2:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture
def calls(monkeypatch):
    """The compiled stack's calls, counted."""
    got = []
    real = backbone_module.mamba3_layers_compiled
    monkeypatch.setattr(
        backbone_module, "mamba3_layers_compiled", lambda *a: got.append(1) or real(*a)
    )
    return got


def window(model, x, state, blocks: bool = False, monkeypatch=None):
    """(out, final state fields, the gradients of the parameters, x and the start state)
    of one window with a loss on the output and the final state; `blocks`: the blocks
    called one by one (the compiled stack turned off)."""
    if blocks:
        with monkeypatch.context() as m:
            m.setattr(MambaBackbone, "_window", lambda *a: (None, None))
            out, final = model(x, state)
    else:
        out, final = model(x, state)
    loss = (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).square().sum()
    for t in final._tensors():  # the state carried on (its gradient reaches the start state)
        loss = loss + (t * torch.linspace(0, 1, t.numel(), dtype=t.dtype).view_as(t)).sum()
    leaves = [*model.parameters(), x, *state._tensors()]
    grads = torch.autograd.grad(loss, leaves)
    return out.detach(), [t.detach() for t in final._tensors()], grads


def inputs(model, B=2, T=9, dtype=torch.float32):
    torch.manual_seed(1)
    x = torch.randn(B, T, model.config.input_dim, dtype=dtype, requires_grad=True)
    state = model.init_state(B)
    fields = (0.5 * torch.randn_like(t) for t in state._tensors())
    return x, type(state)(*(t.requires_grad_() for t in fields))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_window_equals_the_blocks_bit_for_bit(dtype, calls, monkeypatch):
    model = backbone(dtype)
    x, state = inputs(model, dtype=dtype)
    got = window(model, x, state)
    assert calls == [1]
    want = window(model, x, state, blocks=True, monkeypatch=monkeypatch)
    assert calls == [1]
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert len(got[2]) == len(want[2]) == len(list(model.parameters())) + 5
    for a, b in zip(got[2], want[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hooked", ["input_proj", "norm_f", "both"])
def test_a_hooked_input_proj_or_norm_f_is_called_around_the_node(hooked, calls, monkeypatch):
    """The blocks still run as one node; the hooked projection or norm runs as a module
    around it (its hook sees it), the values and gradients those of the modules."""
    model = backbone()
    x, state = inputs(model)
    want = window(model, x, state, blocks=True, monkeypatch=monkeypatch)
    seen = []
    for name in ("input_proj", "norm_f"):
        if hooked in (name, "both"):
            getattr(model, name).register_forward_hook(lambda *a, n=name: seen.append(n))
    got = window(model, x, state)
    assert calls == [1] and len(seen) == 1 + (hooked == "both")
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[2], want[2]):
        assert torch.equal(a, b)


def test_lm_window_equals_the_blocks(calls, monkeypatch):
    """A language model's window (embeddings called, then the node): logits and gradients
    as the modules give them."""
    from mambakit import MambaLM

    torch.manual_seed(0)
    cfg = MambaConfig(d_model=32, n_layers=2, vocab_size=40, pad_vocab_size_multiple=1,
                      mixer="mamba3", d_state=8, headdim=8)  # fmt: skip
    lm = MambaLM(cfg)
    ids = torch.randint(0, 40, (2, 11))

    def run():
        logits = lm(ids).logits
        grads = torch.autograd.grad(logits.square().mean(), list(lm.parameters()))
        return logits.detach(), grads

    got = run()
    assert calls == [1]
    monkeypatch.setattr(MambaBackbone, "_window", lambda *a: (None, None))
    want = run()
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_window_from_a_zero_state_equals_the_blocks(calls, monkeypatch):
    model = backbone()
    x = torch.randn(3, 7, 6)
    out, final = model(x)
    assert calls == [1]
    monkeypatch.setattr(MambaBackbone, "_window", lambda *a: (None, None))
    want, want_final = model(x)
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(final._tensors(), want_final._tensors()))


def test_window_gradcheck_float64(calls):
    """Gradients of the output and the final state in the input, the start state and the
    weights (through `torch.func.functional_call`, still plain tensors) against finite
    differences."""
    model = backbone(torch.float64, d_model=16, n_layers=2)
    x, state = inputs(model, B=1, T=5, dtype=torch.float64)
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]

    def f(x, *tensors):
        fields, weights = tensors[:4], tensors[4:]
        st = type(state)(*fields)
        out, final = torch.func.functional_call(model, dict(zip(names, weights)), (x, st))
        return out, *final._tensors()

    leaves = (x, *state._tensors(), *params)
    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)
    assert calls  # the compiled stack ran


CHANGES = ["hook on a mixer", "hook on a block", "in_proj subclass", "in_proj bias",
           "parametrized norm"]  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
def test_a_block_not_plain_is_called(change, calls, monkeypatch):
    """A hook, an adapter-like module, a bias the node would ignore or a parametrization
    anywhere in the stack: the blocks run as modules (the hook sees them), the same values
    as the untouched model where the change computes the same."""
    model = backbone()
    x, state = inputs(model)
    want = window(model, x, state)
    assert calls == [1]
    seen = []
    block = model.layers[1]
    if change == "hook on a mixer":
        block.mixer.register_forward_hook(lambda *a: seen.append(1))
    elif change == "hook on a block":
        block.register_forward_pre_hook(lambda *a: seen.append(1))
    elif change == "in_proj subclass":

        class Wrapped(nn.Linear):
            def forward(self, u):
                seen.append(1)
                return super().forward(u)

        old = block.mixer.in_proj
        new = Wrapped(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        block.mixer.in_proj = new
    elif change == "in_proj bias":
        old = block.mixer.in_proj
        block.mixer.in_proj = nn.Linear(old.in_features, old.out_features)
        with torch.no_grad():
            block.mixer.in_proj.weight.copy_(old.weight)
            block.mixer.in_proj.bias.zero_()
        seen.append(1)
    else:

        class Same(nn.Module):
            def forward(self, w):
                seen.append(1)
                return w

        nn.utils.parametrize.register_parametrization(block.norm, "weight", Same())
    got = window(model, x, state)
    assert calls == [1] and seen
    assert torch.equal(got[0], want[0])
    if change != "in_proj bias":  # (a new weight: its gradient is the old one's, elsewhere)
        for a, b in zip(got[2][-5:], want[2][-5:]):  # the input's and the state's
            assert torch.equal(a, b)


def test_no_recorded_gradient_runs_the_blocks(calls):
    model = backbone()
    x = torch.randn(2, 5, 6)
    with torch.no_grad():
        model(x)
    model.requires_grad_(False)
    model(x)  # grad mode on, nothing requiring grad
    model(x, seq_idx=torch.zeros(2, 5, dtype=torch.int32))
    assert calls == []


def test_a_weight_changed_before_the_backward_raises(calls):
    model = backbone()
    out, _ = model(torch.randn(1, 4, 6))
    assert calls == [1]
    with torch.no_grad():
        model.layers[0].mixer.dt_bias.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("changed", ["x", "state"])
def test_an_input_changed_before_the_backward_raises(changed, calls):
    """As through the modules (which save them): the node's input and start state are
    checked for in-place changes when its backward runs."""
    model = backbone()
    x, state = inputs(model)
    out, _ = model(x.detach(), state)
    assert calls == [1]
    with torch.no_grad():
        (x if changed == "x" else state.k).zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_loss_on_the_final_state_alone_leaves_unused_weights_without_gradient(calls, monkeypatch):
    """norm_f's weight and the last block's out_proj take no part in the final state: None
    for their gradients, as through the modules, the rest equal bit for bit."""
    model = backbone()
    x, state = inputs(model)
    params = list(model.parameters())

    def grads():
        _, final = model(x, state)
        loss = sum((t * t).sum() for t in final._tensors())
        return torch.autograd.grad(loss, params, allow_unused=True)

    got = grads()
    assert calls == [1]
    monkeypatch.setattr(MambaBackbone, "_window", lambda *a: (None, None))
    want = grads()
    names = [n for n, _ in model.named_parameters()]
    none = {n for n, g in zip(names, want) if g is None}
    assert none == {"norm_f.weight", "layers.2.mixer.out_proj.weight"}
    for n, a, b in zip(names, got, want):
        assert (a is None and b is None) or torch.equal(a, b), n


def test_a_block_subclass_a_wrapper_or_a_mixed_dtype_state_runs_the_modules(calls):
    model = backbone()
    x, state = inputs(model)

    class Scaled(type(model.layers[0])):
        def forward(self, *args, **kw):
            out, *rest = super().forward(*args, **kw)
            return (2 * out, *rest)

    model.layers[1].__class__ = Scaled
    model(x, state)
    model.layers[1].__class__ = Scaled.__mro__[1]

    class Wrapper(nn.Module):  # (as torch's checkpoint wrapper, which forwards attributes)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

        def forward(self, *args, **kw):
            return self.inner(*args, **kw)

    inner = model.layers[2]
    model.layers[2] = Wrapper(inner)
    model(x, state)
    model.layers[2] = inner
    mixed = type(state)(state.angle.double(), state.ssm, state.k, state.x)
    model(x, mixed)
    assert calls == []
    model(x, state)
    assert calls == [1]


def test_a_backbone_subclass_embed_is_called(calls):
    model = backbone()
    seen = []

    class Mine(MambaBackbone):
        def embed(self, x):
            seen.append(1)
            return super().embed(x)

    model.__class__ = Mine
    model(*inputs(model))
    assert calls == [1] and seen == [1]


def test_no_grad_forward_is_the_training_forward_bit_for_bit(calls):
    """An RL policy acts under no_grad and recomputes its log-probs with grad: the two
    forwards give the same values."""
    model = backbone()
    x, state = inputs(model, B=4, T=32)
    with torch.no_grad():
        want, want_final = model(x, state)
    got, final = model(x, state)
    assert calls == [1]
    assert torch.equal(got.detach(), want)
    assert all(torch.equal(a.detach(), b) for a, b in zip(final._tensors(), want_final._tensors()))


def test_the_window_runs_on_torchs_thread_count(calls, monkeypatch):
    """A window of 4 tokens (B x T = 1 x 4, less than any share of work per thread) with
    torch at 2 threads: every compiled scan call, forward and backward, runs on 2 numba
    threads, torch's count, never fewer; torch's count is left as it was."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here")
    from mambakit.ops.cpu_jit import scan3

    seen = []
    for name in ("_forward", "_backward"):  # the parallel kernels, entered under threads()
        kernel = getattr(scan3, name)

        def spy(*a, kernel=kernel):
            seen.append((numba.get_num_threads(), torch.get_num_threads()))
            return kernel(*a)

        monkeypatch.setattr(scan3, name, spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        numba.set_num_threads(1)  # so that a call left at numba's last count would show
        model = backbone()
        x, state = inputs(model, B=1, T=4)
        window(model, x, state)
        assert calls == [1]
        assert seen == [(2, 2)] * 6  # 3 blocks, forward and backward, inside each call
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
