"""Mamba-2 (SSD) scan: the chunked reference against the float64 loop oracle, and the Triton
body (Mamba-3's chunk kernels; the interpreter on a CPU) against the reference.

B batch, T time, H heads of P values, G groups of the B/C rows, N = d_state. The oracle is
`mamba2_scan_naive` (one `mamba2_step_reference` per token: the recurrence as written).
The reference must equal it for any chunk length, with documents packed by `seq_idx`, an
initial state, D per head or per channel, the gate and 1, 2 or 4 groups, and pass
gradcheck in every input. The kernels must give the reference's y, final state and the
gradient of every input (x, delta, A, B, C, D, z, initial_state), for f32 and 16-bit
inputs, B and C as strided slices of one xBC tensor (as the layer passes them), `.sum()`
losses (stride-0 gradients), a loss on the final state alone, T not a multiple of the
kernels' chunks (32 forward, 64 backward) and T = 1. `-m gpu` runs the kernels at the
130m-mamba2 shape against the float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from mambakit.ops.mamba2 import mamba2_scan, mamba2_scan_reference
from mambakit.ops.mamba2.naive import mamba2_scan_naive

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("x", "delta", "A", "B", "C", "D", "z", "initial_state")


def make(Bn=2, T=23, H=4, P=3, G=2, N=5, *, D="head", z=True, state=True, seq=False,
         dtype=torch.float64, seed=0):  # fmt: skip
    """The scan's inputs (float64 draws cast to `dtype`; delta, A, D and the state stay in
    float64 or f32, as the layer gives them) and seq_idx or None."""
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    f = torch.float64 if dtype == torch.float64 else torch.float32
    inp = dict(
        x=r(Bn, T, H, P).to(dtype),
        delta=(torch.rand(Bn, T, H, generator=g, dtype=torch.float64) * 0.5 + 0.01).to(f),
        A=(-(torch.rand(H, generator=g, dtype=torch.float64) * 2 + 0.1)).to(f),
        B=r(Bn, T, G, N, scale=0.5).to(dtype),
        C=r(Bn, T, G, N, scale=0.5).to(dtype),
        D={"head": r(H), "channel": r(H, P), None: None}[D],
        z=r(Bn, T, H, P).to(dtype) if z else None,
        initial_state=r(Bn, H, P, N, scale=0.5).to(f) if state else None,
    )
    if inp["D"] is not None:
        inp["D"] = inp["D"].to(f)
    seq_idx = None
    if seq:
        seq_idx = torch.sort(torch.randint(0, 4, (Bn, T), generator=g), dim=1).values
        seq_idx = seq_idx.to(torch.int32)
    return inp, seq_idx


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


# --------------------------------------------------------------- reference against the oracle


@pytest.mark.parametrize("chunk", [1, 4, 7, 23, 64])
@pytest.mark.parametrize(
    "G, D, z, state",
    [(1, "head", True, True), (2, "channel", False, True), (4, None, True, False),
     (2, "head", False, False)],
    ids=["G1-Dhead-gate-state", "G2-Dchannel-state", "G4-noD-gate", "G2-Dhead-plain"],
)  # fmt: skip
def test_reference_equals_the_loop_oracle(chunk, G, D, z, state):
    inp, _ = make(G=G, D=D, z=z, state=state)
    y, final = mamba2_scan_reference(**inp, chunk=chunk)
    y_ref, final_ref = mamba2_scan_naive(**inp)
    assert y.dtype == torch.float64 and final.dtype == torch.float64
    assert final.shape == (2, 4, 3, 5)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_packed_documents_equal_each_alone_and_the_oracle(chunk):
    """seq_idx zeroes the state where a document starts; the initial state feeds only the
    row's first document; the final state is the last document's. Row 0: documents at 0, 4,
    9 (4 is a chunk boundary for chunk 4), row 1: one start at 1, row 2: one document."""
    T = 14
    inp, _ = make(Bn=3, T=T)
    starts = [[0, 4, 9], [0, 1], [0]]
    seq_idx = torch.zeros(3, T, dtype=torch.int32)
    for b, ss in enumerate(starts):
        for i, s in enumerate(ss):
            seq_idx[b, s:] = i
    y, final = mamba2_scan_reference(**inp, seq_idx=seq_idx, chunk=chunk)
    y_ref, final_ref = mamba2_scan_naive(**inp, seq_idx=seq_idx)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)
    per_row = ("x", "delta", "B", "C", "z")
    for b, ss in enumerate(starts):
        bounds = ss + [T]
        for i in range(len(ss)):
            s, e = bounds[i], bounds[i + 1]
            doc = {k: (v[b : b + 1, s:e] if k in per_row else v) for k, v in inp.items()}
            doc["initial_state"] = inp["initial_state"][b : b + 1] if i == 0 else None
            y_doc, fin_doc = mamba2_scan_reference(**doc, chunk=chunk)
            torch.testing.assert_close(y[b : b + 1, s:e], y_doc, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[b : b + 1], fin_doc, rtol=1e-10, atol=1e-10)


def test_split_sequence_with_carried_state_equals_the_whole():
    inp, _ = make(T=30, G=1)
    y, final = mamba2_scan_reference(**inp, chunk=8)
    cut = 13
    per_row = ("x", "delta", "B", "C", "z")
    first = {k: (v[:, :cut] if k in per_row else v) for k, v in inp.items()}
    rest = {k: (v[:, cut:] if k in per_row else v) for k, v in inp.items()}
    y1, mid = mamba2_scan_reference(**first, chunk=8)
    y2, end = mamba2_scan_reference(**{**rest, "initial_state": mid}, chunk=8)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(end, final, rtol=1e-10, atol=1e-10)


def test_a_plain_decayed_sum():
    """One group, no D or gate: y_t = sum_{s<=t} exp(A sum_{s<r<=t} delta_r) delta_s (C_t .
    B_s) x_s + exp(A sum_{r<=t} delta_r) h_0 C_t, written out."""
    inp, _ = make(T=9, G=1, D=None, z=False)
    y, _ = mamba2_scan_reference(**inp, chunk=4)
    x, dt, A, Bm, Cm, h0 = (inp[k] for k in ("x", "delta", "A", "B", "C", "initial_state"))
    want = torch.zeros_like(y)
    for t in range(9):
        for s in range(t + 1):
            decay = torch.exp(A * dt[:, s + 1 : t + 1].sum(1))  # [B, H]
            cb = (Cm[:, t, 0] * Bm[:, s, 0]).sum(-1)  # [B]
            want[:, t] += (decay * dt[:, s] * cb[:, None]).unsqueeze(-1) * x[:, s]
        start = torch.exp(A * dt[:, : t + 1].sum(1))  # [B, H]
        want[:, t] += start.unsqueeze(-1) * torch.einsum("bhpn,bn->bhp", h0, Cm[:, t, 0])
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)


def test_reference_gradients_equal_the_oracles():
    """Autograd through the chunked reference and through the loop, float64: every input's
    gradient, documents packed, a cotangent on y and on the final state."""
    inp, seq_idx = make(T=11, G=2, seq=True)
    g = torch.Generator().manual_seed(1)
    cot_y = torch.randn(2, 11, 4, 3, generator=g, dtype=torch.float64)
    cot_s = torch.randn(2, 4, 3, 5, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda **kw: mamba2_scan_reference(**kw, chunk=4), mamba2_scan_naive):
        leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
        y, final = fn(**leaves, seq_idx=seq_idx)
        ((y * cot_y).sum() + (final * cot_s).sum()).backward()
        grads.append({k: v.grad for k, v in leaves.items()})
    for k in NAMES:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-9, atol=1e-10, msg=k)


@pytest.mark.parametrize(
    "D, seq, fast", [("head", False, False), ("channel", True, True)],
    ids=["Dhead", "Dchannel-docs-fast"],
)  # fmt: skip
def test_gradcheck_every_input_and_the_state(D, seq, fast):
    """Every input, the initial state included; over a chunk boundary (chunk 4 of 6 steps),
    with documents (the second: gradcheck's fast mode, a random projection of the Jacobian)."""
    inp, seq_idx = make(Bn=2 if seq else 1, T=6, H=4, P=2, G=2, N=3, D=D, seq=seq)
    if seq:
        seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    leaves = [inp[k].clone().requires_grad_() for k in NAMES]

    def fn(*args):
        return mamba2_scan_reference(*args, seq_idx=seq_idx, chunk=4)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, fast_mode=fast)


