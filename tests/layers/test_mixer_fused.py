"""The mixer's fused inner node (Triton backend) against the chain of ops it replaces.

B batch, T time, M = d_model, D = d_inner, N = d_state. On the Triton backend
`Mamba.forward` runs conv, x_proj, dt_proj and the scan as one autograd node
that saves xz and x_dbl and recomputes u and delta in the backward
(ops/mamba_inner). The same kernels chained op by op (`mamba_inner_chain`)
are its oracle for values and every gradient, the float64 reference its oracle
for the math; a saved-tensor hook shows what each keeps. Without CUDA the
kernels run under the Triton interpreter, so the shapes are tiny.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from mambakit import Mamba
from mambakit.layers import mixer
from mambakit.ops.mamba_inner.reference import mamba_inner_chain

if not torch.cuda.is_available():  # before the kernels are first imported, as tests/ops does
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16 = torch.float32, torch.bfloat16

# ||got - ref|| / ||ref||. Fused vs unfused: the same kernels and GEMMs in the same
# dtypes (bit-identical on the CPU); the margin is for GEMM algorithm choices on a GPU.
TOL_UNFUSED = {F32: 1e-5, BF16: 1e-2}
TOL_F64 = 1e-4  # f32 fused vs the float64 reference: f32 sums over T and N


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _chain(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, A, D, dt_bias,
           conv_state, ssm_state, seq_idx, backend, states_at=None):  # fmt: skip
    """The op chain in the fused node's place (the mixer calls `ops._mamba_inner`)."""
    return mamba_inner_chain(
        xz, conv_weight=conv_weight, conv_bias=conv_bias, x_proj_weight=x_proj_weight,
        dt_proj_weight=dt_proj_weight, A=A, D=D, dt_bias=dt_bias, conv_state=conv_state,
        ssm_state=ssm_state, seq_idx=seq_idx, backend=backend, states_at=states_at,
    )  # fmt: skip


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MAMBAKIT_BACKEND", "triton")


def make(randomize, **kw) -> Mamba:
    args = dict(d_model=12, d_state=5, d_conv=4, expand=2)  # D = 24, R = 1
    args.update(kw)
    return randomize(Mamba(**args, device=DEVICE))


def seq_idx_for(Bsz: int, T: int) -> torch.Tensor:
    """Row 0 has documents starting at 5 and 13; row 1 is one document."""
    s = torch.zeros(Bsz, T, dtype=torch.int32, device=DEVICE)
    s[0, 5:] = 1
    s[0, 13:] = 2
    return s


def run(m, x, conv0, ssm0, seq_idx, dtype, loss_on):
    """Forward and backward of a sum loss; returns (outputs, grads by name)."""
    x = x.detach().clone().requires_grad_()
    leaves = {"x": x}
    if conv0 is not None:
        leaves["conv_state"] = conv0 = conv0.detach().clone().requires_grad_()
        leaves["ssm_state"] = ssm0 = ssm0.detach().clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=BF16, enabled=dtype == BF16):
        y, (conv, ssm) = m(x, conv0, ssm0, seq_idx, return_state=True)
    f = torch.float64 if y.dtype == torch.float64 else F32
    wy = torch.linspace(-1, 1, y.numel(), device=y.device, dtype=f).view_as(y)
    loss = 0.0
    if "y" in loss_on:
        loss = loss + (y.to(f) * wy).sum()
    if "state" in loss_on:  # .sum(): the final states' gradients arrive with stride 0
        loss = loss + conv.sum() + ssm.sum()
    loss.backward()
    grads = {k: p.grad for k, p in m.named_parameters()}
    grads.update({k: t.grad for k, t in leaves.items()})
    return (y, conv, ssm), grads


