"""Mamba-3 SISO scan reference: the chunked form against a float64 loop of the recurrence.

The oracle is `mamba3_step_reference` run token by token: the paper's recurrence as
written, S_t = alpha S + beta x_{t-1} k~_{t-1}^T + gamma x_t k~_t^T. The chunked form
(quadratic blocks, a carry loop) must equal it for any chunk size, carry its state
across calls and pass gradcheck.
"""

import math
from dataclasses import replace

import pytest
import torch

from mambakit.ops.mamba3 import (
    Mamba3State,
    mamba3_scan_reference,
    mamba3_step_reference,
    rotate_pairs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, G, P, N, S = 2, 4, 2, 3, 8, 2


def make(T, dtype=torch.float64, seed=0, state=True):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype)

    inp = dict(
        x=r(B, T, H, P),
        q=r(B, T, G, N, scale=0.5),
        k=r(B, T, G, N, scale=0.5),
        delta=(torch.rand(B, T, H, generator=g) * 0.5 + 0.01).to(dtype),
        A=-(torch.rand(B, T, H, generator=g) * 2 + 0.1).to(dtype),
        trap=r(B, T, H),
        theta=r(B, T, S),
        q_bias=r(H, N, scale=0.3) + 1,
        k_bias=r(H, N, scale=0.3) + 1,
        D=r(H),
        z=r(B, T, H, P),
    )
    st = None
    if state:
        st = Mamba3State(
            (torch.rand(B, H, S, generator=g) * 2 * math.pi).to(dtype),
            r(B, H, P, N, scale=0.5),
            r(B, H, N),
            r(B, H, P),
        )
    return inp, st


def loop(inp, state):
    """The recurrence, one token at a time."""
    T = inp["x"].shape[1]
    if state is None:
        state = Mamba3State.zeros(B, H, P, N, S, dtype=inp["x"].dtype)
    ys = []
    for t in range(T):
        y, state = mamba3_step_reference(
            inp["x"][:, t], inp["q"][:, t], inp["k"][:, t], inp["delta"][:, t], inp["A"][:, t],
            inp["trap"][:, t], inp["theta"][:, t], inp["q_bias"], inp["k_bias"], inp["D"],
            inp["z"][:, t], state,
        )  # fmt: skip
        ys.append(y)
    return torch.stack(ys, 1), state


def assert_states_close(a: Mamba3State, b: Mamba3State, **tol):
    for name in Mamba3State._fields:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), **tol, msg=name)


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_the_recurrence(chunk, with_state):
    inp, st = make(T=23, state=with_state)
    y, final = mamba3_scan_reference(**inp, initial_state=st, chunk=chunk)
    y_ref, final_ref = loop(inp, st)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    assert_states_close(final, final_ref, rtol=1e-10, atol=1e-10)


def test_split_sequence_with_carried_state_equals_whole():
    inp, st = make(T=30)
    y, final = mamba3_scan_reference(**inp, initial_state=st, chunk=8)
    cut = 13
    first = {k: (v[:, :cut] if v.dim() > 2 else v) for k, v in inp.items()}
    rest = {k: (v[:, cut:] if v.dim() > 2 else v) for k, v in inp.items()}
    y1, mid = mamba3_scan_reference(**first, initial_state=st, chunk=8)
    y2, end = mamba3_scan_reference(**rest, initial_state=mid, chunk=8)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-10, atol=1e-10)
    assert_states_close(end, final, rtol=1e-10, atol=1e-10)


def test_gradcheck_every_input_and_the_state():
    inp, st = make(T=5)
    names = list(inp)
    leaves = [inp[n].clone().requires_grad_() for n in names] + [
        t.clone().requires_grad_() for t in st
    ]

    def fn(*args):
        kw = dict(zip(names, args[: len(names)]))
        st0 = Mamba3State(*args[len(names) :])
        y, fin = mamba3_scan_reference(**kw, initial_state=st0, chunk=2)
        return y, fin.ssm, fin.k, fin.x

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-5)