def test_f32_inputs_give_f32_outputs_close_to_float64():
    inp, seq_idx = make(T=40, G=2, seq=True)
    y64, f64 = mamba2_scan_reference(**inp, seq_idx=seq_idx, chunk=16)
    y32, f32 = mamba2_scan_reference(**{k: v.float() for k, v in inp.items()}, seq_idx=seq_idx,
                                     chunk=16)  # fmt: skip
    assert y32.dtype == torch.float32 and f32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f32.double(), f64, rtol=1e-5, atol=1e-5)
    bf = {k: v.bfloat16() if k in ("x", "B", "C", "z") else v.float() for k, v in inp.items()}
    y16, f16 = mamba2_scan_reference(**bf, seq_idx=seq_idx, chunk=16)
    assert y16.dtype == torch.bfloat16 and f16.dtype == torch.float32  # the state stays f32


# -------------------------------------------------------------------- the public op's checks


def _bad_cases():
    def edit(**kw):
        return kw

    H, P, G, N = 4, 3, 2, 5
    return {
        "x-3d": (edit(x=torch.zeros(2, 23, 12)), ValueError,
                 r"x must have shape \[\*, \*, \*, \*\]"),
        "B-batch": (edit(B=torch.zeros(1, 23, G, N)), ValueError, r"B must have shape \[2, 23"),
        "groups": (edit(B=torch.zeros(2, 23, 3, N), C=torch.zeros(2, 23, 3, N)), ValueError,
                   r"B: 3 groups do not divide the 4 heads"),
        "C-N": (edit(C=torch.zeros(2, 23, G, N + 1)), ValueError, r"C must have shape"),
        "delta": (edit(delta=torch.zeros(2, 23, H + 1)), ValueError, r"delta must have shape"),
        "A": (edit(A=torch.zeros(H, 1)), ValueError, r"A must have shape \[4\]"),
        "D-head": (edit(D=torch.zeros(H + 1)), ValueError, r"D must have shape \[4\]"),
        "D-channel": (edit(D=torch.zeros(H, P + 1)), ValueError, r"D must have shape \[4, 3\]"),
        "z": (edit(z=torch.zeros(2, 23, H, P + 1)), ValueError, r"z must have shape"),
        "state-shape": (edit(initial_state=torch.zeros(2, H, P, N + 1)), ValueError,
                        r"initial_state must have shape \[2, 4, 3, 5\]"),
        "state-dtype": (edit(initial_state=torch.zeros(2, H, P, N, dtype=torch.bfloat16)),
                        TypeError, r"initial_state must be float32"),
        "x-int": (edit(x=torch.zeros(2, 23, H, P, dtype=torch.int64)), TypeError,
                  r"x must have dtype"),
        "seq_idx-dtype": (edit(seq_idx=torch.zeros(2, 23, dtype=torch.int64)), TypeError,
                          r"seq_idx must have dtype"),
        "seq_idx-shape": (edit(seq_idx=torch.zeros(2, 22, dtype=torch.int32)), ValueError,
                          r"seq_idx must have shape \[2, 23\]"),
        "chunk": (edit(chunk=0), ValueError, r"chunk must be a positive int"),
        "chunk-bool": (edit(chunk=True), ValueError, r"chunk must be a positive int"),
        "backend": (edit(backend="cuda"), ValueError, r"backend must be one of"),
    }  # fmt: skip


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_naming_the_argument(case):
    kw, err, pattern = BAD[case]
    inp, _ = make(dtype=torch.float32)
    with pytest.raises(err, match=pattern):
        mamba2_scan(**{**inp, **kw})


