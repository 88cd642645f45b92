"""The fused Mamba-2 decode step (ops/mamba2/step.py): in_proj's rows to what out_proj reads,
the conv and SSM states advanced in place.

The fused reference against the ops it fuses, composed here in float64 (the conv update,
`mamba2_step_reference`, the gated RMSNorm written out), and T of its steps against one
pass over the sequence (`causal_conv1d_reference`, `mamba2_scan_reference`); the Triton
kernels (the interpreter on the CPU) against the fused reference on float64 states, in
place, at tiny sizes; on the GPU at the 130m-mamba2 shape (`-m gpu`).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mambakit.ops.causal_conv1d.reference import (
    causal_conv1d_reference,
    causal_conv1d_update_reference,
)
from mambakit.ops.mamba2.reference import mamba2_scan_reference, mamba2_step_reference
from mambakit.ops.mamba2.step import (
    Mamba2StepConfig,
    mamba2_step_fused_reference,
    mamba2_step_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Largest relative error (norm of the difference over the norm) against the fused reference
# on float64 states. f32 rows: f32 sums in another order. bf16 rows: the kernels round the
# conv's output and y to bf16 where the reference does, so on the GPU (round to nearest)
# the two differ only where an f32 sum lands the other side of a rounding tie; the
# interpreter truncates to bf16 instead, up to an ulp (2^-7) per rounded value, so x, B, C
# and y drift by ~2^-9 on average and the state's new term with them.
TOL = {
    torch.float32: {"y": 1e-5, "conv": 1e-7, "ssm": 1e-5},
    torch.bfloat16: {"y": 1e-2, "conv": 1e-7, "ssm": 2e-3}
    if DEVICE == "cuda"
    else {"y": 2e-2, "conv": 1e-7, "ssm": 1.5e-2},
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def make(case, seed=0, pad=0):
    """For case (B, d_mlp, H, P, G, N, K, options: bias, D "head" / "hdim" / None, norm):
    weights, a random prefilled state (f64, CPU) and `rows(dtype, device)`, drawing
    in_proj rows [B, W]: a slice of a wider tensor when pad > 0 (made in the dtype and on
    the device first: a copy of a slice would be contiguous)."""
    Bn, d_mlp, H, P, G, N, K, o = case
    bias, D, norm = o.get("bias", True), o.get("D", "head"), o.get("norm", True)
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    d_ssm = H * P
    conv_dim = d_ssm + 2 * G * N
    W = 2 * d_mlp + d_ssm + conv_dim + H
    w = dict(
        conv_w=r(conv_dim, K, scale=0.5),
        conv_b=r(conv_dim, scale=0.2) if bias else None,
        dt_bias=r(H, scale=0.5) - 1.0,
        A=-torch.exp(r(H, scale=0.5)),
        D={"head": r(H), "hdim": r(H, P), None: None}[D],
        norm_w=1.0 + r(d_ssm, scale=0.3) if norm else None,
    )
    conv = r(Bn, K - 1, conv_dim)
    ssm = r(Bn, H, P, N, scale=0.5)

    def rows(dtype=torch.float64, device="cpu"):
        wide = r(Bn, W + 2 * pad).to(device, dtype)
        return wide[:, pad : pad + W]

    return w, conv, ssm, rows, (d_mlp, d_ssm, G, N, H, P)


def composed_step(zx, conv, ssm, w, eps, sizes, dt_limit, nbg):
    """The step from the ops it fuses (float64): returns (out, conv, ssm), new tensors."""
    d_mlp, d_ssm, G, N, H, P = sizes
    Bn = zx.shape[0]
    z0, x0, z, xBC, dt = zx.split([d_mlp, d_mlp, d_ssm, d_ssm + 2 * G * N, H], -1)
    conv = conv.clone()
    xBC = causal_conv1d_update_reference(conv, xBC, w["conv_w"], w["conv_b"], "silu")
    x, B, C = xBC.split([d_ssm, G * N, G * N], -1)
    delta = F.softplus(dt + w["dt_bias"]).clamp(*dt_limit)
    gate_in_step = w["norm_w"] is None
    y, ssm = mamba2_step_reference(
        x.reshape(Bn, H, P), delta, w["A"], B.reshape(Bn, G, N), C.reshape(Bn, G, N), w["D"],
        z.reshape(Bn, H, P) if gate_in_step else None, ssm,
    )  # fmt: skip
    out = y.reshape(Bn, d_ssm)
    if not gate_in_step:
        out = gated_norm(out, z, w["norm_w"], eps, G, nbg)
    if d_mlp:
        out = torch.cat([z0 * torch.sigmoid(z0) * x0, out], -1)
    return out, conv, ssm


def gated_norm(y, z, weight, eps, G, nbg):
    """RMSNorm over G groups of consecutive channels, gated by silu(z) after (nbg) or
    before the statistics, written out."""
    Bn, d = y.shape
    yg, zg = y.view(Bn, G, d // G), z.reshape(Bn, G, d // G)
    s = zg * torch.sigmoid(zg)
    v = yg if nbg else yg * s
    o = v / torch.sqrt((v * v).sum(-1, keepdim=True) / (d // G) + eps)
    return ((o * s) if nbg else o).reshape(Bn, d) * weight


CASES = {
    # Bn, d_mlp, H, P, G, N, K, options
    "G1-Dhead": (3, 0, 4, 8, 1, 16, 4, dict()),
    "G2-Dhdim-nbg-mlp-limit": (3, 3, 4, 8, 2, 16, 4, dict(D="hdim", nbg=True, limit=True)),
    "G2-nonorm-noD-nobias": (3, 0, 4, 8, 2, 16, 4, dict(D=None, norm=False, bias=False)),
    "odd-P6-N12-K3-mlp-nonorm": (3, 5, 4, 6, 2, 12, 3, dict(norm=False, limit=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_reference_equals_the_composed_ops(case):
    Bn, d_mlp, H, P, G, N, K, o = CASES[case]
    w, conv, ssm, rows, sizes = make(CASES[case], pad=3)
    limit = (0.05, 0.8) if o.get("limit") else (0.0, math.inf)
    nbg = o.get("nbg", False)
    for t in range(3):
        zx = rows()
        want, conv_want, ssm_want = composed_step(zx, conv, ssm, w, 1e-5, sizes, limit, nbg)
        got = mamba2_step_fused_reference(zx, conv, ssm, **w, eps=1e-5, sizes=sizes,
                                          dt_limit=limit, norm_before_gate=nbg)  # fmt: skip
        assert got.shape == (Bn, d_mlp + H * P) and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"y, step {t}")
        torch.testing.assert_close(conv, conv_want, rtol=0, atol=0, msg=f"conv, step {t}")
        torch.testing.assert_close(ssm, ssm_want, rtol=1e-12, atol=1e-12, msg=f"ssm, step {t}")


@pytest.mark.parametrize(
    "norm, nbg", [(True, False), (True, True), (False, False)],
    ids=["gate-in-norm", "norm-before-gate", "no-norm"],
)  # fmt: skip
def test_steps_equal_one_pass_over_the_sequence(norm, nbg):
    """T fused steps == the conv and the chunked scan over all T tokens at once (float64):
    every step's output and the final conv and SSM states."""
    Bn, d_mlp, H, P, G, N, K, T = 2, 2, 4, 3, 2, 5, 4, 9
    w, conv0, ssm0, rows, sizes = make((Bn, d_mlp, H, P, G, N, K, dict(D="hdim", norm=norm)), 1)
    d_ssm = H * P
    limit = (0.05, 2.0)
    zx = torch.stack([rows() for _ in range(T)], 1)  # [B, T, W]
    conv, ssm = conv0.clone(), ssm0.clone()
    kw = dict(eps=1e-5, sizes=sizes, dt_limit=limit, norm_before_gate=nbg)
    steps = [mamba2_step_fused_reference(zx[:, t], conv, ssm, **w, **kw) for t in range(T)]
    # the sequence, loop-free in time
    z0, x0, z, xBC, dt = zx.split([d_mlp, d_mlp, d_ssm, d_ssm + 2 * G * N, H], -1)
    xBC, conv_end = causal_conv1d_reference(xBC, w["conv_w"], w["conv_b"], initial_state=conv0,
                                            activation="silu", return_final_state=True)  # fmt: skip
    x, B, C = xBC.split([d_ssm, G * N, G * N], -1)
    delta = F.softplus(dt + w["dt_bias"]).clamp(*limit)
    y, ssm_end = mamba2_scan_reference(
        x.unflatten(-1, (H, P)), delta, w["A"], B.unflatten(-1, (G, N)),
        C.unflatten(-1, (G, N)), w["D"], z.unflatten(-1, (H, P)) if not norm else None,
        initial_state=ssm0, chunk=4,
    )  # fmt: skip
    y = y.flatten(2)
    if norm:
        y = gated_norm(y.flatten(0, 1), z.flatten(0, 1), w["norm_w"], 1e-5, G, nbg).view_as(y)
    y = torch.cat([F.silu(z0) * x0, y], -1)
    for t in range(T):
        torch.testing.assert_close(steps[t], y[:, t], rtol=1e-10, atol=1e-10, msg=f"step {t}")
    torch.testing.assert_close(conv, conv_end, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ssm_end, rtol=1e-10, atol=1e-10)