def test_without_trapezoid_and_rotation_it_is_a_plain_decayed_sum():
    """lam = 1 (trap -> +inf), theta = 0, zero biases: S_t = exp(A_t delta_t) S_{t-1} +
    delta_t x_t k_t^T, a closed form checked against an explicit sum."""
    inp, _ = make(T=9, state=False)
    inp.update(trap=torch.full_like(inp["trap"], 50.0), theta=torch.zeros_like(inp["theta"]))
    inp.update(q_bias=torch.zeros_like(inp["q_bias"]), k_bias=torch.zeros_like(inp["k_bias"]))
    y, _ = mamba3_scan_reference(**inp, chunk=4)
    k = inp["k"].repeat_interleave(H // G, dim=2)
    q = inp["q"].repeat_interleave(H // G, dim=2)
    adt = inp["A"] * inp["delta"]
    T = y.shape[1]
    want = torch.zeros_like(y)
    for t in range(T):
        for s in range(t + 1):
            decay = torch.exp(adt[:, s + 1 : t + 1].sum(1))  # [B, H]
            qk = (q[:, t] * k[:, s]).sum(-1)  # [B, H]
            want[:, t] += (decay * inp["delta"][:, s] * qk).unsqueeze(-1) * inp["x"][:, s]
    want = (want + inp["D"][:, None] * inp["x"]) * torch.nn.functional.silu(inp["z"])
    torch.testing.assert_close(y, want, rtol=1e-9, atol=1e-9)


def test_rotation_turns_pairs_and_keeps_the_rest():
    v = torch.arange(8, dtype=torch.float64).view(1, 8) + 1
    phi = torch.tensor([[math.pi / 2, math.pi]], dtype=torch.float64)
    out = rotate_pairs(v, phi)
    want = torch.tensor([[-2.0, 1.0, -3.0, -4.0, 5.0, 6.0, 7.0, 8.0]], dtype=torch.float64)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_f32_inputs_stay_close_to_float64():
    inp, st = make(T=40)
    y64, _ = mamba3_scan_reference(**inp, initial_state=st, chunk=16)
    inp32 = {k: v.float() for k, v in inp.items()}
    st32 = Mamba3State(*(t.float() for t in st))
    y32, fin = mamba3_scan_reference(**inp32, initial_state=st32, chunk=16)
    assert y32.dtype == torch.float32 and fin.ssm.dtype == torch.float32
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-4)


def _slice(inp, b, s, e):
    return {
        k: (v[b : b + 1, s:e] if v.dim() > 2 and v.shape[0] == B else v) for k, v in inp.items()
    }


@pytest.mark.parametrize("chunk", [3, 4, 64])
def test_packed_documents_equal_each_document_alone(chunk):
    """seq_idx resets the state at a document start; the initial state feeds only the first
    document of a row. Row 0: documents at 0, 4, 9 (4 is a chunk boundary for chunk 4);
    row 1: one document start at 1."""
    T = 14
    inp, st = make(T)
    starts = [[0, 4, 9], [0, 1]]
    seq_idx = torch.zeros(B, T, dtype=torch.int32)
    for b, ss in enumerate(starts):
        for i, s in enumerate(ss):
            seq_idx[b, s:] = i
    y, final = mamba3_scan_reference(**inp, initial_state=st, seq_idx=seq_idx, chunk=chunk)
    for b, ss in enumerate(starts):
        bounds = ss + [T]
        for i in range(len(ss)):
            s, e = bounds[i], bounds[i + 1]
            st_b = Mamba3State(*(t[b : b + 1] for t in st)) if i == 0 else None
            sub = _slice(inp, b, s, e)
            y_doc, fin_doc = mamba3_scan_reference(**sub, initial_state=st_b, chunk=chunk)
            torch.testing.assert_close(y[b : b + 1, s:e], y_doc, rtol=1e-10, atol=1e-10)
        for name in Mamba3State._fields:  # the final state is the last document's
            got = getattr(final, name)[b : b + 1]
            torch.testing.assert_close(got, getattr(fin_doc, name), rtol=1e-10, atol=1e-10)


def test_gradcheck_with_document_starts():
    inp, st = make(T=6)
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    names = ["x", "q", "k", "delta", "A", "trap", "theta"]
    leaves = [inp[n].clone().requires_grad_() for n in names]

    def fn(*args):
        kw = {**inp, **dict(zip(names, args))}
        y, fin = mamba3_scan_reference(**kw, initial_state=st, seq_idx=seq_idx, chunk=4)
        return y, fin.ssm

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "N_, G_, S_, gate",
    [(8, 2, 2, True), (8, 1, 4, False), (5, 3, 1, True), (6, 6, 3, False)],
    ids=["half-turned", "all-turned", "odd-N", "a-group-per-head"],
)
def test_step_kernel_equals_float64_step(nan_empty, N_, G_, S_, gate):
    """The Triton decode step (interpreter on the CPU): y and every state field after one
    token equal the float64 reference step; the state is advanced in place."""
    from mambakit.ops.mamba3.step import state_update

    Bn, Hn, Pn = 2, 6, 5
    g = torch.Generator().manual_seed(3)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    inp = dict(
        x=r(Bn, Hn, Pn),
        q=r(Bn, G_, N_, scale=0.5),
        k=r(Bn, G_, N_, scale=0.5),
        delta=torch.rand(Bn, Hn, generator=g) * 0.5 + 0.01,
        A=-(torch.rand(Bn, Hn, generator=g) * 2 + 0.1),
        trap=r(Bn, Hn),
        theta=r(Bn, S_),
        q_bias=r(Hn, N_, scale=0.3) + 1,
        k_bias=r(Hn, N_, scale=0.3) + 1,
        D=r(Hn) if gate else None,
        z=r(Bn, Hn, Pn) if gate else None,
    )
    state = Mamba3State(
        torch.rand(Bn, Hn, S_, generator=g) * 6.2,  # angles in [0, 2 pi)
        r(Bn, Hn, Pn, N_),
        r(Bn, Hn, N_),
        r(Bn, Hn, Pn),
    )
    y64, next64 = mamba3_step_reference(
        **{k: v.double() if v is not None else None for k, v in inp.items()},
        state=Mamba3State(*(t.double() for t in state)),
    )
    dev = Mamba3State(*(t.to(DEVICE) for t in state))
    y = state_update(dev, **{k: v.to(DEVICE) if v is not None else None for k, v in inp.items()})
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(Mamba3State._fields, dev, next64):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5, msg=name)