def test_the_public_op_runs_the_reference_on_the_cpu(monkeypatch):
    """backend="auto" on CPU tensors (no MAMBAKIT_BACKEND): the reference's values; the
    chunk does not change them."""
    monkeypatch.delenv("MAMBAKIT_BACKEND", raising=False)
    inp, seq_idx = make(seq=True)
    y, final = mamba2_scan(**inp, seq_idx=seq_idx, chunk=5)
    y_ref, f_ref = mamba2_scan_naive(**inp, seq_idx=seq_idx)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, f_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_sequence_passes_the_state_through(backend):
    """T = 0: no output rows, the final state is the initial one and its gradient reaches
    the initial state unchanged (selective_scan's contract)."""
    inp, _ = make(Bn=2, T=0, H=2, P=4, G=1, N=8, dtype=torch.float32)
    s0 = inp.pop("initial_state").requires_grad_()
    y, final = mamba2_scan(**inp, initial_state=s0, backend=backend)
    assert y.shape == (2, 0, 2, 4) and torch.equal(final, s0.detach())
    w = torch.randn_like(final)
    (final * w).sum().backward()
    assert torch.equal(s0.grad, w)


# ------------------------------------------------------------ the Triton body (interpreter)

# relative error limits against float64, by the dtype of x (the interpreter computes in f32;
# 16-bit: y, x's, B's, C's and z's gradients are rounded to it)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