def _run_both(case, dtype, steps, cfg=None, device=DEVICE, eps=1e-5):
    """`steps` Triton steps (f32 states on `device`) and fused-reference steps (float64
    states on the CPU) from the same prefilled state and in_proj rows in `dtype`; returns
    the largest relative errors of the outputs and the states."""
    o = case[-1]
    w, conv, ssm, rows, sizes = make(case, pad=5)
    limit = (0.05, 0.8) if o.get("limit") else (0.0, math.inf)
    kw = dict(eps=eps, sizes=sizes, dt_limit=limit, norm_before_gate=o.get("nbg", False))
    wk = {k: v.to(device, torch.float32) if v is not None else None for k, v in w.items()}
    conv_k, ssm_k = conv.to(device, torch.float32), ssm.to(device, torch.float32)
    ptrs = (conv_k.data_ptr(), ssm_k.data_ptr())
    err = {"y": 0.0, "conv": 0.0, "ssm": 0.0}
    for _ in range(steps):
        zx = rows(dtype, device)
        assert zx.stride(0) > zx.shape[1]  # rows of a wider tensor
        want = mamba2_step_fused_reference(zx.cpu(), conv, ssm, **w, **kw)
        got = mamba2_step_triton(zx, conv_k, ssm_k, **wk, **kw, cfg=cfg)
        assert got.dtype == dtype and got.shape == want.shape
        assert not got.isnan().any()
        err["y"] = max(err["y"], rel_err(got, want))
        err["conv"] = max(err["conv"], rel_err(conv_k, conv))
        err["ssm"] = max(err["ssm"], rel_err(ssm_k, ssm))
    assert (conv_k.data_ptr(), ssm_k.data_ptr()) == ptrs  # advanced where they are
    return err