CASES = {
    # id: (dtype, with initial states, with seq_idx, what the loss reads, Mamba kwargs);
    # nocb: in_proj and out_proj biases, no conv bias
    "f32-h0-seq": (F32, True, True, ("y", "state"), {}),
    "bf16-h0-nocb": (BF16, True, False, ("y",), dict(bias=True, conv_bias=False)),
    "bf16-seq-stateonly": (BF16, False, True, ("state",), {}),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.slow
def test_fused_matches_unfused(seed, randomize, triton_backend, monkeypatch, case):
    dtype, with_state, with_seq, loss_on, kw = CASES[case]
    m = make(randomize, **kw)
    Bsz, T, D, N, K = 2, 23, m.d_inner, m.d_state, m.d_conv
    x = torch.randn(Bsz, T, m.d_model, device=DEVICE)
    conv0 = torch.randn(Bsz, K - 1, D, device=DEVICE) if with_state else None
    ssm0 = torch.randn(Bsz, D, N, device=DEVICE) if with_state else None
    seq_idx = seq_idx_for(Bsz, T) if with_seq else None

    outs, grads = run(m, x, conv0, ssm0, seq_idx, dtype, loss_on)
    assert type(outs[2].grad_fn).__name__ == "_FusedInnerBackward"
    monkeypatch.setattr(mixer, "_mamba_inner", _chain)
    outs_ref, grads_ref = run(m, x, conv0, ssm0, seq_idx, dtype, loss_on)

    assert outs[0].dtype == dtype and outs[1].dtype == F32 and outs[2].dtype == F32
    for name, a, b in zip(("y", "conv_state", "ssm_state"), outs, outs_ref):
        assert rel(a, b) < TOL_UNFUSED[dtype], name
    assert grads.keys() == grads_ref.keys()
    for k, g in grads.items():
        if grads_ref[k] is None:  # out_proj when the loss reads only the final states
            assert g is None and loss_on == ("state",), k
            continue
        assert g is not None and g.dtype == grads_ref[k].dtype, k
        assert rel(g, grads_ref[k]) < TOL_UNFUSED[dtype], k

    if dtype == F32:  # and against the float64 reference ops (an f64 model stays on them)
        m64 = make(randomize, **kw).double()
        m64.load_state_dict(m.state_dict())
        d = lambda t: t.double() if t is not None else None
        outs64, grads64 = run(m64, d(x), d(conv0), d(ssm0), seq_idx, torch.float64, loss_on)
        for name, a, b in zip(("y", "conv_state", "ssm_state"), outs, outs64):
            assert rel(a, b) < TOL_F64, name
        for k, g in grads.items():
            assert rel(g, grads64[k]) < TOL_F64, k
        assert grads64.keys() == grads.keys()


def saved_by_autograd(m, x, conv0, ssm0):
    """{storage address: (bytes, [shapes saved from it])} for one bf16 forward, and xz, y."""
    seen: dict[int, tuple[int, list]] = {}
    kept: dict[str, torch.Tensor] = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), (st.nbytes(), []))[1].append(tuple(t.shape))
        return t

    h1 = m.in_proj.register_forward_hook(lambda mod, i, o: kept.__setitem__("xz", o))
    h2 = m.out_proj.register_forward_pre_hook(lambda mod, i: kept.__setitem__("y", i[0]))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(x.device.type, dtype=BF16):
                m(x, conv0, ssm0, return_state=True)
    finally:
        h1.remove()
        h2.remove()
    return seen, {k: v.untyped_storage().data_ptr() for k, v in kept.items()}


def per_row(seen, Bsz: int, T: int) -> int:
    """Bytes of the saved storages that grow with the batch: activations [B, T, ...] (or
    [B T, ...]), the scan's tile states [B, T / tile, D, N] and the initial states. The
    rest are weights: the parameters themselves or, on the unfused chain, autocast's
    bf16 copies of the x_proj and dt_proj weights."""
    return sum(n for n, shapes in seen.values() if any(s[0] in (Bsz, Bsz * T) for s in shapes))


def test_fused_saves_no_u_or_delta(seed, randomize, triton_backend, monkeypatch):
    """The only [B, T, D] activations kept are xz (whose halves x_in and z are) and y.

    The chain of ops also keeps u (conv output) and delta: exactly 2 D bf16 values
    more per token. Everything else (x_dbl, the scan's tile states, weights) is shared.
    """
    m = make(randomize)
    Bsz, T, D = 2, 16, m.d_inner
    x = torch.randn(Bsz, T, m.d_model, device=DEVICE, requires_grad=True)
    conv0 = torch.randn(Bsz, m.d_conv - 1, D, device=DEVICE, requires_grad=True)
    ssm0 = torch.randn(Bsz, D, m.d_state, device=DEVICE, requires_grad=True)

    fused, ptr = saved_by_autograd(m, x, conv0, ssm0)
    monkeypatch.setattr(mixer, "_mamba_inner", _chain)
    unfused, ptr_ref = saved_by_autograd(m, x, conv0, ssm0)

    def activations(seen):  # storages saved as [B, T, D] or [B T, D] (linear's 2-D view)
        return {
            p
            for p, (_, shapes) in seen.items()
            if any(s[-1] == D and math.prod(s) == Bsz * T * D for s in shapes)
        }

    assert ptr["xz"] in fused and activations(fused) == {ptr["y"]}
    assert {ptr_ref["xz"], ptr_ref["y"]} < activations(unfused)  # xz through x_in and z
    assert len(activations(unfused)) == 4  # and u and delta
    assert per_row(unfused, Bsz, T) - per_row(fused, Bsz, T) == 2 * Bsz * T * D * BF16.itemsize