def run_scan(inp, seq_idx, dtype, device, backend, *, xbc=False, loss="random", cots=None):
    """(y, final, {name: gradient}) of `mamba2_scan` on leaves made from `inp` (float64):
    x, B, C and z in `dtype`, the rest f32 (float64 when dtype is). With `xbc`, x, B and C
    are strided slices of one leaf xBC [B, T, H P + 2 G N] (the layer's layout) and its
    gradient is reported as "xBC". loss: "random" (cotangents on y and the final state),
    "sum" (y.sum() + final.sum(): stride-0 gradients), "y-sum" (y.sum() alone), "state"
    (a cotangent on the final state alone: no gradient reaches y)."""
    f = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {}
    args = {}
    for k, v in inp.items():
        if v is None:
            args[k] = None
            continue
        t = v.detach().to(device, dtype if k in ("x", "B", "C", "z") else f).clone()
        leaves[k] = args[k] = t.requires_grad_()
    if xbc:
        Bn, T, H, P = inp["x"].shape
        G, N = inp["B"].shape[2:]
        whole = torch.cat([inp["x"].flatten(2), inp["B"].flatten(2), inp["C"].flatten(2)], -1)
        leaves = {k: v for k, v in leaves.items() if k not in ("x", "B", "C")}
        leaves["xBC"] = whole.to(device, dtype).requires_grad_()
        x, Bm, Cm = torch.split(leaves["xBC"], [H * P, G * N, G * N], dim=-1)
        args.update(x=x.unflatten(-1, (H, P)), B=Bm.unflatten(-1, (G, N)),
                    C=Cm.unflatten(-1, (G, N)))  # fmt: skip
        assert args["B"].stride(-1) == 1 and not args["B"].is_contiguous()
    seq = seq_idx.to(device) if seq_idx is not None else None
    y, final = mamba2_scan(**args, seq_idx=seq, backend=backend)
    if loss == "random":
        cot_y, cot_s = (c.to(device) for c in cots)
        total = (y.double() * cot_y).sum() + (final.double() * cot_s).sum()
    elif loss == "sum":
        total = y.sum() + final.sum()
    elif loss == "y-sum":
        total = y.sum()
    else:
        total = (final.double() * cots[1].to(device)).sum()
    total.backward()
    return y, final, {k: v.grad for k, v in leaves.items()}


def check_kernel_against_reference(inp, seq_idx, dtype=torch.float32, **kw):
    """The Triton body's y, final state and every gradient against the reference's in
    float64 (on the same values: 16-bit inputs are rounded first)."""
    g = torch.Generator().manual_seed(7)
    rounded = {k: (v.to(dtype).double() if k in ("x", "B", "C", "z") and v is not None else v)
               for k, v in inp.items()}  # fmt: skip
    Bn, T, H, P = inp["x"].shape
    N = inp["B"].shape[-1]
    cot_y = torch.randn(Bn, T, H, P, generator=g, dtype=torch.float64)
    cots = (cot_y.to(dtype).double(), torch.randn(Bn, H, P, N, generator=g, dtype=torch.float64))
    y64, f64, g64 = run_scan(rounded, seq_idx, torch.float64, "cpu", "reference", cots=cots, **kw)
    y, final, grads = run_scan(inp, seq_idx, dtype, DEVICE, "triton", cots=cots, **kw)
    assert y.dtype == dtype and y.shape == y64.shape
    assert final.dtype == torch.float32 and final.shape == f64.shape
    assert grads.keys() == g64.keys()
    errs = {"y": rel(y, y64), "final": rel(final, f64)}
    for k, want in g64.items():
        got = grads[k]
        if want is None:  # an input the loss does not reach (C, D, z under a state-only loss)
            assert got is None or not got.any(), k
            continue
        assert got is not None and got.shape == want.shape, k
        assert torch.isfinite(got).all(), f"d{k}: non-finite values (an unwritten element?)"
        errs[f"d{k}"] = rel(got, want)
    tol = TOL[dtype]
    assert all(e < tol for e in errs.values()), {k: f"{e:.1e}" for k, e in errs.items()}
    return y, final


