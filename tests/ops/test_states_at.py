"""states_at: the states after given steps, from one forward, against the runs cut there.

B batch, T time, D = d_inner, N = d_state, K = d_conv, k steps asked for per row. The
oracle of every test is the float64 reference run over the prefix that ends at the step
(`input[:, :p+1]`, or from the step's document start): its final state is the state after
step p. So a state stored at the wrong step, into the wrong slot, before a document's reset
or with the initial state leaking into a later document shows up, as does a slot the
kernel never writes (the buffers start as NaN: `nan_empty`). Without CUDA the Triton
kernels run under the interpreter (tests/conftest.py), so the shapes are tiny; under it the
library's scan config cuts time into segments of two tiles of 4 steps, so every Triton call
here crosses segment boundaries.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from mambakit import MambaConfig, MambaLM
from mambakit.ops import _mamba_inner, causal_conv1d, selective_scan
from mambakit.ops.causal_conv1d.reference import conv_states_at
from mambakit.ops.mamba_inner.reference import mamba_inner_chain
from mambakit.ops.selective_scan import launch as K
from mambakit.ops.selective_scan import states_at_buffers
from mambakit.ops.selective_scan.programs import MAX_BLOCK_N
from mambakit.state import MambaState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
I64 = torch.int64
BACKENDS = ["reference", "triton"]

# Tolerance on ||got - ref|| / ||ref|| against the float64 oracle. The states are f32
# recurrences over at most T = 37 steps whose inputs are upcast exactly (bf16 ones too: B,
# C and delta are widened, never rounded), ~1e-7 measured; y in bf16 is rounded once
# (2^-8, and the interpreter truncates: up to 2^-7 per element).
TOL = {F32: 1e-5, BF16: 1e-2}

T = 37
# documents start at these steps (seq_idx numbers them); the steps asked for, in no order:
# a document's last step, its first, one mid-document, step 0, the row's last step (T - 1),
# a one-step document (row 1, step 5: its first and last), tile (4) and segment (8) ends
STARTS = [[0, 10, 22], [0, 5, 6, 20]]
POSITIONS = [[9, 10, 15, 0, 36, 21], [4, 5, 6, 2, 30, 19]]


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
    assert torch.isfinite(got).all(), "non-finite values (an unwritten element?)"
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def seq_from_starts(starts: list[list[int]], T: int) -> torch.Tensor:
    """seq_idx [B, T] int32 numbering the documents that start at `starts[b]`."""
    t = torch.arange(T, device=DEVICE)
    cuts = [torch.tensor(s[1:], device=DEVICE) for s in starts]
    return torch.stack([(t[:, None] >= c[None, :]).sum(-1) for c in cuts]).to(torch.int32)


def doc_start(starts: list[int], p: int) -> int:
    return max(s for s in starts if s <= p)


def positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=I64, device=DEVICE)


@dataclasses.dataclass
class ScanCase:
    Dn: int = 12  # two channel blocks of 8, the second partial
    N: int = 5  # not a power of two: masked states
    full: bool = True  # D, z, delta_bias + softplus, initial_state, seq_idx; else none of them

    @property
    def id(self) -> str:
        return f"D{self.Dn}-N{self.N}-" + ("D+z+bias+softplus+h0+seq" if self.full else "plain")


def scan_inputs(c: ScanCase, dtype=F32, Bsz: int = 2) -> dict:
    """The scan's arguments as keywords; B and C are the slices of one x_proj-like output."""
    kw = dict(device=DEVICE)
    full = c.full
    xp = torch.randn(Bsz, T, 3 + 2 * c.N, **kw).to(dtype)
    delta = torch.randn(Bsz, T, c.Dn, **kw) * 0.5
    if not full:  # delta is used as is: keep it positive
        delta = delta.abs() + 0.05
    return dict(
        u=torch.randn(Bsz, T, c.Dn, **kw).to(dtype),
        delta=delta.to(dtype),
        A=-(torch.rand(c.Dn, c.N, **kw) * 1.5 + 0.1),
        B=xp[..., 3 : 3 + c.N],
        C=xp[..., 3 + c.N :],
        D=torch.randn(c.Dn, **kw) if full else None,
        z=torch.randn(Bsz, T, c.Dn, **kw).to(dtype) if full else None,
        delta_bias=torch.randn(c.Dn, **kw) * 0.3 if full else None,
        delta_softplus=full,
        initial_state=torch.randn(Bsz, c.Dn, c.N, **kw) if full else None,
        seq_idx=seq_from_starts(STARTS, T) if full else None,
    )