def test_layer_step_kernel_equals_reference_over_tokens():
    """`Mamba3.step` on the Triton backend without autograd (in place, the kernel from
    in_proj's rows) over 4 tokens equals the reference step."""
    from mambakit.layers.mamba3 import Mamba3

    torch.manual_seed(0)
    layer = Mamba3(16, d_state=8, headdim=4, ngroups=2)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref = layer.init_state(2)
    mine = layer.init_state(2)
    with torch.no_grad():
        for t in range(4):
            u = torch.randn(2, 16)
            out_ref, ref = layer.step(u, ref)
            out, _ = layer.step(u, mine, backend="triton")
            torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6, msg=f"token {t}")
    for name, a, b in zip(Mamba3State._fields, mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_step_kernels_take_a_strided_D_and_dt_bias(nan_empty):
    """The Triton decode steps with D [H] and dt_bias [H] as views of stride 2: the step on
    made inputs (`mamba3_state_update`) against the float64 reference step, and the step
    from in_proj's rows (`mamba3_step_raw`) against the float64 reference body."""
    from mambakit.layers.mamba3 import Mamba3
    from mambakit.ops.mamba3 import mamba3_state_update, mamba3_step_raw

    def strided(t):
        buf = torch.full((2 * t.shape[0],), float("nan"), dtype=t.dtype, device=t.device)
        buf[::2] = t
        return buf[::2]

    inp, st = make(T=1, seed=2)
    one = {k: (v[:, 0] if v.dim() > 2 else v) for k, v in inp.items()}
    y64, next64 = mamba3_step_reference(**one, state=st)
    args = {k: v.to(DEVICE, torch.float32) for k, v in one.items()}
    args["D"] = strided(args["D"])
    dev = Mamba3State(*(t.to(DEVICE, torch.float32) for t in st))
    y = mamba3_state_update(dev, **args, backend="triton")
    torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(Mamba3State._fields, dev, next64):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5, msg=name)

    torch.manual_seed(0)
    layer = Mamba3(16, d_state=8, headdim=4, ngroups=2)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        zxbc = layer.in_proj(torch.randn(2, 16))
        want = layer.init_state(2)
        st64 = Mamba3State(*(t.double() for t in want))
        w64 = layer.double().decode_weights(projections=False)
        y64 = mamba3_step_raw(st64, zxbc.double(), w64, "reference")
        w = layer.float().to(DEVICE).decode_weights(projections=False)
        w = w._replace(D=strided(w.D), dt_bias=strided(w.dt_bias))
        dev = Mamba3State(*(t.to(DEVICE) for t in want))
        y = mamba3_step_raw(dev, zxbc.to(DEVICE), w, "triton")
    torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(Mamba3State._fields, dev, st64):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5, msg=name)


def _kernel_case(T_, G_, seq, state_in, gate, seed=5, Pn=16, Nn=16):
    """Inputs of the kernel tests (f32, CPU): (scan inputs, initial state or None, seq_idx)."""
    Bn, Hn, Sn = 2, 4, 4
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    inp = dict(
        x=r(Bn, T_, Hn, Pn),
        q=r(Bn, T_, G_, Nn, scale=0.5),
        k=r(Bn, T_, G_, Nn, scale=0.5),
        delta=torch.rand(Bn, T_, Hn, generator=g) * 0.5 + 0.01,
        A=-(torch.rand(Bn, T_, Hn, generator=g) * 2 + 0.1),
        trap=r(Bn, T_, Hn),
        theta=r(Bn, T_, Sn),
        q_bias=r(Hn, Nn, scale=0.3) + 1,
        k_bias=r(Hn, Nn, scale=0.3) + 1,
        D=r(Hn) if gate else None,
        z=r(Bn, T_, Hn, Pn) if gate else None,
    )
    state = None
    if state_in:
        state = Mamba3State(
            torch.rand(Bn, Hn, Sn, generator=g) * 6.2, r(Bn, Hn, Pn, Nn), r(Bn, Hn, Nn),
            r(Bn, Hn, Pn),
        )  # fmt: skip
    seq_idx = None
    if seq:
        ids = torch.randint(0, 4, (Bn, T_), generator=g)
        seq_idx = torch.sort(ids, dim=1).values.to(torch.int32)
    return inp, state, seq_idx


