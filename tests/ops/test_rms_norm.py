"""rms_norm with a fused residual add: the Triton kernels against the float64 reference.

M rows (flattened leading dims), D features. On a machine without CUDA the
kernels run under the Triton interpreter (tiny shapes); `-m gpu` runs the class
at the bottom at a real shape.
"""

from __future__ import annotations

import pytest
import torch

from mambakit.ops import rms_norm
from mambakit.ops.rms_norm import rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5

# Tolerance on max|got - ref| / max|ref| against the float64 oracle, by the dtype of
# the tensor compared. Inputs are drawn in their dtype and upcast exactly; the
# statistics and the residual stream are f32, so the errors are:
# - f32: f32 sums over D (mean of squares, the backward's row dot product) and
#   over rows (dweight), ~1e-6.
# - f16: one rounding of out / dx / dresidual to f16, unit roundoff 2^-11 = 4.9e-4.
# - bf16: one rounding to bf16, 2^-8 = 3.9e-3; the interpreter truncates f32 ->
#   bf16 instead of rounding to nearest, so up to one ulp, 2^-7 = 7.8e-3.
# residual_out and dweight are f32 whatever the input dtype and use the f32 bound.
TOL = {torch.float32: 2e-5, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten element?)"
    err = ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
    tol = TOL[got.dtype]
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e} ({got.dtype})"


def make_inputs(shape, dtype, res_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s, dt=torch.float32):
        return torch.randn(*s, generator=gen).to(device=DEVICE, dtype=dt).requires_grad_()

    return dict(
        x=rnd(*shape, dt=dtype),
        weight=(1.0 + 0.3 * torch.randn(shape[-1], generator=gen)).to(DEVICE).requires_grad_(),
        residual=rnd(*shape, dt=res_dtype) if res_dtype is not None else None,
    )


def run_and_grads(fn, inp, out_dtype, upstream):
    """(out, residual_out, grads) for loss = <out, g_out> + <residual_out, g_res>.

    `upstream` None: `.sum()` of both (stride-0 grads); an entry None: that output unused.
    """
    out, res_out = fn(inp["x"], inp["weight"], EPS, inp["residual"], out_dtype)
    if upstream is None:
        loss = out.sum() + res_out.sum()
    else:
        g_out, g_res = upstream
        loss = 0.0
        if g_out is not None:
            loss = loss + (out * g_out.to(out.dtype)).sum()
        if g_res is not None:
            loss = loss + (res_out * g_res.to(res_out.dtype)).sum()
    names = [n for n, t in inp.items() if t is not None]
    grads = torch.autograd.grad(
        loss, [inp[n] for n in names], allow_unused=True, materialize_grads=True
    )
    return out, res_out, dict(zip(names, grads))


def triton_rms(x, weight, eps, residual, out_dtype):
    return rms_norm(x, weight, eps, residual, out_dtype, backend="triton")


def compare(inp, out_dtype, upstream):
    out, res_out, grads = run_and_grads(triton_rms, inp, out_dtype, upstream)
    ref = {
        n: t.detach().double().requires_grad_() if t is not None else None for n, t in inp.items()
    }
    up64 = None  # the upstream grads as the Triton path saw them: rounded to its output dtypes
    if upstream is not None:
        g_out, g_res = upstream
        up64 = (
            g_out.to(out.dtype).double() if g_out is not None else None,
            g_res.to(res_out.dtype).double() if g_res is not None else None,
        )
    out_r, res_out_r, grads_r = run_and_grads(rms_norm_reference, ref, torch.float64, up64)
    assert out.dtype == (out_dtype or inp["x"].dtype) and res_out.dtype == torch.float32
    assert_close("out", out, out_r)
    assert_close("residual_out", res_out, res_out_r)
    for n, g in grads.items():
        assert g.dtype == inp[n].dtype, n
        assert_close(f"d{n}", g, grads_r[n])


# shape, residual dtype (None: no residual; "x": x's dtype), out_dtype
CASES = [
    ((3, 5), None, None),  # odd D, no residual
    ((2, 7, 33), torch.float32, None),  # f32 residual stream, 3-d input
    ((4, 1, 128), "x", torch.float32),  # residual in x's dtype, f32 out
    ((300, 33), torch.float32, None),  # 19 row blocks: backward programs loop over rows
    ((2, 1000), torch.float32, None),  # one row a program
]