def f64(inp: dict) -> dict:
    return {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inp.items()
    }


def cut(t: torch.Tensor | None, b: int, start: int, stop: int) -> torch.Tensor | None:
    return None if t is None else t[b : b + 1, start:stop]


def prefix_states(inp: dict, pos: torch.Tensor) -> torch.Tensor:
    """The oracle: [B, k, D, N] f64, entry (b, j) the final state of the float64 reference
    scan of row b over steps 0 .. positions[b, j], from the row's initial state."""
    o = f64(inp)
    rows = []
    for b in range(pos.shape[0]):
        row = []
        for p in pos[b].tolist():
            seq = {k: cut(o[k], b, 0, p + 1) for k in ("u", "delta", "B", "C", "z", "seq_idx")}
            h0 = o["initial_state"]
            _, h = selective_scan(
                seq["u"], seq["delta"], o["A"], seq["B"], seq["C"], D=o["D"], z=seq["z"],
                delta_bias=o["delta_bias"], delta_softplus=o["delta_softplus"],
                initial_state=None if h0 is None else h0[b : b + 1], seq_idx=seq["seq_idx"],
                return_final_state=True, backend="reference",
            )  # fmt: skip
            row.append(h[0])
        rows.append(torch.stack(row))
    return torch.stack(rows)


def whole_run(inp: dict, backend: str = "reference"):
    """(y, h_T) of the scan over the whole sequence (float64 inputs: the oracle)."""
    return selective_scan(**inp, return_final_state=True, backend=backend)


# ----------------------------------------------------------------------------------------
# 1. the op, both backends


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", [ScanCase(), ScanCase(Dn=8, N=4, full=False)], ids=lambda c: c.id)
def test_scan_states_equal_the_prefix_runs(backend, c: ScanCase, seed, nan_empty):
    """Each state returned is the float64 scan over the prefix ending at its step (documents
    reset, the initial state in the first document only, D, z, delta_bias with softplus),
    and y and the final state are those of the same call without states_at."""
    inp = scan_inputs(c)
    pos = positions(POSITIONS)
    with torch.no_grad():
        y, hT, states = selective_scan(**inp, return_final_state=True, backend=backend,
                                       states_at=pos)  # fmt: skip
        y0, hT0 = whole_run(inp, backend)
    assert states.shape == (2, 6, c.Dn, c.N) and states.dtype == F32
    assert y.dtype == F32 and hT.dtype == F32
    want = prefix_states(inp, pos)
    for b in range(2):
        for j, p in enumerate(POSITIONS[b]):
            assert rel(states[b, j], want[b, j]) < TOL[F32], (b, j, p)
    # the state after T - 1 is the final state
    assert torch.equal(states[0, 4], hT[0])
    yo, hTo = whole_run(f64(inp))
    assert rel(y, yo) < TOL[F32] and rel(hT, hTo) < TOL[F32]
    if backend == "triton":  # the same kernel pass with one more masked store
        assert torch.equal(y, y0) and torch.equal(hT, hT0)
    else:  # the reference cuts the scan at the steps: the same up to f32 rounding
        torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(hT, hT0, rtol=1e-5, atol=1e-6)
    if c.full:  # a later document starts from zero, whatever came before it
        o = f64(inp)
        for b, j in ((0, 1), (0, 2), (1, 1), (1, 4)):
            p = POSITIONS[b][j]
            s = doc_start(STARTS[b], p)
            assert s > 0
            args = [cut(o[k], b, s, p + 1) for k in ("u", "delta")]
            _, h = selective_scan(
                *args, o["A"], cut(o["B"], b, s, p + 1), cut(o["C"], b, s, p + 1),
                delta_bias=o["delta_bias"], delta_softplus=True, return_final_state=True,
                backend="reference",
            )  # fmt: skip
            assert rel(states[b, j], h[0]) < TOL[F32], (b, j, p)