@pytest.mark.parametrize(
    "T_, G_, seq, state_in, gate",
    [(40, 2, False, True, True), (37, 2, True, True, True), (16, 1, False, False, False),
     (5, 4, True, False, True)],
    ids=["chunks", "documents", "one-chunk-no-state", "short-documents"],
)  # fmt: skip
@pytest.mark.parametrize("parallel", [False, True], ids=["walk", "parallel-chunks"])
def test_chunk_kernel_equals_float64_scan(nan_empty, T_, G_, seq, state_in, gate, parallel):
    """The Triton sequence forward (interpreter on the CPU; chunks of 32 steps, a partial
    last one) equals the float64 reference scan: y and every final state field, with
    packed documents, with and without an initial state and the D / z terms; one program
    per (row, head) walking the chunks, or the chunks in parallel (three passes)."""
    from mambakit.ops.mamba3 import chunk
    from mambakit.ops.mamba3.chunk import mamba3_scan_fwd

    below = 10**9 if parallel else 0
    cfg = replace(chunk.CONFIG, parallel_below=below, parallel_min_chunks=1)

    inp, state, seq_idx = _kernel_case(T_, G_, seq, state_in, gate)
    y64, f64 = mamba3_scan_reference(
        **{k: v.double() if v is not None else None for k, v in inp.items()},
        initial_state=Mamba3State(*(t.double() for t in state)) if state else None,
        seq_idx=seq_idx,
        chunk=7,
    )
    dev = {k: v.to(DEVICE) if v is not None else None for k, v in inp.items()}
    y, final = mamba3_scan_fwd(
        **dev,
        initial_state=Mamba3State(*(t.to(DEVICE) for t in state)) if state else None,
        seq_idx=seq_idx.to(DEVICE) if seq_idx is not None else None,
        cfg=cfg,
    )
    assert y.shape == (2, T_, 4, 16) and y.dtype == torch.float32
    torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(Mamba3State._fields, final, f64):
        if name == "angle":  # mod 2 pi: compared where it wraps, too
            got, want = torch.stack([got.cos(), got.sin()]), torch.stack([want.cos(), want.sin()])
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("T_", [1, 37, 48], ids=["one-step", "5-chunks", "6-chunks-edges"])
def test_parallel_forward_chunks_and_document_edges(T_):
    """The forward's chunks in parallel with chunks of 8 and the start-state scan walking 2
    chunks at a time (groups of chunks, a padded last group), documents that start at a
    chunk's first step (8, 16, 32) and one of a single step: y and the final state equal
    the float64 reference; below `parallel_min_chunks` chunks the walk runs (the same
    values)."""
    from mambakit.ops.mamba3 import chunk

    cfg = replace(chunk.CONFIG, chunk=8, scan_chunks=2, parallel_below=10**9)
    inp, state, _ = _kernel_case(T_, 2, False, True, True, seed=3)
    seq_idx = torch.zeros(2, T_, dtype=torch.int32)
    for t in (8, 16, 32, T_ - 1):
        seq_idx[0, t:] += 1 if 0 < t < T_ else 0
    y64, f64 = mamba3_scan_reference(
        **{k: v.double() for k, v in inp.items()},
        initial_state=Mamba3State(*(t.double() for t in state)),
        seq_idx=seq_idx,
        chunk=5,
    )
    for min_chunks in (1, 10):
        y, final = chunk.mamba3_scan_fwd(
            **{k: v.to(DEVICE) for k, v in inp.items()},
            initial_state=Mamba3State(*(t.to(DEVICE) for t in state)),
            seq_idx=seq_idx.to(DEVICE),
            cfg=replace(cfg, parallel_min_chunks=min_chunks),
        )
        torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-5, atol=1e-5)
        for name in ("ssm", "k", "x"):
            got, want = getattr(final, name).cpu().double(), getattr(f64, name)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "T_, G_, seq, state_in, gate",
    [(70, 2, False, True, True), (70, 2, True, True, True), (33, 1, True, False, False),
     (1, 4, False, True, True), (32, 2, False, False, True)],
    ids=["3-chunks", "documents", "documents-no-state", "one-step", "one-full-chunk"],
)  # fmt: skip
def test_chunk_kernels_gradients_equal_float64_scan(T_, G_, seq, state_in, gate):
    """The differentiable kernel scan (forward kernel, backward kernel over chunks of 16 in
    reverse, the per-token terms through autograd) against the float64 reference: y, the
    final state, and the gradient of every input and of every initial state field, for a
    random cotangent on y and on the final S, k~ and x."""
    _check_kernel_gradients(*_kernel_case(T_, G_, seq, state_in, gate, seed=T_))


