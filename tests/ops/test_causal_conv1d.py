"""causal_conv1d and its one-step update: the Triton kernels against the float64 reference.

B batch, T time, D channels, K = d_conv taps. On a machine without CUDA the
kernels run under the Triton interpreter (tiny shapes); `-m gpu` runs the
class at the bottom at the 130m model's shapes.
"""

from __future__ import annotations

import pytest
import torch

from mambakit.ops import causal_conv1d, causal_conv1d_update
from mambakit.ops.causal_conv1d import (
    causal_conv1d_reference,
    causal_conv1d_update_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Tolerance on max|got - ref| / max|ref| against the float64 oracle, by the dtype of
# the tensor compared. Inputs are drawn in their dtype and upcast exactly, so
# the only errors are f32 accumulation and the final rounding of out and dx:
# - f32: reordered f32 sums of K taps (dweight, dbias: of B*T terms) ~1e-6.
# - f16: one rounding to f16, unit roundoff 2^-11 = 4.9e-4 of the element.
# - bf16: one rounding to bf16, 2^-8 = 3.9e-3; the interpreter truncates f32 ->
#   bf16 instead of rounding to nearest, so up to one ulp, 2^-7 = 7.8e-3.
# f32 results (final state, dweight, dbias, dinitial_state) use the f32 bound
# whatever the input dtype: they never pass through a narrow dtype.
TOL = {torch.float32: 2e-5, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values (an unwritten element?)"
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    tol = TOL[got.dtype]
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e} ({got.dtype})"


def make_seq_idx(Bsz: int, T: int, n_docs: int, gen: torch.Generator) -> torch.Tensor | None:
    """[B, T] int32, non-decreasing, n_docs documents per row (row 0's last one is 1 step)."""
    if n_docs == 0:
        return None
    rows = []
    for b in range(Bsz):
        starts = torch.randperm(T - 1, generator=gen)[: n_docs - 1] + 1
        if b == 0:
            starts[0] = T - 1  # a last document shorter than K-1: final state partly zero
        marks = torch.zeros(T, dtype=torch.int32)
        marks[starts] = 1
        rows.append(marks.cumsum(0, dtype=torch.int32) + 5 * b + 2)
    return torch.stack(rows).to(DEVICE)


def make_inputs(Bsz, T, D, K, dtype, bias=True, init=True, n_docs=0, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dt)

    return dict(
        x=rnd(Bsz, T, D, dt=dtype).requires_grad_(),
        weight=(rnd(D, K) * 0.5).requires_grad_(),
        bias=rnd(D).requires_grad_() if bias else None,
        initial_state=rnd(Bsz, K - 1, D).requires_grad_() if init else None,
        seq_idx=make_seq_idx(Bsz, T, n_docs, gen),
    )


def leaves(inp: dict) -> dict:
    return {n: t for n, t in inp.items() if t is not None and t.is_floating_point()}


def as_f64(inp: dict) -> dict:
    return {
        n: t.detach().double().requires_grad_() if t is not None and t.is_floating_point() else t
        for n, t in inp.items()
    }


def run_and_grads(fn, inp, activation, gout_gfinal=None):
    """(out, final, {name: grad}) for loss <out, gout> + <final, gfinal>; `.sum()` if None."""
    out, final = fn(**inp, activation=activation, return_final_state=True)
    if gout_gfinal is None:
        loss = out.sum() + final.sum()
    else:
        gout, gfinal = gout_gfinal
        loss = (out * gout.to(out.dtype)).sum() + (final * gfinal.to(final.dtype)).sum()
    names = list(leaves(inp))
    grads = torch.autograd.grad(loss, [inp[n] for n in names])
    return out, final, dict(zip(names, grads))


def triton_conv(**kw):
    return causal_conv1d(**kw, backend="triton")


def compare(inp, activation, upstream):
    out, final, grads = run_and_grads(triton_conv, inp, activation, upstream)
    ref = as_f64(inp)
    # the upstream grads as the Triton path saw them: rounded to its output dtypes
    up64 = None if upstream is None else (upstream[0].to(out.dtype).double(), upstream[1].double())
    out_r, final_r, grads_r = run_and_grads(causal_conv1d_reference, ref, activation, up64)
    assert out.dtype == inp["x"].dtype and final.dtype == torch.float32
    assert_close("out", out, out_r)
    assert_close("final_state", final, final_r)
    for n, g in grads.items():
        assert g.dtype == inp[n].dtype, n
        assert_close(f"d{n}", g, grads_r[n])


# B, T, D, K, bias, initial_state, documents per row (0: no seq_idx), silu
CASES = [
    (2, 33, 16, 4, True, True, 3, True),
    (1, 7, 5, 3, False, False, 0, False),  # odd sizes, no optional input
    (2, 1, 8, 4, True, True, 0, True),  # seqlen 1: everything but x_0 is state
    (2, 2, 6, 5, True, True, 2, True),  # T < K-1: the final state keeps initial rows
    (1, 19, 12, 8, True, True, 4, True),  # K = 8
    (3, 20, 16, 2, True, False, 5, True),  # K = 2, many short documents
    (1, 300, 3, 4, False, True, 3, True),  # several T-blocks and backward tiles
    (1, 600, 10, 4, True, True, 3, True),  # several backward programs along time
    (2, 70, 9, 3, True, True, 2, True),  # K = 3: a padded tap slot in the backward
    # no seq_idx and K <= 4: the forward's row-walking kernel
    (2, 75, 9, 4, True, True, 0, True),  # several chunks, a tail of 3 times
    (1, 66, 300, 3, False, True, 0, True),  # a tail of 2, three blocks of channels in f32
    (2, 5, 6, 2, True, True, 0, False),  # K = 2, one chunk shorter than a step
    (1, 2, 4, 4, True, True, 0, True),  # T < K-1: the final state keeps initial rows
    (2, 64, 16, 4, True, True, 0, True),  # whole tiles of 32 times
]


def case_id(c):
    Bsz, T, D, K, bias, init, docs, silu = c
    return (
        f"B{Bsz}-T{T}-D{D}-K{K}" + ("-bias" if bias else "") + ("-h0" if init else "")
        + (f"-docs{docs}" if docs else "") + ("-silu" if silu else "")
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_conv_matches_reference(case, dtype, nan_empty):
    Bsz, T, D, K, bias, init, docs, silu = case
    inp = make_inputs(Bsz, T, D, K, dtype, bias, init, docs)
    gen = torch.Generator().manual_seed(1)
    upstream = (
        torch.randn(Bsz, T, D, generator=gen).to(DEVICE, dtype),
        torch.randn(Bsz, K - 1, D, generator=gen).to(DEVICE),
    )
    compare(inp, "silu" if silu else None, upstream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_conv_sum_loss_expanded_grads(dtype, nan_empty):
    """`.sum()` hands the backward stride-0 expanded gradients for out and the final state."""
    compare(make_inputs(2, 11, 7, 4, dtype, n_docs=2), "silu", None)


@pytest.mark.parametrize("which", ["out", "final"])
def test_conv_grad_through_one_output(which, nan_empty):
    inp = make_inputs(2, 9, 6, 4, torch.float32, n_docs=2)
    ref = as_f64(inp)
    grads = []
    for fn, args in ((triton_conv, inp), (causal_conv1d_reference, ref)):
        out, final = fn(**args, return_final_state=True)
        loss = (out if which == "out" else final).pow(2).sum()
        grads.append(torch.autograd.grad(loss, list(leaves(args).values()), allow_unused=True))
    for g, g_r in zip(*grads):
        if g_r is None:  # bias, weight: unused by the final state
            assert g is None or not g.any()
        else:
            assert_close("grad", g, g_r)


def test_conv_no_final_state(nan_empty):
    inp = make_inputs(2, 10, 6, 3, torch.float32, n_docs=2)
    out = triton_conv(**inp)
    out.sum().backward()
    ref = as_f64(inp)
    causal_conv1d_reference(**ref).sum().backward()
    assert_close("out", out, causal_conv1d_reference(**ref).detach())
    for n, t in leaves(inp).items():
        assert_close(f"d{n}", t.grad, ref[n].grad)


def test_conv_strided_input():
    """x may be a slice of a wider tensor (the in_proj output): read in place, same result."""
    inp = make_inputs(2, 13, 6, 4, torch.bfloat16, n_docs=2)
    wide = torch.randn(2, 13, 15, device=DEVICE, dtype=torch.bfloat16)
    wide[..., 3:9] = inp["x"].detach()
    wide.requires_grad_()
    view = wide[..., 3:9]
    assert not view.is_contiguous()
    out_c, final_c, grads_c = run_and_grads(triton_conv, inp, "silu")
    out_v, final_v, grads_v = run_and_grads(triton_conv, {**inp, "x": view}, "silu")
    assert torch.equal(out_c, out_v) and torch.equal(final_c, final_v)
    (g_wide,) = torch.autograd.grad(triton_conv(**{**inp, "x": view}).float().pow(2).sum(), [wide])
    (g_x,) = torch.autograd.grad(triton_conv(**inp).float().pow(2).sum(), [inp["x"]])
    assert torch.equal(g_wide[..., 3:9], g_x) and not g_wide[..., :3].any()
    for n in ("weight", "bias", "initial_state"):
        assert torch.equal(grads_c[n], grads_v[n]), n


def test_conv_grads_bit_identical(deterministic):
    inp = make_inputs(3, 150, 10, 4, torch.bfloat16, n_docs=3)
    first = run_and_grads(triton_conv, inp, "silu")
    second = run_and_grads(triton_conv, inp, "silu")
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for n in first[2]:
        assert torch.equal(first[2][n], second[2][n]), n


def test_conv_torch_compile_fullgraph():
    inp = make_inputs(2, 9, 6, 4, torch.float32, n_docs=2)

    def f(x, weight, bias, initial_state, seq_idx):
        out, final = causal_conv1d(
            x, weight, bias, initial_state, seq_idx, return_final_state=True, backend="triton"
        )
        return out.pow(2).sum() + final.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    names = list(leaves(inp))
    g_c = torch.autograd.grad(compiled(**inp), [inp[n] for n in names])
    g_e = torch.autograd.grad(f(**inp), [inp[n] for n in names])
    for n, a, b in zip(names, g_c, g_e):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("K", [2, 4, 5])
def test_conv_update_matches_reference(K, dtype, nan_empty):
    Bsz, D = 3, 10
    gen = torch.Generator().manual_seed(K)
    state = torch.randn(Bsz, K - 1, D, generator=gen).to(DEVICE)
    x = torch.randn(Bsz, D, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(D, K, generator=gen).to(DEVICE)
    bias = torch.randn(D, generator=gen).to(DEVICE)
    state_r = state.double()
    ptr = state.data_ptr()
    out = causal_conv1d_update(state, x, weight, bias, "silu", backend="triton")
    out_r = causal_conv1d_update_reference(state_r, x.double(), weight.double(), bias.double())
    assert out.dtype == dtype and state.data_ptr() == ptr
    assert_close("out", out, out_r)
    assert torch.equal(state.double(), state_r)  # a shift: exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_conv_update_steps_equal_forward(dtype):
    """T one-step updates from a state == one forward over T with that initial state."""
    Bsz, T, D, K = 2, 6, 7, 4
    inp = make_inputs(Bsz, T, D, K, dtype)
    x, weight, bias, h0 = (inp[n].detach() for n in ("x", "weight", "bias", "initial_state"))
    out, final = triton_conv(
        x=x, weight=weight, bias=bias, initial_state=h0, return_final_state=True
    )
    state = h0.clone()
    steps = [causal_conv1d_update(state, x[:, t], weight, bias, backend="triton") for t in range(T)]
    assert torch.equal(state, final)
    assert rel_err(torch.stack(steps, 1), out.double()) <= TOL[dtype]


def test_conv_update_no_bias_no_activation():
    state = torch.randn(2, 2, 5, device=DEVICE)
    state_r = state.clone()
    x = torch.randn(2, 5, device=DEVICE)
    w = torch.randn(5, 3, device=DEVICE)
    out = causal_conv1d_update(state, x, w, None, None, backend="triton")
    out_r = causal_conv1d_update_reference(state_r, x, w, None, None)
    assert_close("out", out, out_r.double())
    assert torch.equal(state, state_r)


def test_conv_reference_gradcheck():
    inp = as_f64(make_inputs(2, 6, 3, 3, torch.float64, n_docs=2))

    def f(x, weight, bias, initial_state):
        return causal_conv1d_reference(
            x, weight, bias, initial_state, inp["seq_idx"], "silu", return_final_state=True
        )

    args = [inp[n] for n in ("x", "weight", "bias", "initial_state")]
    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((2, 100, 16), id="tiny"),
        pytest.param(
            (8, 2048, 1536), id="130m", marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)  # fmt: skip
def test_pipelined_backward_gives_the_same_bits(shape, stages):
    """`ConvConfig.bwd_stages` only moves when the tiles' loads are issued (async copies on
    the GPU): dx, d weight, d bias and d initial_state are bit for bit those of one stage,
    with documents and an initial state."""
    import dataclasses

    from mambakit.ops.causal_conv1d import launch as K

    Bsz, T, D = shape
    inp = make_inputs(Bsz, T, D, 4, torch.bfloat16, n_docs=3)
    x, w, b, init = (inp[k].detach() for k in ("x", "weight", "bias", "initial_state"))
    dout = torch.randn(Bsz, T, D, device=DEVICE, dtype=torch.bfloat16)
    dfinal = torch.randn(Bsz, 3, D, device=DEVICE)
    runs = [
        K.conv_bwd(dout, dfinal, x, w, b, init, inp["seq_idx"], True,
                   cfg=dataclasses.replace(K.CONFIG, bwd_stages=s))
        for s in (1, stages)
    ]  # fmt: skip
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@pytest.mark.parametrize(
    "Bsz, T, D, K, bias, silu",
    [
        (2, 45, 16, 4, True, True),  # several chunks of 8, a tail of 5
        (1, 8, 12, 4, False, True),  # one whole chunk
        (3, 3, 5, 4, True, True),  # T = K - 1: every row's taps reach before 0
        (2, 2, 5, 4, True, True),  # T < K - 1
        (1, 1, 3, 1, True, True),  # T = 1, K = 1 (three zero taps)
        (1, 30, 300, 3, True, False),  # K = 3 (a zero tap), three blocks of channels
        (2, 17, 9, 2, False, True),  # K = 2
        pytest.param(8, 2048, 1536, 4, True, True, marks=ON_GPU),  # the 130m layer's shape
        pytest.param(4, 2048, 4096, 4, True, True, marks=ON_GPU),  # 1.4b's (128 channels)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_backward_by_rows_matches_reference(Bsz, T, D, K, bias, silu, dtype, nan_empty):
    """The backward walking rows (`ConvConfig.bwd_rows_chunk`: K <= 4, no documents or
    initial state): dx, d weight and d bias against the float64 autograd of the reference,
    in chunks of 8 times (several programs along time and channels; the real shapes in the
    library's config), 4 rows an iteration and 1; dx written into the left half of a
    [B, T, 2D] tensor as the mixer does (the right half untouched), and the same bits again
    into a tensor of its own; a stride-0 dout (a `.sum()` loss's); a final-state gradient
    (strided), and one of zeros giving the bits of none (what a compiled graph passes for an
    unused final state). The tile kernel, on the same cases, against the same oracle."""
    import dataclasses

    from mambakit.ops.causal_conv1d import launch as L

    inp = make_inputs(Bsz, T, D, K, dtype, bias=bias, init=False)
    gen = torch.Generator().manual_seed(3)
    x, w = inp["x"].detach(), inp["weight"].detach()
    b = None if inp["bias"] is None else inp["bias"].detach()
    ref = as_f64(inp)
    out, final = causal_conv1d_reference(
        **ref, activation="silu" if silu else None, return_final_state=True
    )
    names = [n for n in ("x", "weight", "bias") if ref[n] is not None]
    # small shapes: chunks of 8 times, 128 channels; the real ones: the library's config
    small = dict(bwd_rows_chunk=8, bwd_rows_block_d=128) if T < 1000 else {}
    dfinal = torch.randn(Bsz, D, K - 1, generator=gen).to(DEVICE).transpose(1, 2)  # strided
    cases = [  # dout, rows an iteration, final-state gradient
        (torch.randn(Bsz, T, D, generator=gen).to(DEVICE, dtype), 4, None),
        (torch.randn(D, generator=gen).to(DEVICE, dtype).expand(Bsz, T, D), 1, None),
        (torch.randn(Bsz, T, D, generator=gen).to(DEVICE, dtype), 4, dfinal),
    ]
    for dout, unroll, dfin in cases:
        cfg = dataclasses.replace(L.CONFIG, **small, bwd_rows_unroll=unroll)
        dxz = torch.full((Bsz, T, 2 * D), 7.0, device=DEVICE, dtype=dtype)
        dx, dw, db, dinit = L.conv_bwd(dout, dfin, x, w, b, None, None, silu, dxz[..., :D],
                                       cfg=cfg)  # fmt: skip
        again = L.conv_bwd(dout, dfin, x, w, b, None, None, silu, cfg=cfg)
        assert all(torch.equal(p, q) for p, q in zip((dx, dw, db), again[:3]) if p is not None)
        assert dinit is None and dx.dtype == dtype and dx.data_ptr() == dxz.data_ptr()
        assert (dxz[..., D:] == 7.0).all()  # the other half untouched
        if dfin is None:
            zeros = torch.zeros(Bsz, K - 1, D, device=DEVICE)
            same = L.conv_bwd(dout, zeros, x, w, b, None, None, silu, cfg=cfg)
            assert all(torch.equal(p, q) for p, q in zip((dx, dw, db), same[:3]) if p is not None)
        loss = (out * dout.double()).sum()
        if dfin is not None:
            loss = loss + (final * dfin.double()).sum()
        want = torch.autograd.grad(loss, [ref[n] for n in names], retain_graph=True)
        tiles = L.conv_bwd(dout, dfin, x, w, b, None, None, silu,
                           cfg=dataclasses.replace(L.CONFIG, bwd_rows_chunk=0))  # fmt: skip
        for kernel, got in (("rows", (dx, dw, db)), ("tiles", tiles[:3])):
            got = dict(zip(("x", "weight", "bias"), got))
            for n, g in zip(names, want):
                assert_close(f"d{n} ({kernel})", got[n], g)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCausalConv1dGPU:
    """The 130m model's shapes (B=8, T=2048, d_inner=1536, K=4) on the device."""

    def test_real_shapes_match_reference(self, nan_empty):
        for dtype in DTYPES:
            inp = make_inputs(8, 2048, 1536, 4, dtype, n_docs=4)
            gen = torch.Generator().manual_seed(1)
            upstream = (
                torch.randn(8, 2048, 1536, generator=gen).to(DEVICE, dtype),
                torch.randn(8, 3, 1536, generator=gen).to(DEVICE),
            )
            compare(inp, "silu", upstream)

    def test_real_shapes_strided_and_deterministic(self, deterministic):
        xz = torch.randn(8, 2048, 2 * 1536, device=DEVICE, dtype=torch.bfloat16)
        inp = make_inputs(8, 2048, 1536, 4, torch.bfloat16, n_docs=4)
        inp["x"] = xz[..., :1536].requires_grad_()
        first = run_and_grads(triton_conv, inp, "silu")
        second = run_and_grads(triton_conv, inp, "silu")
        for a, b in zip(first[:2], second[:2]):
            assert torch.equal(a, b)
        for n in first[2]:
            assert torch.equal(first[2][n], second[2][n]), n

    def test_update_real_shapes(self):
        state = torch.randn(8, 3, 1536, device=DEVICE)
        state_r = state.double()
        x = torch.randn(8, 1536, device=DEVICE, dtype=torch.bfloat16)
        w = torch.randn(1536, 4, device=DEVICE)
        b = torch.randn(1536, device=DEVICE)
        out = causal_conv1d_update(state, x, w, b, backend="triton")
        out_r = causal_conv1d_update_reference(state_r, x.double(), w.double(), b.double())
        assert_close("out", out, out_r)
        assert torch.equal(state.double(), state_r)