F32, BF16 = torch.float32, torch.bfloat16
P_BLOCKS = Mamba2StepConfig(block_p=4, warps=2)  # two programs per head
TRITON_CASES = {  # (case, dtype, steps, cfg): every feature in f32 and in bf16, kept fast
    "G1-Dhead-f32": (CASES["G1-Dhead"], F32, 2, None),
    "G1-Dhead-bf16": (CASES["G1-Dhead"], BF16, 1, None),
    "G2-Dhdim-nbg-mlp-limit-f32": (CASES["G2-Dhdim-nbg-mlp-limit"], F32, 1, None),
    "G2-Dhdim-nbg-mlp-limit-bf16": (CASES["G2-Dhdim-nbg-mlp-limit"], BF16, 1, None),
    "G2-nonorm-noD-nobias-bf16": (CASES["G2-nonorm-noD-nobias"], BF16, 1, None),
    "odd-P6-N12-K3-mlp-nonorm-f32": (CASES["odd-P6-N12-K3-mlp-nonorm"], F32, 1, None),
    "G2-P-blocks-f32": ((3, 0, 4, 8, 2, 16, 4, dict(nbg=True)), F32, 1, P_BLOCKS),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_step_equals_fused_reference(nan_empty, case):
    """Triton steps (interpreter on the CPU) against the fused reference on float64
    states: y and both states, advanced in place."""
    c, dtype, steps, cfg = TRITON_CASES[case]
    err = _run_both(c, dtype, steps=steps, cfg=cfg)
    assert all(err[k] < TOL[dtype][k] for k in err), err


def test_triton_step_checks_its_arguments():
    w, conv, ssm, rows, sizes = make(CASES["G1-Dhead"])
    w = {k: v.float() if v is not None else None for k, v in w.items()}
    zx, conv, ssm = rows().float(), conv.float(), ssm.float()
    with pytest.raises(TypeError, match="ssm_state"):
        mamba2_step_triton(zx, conv, ssm.double(), **w, eps=1e-5, sizes=sizes)
    with pytest.raises(ValueError, match="zxbcdt"):
        mamba2_step_triton(zx[:, 1:], conv, ssm, **w, eps=1e-5, sizes=sizes)
    with pytest.raises(ValueError, match="conv_state"):
        mamba2_step_triton(zx, conv[:, 1:], ssm, **w, eps=1e-5, sizes=sizes)
    with pytest.raises(ValueError, match="block_p"):
        mamba2_step_triton(zx, conv, ssm, **w, eps=1e-5, sizes=sizes,
                           cfg=Mamba2StepConfig(block_p=6))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("Bn", [1, 64])
def test_triton_step_on_gpu_at_the_130m_mamba2_shape(nan_empty, Bn):
    """130m-mamba2 (d_model 768: d_ssm 1536, 24 heads of 64, one group, N 128, K 4), bf16
    rows, three steps against the fused reference on float64 states; then the step captured
    in a CUDA graph and replayed equals it run eagerly."""
    case = (Bn, 0, 24, 64, 1, 128, 4, dict())
    err = _run_both(case, torch.bfloat16, steps=3, device="cuda")
    print(err)
    assert all(err[k] < TOL[torch.bfloat16][k] for k in err), err
    w, conv, ssm, rows, sizes = make(case, seed=4)
    w = {k: v.cuda().float() if v is not None else None for k, v in w.items()}
    zx = rows(torch.bfloat16, "cuda")
    conv, ssm = conv.cuda().float(), ssm.cuda().float()
    conv_e, ssm_e = conv.clone(), ssm.clone()
    eager = mamba2_step_triton(zx, conv_e, ssm_e, **w, eps=1e-5, sizes=sizes)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture, on a scratch state
        mamba2_step_triton(zx, conv.clone(), ssm.clone(), **w, eps=1e-5, sizes=sizes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mamba2_step_triton(zx, conv, ssm, **w, eps=1e-5, sizes=sizes)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(conv, conv_e) and torch.equal(ssm, ssm_e)