@pytest.mark.parametrize(
    "seq, state_in", [(True, True), (False, False)], ids=["documents", "plain"]
)
def test_chunk_kernels_in_blocks_of_p_and_n(seq, state_in):
    """The forward programs own blocks of 16 of the head's P values, the backward's first
    kernel walks blocks of 16 of P and N and its scan blocks of 256 of P N (P 40, N 32:
    partial blocks): values and every gradient as the float64 reference, without autograd
    (D and the gate inside the kernel) and with it."""
    from mambakit.ops.mamba3 import chunk

    cfg = replace(chunk.CONFIG, fwd_block_p=16, states_block_p=16, dy_block_p=16, dy_block_n=16,
                  scan_block=256)  # P N = 1280: a partial block  # fmt: skip
    inp, state, seq_idx = _kernel_case(45, 2, seq, state_in, True, seed=7, Pn=40, Nn=32)
    y64, f64 = mamba3_scan_reference(
        **{k: v.double() for k, v in inp.items()},
        initial_state=Mamba3State(*(t.double() for t in state)) if state else None,
        seq_idx=seq_idx,
        chunk=6,
    )
    # walking; then the chunks in parallel: P in blocks of 16 (the last partial), N in
    # blocks of 16 for u
    cfg = replace(cfg, parallel_min_chunks=1, parallel_block_p=16, end_block_n=16)
    for below in (0, 10**9):
        y, final = chunk.mamba3_scan_fwd(
            **{k: v.to(DEVICE) for k, v in inp.items()},
            initial_state=Mamba3State(*(t.to(DEVICE) for t in state)) if state else None,
            seq_idx=seq_idx.to(DEVICE) if seq_idx is not None else None,
            cfg=replace(cfg, parallel_below=below),
        )
        torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-5, atol=1e-5)
        for name in ("ssm", "k", "x"):
            got, want = getattr(final, name).cpu().double(), getattr(f64, name)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    _check_kernel_gradients(inp, state, seq_idx, replace(cfg, parallel_below=0))


@pytest.mark.parametrize("chunk_bwd, seq", [(8, True), (8, False), (16, True), (32, True)])
def test_chunk_kernels_backward_in_other_chunks_than_the_forward(chunk_bwd, seq):
    """The forward (chunks of 16) keeps the start states of the backward's chunks when its
    chunks divide them (16, 32: every chunk's or every other's); a backward in other chunks
    (8) recomputes them in a pass of its own (the forward kernel storing states alone).
    The start states' gradients load 4 chunks at a time (without documents, so the carry
    between the tiles matters). Every gradient as the float64 reference either way."""
    from mambakit.ops.mamba3 import chunk

    cfg = replace(chunk.CONFIG, chunk_bwd=chunk_bwd, scan_chunks=4)  # 8: 6 chunks, two tiles of 4
    _check_kernel_gradients(*_kernel_case(45, 2, seq, True, True, seed=11), cfg)


def _check_kernel_gradients(inp, state, seq_idx, cfg=None):
    """mamba3_scan_kernel's y, final state and every gradient against the float64 scan
    (cfg: the kernels' launch parameters, the library's when None)."""
    from mambakit.ops.mamba3 import mamba3_scan_kernel

    g = torch.Generator().manual_seed(9)
    names = [k for k, v in inp.items() if v is not None]

    def run(dtype, device):
        leaves = {k: inp[k].to(device, dtype).requires_grad_(True) for k in names}
        st = None
        if state is not None:
            st = Mamba3State(*(t.to(device, dtype).requires_grad_(True) for t in state))
        seq = seq_idx.to(device) if seq_idx is not None else None
        full = {**{k: None for k in inp}, **leaves}
        if dtype == torch.float64:
            y, fin = mamba3_scan_reference(**full, initial_state=st, seq_idx=seq, chunk=5)
        else:
            y, fin = mamba3_scan_kernel(**full, initial_state=st, seq_idx=seq, cfg=cfg)
        return leaves, st, y, fin

    leaves64, st64, y64, fin64 = run(torch.float64, "cpu")
    cot_y = torch.randn(y64.shape, generator=g, dtype=torch.float64)
    cot_s = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in fin64[1:]]
    outs = {}
    for key, (leaves, st, y, fin) in (("f64", (leaves64, st64, y64, fin64)),
                                      ("kernel", run(torch.float32, DEVICE))):  # fmt: skip
        loss = (y * cot_y.to(y)).sum() + sum((a * c.to(a)).sum() for a, c in zip(fin[1:], cot_s))
        loss.backward()
        got = {"y": y, **{f"final.{n}": t for n, t in zip(Mamba3State._fields[1:], fin[1:])}}
        got.update({f"d{k}": v.grad for k, v in leaves.items()})
        if st is not None:
            got.update({f"dstate.{n}": t.grad for n, t in zip(Mamba3State._fields, st)})
        outs[key] = {k: v.detach().cpu().double() for k, v in got.items()}
    assert outs["kernel"].keys() == outs["f64"].keys()
    for name, want in outs["f64"].items():
        got = outs["kernel"][name]
        err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "autograd"])
