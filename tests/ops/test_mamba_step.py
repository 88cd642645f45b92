"""The fused decode step of a Mamba block (ops.mamba_layer_step) and the small-batch
linear (ops.norm_linear) against the float64 op chain.

On the CPU the kernels run under the Triton interpreter at tiny shapes; on the
device (`-m gpu`) at the 130m model's shapes and batch sizes 1, 2, 8 and 64 (the
three code paths: the norm fused into the first kernel, a norm launch before
the row-loop kernels, cuBLAS projections around the fused conv and SSM kernels).
"""

import dataclasses
import math

import pytest
import torch

from mambakit import MambaConfig, MambaLM
from mambakit.ops import StepWeights, mamba_layer_step, norm_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

DTYPES = (torch.float32, torch.bfloat16)


def make_weights(M, Dn, N, R, K, dtype, bias, gen, device=DEVICE) -> StepWeights:
    def w(*shape):
        return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])).to(device, dtype)

    return StepWeights(
        norm_w=(1 + 0.1 * torch.randn(M, generator=gen)).to(device, dtype),
        eps=1e-5,
        in_w=w(2 * Dn, M),
        in_b=w(2 * Dn) if bias else None,
        conv_w=w(Dn, K),
        conv_b=w(Dn) if bias else None,
        x_w=w(R + 2 * N, Dn),
        dt_w=w(Dn, R),
        dt_bias=(0.5 * torch.randn(Dn, generator=gen)).to(device),
        A=(-0.5 - torch.rand(Dn, N, generator=gen)).to(device),
        D=torch.randn(Dn, generator=gen).to(device),
        out_w=w(M, Dn),
        out_b=w(M) if bias else None,
    )


def to64(w: StepWeights) -> StepWeights:
    return StepWeights(*(t.double() if isinstance(t, torch.Tensor) else t for t in w))


def run(w, hidden, residual, conv, ssm, backend, cfg=None):
    """The step on `backend`; with cfg, the Triton launcher itself with those settings."""
    conv, ssm = conv.clone(), ssm.clone()
    if cfg is not None:
        from mambakit.ops.mamba_step.launch import layer_step

        out, res = layer_step(hidden, residual, w, conv, ssm, cfg=cfg)
    else:
        out, res = mamba_layer_step(hidden, residual, w, conv, ssm, backend=backend)
    return out, res, conv, ssm


# The interpreter truncates to bf16 where the GPU rounds to nearest: its bf16 results
# drift further from the oracle than the op chain's, by up to a bf16 ulp per rounding.
BF16_FACTOR, BF16_SLACK = (2.0, 2e-3) if DEVICE == "cuda" else (4.0, 1e-2)


def bf16_ok(got, ref, oracle) -> bool:
    """got is as close to the float64 oracle as the bf16 op chain `ref`, within rounding."""
    return rel_err(got, oracle) <= BF16_FACTOR * rel_err(ref, oracle) + BF16_SLACK


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def check_step(M, Dn, N, R, K, B, dtype, bias, first, seed=0, cfg=None):
    gen = torch.Generator().manual_seed(seed)
    w = make_weights(M, Dn, N, R, K, dtype, bias, gen)
    hidden = torch.randn(B, M, generator=gen).to(DEVICE, dtype)
    residual = None if first else torch.randn(B, M, generator=gen).to(DEVICE)
    conv = torch.randn(B, K - 1, Dn, generator=gen).to(DEVICE)
    ssm = torch.randn(B, Dn, N, generator=gen).to(DEVICE)
    got = run(w, hidden, residual, conv, ssm, "triton", cfg)
    ref = run(w, hidden, residual, conv, ssm, "reference")
    oracle = run(
        to64(w), hidden.double(), None if first else residual.double(), conv.double(),
        ssm.double(), "reference",
    )  # fmt: skip
    names = ("out", "residual", "conv_state", "ssm_state")
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for name, g, r, o in zip(names, got, ref, oracle):
        assert torch.isfinite(g).all(), name
        if dtype == torch.float32:
            assert rel_err(g, o) < 2e-5, name
        else:
            assert bf16_ok(g, r, o), (name, rel_err(g, o), rel_err(r, o))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "B, rows_max, dt_bytes, ssm_rows",
    [(1, 1, 1 << 24, 2), (3, 16, 1 << 24, 2), (20, 1, 1 << 24, 2), (20, 1, 0, 2),
     (5, 1, 1 << 24, 4)],
)  # fmt: skip
def test_layer_step_matches_float64_op_chain(nan_empty, dtype, B, rows_max, dt_bytes, ssm_rows):
    # B = 1: matrix-vector kernels, the norm fused into in_proj's; B > rows_max_batch:
    # cuBLAS projections around the fused conv and SSM kernels (dt_proj fused; B = 5 with
    # ssm_rows = 4: the last row block three quarters masked); B = 3 with rows_max_batch =
    # 16: a norm launch, then the row-loop kernels; dt_proj_fused_bytes = 0: dt_proj by
    # cuBLAS, the SSM kernel reads delta
    from mambakit.ops.mamba_step import launch

    cfg = dataclasses.replace(
        launch.config(DEVICE == "cpu"),
        rows_max_batch=rows_max,
        rows_max_batch_f32=rows_max,
        dt_proj_fused_bytes=dt_bytes,
        ssm_rows=ssm_rows,
    )
    for bias, first in ((False, False), (True, True)):
        check_step(M=24, Dn=40, N=4, R=3, K=4, B=B, dtype=dtype, bias=bias, first=first, cfg=cfg)