def head(inp: dict, n: int) -> dict:
    """The scan's arguments over the first n steps."""
    timed = ("u", "delta", "B", "C", "z", "seq_idx")
    return {k: v[:, :n] if k in timed and v is not None else v for k, v in inp.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_edge_steps(backend, seed):
    """One row of one step; no steps asked for ([B, 0]); every step of a short row."""
    inp = scan_inputs(ScanCase(Dn=4, N=3))
    with torch.no_grad():
        one = positions([[0], [0]])
        _, hT, states = selective_scan(**head(inp, 1), return_final_state=True, backend=backend,
                                       states_at=one)  # fmt: skip
        assert states.shape == (2, 1, 4, 3)
        torch.testing.assert_close(states[:, 0], hT, rtol=0, atol=0)
        none = torch.zeros(2, 0, dtype=I64, device=DEVICE)
        y, hT, states = selective_scan(**inp, return_final_state=True, backend=backend,
                                       states_at=none)  # fmt: skip
        assert states.shape == (2, 0, 4, 3)
        yo, hTo = whole_run(f64(inp))
        assert rel(y, yo) < TOL[F32] and rel(hT, hTo) < TOL[F32]
        pos = torch.stack([torch.randperm(9, device=DEVICE) for _ in range(2)])
        _, _, states = selective_scan(**head(inp, 9), return_final_state=True, backend=backend,
                                      states_at=pos)  # fmt: skip
    assert rel(states, prefix_states(head(inp, 9), pos)) < TOL[F32]


def test_reference_states_carry_gradients(seed):
    """On the reference backend the states are differentiable: the gradients of a loss on
    them (and on y) are those through the float64 prefix runs."""
    c = ScanCase(Dn=4, N=3)
    inp = scan_inputs(c)
    pos = positions(POSITIONS)
    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
    leaves = {k: inp[k].detach().clone().requires_grad_() for k in names}
    oleaves = {k: inp[k].detach().double().requires_grad_() for k in names}
    y, _, states = selective_scan(**{**inp, **leaves}, return_final_state=True,
                                  backend="reference", states_at=pos)  # fmt: skip
    w, wy = torch.randn_like(states), torch.randn_like(y)
    ((states * w).sum() + (y * wy).sum()).backward()
    o = {**inp, **oleaves}
    yo, _ = whole_run(o)
    ((prefix_states(o, pos) * w.double()).sum() + (yo * wy.double()).sum()).backward()
    for k in names:
        assert rel(leaves[k].grad, oleaves[k].grad) < 1e-4, k


# ----------------------------------------------------------------------------------------
# 2. the Triton kernel: segments, several state blocks, bf16


@pytest.mark.parametrize(
    "seg_tiles, N",
    [(1, 5), (3, MAX_BLOCK_N + 8), (1 << 20, 5)],
    ids=["segments-of-1-tile", "segments-of-3-tiles-N-split", "one-segment"],
)
def test_triton_states_across_segments_and_state_blocks(seg_tiles, N, seed, nan_empty):
    """`scan_fwd` with `at`, time cut into segments of 1 or 3 tiles (each segment's start
    composed from the summaries before it) or not cut, and N over two state blocks (each
    program stores its block of the state)."""
    c = ScanCase(Dn=5, N=N)
    inp = scan_inputs(c)
    base = K.config(c.Dn, DEVICE != "cuda")
    cfg = dataclasses.replace(base, seg_tiles=seg_tiles)
    nc = -(-T // cfg.fwd_tile)
    nseg, _ = K.time_segments(nc, 2, cfg.fwd_seg_target_per_sm, cfg, torch.device(DEVICE))
    assert (nseg > 1) == (seg_tiles < nc)
    # steps at segment ends and starts: with 1-tile segments every 4th step starts one
    pos = positions([[3, 4, 11, 12, 36, 0, 23], [7, 8, 5, 6, 35, 19, 20]])
    at = states_at_buffers(pos, T, c.Dn, N, torch.device(DEVICE))
    out = at[2]
    args = [inp[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    y, hT, saved = K.scan_fwd(*args, True, inp["initial_state"], inp["seq_idx"], False, cfg=cfg,
                              at=at)  # fmt: skip
    assert saved.numel() == 0 and out.shape == (2, 7, c.Dn, N)
    want = prefix_states(inp, pos)
    for b in range(2):
        for j in range(7):
            assert rel(out[b, j], want[b, j]) < TOL[F32], (b, j, pos[b, j].item())
    yo, hTo = whole_run(f64(inp))
    assert rel(y, yo) < TOL[F32] and rel(hT, hTo) < TOL[F32]


def test_triton_bf16_inputs(seed, nan_empty):
    """bf16 u, delta, z and B, C (slices of one x_proj output): the states are f32 and meet
    the f32 bound (their inputs widen exactly); y is rounded to bf16 once."""
    c = ScanCase(Dn=8, N=4)
    inp = scan_inputs(c, dtype=BF16)
    pos = positions(POSITIONS)
    with torch.no_grad():
        y, hT, states = selective_scan(**inp, return_final_state=True, backend="triton",
                                       states_at=pos)  # fmt: skip
    assert y.dtype == BF16 and states.dtype == F32
    assert rel(states, prefix_states(inp, pos)) < TOL[F32]
    yo, hTo = whole_run(f64(inp))
    assert rel(y, yo) < TOL[BF16] and rel(hT, hTo) < TOL[F32]


# ----------------------------------------------------------------------------------------
# 3. the conv states


def conv_window(x, h0, seq, b: int, p: int, Kc: int) -> torch.Tensor:
    """The closed form: the K-1 conv inputs up to step p of row b, oldest first; zero where
    they lie in another document, the initial state's tail before step 0 (first document)."""
    out = torch.zeros(Kc - 1, x.shape[-1], dtype=F64, device=x.device)
    first_doc = seq is None or seq[b, 0] == seq[b, p]
    for i, t in enumerate(range(p - Kc + 2, p + 1)):
        if t >= 0 and (seq is None or seq[b, t] == seq[b, p]):
            out[i] = x[b, t]
        elif t < 0 and h0 is not None and first_doc:
            out[i] = h0[b, t + Kc - 1]
    return out


@pytest.mark.parametrize("Kc", [2, 4])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "with_h0, with_seq",
    [(True, True), (True, False), (False, True), (False, False)],
    ids=["h0+seq", "h0", "seq", "plain"],
)
def test_conv_states_equal_the_conv_run_to_each_step(Kc, dtype, with_h0, with_seq, seed):
    """conv_states_at: the final state of the float64 conv run over each prefix, and the
    closed form, with documents (a step at a document's start sees zeros, not the document
    before) and the initial state (read before step 0, in the first document only)."""
    Bsz, Dn = 2, 6
    x = torch.randn(Bsz, T, Dn, device=DEVICE, dtype=dtype)
    w = torch.randn(Dn, Kc, device=DEVICE, dtype=F64)
    h0 = torch.randn(Bsz, Kc - 1, Dn, device=DEVICE, dtype=dtype) if with_h0 else None
    seq = seq_from_starts(STARTS, T) if with_seq else None
    rows = [[1, 9, 10, 11, 0, 36, 21], [4, 5, 6, 7, 2, 30, 1]]  # 1: the initial state's tail
    pos = positions(rows)
    got = conv_states_at(x, pos, Kc, h0, seq)
    assert got.shape == (Bsz, 7, Kc - 1, Dn) and got.dtype == dtype
    for b in range(Bsz):
        for j, p in enumerate(rows[b]):
            _, final = causal_conv1d(
                x[b : b + 1, : p + 1].double(), w, None,
                initial_state=None if h0 is None else h0[b : b + 1].double(),
                seq_idx=None if seq is None else seq[b : b + 1, : p + 1],
                return_final_state=True, backend="reference",
            )  # fmt: skip
            torch.testing.assert_close(got[b, j].double(), final[0], rtol=0, atol=0)
            torch.testing.assert_close(got[b, j].double(), conv_window(x, h0, seq, b, p, Kc),
                                       rtol=0, atol=0)  # fmt: skip
    if with_seq:  # the one-step document (row 1, step 5) keeps x_5 alone
        assert torch.equal(got[1, 1, -1], x[1, 5]) and not got[1, 1, :-1].any()


@pytest.mark.parametrize("Kc", [2, 3, 4])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "with_h0, with_seq",
    [(True, True), (True, False), (False, True), (False, False)],
    ids=["h0+seq", "h0", "seq", "plain"],
)
def test_conv_states_kernel_equals_the_gathers(Kc, dtype, with_h0, with_seq, seed):
    """The Triton gather of the conv states (`conv_states_at_triton`, one launch) gives
    exactly what the torch gathers give, which the test above checks against the conv run
    to each step: x a view of half of in_proj's output (strided rows), more channels than
    one program holds, the initial state's tail, documents."""
    from mambakit.ops.causal_conv1d.states_at import BLOCK_D, conv_states_at_triton

    Bsz, Dn = 2, BLOCK_D + 6
    xz = torch.randn(Bsz, T, 2 * Dn, device=DEVICE).to(dtype)
    x = xz[..., :Dn]
    h0 = torch.randn(Bsz, Kc - 1, Dn, device=DEVICE).to(dtype) if with_h0 else None
    seq = seq_from_starts(STARTS, T) if with_seq else None
    pos = positions([[1, 9, 10, 11, 0, 36, 21], [4, 5, 6, 7, 2, 30, 1]])
    got = conv_states_at_triton(x, pos, Kc, h0, seq)
    want = conv_states_at(x, pos, Kc, h0, seq)
    assert got.dtype == want.dtype == F32
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------
# the mixer's inner op (conv and scan states together)


def inner_inputs(Bsz: int = 2, Dn: int = 8, N: int = 4, R: int = 2, Kc: int = 4) -> dict:
    kw = dict(device=DEVICE)
    return dict(
        xz=torch.randn(Bsz, T, 2 * Dn, **kw),
        conv_weight=torch.randn(Dn, Kc, **kw) * 0.5,
        conv_bias=torch.randn(Dn, **kw) * 0.2,
        x_proj_weight=torch.randn(R + 2 * N, Dn, **kw) * 0.4,
        dt_proj_weight=torch.randn(Dn, R, **kw) * 0.5,
        A=-torch.exp(torch.randn(Dn, N, **kw) * 0.5),
        D=torch.randn(Dn, **kw),
        dt_bias=torch.randn(Dn, **kw) * 0.5 - 1.0,
        conv_state=torch.randn(Bsz, Kc - 1, Dn, **kw),
        ssm_state=torch.randn(Bsz, Dn, N, **kw),
        seq_idx=seq_from_starts(STARTS, T),
    )


INNER = ("xz", "conv_weight", "conv_bias", "x_proj_weight", "dt_proj_weight", "A", "D",
         "dt_bias", "conv_state", "ssm_state", "seq_idx")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba_inner_states_equal_the_prefix_runs(backend, seed, nan_empty):
    """`_mamba_inner(..., states_at=)`: (y, final conv and ssm states) as without it, and
    the conv and ssm states after each step: those the float64 chain leaves over the
    prefix ending there (from the given states in the first document)."""
    inp = inner_inputs()
    pos = positions(POSITIONS)
    with torch.no_grad():
        y, conv_out, ssm_out, conv_at, ssm_at = _mamba_inner(
            *[inp[k] for k in INNER], backend, states_at=pos
        )
        y0, conv0, ssm0 = _mamba_inner(*[inp[k] for k in INNER], backend)
    assert conv_at.shape == (2, 6, 3, 8) and ssm_at.shape == (2, 6, 8, 4)
    torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-6)
    assert torch.equal(conv_out, conv0)
    torch.testing.assert_close(ssm_out, ssm0, rtol=1e-5, atol=1e-6)
    o = f64(inp)
    for b in range(2):
        for j, p in enumerate(POSITIONS[b]):
            _, conv_w, ssm_w = mamba_inner_chain(
                o["xz"][b : b + 1, : p + 1],
                **{k: o[k] for k in INNER[1:8]},
                conv_state=o["conv_state"][b : b + 1],
                ssm_state=o["ssm_state"][b : b + 1],
                seq_idx=o["seq_idx"][b : b + 1, : p + 1],
                backend="reference",
            )
            assert rel(conv_at[b, j], conv_w[0]) < TOL[F32], ("conv", b, j, p)
            assert rel(ssm_at[b, j], ssm_w[0]) < TOL[F32], ("ssm", b, j, p)


# ----------------------------------------------------------------------------------------
# 4. the model

MT = 20
M_STARTS = [[0, 7, 12], [0, 3, 4, 13]]
# every prompt's last step, then a few inside prompts (row 1, step 3: a one-step prompt)
M_POSITIONS = [[6, 11, 19, 2, 9, 0], [2, 3, 12, 19, 8, 13]]


def tiny_lm(randomize) -> MambaLM:
    """Two Mamba-1 layers, d_inner 16 (two channel blocks under the interpreter), random
    SSM parameters (a fresh init's A_log, D and norms would hide a wrong layout)."""
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=16, n_layers=2, vocab_size=64, d_state=8, expand=1)
    return randomize(MambaLM(cfg).to(DEVICE)).eval()