@pytest.mark.parametrize("layout", ["q-batch-minor", "k-batch-minor", "D-strided"])
def test_public_scan_takes_q_and_k_of_other_strides_and_a_strided_D(nan_empty, layout, grad):
    """`mamba3_scan` on the Triton body with q and k of different strides (one of them
    stored time-major: [B, T, G, N] over a [T, B, G, N] buffer, last stride 1 for both) or
    D [H] a view of stride 2, which the checks accept: y and the final state equal the
    float64 oracle's (`mamba3_scan_naive`) on the same values, and under autograd the
    gradients of q, k and D too."""
    from mambakit.ops.mamba3 import mamba3_scan
    from mambakit.ops.mamba3.naive import mamba3_scan_naive

    inp, st = make(T=21, seed=3)
    seq_idx = torch.zeros(B, 21, dtype=torch.int32)
    seq_idx[0, 8:] = 1
    leaves64 = {k: v.clone().requires_grad_(grad) for k, v in inp.items()}
    y64, f64 = mamba3_scan_naive(**leaves64, initial_state=st, seq_idx=seq_idx)
    leaves = {k: v.to(DEVICE, torch.float32).requires_grad_(grad) for k, v in inp.items()}
    args = dict(leaves)
    if layout == "D-strided":
        buf = torch.full((2 * H,), float("nan"), device=DEVICE)
        buf[::2] = leaves["D"]
        args["D"] = buf[::2]
    else:
        name = layout[0]
        args[name] = leaves[name].transpose(0, 1).contiguous().transpose(0, 1)
        assert args["q"].stride() != args["k"].stride()
    st32 = Mamba3State(*(t.to(DEVICE, torch.float32) for t in st))
    with torch.set_grad_enabled(grad):
        y, final = mamba3_scan(**args, initial_state=st32, seq_idx=seq_idx.to(DEVICE),
                               backend="triton")  # fmt: skip
    torch.testing.assert_close(y.cpu().double(), y64.detach(), rtol=1e-5, atol=1e-5)
    for name, got, want in zip(Mamba3State._fields, final, f64):
        if name == "angle":  # mod 2 pi
            got, want = torch.stack([got.cos(), got.sin()]), torch.stack([want.cos(), want.sin()])
        torch.testing.assert_close(got.cpu().double(), want.detach(), rtol=1e-5, atol=1e-5,
                                   msg=name)  # fmt: skip
    if grad:
        cot = torch.randn(y64.shape, generator=torch.Generator().manual_seed(1), dtype=y64.dtype)
        (y64 * cot).sum().backward()
        (y * cot.to(y)).sum().backward()
        for name in ("q", "k", "D"):
            torch.testing.assert_close(leaves[name].grad.cpu().double(), leaves64[name].grad,
                                       rtol=1e-4, atol=1e-5, msg=name)  # fmt: skip