KERNEL_CASES = {
    # id: (make's arguments, run_scan's)
    "G2-docs-state-xBC": (dict(Bn=2, T=37, H=4, P=4, G=2, N=8, seq=True), dict(xbc=True)),
    "G1-Dchannel-gate-sum": (dict(Bn=1, T=40, H=2, P=4, G=1, N=8, D="channel"), dict(loss="sum")),
    "G1-Dchannel-nogate": (dict(Bn=1, T=33, H=2, P=4, G=1, N=8, D="channel", z=False), {}),
    "G4-per-head-docs-state-only": (
        dict(Bn=1, T=20, H=4, P=4, G=4, N=8, D=None, z=False, seq=True), dict(loss="state")),
    "G1-y-sum-only": (dict(Bn=1, T=40, H=2, P=4, G=1, N=8, seq=True), dict(loss="y-sum")),
    "T1": (dict(Bn=2, T=1, H=2, P=4, G=1, N=8), {}),
    "G2-no-state-xBC-sum": (dict(Bn=1, T=24, H=4, P=4, G=2, N=8, state=False),
                            dict(xbc=True, loss="sum")),
}  # fmt: skip


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Counts the Triton body's calls where `mamba2_scan` looks it up."""
    from mambakit.ops import mamba2 as ops_m2

    calls, kernel = [], ops_m2.mamba2_scan_kernel
    monkeypatch.setattr(ops_m2, "mamba2_scan_kernel",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))  # fmt: skip
    return calls


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernels_equal_the_reference_values_and_every_gradient(nan_empty, kernel_calls, case):
    make_kw, run_kw = KERNEL_CASES[case]
    inp, seq_idx = make(**make_kw, seed=len(case))
    check_kernel_against_reference(inp, seq_idx, **run_kw)
    assert kernel_calls  # the Triton body ran, not the reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_kernels_with_16bit_inputs(nan_empty, kernel_calls, dtype):
    """x, B, C (slices of xBC) and z in 16-bit, delta, A, D and the state f32: y in 16-bit,
    the final state and delta's, A's, D's and the state's gradients f32."""
    inp, seq_idx = make(Bn=1, T=40, H=2, P=4, G=1, N=8, seq=True, seed=3)
    check_kernel_against_reference(inp, seq_idx, dtype, xbc=True)
    assert kernel_calls


def test_kernel_forward_without_autograd(nan_empty, kernel_calls):
    """No gradient recorded: the forward custom op alone (`mambakit::mamba2_scan_fwd`), the
    reference's values; the inputs are not changed."""
    inp, seq_idx = make(Bn=2, T=37, H=4, P=4, G=2, N=8, seq=True, seed=5)
    args = {k: v.float() for k, v in inp.items()}
    before = {k: v.clone() for k, v in args.items()}
    y64, f64 = mamba2_scan_reference(**inp, seq_idx=seq_idx)
    with torch.no_grad():
        y, final = mamba2_scan(**{k: v.to(DEVICE) for k, v in args.items()},
                               seq_idx=seq_idx.to(DEVICE), backend="triton")  # fmt: skip
    assert kernel_calls and rel(y, y64) < 1e-5 and rel(final, f64) < 1e-5
    for k, v in args.items():
        assert torch.equal(v, before[k]), k


