"""rms_norm_gated (Mamba-2's gated RMSNorm): the reference against its naive oracle and
transformers' Mamba2RMSNormGated, the Triton kernels against the float64 reference.

M rows (flattened leading dims), D features in groups of G. On a machine without CUDA the
kernels run under the Triton interpreter (tiny shapes); `-m gpu` runs the class at the
bottom at a real shape.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from mambakit import ops as ops_pkg
from mambakit.ops import rms_norm_gated
from mambakit.ops.rms_norm_gated import rms_norm_gated_reference
from mambakit.ops.rms_norm_gated.naive import rms_norm_gated_naive

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5

# Tolerance on max|got - ref| / max|ref| against the float64 oracle, by the dtype of the
# tensor compared (test_rms_norm.py gives the reasons): inputs drawn in their dtype and
# upcast exactly, f32 arithmetic, one rounding of out / dx / dz to the input dtype (bf16:
# one ulp, the interpreter truncates), dweight f32.
TOL = {torch.float32: 2e-5, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}


def dtype_id(d) -> str:
    return str(d).replace("torch.", "")


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten element?)"
    err = ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
    tol = TOL[got.dtype]
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e} ({got.dtype})"


def make_inputs(shape, dtype, has_z=True, has_w=True, w_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s, dt):
        return torch.randn(*s, generator=gen).to(device=DEVICE, dtype=dt).requires_grad_()

    x = rnd(*shape, dt=dtype)
    z = (2 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype).requires_grad_()
    w = (1.0 + 0.3 * torch.randn(shape[-1], generator=gen)).to(DEVICE, w_dtype).requires_grad_()
    return dict(x=x, z=z if has_z else None, weight=w if has_w else None)


def run_and_grads(fn, inp, G, nbg, out_dtype, upstream):
    """(out, grads of the present inputs) for loss = <out, upstream>, or out.sum() (a
    stride-0 gradient) when upstream is None."""
    out = fn(inp["x"], inp["z"], inp["weight"], EPS, G, nbg, out_dtype)
    loss = out.sum() if upstream is None else (out * upstream.to(out.dtype)).sum()
    names = [n for n, t in inp.items() if t is not None]
    grads = torch.autograd.grad(loss, [inp[n] for n in names])
    return out, dict(zip(names, grads))


def triton_gated(x, z, weight, eps, G, nbg, out_dtype):
    return rms_norm_gated(x, z, weight, eps, G, nbg, out_dtype, backend="triton")


def ref64(inp):
    return {n: t.detach().double().requires_grad_() if t is not None else None
            for n, t in inp.items()}  # fmt: skip


def compare(inp, G, nbg, out_dtype, upstream):
    out, grads = run_and_grads(triton_gated, inp, G, nbg, out_dtype, upstream)
    up64 = upstream.to(out.dtype).double() if upstream is not None else None
    out_r, grads_r = run_and_grads(
        rms_norm_gated_reference, ref64(inp), G, nbg, torch.float64, up64
    )
    assert out.dtype == (out_dtype or inp["x"].dtype) and out.is_contiguous()
    assert_close("out", out, out_r)
    for n, g in grads.items():
        assert g.dtype == inp[n].dtype, n
        assert_close(f"d{n}", g, grads_r[n])


# --- the reference against its oracles ------------------------------------------------------

VARIANTS = [(True, True), (True, False), (False, True), (False, False)]  # (z, weight)


@pytest.mark.parametrize("nbg", [False, True], ids=["gate_first", "norm_first"])
@pytest.mark.parametrize("zw", VARIANTS, ids=["z-w", "z", "w", "plain"])
@pytest.mark.parametrize("groups", [1, 4], ids=["G=D", "G=D/4"])
def test_reference_matches_naive_float64(nbg, zw, groups):
    inp = make_inputs((3, 2, 16), torch.float64, *zw, w_dtype=torch.float64, seed=1)
    inp = {n: t.cpu().detach().requires_grad_() if t is not None else None
           for n, t in inp.items()}  # fmt: skip
    G = 16 // groups if groups > 1 else None
    up = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def naive(x, z, w, eps, G, nbg, _out_dtype):
        return rms_norm_gated_naive(x, z, w, eps, G, nbg)

    out, grads = run_and_grads(rms_norm_gated_reference, inp, G, nbg, None, up)
    out_n, grads_n = run_and_grads(naive, inp, G, nbg, None, up)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, out_n, rtol=1e-12, atol=1e-12)
    for n in grads:
        torch.testing.assert_close(grads[n], grads_n[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("nbg", [False, True], ids=["gate_first", "norm_first"])
def test_reference_gradcheck(nbg):
    gen = torch.Generator().manual_seed(3)
    x, z = (torch.randn(3, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    w = 1 + 0.3 * torch.randn(8, generator=gen, dtype=torch.float64)
    args = [t.requires_grad_() for t in (x, z, w)]
    assert torch.autograd.gradcheck(
        lambda x, z, w: rms_norm_gated_reference(x, z, w, EPS, 4, nbg), args
    )


@pytest.mark.parametrize("groups", [1, 4])
def test_reference_matches_transformers(groups):
    """transformers' Mamba2RMSNormGated (gate before the norm, f32) is an independent oracle
    (MambaRMSNormGated in older releases, without groups)."""
    modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    cls = getattr(modeling, "Mamba2RMSNormGated", None) or modeling.MambaRMSNormGated
    D = 32
    if "group_size" in inspect.signature(cls).parameters:
        hf = cls(D, group_size=D // groups, eps=1e-5)
    elif groups == 1:
        hf = cls(D, eps=1e-5)
    else:
        pytest.skip("this transformers' gated RMSNorm has no groups")
    gen = torch.Generator().manual_seed(4)
    x, z = torch.randn(2, 5, D, generator=gen), torch.randn(2, 5, D, generator=gen)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
        want = hf(x, z)
        want_plain = hf(x)
    got = rms_norm_gated(x, z, hf.weight.detach(), 1e-5, D // groups, backend="reference")
    got_plain = rms_norm_gated(x, None, hf.weight.detach(), 1e-5, D // groups,
                               backend="reference")  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_plain, want_plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nbg", [False, True], ids=["gate_first", "norm_first"])
def test_reference_matches_mamba_ssm(nbg):
    """mamba_ssm's own reference (`rms_norm_ref`), where mamba_ssm imports."""
    lng = pytest.importorskip("mamba_ssm.ops.triton.layernorm_gated")
    gen = torch.Generator().manual_seed(5)
    x, z = torch.randn(4, 24, generator=gen), torch.randn(4, 24, generator=gen)
    w = 1 + 0.3 * torch.randn(24, generator=gen)
    want = lng.rms_norm_ref(x, w, None, z=z, eps=1e-5, group_size=8, norm_before_gate=nbg)
    got = rms_norm_gated(x, z, w, 1e-5, 8, nbg, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# --- the Triton kernels against the float64 reference ---------------------------------------

# shape, groups (D / G), norm_before_gate, z, weight, out_dtype
CASES = [
    ((3, 5, 16), 1, False, True, True, None),  # Mamba-2's form: one group
    ((2, 7, 24), 4, False, True, True, None),  # G = 6, not a power of two
    ((5, 32), 4, True, True, True, torch.float32),  # gate after the norm, f32 out
    ((4, 20), 2, False, False, True, None),  # no gate
    ((4, 20), 1, True, True, False, None),  # no weight
    ((70, 12), 3, False, True, True, None),  # several row blocks per backward program
]


def case_id(c):
    shape, groups, nbg, z, w, od = c
    parts = ["x".join(map(str, shape)), f"ng{groups}", "norm_first" if nbg else "gate_first"]
    parts += [] if z else ["noz"]
    parts += [] if w else ["now"]
    parts += [] if od is None else [f"out_{dtype_id(od)}"]
    return "-".join(parts)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_matches_reference(case, dtype, nan_empty):
    shape, groups, nbg, has_z, has_w, out_dtype = case
    inp = make_inputs(shape, dtype, has_z, has_w)
    gen = torch.Generator().manual_seed(1)
    upstream = torch.randn(*shape, generator=gen).to(DEVICE, out_dtype or dtype)
    compare(inp, shape[-1] // groups, nbg, out_dtype, upstream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("nbg", [False, True], ids=["gate_first", "norm_first"])
def test_triton_sum_loss_expanded_grad(nbg, dtype, nan_empty):
    """`.sum()` hands the backward a stride-0 expanded gradient."""
    compare(make_inputs((3, 4, 16), dtype), 8, nbg, None, None)


def test_triton_weight_in_input_dtype(nan_empty):
    """A bf16 weight (a model cast whole to bf16) gets its gradient in bf16."""
    inp = make_inputs((6, 16), torch.bfloat16, w_dtype=torch.bfloat16)
    compare(inp, 8, False, None, torch.randn(6, 16).to(DEVICE, torch.bfloat16))


@pytest.mark.parametrize("transposed", [False, True], ids=["rows_view", "rows_copied"])
def test_triton_strided_views(transposed, nan_empty):
    """x and z as slices of in_proj's [B, T, W] output (stride 1 in D, rows strided): the
    same values and gradients as on contiguous copies. Transposed leading dims cannot be
    flattened to rows as a view: the launcher copies them."""
    B, T, D = 2, 5, 16
    gen = torch.Generator().manual_seed(6)
    big = torch.randn(B, T, 2 * D + 8, generator=gen).to(DEVICE).requires_grad_()
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEVICE).requires_grad_()
    up = torch.randn(B, T, D, generator=gen).to(DEVICE)
    src = big.transpose(0, 1) if transposed else big
    x, z = src[..., 4 : 4 + D], src[..., 4 + D : 4 + 2 * D]
    up = up.transpose(0, 1) if transposed else up
    out_v = triton_gated(x, z, w, EPS, 4, False, None)
    g_big, g_w = torch.autograd.grad((out_v * up).sum(), [big, w])
    xc, zc = (t.detach().contiguous().requires_grad_() for t in (x, z))
    wc = w.detach().clone().requires_grad_()
    out_c = triton_gated(xc, zc, wc, EPS, 4, False, None)
    g_x, g_z, g_wc = torch.autograd.grad((out_c * up).sum(), [xc, zc, wc])
    assert out_v.is_contiguous() and torch.equal(out_v, out_c)
    g_src = g_big.transpose(0, 1) if transposed else g_big
    assert torch.equal(g_src[..., 4 : 4 + D], g_x) and torch.equal(g_src[..., 4 + D : -4], g_z)
    assert torch.equal(g_w, g_wc)
    inp = dict(x=x, z=z, weight=w)
    out_r, grads_r = run_and_grads(rms_norm_gated_reference, ref64(inp), 4, False, None,
                                   up.double())  # fmt: skip
    assert_close("out", out_v, out_r)
    assert_close("dx", g_x, grads_r["x"])
    assert_close("dz", g_z, grads_r["z"])


def test_triton_grads_bit_identical(deterministic):
    inp = make_inputs((70, 24), torch.bfloat16)
    first = run_and_grads(triton_gated, inp, 8, False, None, None)
    second = run_and_grads(triton_gated, inp, 8, False, None, None)
    assert torch.equal(first[0], second[0])
    for n in first[1]:
        assert torch.equal(first[1][n], second[1][n]), n


def test_triton_torch_compile_fullgraph():
    inp = make_inputs((4, 16), torch.float32)

    def f(x, z, weight):
        out = rms_norm_gated(x, z, weight, EPS, 8, False, torch.bfloat16, backend="triton")
        return out.float().pow(2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [inp["x"], inp["z"], inp["weight"]]
    g_c = torch.autograd.grad(compiled(*leaves), leaves)
    g_e = torch.autograd.grad(f(*leaves), leaves)
    for a, b in zip(g_c, g_e):
        assert torch.equal(a, b)


def test_triton_f64_is_refused_as_rms_norm_does():
    x = torch.randn(2, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="f32, bf16 and f16"):
        rms_norm_gated(x, backend="triton")


# --- bad input ------------------------------------------------------------------------------


def _bad_cases():
    x = torch.randn(4, 8)
    return [
        ("z", dict(z=torch.randn(4, 9)), ValueError),
        ("z", dict(z=torch.randn(8, 4).t()), ValueError),  # last dim stride 4
        ("z", dict(z=torch.randn(4, 8, device="meta")), ValueError),  # another device
        ("weight", dict(weight=torch.randn(4)), ValueError),
        ("weight", dict(weight=torch.ones(8, dtype=torch.int64)), TypeError),
        ("group_size", dict(group_size=3), ValueError),
        ("group_size", dict(group_size=0), ValueError),
        ("group_size", dict(group_size=2.0), ValueError),
        ("out_dtype", dict(out_dtype=torch.int32), TypeError),
        ("eps", dict(eps=0.0), ValueError),
        ("x", dict(x=torch.randn(8, 4).t()), ValueError),  # last dim stride 4
        ("x", dict(x=torch.ones(4, 8, dtype=torch.int32)), TypeError),
        ("x", dict(x=x.numpy()), TypeError),
    ]


@pytest.mark.parametrize("name, kwargs, exc", _bad_cases(),
                         ids=lambda v: v if isinstance(v, str) else "")  # fmt: skip
def test_bad_input_names_the_argument(name, kwargs, exc, monkeypatch):
    def body(*args):
        raise AssertionError("the body ran before the checks failed")

    monkeypatch.setattr(ops_pkg, "_rms_norm_gated", body)
    args = dict(x=torch.randn(4, 8), z=torch.randn(4, 8), weight=torch.ones(8))
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        rms_norm_gated(**args, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestRmsNormGatedGPU:
    """A Mamba-2 layer's gate at batch 8 x 2048 tokens, d_inner 1536 (the 130m's), bf16."""

    @pytest.mark.parametrize("groups", [1, 8])
    @pytest.mark.parametrize("nbg", [False, True], ids=["gate_first", "norm_first"])
    def test_real_shape_matches_reference(self, groups, nbg, nan_empty):
        inp = make_inputs((8, 2048, 1536), torch.bfloat16)
        gen = torch.Generator().manual_seed(1)
        upstream = torch.randn(8, 2048, 1536, generator=gen).to(DEVICE, torch.bfloat16)
        compare(inp, 1536 // groups, nbg, None, upstream)

    def test_real_shape_wide_group(self, nan_empty):
        """The 2.7b's d_inner 5120 as one group: one row a program."""
        compare(make_inputs((64, 5120), torch.bfloat16), 5120, False, None, None)

    def test_real_shape_bit_identical(self, deterministic):
        inp = make_inputs((8, 2048, 1536), torch.bfloat16)
        first = run_and_grads(triton_gated, inp, 192, False, None, None)
        second = run_and_grads(triton_gated, inp, 192, False, None, None)
        for n in first[1]:
            assert torch.equal(first[1][n], second[1][n]), n