def test_layer_runs_the_chunk_kernels_with_and_without_autograd(monkeypatch):
    """`Mamba3.forward` on the Triton backend runs the chunk kernels (and delta and A's):
    the fused forward under no_grad, the differentiable kernel scan when gradients are
    recorded; both equal the reference backend, the second in every parameter's and the
    input's gradient."""
    from mambakit.layers import mamba3 as layer_mod
    from mambakit.ops import mamba3 as m3
    from mambakit.ops.mamba3 import activations

    calls, fused = [], []
    kernel = m3.mamba3_scan_kernel  # `ops.mamba3._mamba3_scan` looks it up there
    monkeypatch.setattr(m3, "mamba3_scan_kernel",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))  # fmt: skip
    dt_and_A = activations.dt_and_A  # the layer imports it at each call
    monkeypatch.setattr(activations, "dt_and_A",
                        lambda *a: fused.append(1) or dt_and_A(*a))  # fmt: skip
    monkeypatch.setenv("MAMBAKIT_BACKEND", "triton")
    torch.manual_seed(0)
    layer = layer_mod.Mamba3(32, d_state=16, headdim=16, ngroups=2, chunk_size=8)
    u = torch.randn(2, 45, 32)
    cot = torch.randn(2, 45, 32)
    with torch.no_grad():
        y_nograd, s_nograd = layer(u, return_state=True)
    assert calls == [1]
    runs = {}
    for name in ("triton", "reference"):
        monkeypatch.setenv("MAMBAKIT_BACKEND", name)
        layer.zero_grad(set_to_none=True)
        ug = u.clone().requires_grad_(True)
        y, st = layer(ug, return_state=True)
        (y * cot).sum().backward()
        grads = {k: p.grad.clone() for k, p in layer.named_parameters()}
        runs[name] = (y.detach(), st, ug.grad, grads)
    assert calls == [1, 1]
    assert fused == [1, 1]  # delta and A from their kernel, with and without autograd
    y_k, s_k, gu_k, g_k = runs["triton"]
    y_r, s_r, gu_r, g_r = runs["reference"]
    torch.testing.assert_close(y_nograd, y_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_k, y_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gu_k, gu_r, rtol=1e-4, atol=1e-5)
    for k in g_r:
        torch.testing.assert_close(g_k[k], g_r[k], rtol=1e-4, atol=1e-5, msg=k)
    for name, a, b, c in zip(Mamba3State._fields[1:], s_nograd[1:], s_k[1:], s_r[1:]):
        torch.testing.assert_close(a, c.detach(), rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(b.detach(), c.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_chunk_kernels_on_gpu_at_the_130m_head_shape(dtype):
    """On the GPU at the 130m-mamba3 head shape (P 64, N 128, 32 angles, one group),
    300 steps (10 backward chunks, a partial last one), documents and an initial state: the
    kernel scan's y, final state and every gradient against the float64 reference, and y
    and the final state without autograd, the chunks walked and in parallel. x, z and the
    cotangent in `dtype`; products with bf16 operands for bf16 inputs, tf32x3 for f32 ones."""
    from mambakit.ops.mamba3 import chunk, mamba3_scan_kernel

    Bn, T_, Hn, Pn, Nn, Sn = 2, 300, 3, 64, 128, 32
    g = torch.Generator().manual_seed(11)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    inp = dict(
        x=r(Bn, T_, Hn, Pn), q=r(Bn, T_, 1, Nn, scale=0.1), k=r(Bn, T_, 1, Nn, scale=0.1),
        delta=torch.rand(Bn, T_, Hn, generator=g, dtype=torch.float64) * 0.1 + 0.001,
        A=-(torch.rand(Bn, T_, Hn, generator=g, dtype=torch.float64) * 2 + 0.1),
        trap=r(Bn, T_, Hn), theta=r(Bn, T_, Sn), q_bias=r(Hn, Nn, scale=0.3) + 1,
        k_bias=r(Hn, Nn, scale=0.3) + 1, D=r(Hn), z=r(Bn, T_, Hn, Pn),
    )  # fmt: skip
    state = Mamba3State(torch.rand(Bn, Hn, Sn, generator=g, dtype=torch.float64) * 6.2,
                        r(Bn, Hn, Pn, Nn), r(Bn, Hn, Nn), r(Bn, Hn, Pn))  # fmt: skip
    seq_idx = torch.zeros(Bn, T_, dtype=torch.int32)
    seq_idx[0, 100:], seq_idx[0, 231:] = 1, 2  # documents start mid-chunk
    cot = r(Bn, T_, Hn, Pn).to(dtype).double()
    outs = {}
    for key in ("f64", "kernel"):
        dt, dev = (torch.float64, "cpu") if key == "f64" else (torch.float32, "cuda")
        leaves = {k: v.detach().to(dev, dt) for k, v in inp.items()}
        for k in ("x", "z"):
            leaves[k] = inp[k].detach().to(dtype).to(dev, dt if key == "f64" else dtype)
        for v in leaves.values():
            v.requires_grad_(True)
        st = Mamba3State(*(t.detach().to(dev, dt).requires_grad_(True) for t in state))
        seq = seq_idx.to(dev)
        if key == "f64":
            y, fin = mamba3_scan_reference(**leaves, initial_state=st, seq_idx=seq)
        else:
            y, fin = mamba3_scan_kernel(**leaves, initial_state=st, seq_idx=seq)
        (y.double() * cot.to(dev)).sum().add(fin.ssm.double().sum()).backward()
        got = {"y": y, "final.ssm": fin.ssm, "final.k": fin.k}
        got.update({f"d{k}": v.grad for k, v in leaves.items()})
        got.update({f"dstate.{n}": t.grad for n, t in zip(Mamba3State._fields, st)})
        outs[key] = {k: v.detach().cpu().double() for k, v in got.items()}
    # without autograd: the chunks walked, and in parallel (what a prefill runs)
    for below in (0, 10**9):
        with torch.no_grad():
            args = {k: v.detach().to("cuda", torch.float32) for k, v in inp.items()}
            args["x"], args["z"] = (inp[k].to(dtype).cuda() for k in ("x", "z"))
            y, fin = chunk.mamba3_scan_fwd(
                **args, initial_state=Mamba3State(*(t.cuda().float() for t in state)),
                seq_idx=seq_idx.cuda(), cfg=replace(chunk.CONFIG, parallel_below=below),
            )  # fmt: skip
        outs[f"no-grad {below}"] = {"y": y.cpu().double(), "final.ssm": fin.ssm.cpu().double(),
                                    "final.k": fin.k.cpu().double()}  # fmt: skip
    limit = 1e-2 if dtype == torch.bfloat16 else 1e-4
    errs = {}
    for key in ("kernel", "no-grad 0", f"no-grad {10**9}"):
        for name, got in outs[key].items():
            want = outs["f64"][name]
            errs[f"{key} {name}"] = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    print({k: f"{v:.1e}" for k, v in errs.items()})
    assert all(e < limit for e in errs.values()), errs


@pytest.mark.parametrize(
    "Bn, T_, Hn, G_, Nn, Sn, seq",
    [(2, 40, 4, 2, 16, 4, False), (2, 70, 4, 2, 16, 4, True), (1, 33, 4, 4, 10, 2, True),
     (2, 1, 2, 1, 16, 8, False), (2, 65, 2, 1, 12, 3, False)],
    ids=["blocks", "documents", "odd-pairs-documents", "one-step", "partial-block"],
)  # fmt: skip
@pytest.mark.parametrize("block, chunk_blocks", [(16, 1), (16, 8), (32, 1), (32, 2)])
def test_token_terms_kernels_equal_the_reference(Bn, T_, Hn, G_, Nn, Sn, seq, block, chunk_blocks):
    """terms.py (blocks of 16 or 32 steps carrying the angle, pairs as even/odd halves, chunks
    of 1 to 8 blocks in parallel, composed from their sums; the turn and its backward in
    blocks of as many steps, the latter over a group's heads) against reference.token_terms
    in float64: the final angle, q~, k~, A delta, gamma, late, and the gradient of every
    input (group rows summed over their heads, biases over rows and time, theta over the
    heads). The final angle is compared through its sine: it is taken mod 2 pi."""
    from mambakit.ops.mamba3 import terms
    from mambakit.ops.mamba3.reference import token_terms
    from mambakit.ops.mamba3.terms import token_terms_kernel

    cfg = replace(terms.CONFIG, block_t=block, fwd_chunk_blocks=chunk_blocks,
                  bwd_chunk_blocks=chunk_blocks, turn_block_t=block)  # fmt: skip
    g = torch.Generator().manual_seed(T_)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    inp = dict(
        q=r(Bn, T_, G_, Nn), k=r(Bn, T_, G_, Nn),
        delta=torch.rand(Bn, T_, Hn, generator=g, dtype=torch.float64) * 0.5 + 0.01,
        A=-(torch.rand(Bn, T_, Hn, generator=g, dtype=torch.float64) * 2 + 0.1),
        trap=r(Bn, T_, Hn), theta=r(Bn, T_, Sn) * 2, q_bias=r(Hn, Nn), k_bias=r(Hn, Nn),
        angle0=torch.rand(Bn, Hn, Sn, generator=g, dtype=torch.float64) * 6,
    )  # fmt: skip
    seq_idx = None
    if seq:
        ids = torch.randint(0, 4, (Bn, T_), generator=g)
        seq_idx = torch.sort(ids, dim=1).values.to(torch.int32)
    outs, cots = {}, None
    for key in ("f64", "kernel"):
        dt, dev = (torch.float64, "cpu") if key == "f64" else (torch.float32, DEVICE)
        leaves = {n: v.detach().to(dev, dt).requires_grad_(True) for n, v in inp.items()}
        args = [leaves[n] for n in ("q", "k", "delta", "A", "trap", "theta", "q_bias",
                                    "k_bias", "angle0")]  # fmt: skip
        if key == "f64":
            phi, *rest = token_terms(*args, seq_idx, torch.float64)
            res = [phi[:, -1], *rest]
        else:
            res = list(token_terms_kernel(*args, seq_idx.to(dev) if seq else None, cfg=cfg))
        if cots is None:
            cots = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in res]
        res[0] = torch.sin(res[0])
        sum((t.double() * c.to(dev)).sum() for t, c in zip(res, cots)).backward()
        got = {f"out{j}": t for j, t in enumerate(res)}
        got.update({f"d{n}": v.grad for n, v in leaves.items()})
        outs[key] = {n: v.detach().cpu().double() for n, v in got.items()}
    for name, want in outs["f64"].items():
        err = ((outs["kernel"][name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"
