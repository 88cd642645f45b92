"""The Mamba-2 mixer layer against a plain-PyTorch oracle, and its invariances on both
backends (the reference; Triton through the interpreter on a CPU, at tiny sizes).

B batch, T time, M d_model, E = d_inner, H heads of P = headdim, G ngroups, N d_state,
K d_conv, C = conv_dim = d_ssm + 2 G N. The oracle (`oracle` below) is written from
mamba_ssm's `Mamba2.forward` in float64 without any mambakit op: in_proj, the depthwise conv
as `F.conv1d` over [conv state; xBC], silu, the split, softplus and the dt clamp, a loop
over time of h = exp(delta A) h + delta x B^T, y = h C + D x, the gated RMSNorm over groups
written out, the gated MLP part, out_proj. Every option of the layer (d_ssm < d_inner,
D_has_hdim, rmsnorm=False, norm_before_gate=True, ngroups 2, a finite dt_limit, biases) is
checked against it in values, final state and every gradient; peft's LoRA on in_proj and
out_proj and a forward hook on conv1d against the oracle run on the adapted modules.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from mambakit import Mamba2, Mamba2State

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"]  # triton: the interpreter on a CPU


# the layers of the tests: float64 on the reference; f32 and smaller on Triton, whose
# interpreter runs every program in Python (H 2, C 16 + 2 G 4)
SIZES = {
    "reference": dict(d_model=16, d_state=8, headdim=8),
    "triton": dict(d_model=8, d_state=4, headdim=8),
}
DTYPES = {"reference": torch.float64, "triton": torch.float32}


def layer(dtype=torch.float64, seed=0, **kw) -> Mamba2:
    """A tiny layer whose every parameter is off its initial value (D = norm weight = 1,
    conv bias 0 would hide a dropped or swapped term)."""
    torch.manual_seed(seed)
    cfg = dict(d_model=16, d_state=8, d_conv=4, expand=2, headdim=8, chunk_size=4)
    m = Mamba2(**{**cfg, **kw})
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name in ("D", "norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
            elif name == "A_log":
                p.copy_(torch.randn_like(p) * 0.5)  # A in about [-3, -0.4]
            elif name == "dt_bias":
                p.copy_(torch.randn_like(p) * 0.5 - 1.5)
            else:
                p.add_(0.1 * torch.randn_like(p))
    return m.to(DEVICE, dtype)


def layer_for(backend: str, **kw) -> Mamba2:
    return layer(DTYPES[backend], **{**SIZES[backend], **kw})


def close(backend: str) -> dict:
    """assert_close tolerances of a comparison of two runs of one backend."""
    return dict(rtol=1e-10, atol=1e-10) if backend == "reference" else dict(rtol=1e-5, atol=1e-5)


def inputs(m: Mamba2, *shape) -> torch.Tensor:
    return torch.randn(*shape, m.d_model, dtype=m.in_proj.weight.dtype, device=DEVICE)


def random_state(m: Mamba2, batch: int, seed: int = 1) -> Mamba2State:
    g = torch.Generator().manual_seed(seed)
    st = m.init_state(batch)
    return Mamba2State(*(torch.randn(t.shape, generator=g).to(t) * 0.5 for t in st))


def oracle(m: Mamba2, u, state=None, in_proj=None, conv=None, out_proj=None):
    """(out [B, T, M], Mamba2State) of mamba_ssm's Mamba2 forward in float64, from `m`'s
    parameters; in_proj, conv (the pre-activation conv of a window [B, K-1+T, C] -> [B, T,
    C]) and out_proj default to F.linear / F.conv1d on the weights."""

    def w(p):
        return None if p is None else p.double()

    H, P, G, N, K = m.nheads, m.headdim, m.ngroups, m.d_state, m.d_conv
    d_ssm, Cd = m.d_ssm, m.conv_dim
    d_mlp = m.d_inner - d_ssm  # mamba_ssm: (in_proj rows - 2 d_ssm - 2 G N - H) / 2
    u = u.double()
    Bsz, T, _ = u.shape
    if in_proj is None:
        in_proj = lambda t: F.linear(t, w(m.in_proj.weight), w(m.in_proj.bias))
    if out_proj is None:
        out_proj = lambda t: F.linear(t, w(m.out_proj.weight), w(m.out_proj.bias))
    if conv is None:
        conv = lambda x: F.conv1d(x.mT, w(m.conv1d.weight), w(m.conv1d.bias), groups=Cd).mT
    z0, x0, z, xBC, dt = torch.split(in_proj(u), [d_mlp, d_mlp, d_ssm, Cd, H], dim=-1)
    if state is None:
        state = Mamba2State(u.new_zeros(Bsz, K - 1, Cd), u.new_zeros(Bsz, H, P, N))
    window = torch.cat([state.conv.double(), xBC], dim=1)  # [B, K-1+T, C]
    xBC = F.silu(conv(window))
    x, Bm, Cm = torch.split(xBC, [d_ssm, G * N, G * N], dim=-1)
    x = x.reshape(Bsz, T, H, P)
    Bm = Bm.reshape(Bsz, T, G, N).repeat_interleave(H // G, dim=2)  # head h reads group h // (H/G)
    Cm = Cm.reshape(Bsz, T, G, N).repeat_interleave(H // G, dim=2)
    delta = F.softplus(dt + m.dt_bias.double())  # [B, T, H]
    if tuple(m.dt_limit) != (0.0, math.inf):
        delta = delta.clamp(*m.dt_limit)
    A = -torch.exp(m.A_log.double())
    D = m.D.double().reshape(H, P) if m.D_has_hdim else m.D.double()[:, None]
    h = state.ssm.double()
    ys = []
    for t in range(T):
        a = torch.exp(delta[:, t] * A)  # [B, H]
        dx = delta[:, t, :, None] * x[:, t]  # [B, H, P]
        h = a[..., None, None] * h + dx[..., None] * Bm[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Cm[:, t]) + D * x[:, t])
    y = torch.stack(ys, dim=1).reshape(Bsz, T, d_ssm)
    gate = F.silu(z)
    if not m.rmsnorm:
        y = y * gate
    else:  # RMSNormGated over G groups of d_ssm / G channels, eps 1e-5
        v = y if m.norm_before_gate else y * gate
        v = v.reshape(Bsz, T, G, d_ssm // G)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)
        y = v.reshape(Bsz, T, d_ssm) * m.norm.weight.double()
        if m.norm_before_gate:
            y = y * gate
    if d_mlp:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return out_proj(y), Mamba2State(window[:, T:], h)


def rel(got, want) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def run(fn, m, u, state, cot):
    """(out, final state, {name: gradient}) of <out, cot> + <final, 1>: every trained
    parameter's, the input's (u) and the initial state's fields' (state.conv, state.ssm)."""
    m.zero_grad(set_to_none=True)
    u = u.detach().clone().requires_grad_()
    st = Mamba2State(*(t.detach().clone().requires_grad_() for t in state))
    out, final = fn(u, st)
    ((out.double() * cot.double()).sum() + sum(t.double().sum() for t in final)).backward()
    grads = {f"param {k}": p.grad for k, p in m.named_parameters() if p.requires_grad}
    grads.update({"u": u.grad, "state.conv": st.conv.grad, "state.ssm": st.ssm.grad})
    return out.detach(), Mamba2State(*(t.detach() for t in final)), grads


def compare_with_oracle(m, m64, u, state, limit, backend="reference", **oracle_kw):
    """`m` (on `backend`) against the oracle on `m64`'s parameters (float64): out, final
    state and every gradient, each within `limit` relative error."""
    cot = torch.randn(u.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cot = cot.to(u.device)
    got = run(lambda x, s: m(x, s, return_state=True, backend=backend), m, u, state, cot.to(u))
    want = run(lambda x, s: oracle(m64, x, s, **oracle_kw), m64, u.double(),
               Mamba2State(*(t.double() for t in state)), cot)  # fmt: skip
    errs = {"out": rel(got[0], want[0]), "state.conv": rel(got[1].conv, want[1].conv),
            "state.ssm": rel(got[1].ssm, want[1].ssm)}  # fmt: skip
    assert got[2].keys() == want[2].keys()
    for k, g in want[2].items():
        assert g is not None and got[2][k] is not None, f"{k} got no gradient"
        assert g.abs().sum() > 0, f"{k}: the oracle's gradient is zero (a dead test)"
        errs[k] = rel(got[2][k], g)
    bad = {k: f"{e:.1e}" for k, e in errs.items() if not e < limit}
    assert not bad, bad


OPTIONS = {
    "default": {},
    "d_ssm-mlp": dict(d_ssm=16),  # 2 heads on 16 of the 32 channels, a gated MLP on 16
    "D_has_hdim": dict(D_has_hdim=True),
    "no-rmsnorm": dict(rmsnorm=False),  # the gate inside the scan
    "norm_before_gate": dict(norm_before_gate=True),
    "ngroups2": dict(ngroups=2),
    "dt_limit": dict(dt_limit=(0.05, 0.3)),
    "bias-no-conv-bias": dict(bias=True, conv_bias=False),
    "all": dict(d_ssm=16, D_has_hdim=True, rmsnorm=False, ngroups=2, dt_limit=(0, 0.2), d_conv=3),
}
TRITON_OPTIONS = {  # on the Triton sizes (E 16, P 8)
    "ngroups2": dict(ngroups=2),
    "all": dict(d_ssm=8, D_has_hdim=True, rmsnorm=False, dt_limit=(0.0, 0.2), d_conv=3),
    "norm_before_gate-d_ssm": dict(d_ssm=8, norm_before_gate=True, bias=True),
}


def test_parameters_follow_mamba_ssm():
    """Names, shapes and dtypes of mamba_ssm's Mamba2 (130m-mamba2 layer: M 768, N 128, P 64;
    in_proj rows z, x, B, C, dt = 1536 + 1536 + 128 + 128 + 24), and its initial values."""
    m = Mamba2(768, d_state=128, headdim=64)
    shapes = {k: tuple(p.shape) for k, p in m.named_parameters()}
    assert shapes == {
        "dt_bias": (24,), "A_log": (24,), "D": (24,),
        "in_proj.weight": (3352, 768), "conv1d.weight": (1792, 1, 4), "conv1d.bias": (1792,),
        "norm.weight": (1536,), "out_proj.weight": (768, 1536),
    }  # fmt: skip
    A = -torch.exp(m.A_log.detach())
    assert float(A.min()) >= -16 * (1 + 1e-6) and float(A.max()) <= -1 * (1 - 1e-6)
    dt = F.softplus(m.dt_bias.detach())
    assert float(dt.min()) >= 1e-3 * (1 - 1e-5) and float(dt.max()) <= 0.1 * (1 + 1e-5)
    assert torch.equal(m.D.detach(), torch.ones(24))
    m = Mamba2(64, d_state=16, headdim=16, d_ssm=64, D_has_hdim=True, rmsnorm=False, ngroups=2,
               bias=True)  # fmt: skip
    shapes = {k: tuple(p.shape) for k, p in m.named_parameters()}
    # rows 2 E + 2 G N + H = 256 + 64 + 4, read as z0, x0 (d_mlp = E - d_ssm = 64 each), z
    # (64), xBC (64 + 64) and dt (4)
    assert shapes["in_proj.weight"] == (324, 64) and shapes["in_proj.bias"] == (324,)
    assert shapes["D"] == (64,) and "norm.weight" not in shapes
    assert shapes["out_proj.weight"] == (64, 128) and shapes["conv1d.weight"] == (128, 1, 4)
    st = m.init_state(3)
    assert st.conv.shape == (3, 3, 128) and st.ssm.shape == (3, 4, 16, 16)
    assert st.conv.dtype == st.ssm.dtype == torch.float32


@pytest.mark.parametrize("opts", list(OPTIONS.values()), ids=list(OPTIONS))
def test_layer_equals_the_oracle(opts):
    """Reference backend, float64, a random initial state: out, final state and the
    gradients of every parameter, the input and the initial state."""
    m = layer(**opts)
    compare_with_oracle(m, m, inputs(m, 2, 11), random_state(m, 2), 1e-10)


@pytest.mark.parametrize("opts", list(TRITON_OPTIONS.values()), ids=list(TRITON_OPTIONS))
def test_triton_layer_equals_the_oracle(nan_empty, opts):
    """Triton backend (conv and scan kernels; the interpreter on a CPU), f32, against the
    float64 oracle on the same weights: out, final state and every gradient."""
    m = layer_for("triton", **opts)
    m64 = copy.deepcopy(m).double()
    compare_with_oracle(m, m64, inputs(m, 2, 21), random_state(m, 2), 1e-5, backend="triton")


@pytest.mark.parametrize(
    "backend, splits",
    [("reference", (7, 1, 11)), ("reference", (2, 2, 15)), ("triton", (2, 17))],
    ids=["reference-7-1-11", "reference-2-2-15", "triton-2-17"],
)
def test_chunks_with_carried_state_equal_the_whole(backend, splits):
    """Values and every parameter's gradient, through the state carried between chunks;
    chunks shorter than the conv's K - 1 = 3 steps of history among them."""
    tol = 1e-10 if backend == "reference" else 2e-5
    m = layer_for(backend, ngroups=2)
    u = inputs(m, 1 if backend == "triton" else 2, sum(splits))
    cot = torch.randn_like(u)
    st0 = random_state(m, u.shape[0])
    y, fin = m(u, st0, return_state=True, backend=backend)
    ((y * cot).sum() + fin.ssm.sum() + fin.conv.sum()).backward()
    whole = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    st, ys, start = st0, [], 0
    for n in splits:
        y_c, st = m(u[:, start : start + n], st, return_state=True, backend=backend)
        ys.append(y_c)
        start += n
    ys = torch.cat(ys, 1)
    ((ys * cot).sum() + st.ssm.sum() + st.conv.sum()).backward()
    assert rel(ys, y) < tol and rel(st.ssm, fin.ssm) < tol and rel(st.conv, fin.conv) < tol
    for k, p in m.named_parameters():
        assert rel(p.grad, whole[k]) < 10 * tol, k


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_loop_equals_forward(backend):
    """T steps == one forward: outputs and final state, without autograd (decode, the state
    advanced in place) and with it (functional steps, the state passed in unchanged)."""
    m = layer_for(backend, ngroups=2, D_has_hdim=True)
    u = inputs(m, 2, 9 if backend == "reference" else 6)
    st0 = random_state(m, 2)
    with torch.no_grad():
        y, fin = m(u, st0, return_state=True, backend=backend)
        st = Mamba2State(*(t.clone() for t in st0))
        ptrs = [t.data_ptr() for t in st]
        outs = []
        for t in range(u.shape[1]):
            o, st2 = m.step(u[:, t], st, backend=backend)
            assert st2 is st
            outs.append(o)
    assert [t.data_ptr() for t in st] == ptrs
    torch.testing.assert_close(torch.stack(outs, 1), y, **close(backend))
    torch.testing.assert_close(st.conv, fin.conv, **close(backend))
    torch.testing.assert_close(st.ssm, fin.ssm, **close(backend))
    st = Mamba2State(*(t.clone() for t in st0))  # with autograd: functional
    o, new = m.step(u[:, 0], st, backend=backend)
    assert o.requires_grad and new is not st and torch.equal(st.ssm, st0.ssm)
    torch.testing.assert_close(o.detach(), y[:, 0], **close(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_equal_documents_alone(backend):
    """seq_idx: each document as if run alone, the initial state feeding only a row's first
    document, the final state the last document's (its conv state zero before its start
    when it is shorter than K - 1)."""
    m = layer_for(backend)
    T = 15
    starts = [[0, 5, 13], [0, 1]]  # a last document of 2 steps (< K - 1 = 3)
    seq_idx = torch.zeros(2, T, dtype=torch.int32)
    for b, ss in enumerate(starts):
        for i, s in enumerate(ss):
            seq_idx[b, s:] = i
    u = inputs(m, 2, T)
    st0 = random_state(m, 2)
    with torch.no_grad():
        y, fin = m(u, st0, seq_idx=seq_idx.to(DEVICE), return_state=True, backend=backend)
        for b, ss in enumerate(starts):
            bounds = ss + [T]
            for i in range(len(ss)):
                s, e = bounds[i], bounds[i + 1]
                st_b = Mamba2State(*(t[b : b + 1] for t in st0)) if i == 0 else None
                y_doc, fin_doc = m(u[b : b + 1, s:e], st_b, return_state=True, backend=backend)
                torch.testing.assert_close(y[b : b + 1, s:e], y_doc, **close(backend))
            torch.testing.assert_close(fin.conv[b : b + 1], fin_doc.conv, **close(backend))
            torch.testing.assert_close(fin.ssm[b : b + 1], fin_doc.ssm, **close(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_row_alone_equals_the_row_in_the_batch(backend):
    m = layer_for(backend, ngroups=2)
    u = inputs(m, 3, 10)
    st0 = random_state(m, 3)
    with torch.no_grad():
        y, fin = m(u, st0, return_state=True, backend=backend)
        for b in range(3):
            st_b = Mamba2State(*(t[b : b + 1] for t in st0))
            y_b, fin_b = m(u[b : b + 1], st_b, return_state=True, backend=backend)
            torch.testing.assert_close(y[b : b + 1], y_b, **close(backend))
            torch.testing.assert_close(fin.ssm[b : b + 1], fin_b.ssm, **close(backend))
            torch.testing.assert_close(fin.conv[b : b + 1], fin_b.conv, **close(backend))


def test_gradcheck_through_the_layer_and_its_state():
    """torch.autograd.gradcheck of the float64 layer in the input and both initial state
    fields (values through out and the final state), over reference chunks of 2."""
    m = layer(d_model=4, d_state=2, headdim=2, ngroups=2, d_conv=3, chunk_size=2)
    st = random_state(m, 1)
    u = inputs(m, 1, 5)
    leaves = [t.clone().requires_grad_() for t in (u, st.conv, st.ssm)]

    def fn(u, conv, ssm):
        out, fin = m(u, Mamba2State(conv, ssm), return_state=True)
        return out, fin.conv, fin.ssm

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7)


def test_bf16_layer_is_close_to_float64():
    """A bf16 layer (reference ops; the state and the scan in f32) near the float64 one."""
    m64 = layer()
    m16 = copy.deepcopy(m64).to(torch.bfloat16)
    u = inputs(m64, 2, 13)
    with torch.no_grad():
        y16, st16 = m16(u.bfloat16(), return_state=True)
        y64, _ = m64(u.bfloat16().double(), return_state=True)
    assert y16.dtype == torch.bfloat16 and st16.ssm.dtype == torch.float32
    assert rel(y16, y64) < 3e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_and_a_conv_hook_are_honoured(backend):
    """peft LoRA on in_proj and out_proj and a forward hook on conv1d (out * 0.5 + 0.1): the
    forward (values, final state, the gradients of the adapters, the input and the state)
    equals the oracle run on the adapted projections with the hook's effect written out;
    step equals it too; with seq_idx the layer says it cannot reset the hooked module's
    window at document starts."""
    peft = pytest.importorskip("peft")
    base = layer_for(backend)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["in_proj", "out_proj"],
                          init_lora_weights=False)  # fmt: skip
    m = peft.get_peft_model(base, cfg).base_model.model.to(DTYPES[backend])
    m.conv1d.register_forward_hook(lambda mod, args, out: out * 0.5 + 0.1)
    m64 = copy.deepcopy(m).double()
    Cd = m.conv_dim

    def conv(x):  # the conv and its hook, written out
        w, b = m64.conv1d.weight, m64.conv1d.bias
        return F.conv1d(x.mT, w, b, groups=Cd).mT * 0.5 + 0.1

    u = inputs(m, 2, 9)
    st0 = random_state(m, 2)
    limit = 1e-10 if backend == "reference" else 1e-5
    adapted = dict(in_proj=m64.in_proj, out_proj=m64.out_proj, conv=conv)
    compare_with_oracle(m, m64, u, st0, limit, backend=backend, **adapted)
    lora = {k: p.grad for k, p in m.named_parameters() if "lora_" in k}
    assert len(lora) == 4 and all(g is not None and g.abs().sum() > 0 for g in lora.values())
    with torch.no_grad():
        want = oracle(m64, u, st0, **adapted)[0]
        plain = oracle(m64, u, st0)[0]  # the adapters and the hook dropped
        assert rel(plain, want) > 1e-2  # they matter
        st = Mamba2State(*(t.clone() for t in st0))
        outs = [m.step(u[:, t], st, backend=backend)[0] for t in range(9)]
        assert rel(torch.stack(outs, 1), want) < limit
        with pytest.raises(NotImplementedError, match="seq_idx"):
            m(u, seq_idx=torch.zeros(2, 9, dtype=torch.int32, device=DEVICE), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lora_adapter_on_the_conv_is_honoured(backend):
    """peft's LoRA on conv1d (a module of its own, which has no `kernel_size`, in the
    conv's place): the forward (values, final state, every gradient) and step equal the
    oracle run on the adapted conv module, called on the window as mamba_ssm's conv is."""
    peft = pytest.importorskip("peft")
    base = layer_for(backend)
    K, Cd = base.d_conv, base.conv_dim
    # (peft takes a rank that is a multiple of the conv's groups)
    cfg = peft.LoraConfig(r=Cd, lora_alpha=Cd, target_modules=["conv1d"],
                          init_lora_weights=False)  # fmt: skip
    m = peft.get_peft_model(base, cfg).base_model.model.to(DTYPES[backend])
    m64 = copy.deepcopy(m).double()

    def conv(x):  # x [B, K-1+T, C]: the adapted module over the window, padded K-1 both sides
        return m64.conv1d(x.mT)[..., K - 1 : x.shape[1]].mT

    u = inputs(m, 2, 9)
    st0 = random_state(m, 2)
    limit = 1e-10 if backend == "reference" else 1e-5
    compare_with_oracle(m, m64, u, st0, limit, backend=backend, conv=conv)
    lora = {k: p.grad for k, p in m.named_parameters() if "lora_" in k}
    assert len(lora) == 2 and all(g is not None and g.abs().sum() > 0 for g in lora.values())
    with torch.no_grad():
        want = oracle(m64, u, st0, conv=conv)[0]
        assert rel(oracle(m64, u, st0)[0], want) > 1e-2  # the adapter matters
        st = Mamba2State(*(t.clone() for t in st0))
        outs = [m.step(u[:, t], st, backend=backend)[0] for t in range(9)]
        assert rel(torch.stack(outs, 1), want) < limit


def test_compiles_fullgraph_forward_and_backward(monkeypatch):
    """torch.compile(fullgraph=True) of the layer's forward and backward on the Triton
    backend (the scan's custom ops `mambakit::mamba2_scan_train` / `_bwd`): no graph break,
    no reference scan, and the loss, the input's, the state's and every parameter's
    gradient equal eager."""
    from mambakit.ops import mamba2 as ops_m2

    ran = []
    ref = ops_m2.mamba2_scan_reference
    monkeypatch.setattr(ops_m2, "mamba2_scan_reference",
                        lambda *a, **k: ran.append(1) or ref(*a, **k))  # fmt: skip
    monkeypatch.setenv("MAMBAKIT_BACKEND", "triton")
    m = layer_for("triton", ngroups=2)
    u0 = inputs(m, 1, 9)
    st0 = random_state(m, 1)

    def loss_fn(u, conv, ssm):
        y, fin = m(u, Mamba2State(conv, ssm), return_state=True)
        return y.square().sum() + fin.ssm.sum()

    def loss_and_grads(fn):
        m.zero_grad(set_to_none=True)
        leaves = [t.detach().clone().requires_grad_() for t in (u0, *st0)]
        loss = fn(*leaves)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in m.named_parameters()}
        grads.update({f"input {i}": t.grad for i, t in enumerate(leaves)})
        return loss.detach(), grads

    eager_loss, eager = loss_and_grads(loss_fn)
    torch._dynamo.reset()
    loss, grads = loss_and_grads(torch.compile(loss_fn, backend="aot_eager", fullgraph=True))
    assert not ran
    assert rel(loss, eager_loss) < 1e-6
    for k, g in eager.items():
        assert rel(grads[k], g) < 1e-5, k


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="headdim"):
        Mamba2(d_model=10, headdim=8)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2(d_model=16, headdim=8, ngroups=3)
    with pytest.raises(ValueError, match="d_ssm"):
        Mamba2(d_model=16, headdim=8, d_ssm=40)
    with pytest.raises(ValueError, match="d_ssm"):
        Mamba2(d_model=16, headdim=8, d_ssm=0)
    with pytest.raises(ValueError, match="dt_limit"):
        Mamba2(d_model=16, headdim=8, dt_limit=(0.5, 0.1))
    with pytest.raises(ValueError, match="A_init_range"):
        Mamba2(d_model=16, headdim=8, A_init_range=(0.0, 1.0))
    with pytest.raises(ValueError, match="d_conv"):
        Mamba2(d_model=16, headdim=8, d_conv=1)
    m = layer()
    u = torch.randn(2, 3, 16, dtype=torch.float64, device=DEVICE)
    st = m.init_state(2)
    with pytest.raises(ValueError, match="state.ssm"):
        m(u, st._replace(ssm=st.ssm[..., :-1]))
    with pytest.raises(ValueError, match="state.conv"):
        m(u, st._replace(conv=st.conv[:, 1:]))
    with pytest.raises(TypeError, match="state.ssm must be float32"):
        m(u, st._replace(ssm=st.ssm.half()))
    with pytest.raises(TypeError, match="Mamba2State"):
        m(u, tuple(st))
    with pytest.raises(ValueError, match="u must have shape"):
        m(torch.randn(2, 3, 15, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="seq_idx"):
        m(u, seq_idx=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="u must have shape"):
        m.step(u, st)
    assert math.isfinite(float(m(u).detach().sum()))