@pytest.mark.parametrize("K", [2, 3])
def test_layer_step_short_convs(nan_empty, K):
    check_step(M=16, Dn=24, N=8, R=2, K=K, B=2, dtype=torch.float32, bias=True, first=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [1, 5])
def test_norm_linear_matches_float64(nan_empty, dtype, B):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, 40, generator=gen).to(DEVICE, dtype)
    W = (torch.randn(70, 40, generator=gen) / 6).to(DEVICE, dtype)
    bias = torch.randn(70, generator=gen).to(DEVICE, dtype)
    res = torch.randn(B, 40, generator=gen).to(DEVICE)
    nw = torch.randn(40, generator=gen).to(DEVICE, dtype)
    for kw in ({}, {"bias": bias}, {"residual": res, "norm_weight": nw}):
        got = norm_linear(x, W, backend="triton", **kw)
        ref = norm_linear(x, W, backend="reference", **kw)
        o64 = {k: v.double() for k, v in kw.items()}
        oracle = norm_linear(x.double(), W.double(), backend="reference", **o64)
        assert got.dtype == dtype and got.shape == (B, 70)
        if dtype == torch.float32:
            assert rel_err(got, oracle) < 1e-5
        else:
            assert bf16_ok(got, ref, oracle)


@pytest.mark.parametrize("first", [False, True], ids=["residual", "first-layer"])
@pytest.mark.parametrize("B", [1, 5])
def test_linear_returns_the_residual(B, first):
    """`linear(..., return_residual=True)`: the norm's input x + residual in f32 beside the
    output (the streaming kernel's first column block stores it at batch 1; above, the
    norm launch's), the output as without it; without norm_weight it is refused."""
    from mambakit.ops.mamba_step.launch import linear

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, 40, generator=gen).to(DEVICE, torch.bfloat16)
    W = (torch.randn(70, 40, generator=gen) / 6).to(DEVICE, torch.bfloat16)
    res = None if first else torch.randn(B, 40, generator=gen).to(DEVICE)
    nw = torch.randn(40, generator=gen).to(DEVICE, torch.bfloat16)
    out, r = linear(x, W, residual=res, norm_weight=nw, return_residual=True)
    want = x.float() + (res if res is not None else 0)
    assert r.dtype == torch.float32 and r.shape == (B, 40)
    torch.testing.assert_close(r, want, rtol=0, atol=0)
    torch.testing.assert_close(out, linear(x, W, residual=res, norm_weight=nw), rtol=0, atol=0)
    with pytest.raises(ValueError, match="return_residual needs norm_weight"):
        linear(x, W, return_residual=True)