def random_state(model: MambaLM, Bsz: int) -> MambaState:
    s = model.init_state(Bsz)
    return MambaState(torch.randn_like(s.conv), torch.randn_like(s.ssm) * 0.5)


def model_oracle(model: MambaLM, ids, seq_idx, state, rows, starts):
    """Per step p of row b: `last_logits` of the float64 model over the prompt up to p (from
    the row's state when p is in the row's first prompt): (logits [B, k, V], conv and ssm
    states [L, B*k, ...]), all float64."""
    ref = copy.deepcopy(model).double()
    logits, convs, ssms = [], [], []
    with torch.no_grad():
        for b, row in enumerate(rows):
            for p in row:
                s = doc_start(starts[b], p)
                st = None
                if state is not None and s == 0:
                    st = MambaState(state.conv[:, b : b + 1].double(),
                                    state.ssm[:, b : b + 1].double())  # fmt: skip
                lg, out = ref.last_logits(ids[b : b + 1, s : p + 1], state=st)
                logits.append(lg[0])
                convs.append(out.conv[:, 0])
                ssms.append(out.ssm[:, 0])
    Bsz, k = len(rows), len(rows[0])
    return torch.stack(logits).view(Bsz, k, -1), torch.stack(convs, 1), torch.stack(ssms, 1)