def case_id(c):
    shape, res, od = c
    res_s = "" if res is None else "-res_" + ("x" if res == "x" else str(res).replace("torch.", ""))
    od_s = "" if od is None else "-out_" + str(od).replace("torch.", "")
    return "x".join(map(str, shape)) + res_s + od_s


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rms_norm_matches_reference(case, dtype, nan_empty):
    shape, res, out_dtype = case
    inp = make_inputs(shape, dtype, dtype if res == "x" else res)
    gen = torch.Generator().manual_seed(1)
    upstream = (
        torch.randn(*shape, generator=gen).to(DEVICE, out_dtype or dtype),
        torch.randn(*shape, generator=gen).to(DEVICE),
    )
    compare(inp, out_dtype, upstream)


@pytest.mark.parametrize("used", ["out", "residual_out"])
def test_rms_norm_grad_through_one_output(used, nan_empty):
    inp = make_inputs((5, 24), torch.bfloat16, torch.float32)
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(5, 24, generator=gen).to(DEVICE)
    compare(inp, None, (g, None) if used == "out" else (None, g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rms_norm_sum_loss_expanded_grads(dtype, nan_empty):
    """`.sum()` hands the backward stride-0 expanded gradients for both outputs."""
    compare(make_inputs((3, 4, 20), dtype, torch.float32), None, None)


def test_rms_norm_strided_rows():
    """Rows of x may be strided (a slice of a wider tensor) as long as D has stride 1."""
    inp = make_inputs((6, 10), torch.float32, torch.float32)
    wide = torch.randn(6, 16, device=DEVICE)
    wide[:, 2:12] = inp["x"].detach()
    out_v, res_v = triton_rms(wide[:, 2:12], inp["weight"], EPS, inp["residual"], None)
    out_c, res_c = triton_rms(inp["x"], inp["weight"], EPS, inp["residual"], None)
    assert torch.equal(out_v, out_c) and torch.equal(res_v, res_c)


def test_rms_norm_grads_bit_identical(deterministic):
    inp = make_inputs((300, 33), torch.bfloat16, torch.float32)
    first = run_and_grads(triton_rms, inp, None, None)
    second = run_and_grads(triton_rms, inp, None, None)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for n in first[2]:
        assert torch.equal(first[2][n], second[2][n]), n


def test_rms_norm_torch_compile_fullgraph():
    inp = make_inputs((4, 16), torch.float32, torch.float32)

    def f(x, weight, residual):
        out, res = rms_norm(x, weight, EPS, residual, torch.bfloat16, backend="triton")
        return out.float().pow(2).sum() + res.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [inp["x"], inp["weight"], inp["residual"]]
    g_c = torch.autograd.grad(compiled(*leaves), leaves)
    g_e = torch.autograd.grad(f(*leaves), leaves)
    for a, b in zip(g_c, g_e):
        assert torch.equal(a, b)


def test_rms_norm_reference_gradcheck():
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(3, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(6, generator=gen, dtype=torch.float64)
    args = [t.requires_grad_() for t in (x, weight, residual)]
    assert torch.autograd.gradcheck(
        lambda x, w, r: rms_norm_reference(x, w, EPS, r, torch.float64), args
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestRmsNormGPU:
    """The 130m model's residual stream at batch 8 x 2048 tokens: 16384 rows of d_model 768."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
    def test_real_shape_matches_reference(self, dtype, nan_empty):
        inp = make_inputs((16384, 768), dtype, torch.float32)
        gen = torch.Generator().manual_seed(1)
        upstream = (
            torch.randn(16384, 768, generator=gen).to(DEVICE, dtype),
            torch.randn(16384, 768, generator=gen).to(DEVICE),
        )
        compare(inp, None, upstream)

    def test_real_shape_wide_rows(self, nan_empty):
        inp = make_inputs((64, 8192), torch.bfloat16, torch.float32)
        compare(inp, None, None)

    def test_real_shape_bit_identical(self, deterministic):
        inp = make_inputs((16384, 768), torch.bfloat16, torch.float32)
        first = run_and_grads(triton_rms, inp, None, None)
        second = run_and_grads(triton_rms, inp, None, None)
        for n in first[2]:
            assert torch.equal(first[2][n], second[2][n]), n