SSD_CASES = {
    # id: (make's arguments, the documents' first rows or None, x's dtype); the chunk is 32
    # steps in blocks of 16: documents starting inside a chunk, on a chunk's first row and on
    # its last, the last chunk partial
    "G2-docs-state-gate": (dict(Bn=2, T=100, H=4, P=4, G=2, N=8), (31, 32, 63, 70), None),
    "G1-Dchannel-nostate": (
        dict(Bn=1, T=77, H=2, P=4, G=1, N=8, D="channel", state=False),
        None,
        None,
    ),  # fmt: skip
    "G4-noD-nogate-docs": (
        dict(Bn=1, T=64, H=4, P=4, G=4, N=8, D=None, z=False),
        (1, 40),
        None,
    ),  # fmt: skip
    "T1": (dict(Bn=2, T=1, H=2, P=4, G=1, N=8), None, None),
    "bf16-xBC": (dict(Bn=1, T=70, H=2, P=4, G=1, N=8), (20,), torch.bfloat16),
    "f16-xBC": (dict(Bn=1, T=70, H=2, P=4, G=1, N=8), None, torch.float16),
}


@pytest.mark.parametrize("case", list(SSD_CASES))
def test_ssd_forward_without_autograd_equals_the_reference(nan_empty, case):
    """The forward without autograd (ssd_kernels.py: every chunk in parallel) in chunks of 32
    steps, with the scores per head and per group, and in the library's chunks: y and the
    final state against the float64 reference on the same (rounded) inputs; 16-bit x, B, C,
    z as slices of one xBC."""
    import dataclasses

    from mambakit.ops.mamba2 import mamba2_scan_kernel
    from mambakit.ops.mamba3.chunk import CONFIG

    make_kw, starts, dtype = SSD_CASES[case]
    inp, _ = make(**make_kw, seed=len(case))
    Bn, T = inp["x"].shape[:2]
    seq_idx = None
    if starts:
        seq_idx = torch.zeros(Bn, T, dtype=torch.int32)
        for s in starts:
            seq_idx[:, s:] += 1
    dt = dtype or torch.float32
    rounded = {k: (v.to(dt).double() if k in ("x", "B", "C", "z") and v is not None else v)
               for k, v in inp.items()}  # fmt: skip
    y64, f64 = mamba2_scan_reference(**rounded, seq_idx=seq_idx)
    args = {k: (v.to(DEVICE, dt if k in ("x", "B", "C", "z") else torch.float32)
                if v is not None else None) for k, v in inp.items()}  # fmt: skip
    if dtype is not None:  # x, B, C as the layer passes them: strided slices of one tensor
        H, P = args["x"].shape[2:]
        G, N = args["B"].shape[2:]
        whole = torch.cat([args[k].flatten(2) for k in ("x", "B", "C")], -1)
        x, Bm, Cm = torch.split(whole, [H * P, G * N, G * N], dim=-1)
        args.update(x=x.unflatten(-1, (H, P)), B=Bm.unflatten(-1, (G, N)),
                    C=Cm.unflatten(-1, (G, N)))  # fmt: skip
    seq = seq_idx.to(DEVICE) if seq_idx is not None else None
    small = dataclasses.replace(CONFIG, ssd_chunk=32, ssd_block_m=16, ssd_block_k=16)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dt]
    for cfg in (small, dataclasses.replace(small, ssd_cb=not small.ssd_cb), CONFIG):
        assert cfg.m2_fwd == "ssd"
        with torch.no_grad():
            y, final = mamba2_scan_kernel(**args, seq_idx=seq, cfg=cfg)
        assert y.dtype == dt and final.dtype == torch.float32
        errs = (rel(y, y64), rel(final, f64))
        assert all(e < tol for e in errs), (cfg.ssd_chunk, errs)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.05, 0.4)], ids=["nolimit", "limit"])