@pytest.mark.parametrize("B", [1, 3, 17])
def test_lm_step_runs_the_fused_kernels_and_equals_the_op_chain(monkeypatch, B):
    from mambakit.ops.mamba_step import launch

    calls = {"layer": 0, "linear": 0}
    layer_step, linear = launch.layer_step, launch.linear

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(launch, "layer_step", count("layer", layer_step))
    monkeypatch.setattr(launch, "linear", count("linear", linear))
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=32, n_layers=2, vocab_size=64)
    model = MambaLM(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 64, (B, 5), device=DEVICE)
    logits, states = {}, {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
        state = model.init_state(B)
        with torch.no_grad():
            logits[backend] = torch.stack([model.step(ids[:, t], state)[0] for t in range(5)], 1)
        states[backend] = state
    # 5 steps of 2 layers; each step's LM head is a `linear`, and so are each layer's x_proj
    # and out_proj up to `rows_max_batch_f32` (16) rows of these float32 weights (at 17 rows
    # cuBLAS runs them)
    assert launch.config(DEVICE == "cpu").rows_max_batch_f32 == 16
    assert calls == {"layer": 10, "linear": 5 + (20 if B <= 16 else 0)}
    torch.testing.assert_close(logits["triton"], logits["reference"], rtol=1e-5, atol=1e-5)
    for part in ("conv", "ssm"):
        a, b = getattr(states["triton"], part), getattr(states["reference"], part)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and the parallel forward over the same tokens
    monkeypatch.setenv("MAMBAKIT_BACKEND", "reference")
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(logits["triton"], full, rtol=1e-4, atol=1e-4)


def test_layer_step_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    w = make_weights(16, 24, 4, 2, 4, torch.float32, False, gen, device="cpu")
    h = torch.randn(2, 16)
    conv, ssm = torch.zeros(2, 3, 24), torch.zeros(2, 24, 4)
    with pytest.raises(ValueError, match="ssm_state"):
        mamba_layer_step(h, None, w, conv, torch.zeros(2, 24, 5))
    with pytest.raises(ValueError, match="conv_state"):
        mamba_layer_step(h, None, w, torch.zeros(3, 3, 24), ssm)
    with pytest.raises(ValueError, match="hidden"):
        mamba_layer_step(torch.randn(2, 17), None, w, conv, ssm)
    with pytest.raises(TypeError, match="residual"):
        mamba_layer_step(h, torch.randn(2, 16, dtype=torch.float64), w, conv, ssm)
    with pytest.raises(TypeError, match="ssm_state"):
        mamba_layer_step(h, None, w, conv, ssm.double())
    with pytest.raises(TypeError, match="weights"):
        mamba_layer_step(h, None, tuple(w), conv, ssm)
    # the weights themselves, on both bodies: the fused kernels index them without checks
    bad_weights = {
        "weights.in_w": w._replace(in_w=torch.randn(50, 16)),
        "weights.x_w": w._replace(x_w=torch.randn(11, 24)),
        "weights.dt_bias": w._replace(dt_bias=torch.randn(23)),
        "weights.out_w": w._replace(out_w=torch.randn(16, 25)),
        "weights.A": w._replace(A=w.A.t().contiguous().t()),  # transposed storage
        "weights.D": w._replace(D=torch.randn(24, 2)[:, 0]),  # stride 2
    }
    for name, wb in bad_weights.items():
        for backend in ("reference", "triton"):
            with pytest.raises(ValueError, match=name):
                mamba_layer_step(h, None, wb, conv.clone(), ssm.clone(), backend=backend)
    with pytest.raises(ValueError, match="x must have shape"):
        norm_linear(torch.randn(2, 5), torch.randn(7, 6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestGPU:
    """The 130m block (M 768, D 1536, N 16, R 48) and LM head at decode batch sizes."""

    @pytest.mark.parametrize("B", [1, 2, 8, 64])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_130m_block(self, nan_empty, B, dtype):
        check_step(M=768, Dn=1536, N=16, R=48, K=4, B=B, dtype=dtype, bias=False, first=False)

    @pytest.mark.parametrize("B", [1, 2, 8, 64])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_lm_head(self, nan_empty, B, dtype):
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(B, 768, generator=gen).to(DEVICE, dtype)
        W = (torch.randn(50280, 768, generator=gen) / 28).to(DEVICE, dtype)
        res = torch.randn(B, 768, generator=gen).to(DEVICE)
        nw = torch.randn(768, generator=gen).to(DEVICE, dtype)
        got = norm_linear(x, W, residual=res, norm_weight=nw)
        ref = norm_linear(x, W, residual=res, norm_weight=nw, backend="reference")
        oracle = norm_linear(
            x.double(), W.double(), residual=res.double(), norm_weight=nw.double(),
            backend="reference",
        )  # fmt: skip
        if dtype == torch.float32:
            assert rel_err(got, oracle) < 1e-5
        else:
            assert bf16_ok(got, ref, oracle)
        assert torch.equal(got, norm_linear(x, W, residual=res, norm_weight=nw))  # deterministic


def test_projections_stream_by_batch_dtype_and_weight_size():
    """Where the step's projections stream through its kernels rather than cuBLAS: at batch
    1; 16-bit weights up to 2 rows while their rows are at most 1,024 long, or 2,048 and the
    weight at most 8 MiB (the 130m models); float32 weights up to 16 rows while the weight
    is at most 1 MiB (the small RL models)."""
    from mambakit.ops.mamba_step import launch

    cfg = launch.config(False)
    small, large = torch.empty(512, 128), torch.empty(3072, 768)  # 256 KiB, 9 MiB of f32
    half = torch.empty(512, 128, dtype=torch.bfloat16)
    assert [launch._streams(b, small, 128, cfg) for b in (1, 16, 17)] == [True, True, False]
    assert [launch._streams(b, large, 1024, cfg) for b in (1, 2)] == [True, False]
    assert [launch._streams(b, half, 128, cfg) for b in (1, 2, 3)] == [True, True, False]

    def bf16(rows, k):
        return torch.empty(rows, k, dtype=torch.bfloat16)

    # 130m: in_proj, x_proj, out_proj, LM head; 790m's in_proj (9 MiB of rows of 1,536),
    # 1.4b's x_proj (rows of 4,096)
    at_2 = [
        (bf16(3072, 768), 1024),
        (bf16(80, 1536), 2048),
        (bf16(768, 1536), 2048),
        (bf16(50280, 768), 1024),
        (bf16(3072, 1536), 2048),
        (bf16(160, 4096), 4096),
    ]
    assert [launch._streams(2, w, k, cfg) for w, k in at_2] == [True] * 4 + [False] * 2
    assert not launch._streams(1, small, 2 * cfg.tile, cfg)  # rows wider than a slab