def assert_states_at(got, want) -> None:
    (logits, state), (wl, wc, ws) = got, want
    assert logits.shape == wl.shape and state.conv.shape == wc.shape
    assert state.ssm.shape == ws.shape
    Bsz, k = logits.shape[:2]
    for b in range(Bsz):
        for j in range(k):
            r = b * k + j
            assert rel(logits[b, j], wl[b, j]) < 1e-5, ("logits", b, j)
            assert rel(state.conv[:, r], wc[:, r]) < 1e-5, ("conv", b, j)
            assert rel(state.ssm[:, r], ws[:, r]) < 1e-5, ("ssm", b, j)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_state", [False, True], ids=["from-zero", "from-a-state"])
def test_model_states_at_equal_last_logits_of_each_prefix(
    backend, with_state, randomize, monkeypatch
):
    """Two rows of packed prompts (seq_idx numbering them): the logits and the model state
    at every prompt's end and at steps inside prompts are `last_logits` of that prompt up
    to the step; from a given state, the rows' first prompts start from it."""
    model = tiny_lm(randomize)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, MT), device=DEVICE)
    seq_idx = seq_from_starts(M_STARTS, MT)
    state = random_state(model, 2) if with_state else None
    pos = positions(M_POSITIONS)
    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    with torch.no_grad():
        got = model.states_at(ids, pos, state=state, seq_idx=seq_idx)
    monkeypatch.delenv("MAMBAKIT_BACKEND")
    assert got[0].shape == (2, 6, 64) and got[1].conv.shape == (2, 12, 3, 16)
    assert_states_at(got, model_oracle(model, ids, seq_idx, state, M_POSITIONS, M_STARTS))


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_states_at_through_the_modules(backend, randomize, monkeypatch):
    """A forward hook on x_proj makes the mixers call their modules (inner_plain() is
    False): the hook runs once per layer and the result is still `last_logits` of each
    prefix."""
    model = tiny_lm(randomize)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, MT), device=DEVICE)
    seq_idx = seq_from_starts(M_STARTS, MT)
    state = random_state(model, 2)
    pos = positions(M_POSITIONS)
    want = model_oracle(model, ids, seq_idx, state, M_POSITIONS, M_STARTS)
    calls = []
    for layer in model.backbone.layers:
        layer.mixer.x_proj.register_forward_hook(lambda m, args, out: calls.append(m))
    assert not any(layer.mixer.inner_plain() for layer in model.backbone.layers)
    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    with torch.no_grad():
        got = model.states_at(ids, pos, state=state, seq_idx=seq_idx)
    monkeypatch.delenv("MAMBAKIT_BACKEND")
    assert calls == [layer.mixer.x_proj for layer in model.backbone.layers]
    assert_states_at(got, want)