def test_raw_dt_with_its_bias_equals_the_made_delta(nan_empty, backend, limit):
    """Given dt_bias, delta is in_proj's dt: the scan equals the scan of clamp(softplus(dt +
    dt_bias), *limit) made beforehand (the float64 closed form), in y, the final state and,
    under autograd, the gradients of dt (through softplus and the clamp) and dt_bias. The
    Triton forward without autograd makes delta inside its kernels."""
    inp, seq_idx = make(Bn=2, T=70, H=4, P=4, G=2, N=8, seq=True, seed=9)
    g = torch.Generator().manual_seed(1)
    dt = torch.randn(2, 70, 4, generator=g, dtype=torch.float64) * 2 - 1
    bias = torch.randn(4, generator=g, dtype=torch.float64)
    made = torch.nn.functional.softplus(dt + bias).clamp(*limit)
    args = {k: v for k, v in inp.items() if k != "delta"}
    y64, f64 = mamba2_scan_reference(delta=made, **args, seq_idx=seq_idx)
    f = torch.float32
    dev = {k: (v.to(DEVICE, f) if v is not None else None) for k, v in args.items()}
    seq = seq_idx.to(DEVICE)
    with torch.no_grad():
        y, final = mamba2_scan(delta=dt.to(DEVICE, f), **dev, seq_idx=seq, backend=backend,
                               dt_bias=bias.to(DEVICE, f), dt_limit=limit)  # fmt: skip
    assert rel(y, y64) < 1e-5 and rel(final, f64) < 1e-5
    # under autograd: the gradients of dt and dt_bias against float64's
    leaves64 = (dt.clone().requires_grad_(), bias.clone().requires_grad_())
    made64 = torch.nn.functional.softplus(leaves64[0] + leaves64[1]).clamp(*limit)
    y64, f64 = mamba2_scan_reference(delta=made64, **args, seq_idx=seq_idx)
    (y64.sum() + f64.square().sum()).backward()
    leaves = (dt.to(DEVICE, f).requires_grad_(), bias.to(DEVICE, f).requires_grad_())
    y, final = mamba2_scan(delta=leaves[0], **dev, seq_idx=seq, backend=backend,
                           dt_bias=leaves[1], dt_limit=limit)  # fmt: skip
    (y.sum() + final.square().sum()).backward()
    assert rel(leaves[0].grad, leaves64[0].grad) < 1e-5
    assert rel(leaves[1].grad, leaves64[1].grad) < 1e-5


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view with stride 2 in its last dim (every other element of a buffer)."""
    buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype,
                     device=t.device)  # fmt: skip
    buf[..., ::2] = t
    return buf[..., ::2]


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "autograd"])
@pytest.mark.parametrize("name", ["delta", "A", "D", "dt_bias"])
def test_kernels_take_inputs_strided_in_their_last_dim(nan_empty, name, grad):
    """delta [B, T, H], A [H], D [H] and dt_bias [H] as views of stride 2 (which the checks
    accept: only x's layout is the kernels' own concern) give the float64 oracle's y and
    final state, on the forward without autograd (the SSD kernels, which index them by head)
    and with it, where the strided view and x are leaves whose gradients match float64's."""
    inp, seq_idx = make(Bn=2, T=37, H=4, P=4, G=2, N=8, seq=True, seed=4)
    g = torch.Generator().manual_seed(2)
    dt = torch.randn(2, 37, 4, generator=g, dtype=torch.float64) - 1
    bias = torch.randn(4, generator=g, dtype=torch.float64)
    key = name if name != "dt_bias" else "bias"
    leaves64 = {"x": inp["x"].clone(), key: bias.clone() if name == "dt_bias" else inp[name]}
    leaves64 = {k: v.clone().requires_grad_(grad) for k, v in leaves64.items()}
    inp64 = {**inp, **{k: v for k, v in leaves64.items() if k != "bias"}}
    if name == "dt_bias":
        inp64["delta"] = torch.nn.functional.softplus(dt + leaves64["bias"])
    with torch.set_grad_enabled(grad):
        y64, f64 = mamba2_scan_reference(**inp64, seq_idx=seq_idx)
    args = {k: v.to(DEVICE, torch.float32) for k, v in inp.items()}
    extra = {}
    if name == "dt_bias":
        args["delta"] = dt.to(DEVICE, torch.float32)
        extra["dt_bias"] = leaf = _strided(bias.to(DEVICE, torch.float32))
    else:
        args[name] = leaf = _strided(args[name])
    with torch.set_grad_enabled(grad):
        if grad:
            args["x"].requires_grad_()
            leaf.requires_grad_()  # a view of a buffer that records no graph: a leaf
        y, final = mamba2_scan(**args, **extra, seq_idx=seq_idx.to(DEVICE), backend="triton")
    assert rel(y, y64) < 1e-5 and rel(final, f64) < 1e-5
    if grad:
        (y64.sum() + f64.square().sum()).backward()
        (y.sum() + final.square().sum()).backward()
        assert leaf.grad.shape == leaf.shape
        assert rel(leaf.grad, leaves64[key].grad) < 1e-5, name
        assert rel(args["x"].grad, leaves64["x"].grad) < 1e-5