@pytest.mark.parametrize("ks", [1, 2, 4])
def test_fused_saves_what_the_memory_model_counts(ks, seed, randomize, triton_backend, monkeypatch):
    """docs/scaling.md's bytes per token and layer, exactly: in_proj's bf16 input (2 M),
    xz (4 D), x_dbl (2 (R + 2N)), y (2 D) and the scan's f32 state every KS TC steps, plus
    the initial conv and ssm states, for states saved every 1, 2 or 4 backward tiles."""
    import dataclasses

    from mambakit.ops.selective_scan import launch

    library = launch.config
    monkeypatch.setattr(
        launch, "config",
        lambda Dn, interpret: dataclasses.replace(library(Dn, interpret), bwd_save_tiles=ks),
    )  # fmt: skip
    m = make(randomize)
    Bsz, T, M, D, N, R = 2, 45, m.d_model, m.d_inner, m.d_state, m.dt_rank
    x = torch.randn(Bsz, T, M, device=DEVICE, requires_grad=True)
    conv0 = torch.randn(Bsz, m.d_conv - 1, D, device=DEVICE, requires_grad=True)
    ssm0 = torch.randn(Bsz, D, N, device=DEVICE, requires_grad=True)
    seen, _ = saved_by_autograd(m, x, conv0, ssm0)
    every = launch.state_chunk(D, DEVICE == "cuda")
    assert every == launch.save_interval(launch.config(D, DEVICE != "cuda"))
    states = Bsz * math.ceil(T / every) * D * N * 4
    initial = (conv0.numel() + ssm0.numel()) * 4
    expected = Bsz * T * (2 * M + 6 * D + 2 * (R + 2 * N)) + states + initial
    assert per_row(seen, Bsz, T) == expected


def test_fused_compiles_fullgraph(seed, randomize, triton_backend):
    """torch.compile traces the fused node (the trainer's compile=True) without breaks."""
    m = make(randomize, d_model=8, d_state=3, d_conv=3)
    x = torch.randn(1, 9, 8, device=DEVICE)

    def f(ssm0):
        with torch.autocast(x.device.type, dtype=BF16):
            y, (conv, ssm) = m(x, ssm_state=ssm0, return_state=True)
        return y.float().square().sum() + ssm.sum()

    ssm0 = torch.randn(1, 16, 3, device=DEVICE)
    leaves = [ssm0.clone().requires_grad_() for _ in range(2)]
    f(leaves[0]).backward()
    eager = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend="aot_eager")(leaves[1]).backward()
    for (k, p), g in zip(m.named_parameters(), eager):
        assert torch.equal(p.grad, g), k
    assert torch.equal(leaves[0].grad, leaves[1].grad)


def test_fused_reads_strided_vectors(seed, randomize):
    """ops.mamba_inner on Triton with D and dt_bias given as strided views (columns of a
    stacked tensor): the same values and gradients as with their contiguous copies (the
    dt_proj and scan kernels index them densely)."""
    from mambakit.ops import mamba_inner

    m = make(randomize, d_model=8, d_state=3)  # D 16, N 3
    A, D, dt_bias = (t.detach() for t in m._ssm_params())
    Dn, K = D.shape[0], m.conv1d.weight.shape[-1]
    w = dict(
        conv_weight=m.conv1d.weight.detach().squeeze(1), conv_bias=m.conv1d.bias.detach(),
        x_proj_weight=m.x_proj.weight.detach(), dt_proj_weight=m.dt_proj.weight.detach(), A=A,
    )  # fmt: skip
    xz = torch.randn(2, 7, 2 * Dn, device=DEVICE)
    states = (torch.randn(2, K - 1, Dn, device=DEVICE), torch.randn(2, Dn, 3, device=DEVICE))
    results = []
    for strided in (False, True):
        leaves = [t.clone().requires_grad_() for t in (xz, D, dt_bias, *states)]
        x, d, b, conv0, ssm0 = leaves
        if strided:  # the same values at stride 2
            d, b = (torch.stack([t, torch.zeros_like(t)], 1)[:, 0] for t in (d, b))
            assert d.stride(0) == b.stride(0) == 2
        out = mamba_inner(
            x, **w, D=d, dt_bias=b, conv_state=conv0, ssm_state=ssm0, backend="triton"
        )
        sum(o.square().sum() for o in out).backward()
        results.append([*out, *(t.grad for t in leaves)])
    names = ("y", "conv", "ssm", "dxz", "dD", "d dt_bias", "d conv_state", "d ssm_state")
    for name, a, b in zip(names, *results):
        assert rel(b, a) < 1e-6, name