# ----------------------------------------------------------------------------------------
# 5. errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_rejects_bad_steps(backend, seed):
    inp = scan_inputs(ScanCase(Dn=4, N=3))

    def call(pos):
        return selective_scan(**inp, return_final_state=True, backend=backend, states_at=pos)

    with pytest.raises(ValueError, match="states_at.*twice"):
        call(positions([[3, 7, 3], [0, 1, 2]]))
    with pytest.raises(ValueError, match="states_at"):
        call(positions([[3, 7, T], [0, 1, 2]]))
    with pytest.raises(ValueError, match="states_at"):
        call(positions([[3, 7, 1], [0, -1, 2]]))
    with pytest.raises(TypeError, match="states_at"):
        call(torch.tensor([[3, 7, 1], [0, 1, 2]], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="states_at"):  # one row of steps for two rows
        call(positions([[3, 7, 1]]))


def test_triton_scan_states_need_no_autograd(seed):
    """The Triton forward stores the states without a backward: an input that needs a
    gradient is refused; under no_grad the same inputs are fine."""
    c = ScanCase(Dn=4, N=3)
    inp = head(scan_inputs(c), 6)
    pos = positions([[1, 5], [0, 3]])
    for name in ("u", "A", "initial_state"):
        leaf = {**inp, name: inp[name].clone().requires_grad_()}
        with pytest.raises(ValueError, match="states_at"):
            selective_scan(**leaf, backend="triton", states_at=pos)
        with torch.no_grad():
            _, _, states = selective_scan(**leaf, backend="triton", states_at=pos)
        assert rel(states, prefix_states(inp, pos)) < TOL[F32]


def test_model_states_at_no_steps(randomize):
    """No steps asked for: empty logits [B, 0, V] and a state of no rows."""
    model = tiny_lm(randomize)
    ids = torch.randint(0, 64, (2, 8), device=DEVICE)
    with torch.no_grad():
        logits, state = model.states_at(ids, torch.zeros(2, 0, dtype=torch.int64, device=DEVICE))
    assert logits.shape == (2, 0, 64) and state.ssm.shape[1] == 0


def test_model_rejects_bad_steps_and_other_mixers(randomize):
    model = tiny_lm(randomize)
    ids = torch.randint(0, 64, (2, 8), device=DEVICE)
    with pytest.raises(ValueError, match="states_at.*twice"):
        model.states_at(ids, positions([[1, 1], [0, 2]]))
    with pytest.raises(ValueError, match="states_at"):
        model.states_at(ids, positions([[1, 8], [0, 2]]))
    with pytest.raises(ValueError, match="states_at"):
        model.states_at(ids, positions([[1, -1], [0, 2]]))
    with pytest.raises(TypeError, match="states_at"):
        model.states_at(ids, torch.tensor([[1, 2], [0, 2]], dtype=torch.int32, device=DEVICE))
    for mixer in ("mamba2", "mamba3"):
        cfg = MambaConfig(d_model=16, n_layers=1, vocab_size=64, d_state=8, mixer=mixer,
                          headdim=8)  # fmt: skip
        other = MambaLM(cfg).to(DEVICE)
        with pytest.raises(NotImplementedError, match="states_at"):
            other.states_at(ids, positions([[1, 2], [0, 2]]))


def test_states_at_under_autograd_refused_on_triton(randomize, monkeypatch):
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=16, n_layers=1, vocab_size=64, d_state=4, expand=1)
    model = randomize(MambaLM(cfg).to(DEVICE))
    ids = torch.randint(0, 64, (1, 8), device=DEVICE)
    pos = positions([[3, 7]])
    grads = {}
    for backend in BACKENDS:
        model.zero_grad(set_to_none=True)
        monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
        if backend == "triton":  # the kernel's states have no gradient: refused, by name
            with pytest.raises(ValueError, match="states_at"):
                model.states_at(ids, pos)
            monkeypatch.delenv("MAMBAKIT_BACKEND")
            continue
        logits, state = model.states_at(ids, pos)
        monkeypatch.delenv("MAMBAKIT_BACKEND")
        (logits.square().sum() + state.ssm.sum() + state.conv.sum()).backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    # the reference differentiates through every parameter
    assert all(g is not None and g.abs().sum() > 0 for g in grads["reference"].values())