@pytest.mark.parametrize(
    "kw, match",
    [(dict(dt_bias=torch.zeros(3)), "dt_bias"), (dict(dt_limit=(0.5, 0.1)), "dt_limit"),
     (dict(dt_limit=0.3), "dt_limit")],
)  # fmt: skip
def test_bad_dt_bias_or_limit_raise_naming_it(kw, match):
    inp, _ = make(Bn=1, T=5, H=4, P=2, G=1, N=4)
    with pytest.raises(ValueError, match=match):
        mamba2_scan(**inp, **kw)


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_kernels_on_gpu_at_the_130m_shape(dtype):
    """8 x 2048, H 24, P 64, G 1, N 128 (130m-mamba2), documents starting mid-chunk and an
    initial state, D and the gate; x, B, C (slices of xBC) and z in `dtype`: y, the final
    state and every gradient against the float64 reference on the GPU. Without autograd
    too."""
    inp, _ = make(Bn=8, T=2048, H=24, P=64, G=1, N=128, seed=11)
    inp["B"], inp["C"] = inp["B"] * 0.2, inp["C"] * 0.2  # |C . B| ~ 1 at N 128
    inp["delta"] = inp["delta"] * 0.2
    seq_idx = torch.zeros(8, 2048, dtype=torch.int32)
    seq_idx[0, 100:], seq_idx[0, 1231:] = 1, 2
    seq_idx[3, 1:] = 1
    seq_idx[5, 2047:] = 1
    inp64 = {k: (v.to(dtype).double() if k in ("x", "B", "C", "z") else v) for k, v in inp.items()}
    g = torch.Generator().manual_seed(2)
    cot_y = torch.randn(8, 2048, 24, 64, generator=g, dtype=torch.float64).to(dtype).double()
    cots = (cot_y.cuda(), torch.randn(8, 24, 64, 128, generator=g, dtype=torch.float64).cuda())
    outs = {}
    for key, dt, backend in (("f64", torch.float64, "reference"), ("kernel", dtype, "triton")):
        src = inp64 if key == "f64" else inp
        y, final, grads = run_scan({k: v.cuda() for k, v in src.items()}, seq_idx, dt, "cuda",
                                   backend, xbc=True, cots=cots)  # fmt: skip
        outs[key] = {"y": y, "final": final, **{f"d{k}": v for k, v in grads.items()}}
        outs[key] = {k: v.detach().double().cpu() for k, v in outs[key].items()}
        del y, final, grads
    with torch.no_grad():
        x, Bm, Cm = (inp[k].to("cuda", dtype) for k in ("x", "B", "C"))
        rest = {k: inp[k].cuda().float() for k in ("delta", "A", "D", "initial_state")}
        y, final = mamba2_scan(x, B=Bm, C=Cm, z=inp["z"].to("cuda", dtype), **rest,
                               seq_idx=seq_idx.cuda(), backend="triton")  # fmt: skip
    outs["no-grad"] = {"y": y.double().cpu(), "final": final.double().cpu()}
    # H200 (2026-12-04): bf16 at most 2.3e-3 (dz), f32 at most 3.4e-7 (ddelta)
    limit = 1e-2 if dtype == torch.bfloat16 else 1e-5
    errs = {}
    for key in ("kernel", "no-grad"):
        for name, got in outs[key].items():
            assert torch.isfinite(got).all(), f"{key} {name}: non-finite"
            errs[f"{key} {name}"] = rel(got, outs["f64"][name])
    print({k: f"{v:.1e}" for k, v in errs.items()})
    assert all(e < limit for e in errs.values()), errs
