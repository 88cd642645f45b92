"""The Mamba-3 layer's delta and A kernels (`ops.mamba3.activations`) against the chain of
PyTorch ops they replace: softplus(dd_dt + dt_bias) and -max(heavy_tail(dd_A), A_floor), in
float64 for the values and gradients, and in f32 through torch's autograd for the
gradient's ties (clamp's bounds)."""

import pytest
import torch
import torch.nn.functional as F

from mambakit.ops.mamba3.reference import heavy_tail

pytest.importorskip("triton")

from mambakit.ops.mamba3.activations import dt_and_A, fusable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def chain(dd_dt, dd_A, dt_bias, A_floor):
    f = torch.float64
    A = -heavy_tail(dd_A.to(f)).clamp(min=A_floor)
    return F.softplus(dd_dt.to(f) + dt_bias.to(f)), A


def rows(B, T, H, dtype, seed=0, width=None):
    """dd_dt and dd_A as neighbouring column blocks of an in_proj-like output [B, T, W]."""
    g = torch.Generator().manual_seed(seed)
    W = width or 3 * H + 5
    zx = (torch.randn(B, T, W, generator=g) * 3).to(dtype)
    dt, dA = slice(2, 2 + H), slice(2 + H, 2 + 2 * H)
    zx[0, 0, dt] = 30.0  # softplus's linear branch (u > 20)
    zx[-1, -1, dt] = -25.0  # e^u below f32's epsilon
    zx[0, 0, dA] = 0.0  # dd_A at 0: both of heavy_tail's pieces
    zx[-1, -1, dA] = -5.0  # heavy_tail 1/6: below the floor
    zx = zx.to(DEVICE)
    return zx[..., dt], zx[..., dA]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 9, 5), (1, 70, 24), (3, 1, 1)], ids=str)
def test_values_and_gradients_equal_the_float64_chain(dtype, shape, nan_empty):
    B, T, H = shape
    dd_dt, dd_A = rows(B, T, H, dtype)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(H, generator=g).to(DEVICE)
    A_floor = 0.3  # binds where dd_A is negative enough: f(u) = 1 / (1 - u) < 0.3
    assert fusable(dd_dt, dd_A)
    leaves = [t.detach().clone().requires_grad_(True) for t in (dd_dt, dd_A, bias)]
    leaves64 = [t.detach().double().requires_grad_(True) for t in (dd_dt, dd_A, bias)]
    delta, A = dt_and_A(*leaves, A_floor)
    delta64, A64 = chain(*leaves64, A_floor)
    assert delta.dtype == A.dtype == torch.float32 and delta.shape == dd_dt.shape
    torch.testing.assert_close(delta.double(), delta64, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(A.double(), A64, rtol=2e-6, atol=1e-7)
    assert bool((A64 == -A_floor).any()), "the floor never binds: the test misses a branch"
    gd = torch.randn(delta.shape, generator=g).to(DEVICE)
    gA = torch.randn(A.shape, generator=g).to(DEVICE)
    ((delta * gd).sum() + (A * gA).sum()).backward()
    ((delta64 * gd.double()).sum() + (A64 * gA.double()).sum()).backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for name, a, b in zip(("dd_dt", "dd_A", "dt_bias"), leaves, leaves64):
        assert a.grad.dtype == a.dtype, name
        torch.testing.assert_close(a.grad.double(), b.grad, **tol, msg=name)


def test_gradient_ties_follow_torch_autograd(nan_empty):
    """At dd_A = 0 both of heavy_tail's clamps pass the gradient (slope 2), and where
    heavy_tail(dd_A) equals A_floor the floor's clamp passes it: as torch's autograd of the
    chain in f32, exactly."""
    H = 4
    dd_A = torch.tensor([[0.0, -1.0, 2.0, -3.0]], device=DEVICE)  # f(-1) = 0.5, f(-3) below
    dd_dt = torch.tensor([[0.5, 20.0, 21.0, -40.0]], device=DEVICE)
    bias = torch.zeros(H, device=DEVICE)
    leaves = [t.clone().requires_grad_(True) for t in (dd_dt, dd_A, bias)]
    ref = [t.clone().requires_grad_(True) for t in (dd_dt, dd_A, bias)]
    delta, A = dt_and_A(*leaves, 0.5)
    (delta.sum() + A.sum()).backward()
    A_r = -heavy_tail(ref[1]).clamp(min=0.5)
    delta_r = F.softplus(ref[0] + ref[2])
    (delta_r.sum() + A_r.sum()).backward()
    torch.testing.assert_close(A, A_r, rtol=0, atol=0)
    torch.testing.assert_close(delta, delta_r, rtol=1e-6, atol=0)
    assert ref[1].grad.tolist() == [[-2.0, -0.25, -1.0, 0.0]]  # the closed form
    torch.testing.assert_close(leaves[1].grad, ref[1].grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(leaves[0].grad, ref[0].grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(leaves[2].grad, ref[2].grad, rtol=1e-6, atol=0)


def test_fusable_only_for_one_row_stride():
    zx = torch.randn(2, 6, 10)
    assert fusable(zx[..., :3], zx[..., 3:6])
    assert not fusable(zx[..., :3], zx[..., 3:5])  # shapes differ
    assert fusable(zx[:, ::2, :3], zx[:, ::2, 3:6])  # every other row: still one row stride
    t = zx.transpose(0, 1)[..., :3]  # leading dims that do not read as one
    assert not fusable(t, zx.transpose(0, 1)[..., 3:6])
    assert not fusable(zx[..., 0:6:2], zx[..., 1:7:2])  # columns not contiguous


def test_softplus_keeps_its_relative_precision_for_small_steps(nan_empty):
    """delta = softplus(u) for u in [-19, -3] (dt_min's 1e-3 is u = -6.9): within a few f32
    ulps of the float64 value, relative, where log(1 + e^u) would lose most of them."""
    u = torch.linspace(-19.0, -3.0, 97, device=DEVICE)[None, :]
    zeros = torch.zeros_like(u)
    delta, _ = dt_and_A(u, zeros, torch.zeros(u.shape[-1], device=DEVICE), 0.0)
    torch.testing.assert_close(delta.double(), F.softplus(u.double()), rtol=1e-6, atol=0)


def test_nan_stays_nan_and_a_strided_bias_is_read_by_its_stride(nan_empty):
    zx = torch.randn(2, 5, 12, device=DEVICE)
    zx[0, 1, 0] = float("nan")  # dd_dt
    zx[1, 3, 4] = float("nan")  # dd_A
    dd_dt, dd_A = zx[..., 0:4], zx[..., 4:8]
    wide = torch.randn(8, device=DEVICE)
    delta, A = dt_and_A(dd_dt, dd_A, wide[::2], 0.1)  # the bias: every other element
    delta64, A64 = chain(dd_dt.double(), dd_A.double(), wide[::2].double(), 0.1)
    assert bool(delta[0, 1, 0].isnan()) and bool(A[1, 3, 0].isnan())
    torch.testing.assert_close(delta.double(), delta64, rtol=2e-6, atol=1e-7, equal_nan=True)
    torch.testing.assert_close(A.double(), A64, rtol=2e-6, atol=1e-7, equal_nan=True)