def test_states_at_slots_mark_steps_and_tiles():
    """`states_at_buffers`: slot j at step positions[b, j] (-1 elsewhere) and each forward
    tile's largest slot (-1: a tile that keeps none), against a loop; `tile_slots` for
    another tile size likewise."""
    dev = torch.device(DEVICE)
    pos = positions([[3, 9, 0], [17, 4, 5]])
    tc = K.config(6, DEVICE != "cuda").fwd_tile
    slot, tiles, out = states_at_buffers(pos, 19, 6, 3, dev)
    want = torch.full((2, 19), -1, dtype=torch.int32)
    for b in range(2):
        for j, t in enumerate(pos[b].tolist()):
            want[b, t] = j
    assert torch.equal(slot.cpu(), want) and out.shape == (2, 3, 6, 3)
    for size, got in ((tc, tiles), (2 * tc, K.tile_slots(slot, 2 * tc))):
        assert got.shape == (2, -(-19 // size))
        for b in range(2):
            for c in range(got.shape[1]):
                assert got[b, c].item() == want[b, c * size : (c + 1) * size].max().item()


def test_triton_states_with_another_forward_tile(seed, nan_empty):
    """A launch whose forward tile differs from the library's (a cfg of the caller's) builds
    its own tiles from the slots: every state asked for is still written, right."""
    c = ScanCase(Dn=5, N=4)
    inp = scan_inputs(c)
    base = K.config(c.Dn, DEVICE != "cuda")
    cfg = dataclasses.replace(base, fwd_tile=2 * base.fwd_tile)
    pos = positions([[3, 4, 11, 12, 36, 0, 23], [7, 8, 5, 6, 35, 19, 20]])
    at = states_at_buffers(pos, T, c.Dn, c.N, torch.device(DEVICE))
    args = [inp[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    K.scan_fwd(*args, True, inp["initial_state"], inp["seq_idx"], False, cfg=cfg, at=at)
    want = prefix_states(inp, pos)
    for b in range(2):
        for j in range(7):
            assert rel(at[2][b, j], want[b, j]) < TOL[F32], (b, j, pos[b, j].item())
