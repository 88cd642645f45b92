"""selective_scan and selective_state_update on the Triton backend against a float64 oracle.

B batch, T time, D = d_inner, N = d_state. Without CUDA the kernels run under
the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the
shapes here are tiny; the `gpu` class at the bottom runs real shapes on the
device (`pytest -m gpu`).

The oracle is the plain sequential loop over time in float64
(`ops/selective_scan/naive.py`), independent of the reference module; gradients come
from autograd through it.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from mambakit.ops import selective_scan, selective_state_update
from mambakit.ops.selective_scan.naive import selective_scan_naive as oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# Tolerance on ||got - ref|| / ||ref|| against the float64 oracle, by input dtype.
# Inputs are drawn in their dtype and upcast exactly for the oracle, and the
# incoming gradients are the same numbers for both, so what remains is the f32
# arithmetic of the kernels and the final rounding of the outputs:
# - f32: f32 state and sums over T and N, exp2 instead of exp: ~1e-7 measured;
#   1e-4 leaves room for longer reductions (dA, dD over B*T terms).
# - f16: y, du, ddelta, dz, dB, dC are rounded to f16 (2^-11 relative per
#   element, ~3e-4 norm-wise); 2e-3.
# - bf16: the same rounding at 2^-8 (~2e-3 norm-wise); 1e-2.
# Parameter gradients (A, D, delta_bias, initial_state) are f32 reductions of
# the same f32 terms, so they meet the same bound.
TOL = {F32: 1e-4, F16: 2e-3, BF16: 1e-2}


@dataclasses.dataclass
class Case:
    Bsz: int = 2
    T: int = 33
    Dn: int = 5
    N: int = 3
    dtype: torch.dtype = F32
    D: bool = True
    z: bool = True
    bias: bool = True
    softplus: bool = True
    h0: bool = True
    seq: bool = True
    gT: bool = True  # a gradient arrives on the final state
    strided: bool = False  # u, z, B, C as slices of wider projection outputs

    @property
    def id(self) -> str:
        flags = [k for k in ("D", "z", "bias", "softplus", "h0", "seq", "gT", "strided")]
        on = "+".join(k for k in flags if getattr(self, k)) or "plain"
        dt = {F32: "f32", BF16: "bf16", F16: "f16"}[self.dtype]
        return f"B{self.Bsz}-T{self.T}-D{self.Dn}-N{self.N}-{dt}-{on}"


def make_inputs(c: Case, device: str = DEVICE) -> dict:
    dt = c.dtype
    kw = dict(device=device)
    if c.strided:  # the in_proj / x_proj outputs the mixer slices
        xz = torch.randn(c.Bsz, c.T, 2 * c.Dn, **kw).to(dt)
        u, z = xz[..., : c.Dn], xz[..., c.Dn :]
        xp = torch.randn(c.Bsz, c.T, 3 + 2 * c.N, **kw).to(dt)
        B, C = xp[..., 3 : 3 + c.N], xp[..., 3 + c.N :]
    else:
        u = torch.randn(c.Bsz, c.T, c.Dn, **kw).to(dt)
        z = torch.randn(c.Bsz, c.T, c.Dn, **kw).to(dt)
        B = torch.randn(c.Bsz, c.T, c.N, **kw).to(dt)
        C = torch.randn(c.Bsz, c.T, c.N, **kw).to(dt)
    delta = torch.randn(c.Bsz, c.T, c.Dn, **kw) * 0.5
    if not c.softplus:  # delta is used as is: keep it positive
        delta = delta.abs() + 0.05
    inp = dict(
        u=u,
        delta=delta.to(dt),
        A=-(torch.rand(c.Dn, c.N, **kw) * 1.5 + 0.1),
        B=B,
        C=C,
        D=torch.randn(c.Dn, **kw) if c.D else None,
        z=z if c.z else None,
        delta_bias=torch.randn(c.Dn, **kw) * 0.3 if c.bias else None,
        initial_state=torch.randn(c.Bsz, c.Dn, c.N, **kw) if c.h0 else None,
    )
    if c.seq:  # several documents per row, boundaries at odd places
        cuts = torch.sort(torch.randint(1, max(2, c.T), (c.Bsz, 3), **kw), dim=1).values
        t = torch.arange(c.T, **kw)
        inp["seq_idx"] = (t[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32)
    else:
        inp["seq_idx"] = None
    return inp


ARGS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def run(inp: dict, softplus: bool, backend: str = "triton", oracle_fn=None):
    """(y, hT) from leaves that require grad, and those leaves by name."""
    leaves = {}
    for k, v in inp.items():
        if v is not None and v.is_floating_point():
            leaf = v.detach().clone() if oracle_fn is None else v.detach().double()
            leaves[k] = leaf.requires_grad_()
        else:
            leaves[k] = v
    args = [leaves[k] for k in ARGS]
    if oracle_fn is not None:
        y, hT = oracle_fn(*args, softplus, leaves["initial_state"], leaves["seq_idx"])
    else:
        y, hT = selective_scan(
            *args,
            delta_softplus=softplus,
            initial_state=leaves["initial_state"],
            seq_idx=leaves["seq_idx"],
            return_final_state=True,
            backend=backend,
        )
    return y, hT, leaves


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


def check_case(c: Case, sum_loss: bool = False):
    inp = make_inputs(c)
    y, hT, leaves = run(inp, c.softplus)
    yo, hTo, oleaves = run(inp, c.softplus, oracle_fn=oracle)
    assert y.dtype == c.dtype and hT.dtype == F32
    assert y.shape == (c.Bsz, c.T, c.Dn) and hT.shape == (c.Bsz, c.Dn, c.N)
    tol = TOL[c.dtype]
    assert rel(y, yo) < tol, ("y", rel(y, yo))
    assert rel(hT, hTo) < tol, ("final_state", rel(hT, hTo))
    if sum_loss:  # .sum() hands the backward expanded, stride-0 gradients
        loss, oloss = y.sum(), yo.sum()
        if c.gT:
            loss, oloss = loss + hT.sum(), oloss + hTo.sum()
    else:
        wy = torch.randn_like(y)
        loss, oloss = (y * wy).sum(), (yo * wy.double()).sum()
        if c.gT:
            wh = torch.randn_like(hT)
            loss, oloss = loss + (hT * wh).sum(), oloss + (hTo * wh.double()).sum()
    loss.backward()
    oloss.backward()
    for k, leaf in leaves.items():
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            assert leaf.grad is not None, k
            assert leaf.grad.dtype == leaf.dtype, k
            assert torch.isfinite(leaf.grad).all(), k
            err = rel(leaf.grad, oleaves[k].grad)
            assert err < tol, (k, err)


CASES = [
    Case(),
    Case(dtype=BF16),
    Case(dtype=F16),
    Case(T=20, D=False, z=False, bias=False, softplus=False, h0=False, seq=False, gT=False),
    Case(Bsz=1, T=1),  # seqlen 1
    Case(Bsz=1, T=1, Dn=3, N=2, dtype=BF16, seq=False),
    Case(T=16, Dn=8, N=4, z=False, bias=False, h0=False, seq=False, gT=False),  # D only
    Case(T=17, z=True, D=False, bias=False, h0=False, seq=False, gT=False),  # z only
    Case(T=17, D=False, z=False, h0=False, seq=False, gT=False),  # delta_bias only
    Case(T=17, D=False, z=False, bias=False, seq=False, gT=False),  # initial_state only
    Case(T=40, D=False, z=False, bias=False, h0=False, gT=False),  # seq_idx only
    Case(T=17, D=False, z=False, bias=False, h0=False, seq=False),  # final-state grad only
    Case(Bsz=1, T=20, Dn=3, N=40),  # N split over two state blocks
    Case(strided=True, dtype=BF16),
    Case(T=32, Dn=8, N=4, dtype=BF16),  # whole tiles: the kernels drop their masks
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_matches_oracle(c: Case, seed):
    check_case(c)


@pytest.mark.parametrize(
    "c",
    [Case(), Case(Bsz=1, T=20, Dn=3, N=40, dtype=BF16), Case(T=32, Dn=8, N=4)],
    ids=lambda c: c.id,
)
def test_a_state_per_tile_matches_oracle(c: Case, seed, monkeypatch):
    """The GPU's default, a state saved every backward tile (KS = 1: no replay), against the
    float64 recurrence; the interpreter's own config saves one every 2 tiles."""
    from mambakit.ops.selective_scan import launch as K

    library = K.config
    monkeypatch.setattr(
        K, "config",
        lambda Dn, interpret: dataclasses.replace(library(Dn, interpret), bwd_save_tiles=1),
    )  # fmt: skip
    check_case(c)


@pytest.mark.parametrize(
    "c", [Case(dtype=BF16), Case(Bsz=1, T=20, Dn=3, N=40, seq=False)], ids=lambda c: c.id
)
def test_sum_loss(c: Case, seed):
    check_case(c, sum_loss=True)


def scan_inputs(c: Case):
    """The scan's inputs for case c, with a gradient for y and one for the final state."""
    inp = make_inputs(c)
    gy = torch.randn(c.Bsz, c.T, c.Dn, device=DEVICE)
    gT = torch.randn(c.Bsz, c.Dn, c.N, device=DEVICE)
    return [inp[k] for k in ARGS], inp["initial_state"], inp["seq_idx"], gy, gT


def assert_configs_agree(K, inputs, cfgs) -> None:
    """The forward (saving states) and backward under each launch config give the first's
    results (y, h_T and every gradient)."""
    args, h0, seq, gy, gT = inputs
    outs = []
    for cfg in cfgs:
        y, hT, states = K.scan_fwd(*args, True, h0, seq, True, cfg=cfg)
        assert states.shape == (len(y), -(-y.shape[1] // K.save_interval(cfg)), *hT.shape[1:])
        grads = K.scan_bwd(gy, gT, *args, True, h0, seq, states, cfg=cfg)
        outs.append((y, hT, *grads))
    for out in outs[1:]:
        for a, b in zip(outs[0], out):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "over, reduce_scatter",
    [
        ({"seg_tiles": 1}, None),
        ({"seg_tiles": 3}, None),
        ({"fwd_tile": 8, "bwd_tile": 2, "seg_tiles": 2}, None),
        ({"bwd_block_d": 2, "bwd_tile": 8}, False),  # 16 lanes for 4 states: tl.sum
        ({"bwd_block_d": 16, "bwd_tile": 8}, True),
        ({"bwd_block_d": 32, "bwd_tile": 8}, True),
        ({"bwd_save_tiles": 1}, None),
        ({"bwd_save_tiles": 3, "seg_tiles": 2}, None),
        ({"bwd_save_tiles": 4, "bwd_tile": 2, "seg_tiles": 1 << 20}, None),
        ({"bwd_block_d_seg": 2, "seg_tiles": 2}, None),
    ],
    ids=[
        "seg1",
        "seg3",
        "fwd-tile-8-bwd-tile-2",
        "channel-sums-by-tl.sum",
        "reduce-scatter-16-channels",
        "reduce-scatter-32-channels",
        "a-state-per-tile",
        "a-state-per-3-tiles-segments",
        "a-state-per-4-tiles-one-segment",
        "segments-take-their-own-channel-block",
    ],
)
@pytest.mark.slow
def test_tilings_and_segments_agree(over: dict, reduce_scatter: bool | None, seed):
    """Other time tiles and channel blocks, time cut into segments (with carries between
    them), and states saved every tile or every few tiles (a replay rebuilding the rest),
    give the results of one segment per row. reduce_scatter: whether the backward's channel
    sums take the warp reduce-scatter (N = 3 is one block of 4 states)."""
    from mambakit.ops.selective_scan import launch as K
    from mambakit.ops.selective_scan.launch import reduce_scatter_fits

    c = Case(T=45, N=3)
    base = K.config(c.Dn, DEVICE != "cuda")
    cfg = dataclasses.replace(base, **over)
    if reduce_scatter is not None:
        rs = reduce_scatter_fits(cfg.bwd_tile, cfg.bwd_block_d, 4, cfg.bwd_warps)
        assert rs == reduce_scatter
    # the latter: one segment a row
    assert_configs_agree(K, scan_inputs(c), [cfg, dataclasses.replace(base, seg_tiles=1 << 20)])


def test_segmented_backward_takes_its_channel_block(monkeypatch):
    """`bwd_block_d_seg`: where rows x channel blocks are too few programs for the device,
    the backward's programs take that many channels and time is cut again for that many
    programs (segments by SMs, as on a GPU: here 4 of them); a row with programs enough is
    one segment at `bwd_block_d`. Both give the gradients of one segment."""
    from mambakit.ops.selective_scan import launch as K
    from mambakit.ops.selective_scan import programs

    c = Case(T=200, N=3)
    base = K.config(c.Dn, DEVICE != "cuda")
    cfg = dataclasses.replace(base, seg_tiles=0, seg_below_per_sm=2, seg_target_per_sm=16,
                              bwd_block_d_seg=2)  # fmt: skip
    monkeypatch.setattr(programs, "sm_count", lambda index=0: 4)
    cut = programs.time_segments  # cuts time only on a CUDA device: tell it it is on one
    monkeypatch.setattr(
        K, "time_segments", lambda nc, n, per, cf, dev: cut(nc, n, per, cf, torch.device("cuda"))
    )
    blocks, real = [], K.launch

    def spy(kernel, grid, *a, **kw):
        if kernel is K._bwd_kernel:
            blocks.append((kw["BLOCK_D"], grid[0], grid[1]))
        return real(kernel, grid, *a, **kw)

    monkeypatch.setattr(K, "launch", spy)
    # the latter: one segment a row
    assert_configs_agree(K, scan_inputs(c), [cfg, dataclasses.replace(cfg, seg_below_per_sm=0)])
    # 25 tiles: 2 rows x 1 block of 8 channels want 32 segments (25); 2 x 3 blocks of 2, 10
    # segments of 3 tiles: 9
    assert blocks == [(2, 3, 9), (base.bwd_block_d, 1, 1)]


def test_short_last_segment_without_masks(monkeypatch):
    """Whole tiles (T, D, N multiples of the tiles) but a last segment shorter than the others
    (its programs walk only the tiles that hold steps): the kernels run unmasked and give
    the results of one segment per row."""
    from mambakit.ops.selective_scan import launch as K

    c = Case(T=40, Dn=8, N=4)
    base = K.config(c.Dn, DEVICE != "cuda")
    cfg = dataclasses.replace(base, seg_tiles=3)
    assert -(-c.T // cfg.bwd_tile) % 3 and -(-c.T // cfg.fwd_tile) % 3  # both passes: short
    even, real = [], K.launch

    def spy(kernel, grid, *a, **kw):
        if kernel in (K._fwd_kernel, K._bwd_kernel, K._bwd_local_kernel):
            even.append(kw["EVEN"])
        return real(kernel, grid, *a, **kw)

    monkeypatch.setattr(K, "launch", spy)
    assert_configs_agree(K, scan_inputs(c), [cfg, dataclasses.replace(base, seg_tiles=1 << 20)])
    assert even and all(even)


def test_backward_int64_offsets_agree(monkeypatch):
    """The backward's per-tile offsets in int64 (taken where a row's steps pass int32) give
    the same gradients as in int32, bit for bit: its main pass and, with time cut into
    segments, the segments' first pass."""
    from mambakit.ops.selective_scan import launch as K

    c = Case(T=45, N=3)
    inp = make_inputs(c)
    args = [inp[k] for k in ARGS]
    h0, seq = inp["initial_state"], inp["seq_idx"]
    gy = torch.randn(c.Bsz, c.T, c.Dn, device=DEVICE)
    gT = torch.randn(c.Bsz, c.Dn, c.N, device=DEVICE)
    base = K.config(c.Dn, DEVICE != "cuda")
    cfg = dataclasses.replace(base, seg_tiles=2)  # segments: the first pass runs too
    _, _, states = K.scan_fwd(*args, True, h0, seq, True, cfg=cfg)
    flags, real = [], K.launch

    def spy(kernel, grid, *a, **kw):
        if kernel in (K._bwd_kernel, K._bwd_local_kernel):
            flags.append(("local" if kernel is K._bwd_local_kernel else "main", kw["OFF64"]))
        return real(kernel, grid, *a, **kw)

    monkeypatch.setattr(K, "launch", spy)
    narrow = K.scan_bwd(gy, gT, *args, True, h0, seq, states, cfg=cfg)
    # the launcher asks about every step stride the kernels multiply by t0: strided views
    # (u, z in one [B, T, 2D] tensor, dz into one too) give each its own
    asked, real_need = [], K.steps_need_int64
    monkeypatch.setattr(
        K, "steps_need_int64", lambda T, *st: asked.append((T, st)) or real_need(T, *st)
    )

    # every input a view with a step stride of its own, none equal to Dn (5) or N (3)
    def strided(x, width):
        return torch.zeros(*x.shape[:2], width, dtype=x.dtype, device=DEVICE)[
            ..., : x.shape[2]
        ].copy_(x)

    sargs = dict(zip(ARGS, args))
    widths = {"u": 11, "delta": 13, "B": 7, "C": 8, "z": 17}
    sargs |= {k: strided(sargs[k], w) for k, w in widths.items()}
    gy_s = strided(gy, 10)
    dxz = torch.empty(c.Bsz, c.T, 15, device=DEVICE)
    K.scan_bwd(gy_s, gT, *[sargs[k] for k in ARGS], True, h0, seq, states, cfg=cfg,
               dz_out=dxz[..., : c.Dn])  # fmt: skip
    # the inputs' strides decide both passes; the outputs' the main one
    (T_in, inputs), (T_out, outputs) = asked
    assert T_in >= c.T and T_out >= c.T
    assert {10, *widths.values()} <= set(inputs), inputs
    assert {c.Dn, c.N, 15} <= set(outputs), outputs
    monkeypatch.setattr(K, "steps_need_int64", lambda *a: True)
    wide = K.scan_bwd(gy, gT, *args, True, h0, seq, states, cfg=cfg)
    assert flags == [("local", False), ("main", False)] * 2 + [("local", True), ("main", True)]
    for a, b in zip(narrow, wide):
        if a is not None:
            assert torch.equal(a, b)


def test_segments_fill_whole_waves(monkeypatch):
    """A long single sequence is cut into segments, as many as the target programs per SM
    allow and never more (one segment over puts a few programs in a wave of their own),
    and the segments cover every tile once."""
    from mambakit.ops.selective_scan import launch as K
    from mambakit.ops.selective_scan import programs as P

    monkeypatch.setattr(P, "sm_count", lambda index: 132)
    cfg = K.config(1536, interpret=False)
    cuda = torch.device("cuda", 0)
    for per_sm in (cfg.fwd_seg_target_per_sm, cfg.seg_target_per_sm):
        target = per_sm * 132
        for programs in (48, 64, 100, 128, 200):
            nseg, per = K.time_segments(512, programs, per_sm, cfg, cuda)
            assert programs * nseg <= target
            assert programs * nseg > target // 2
            assert per * nseg >= 512 and per * (nseg - 1) < 512
    # enough programs already: one segment
    assert K.time_segments(512, 2 * 264, cfg.fwd_seg_target_per_sm, cfg, cuda) == (1, 512)


@pytest.mark.parametrize(
    "c",
    [
        Case(T=45, N=3, bias=False, softplus=False),
        Case(T=45, N=3, bias=False, softplus=False, seq=False, h0=False, D=False, z=False),
        Case(T=30, N=4, bias=False, softplus=False, seq=False, strided=True, dtype=BF16),
        Case(Bsz=3, T=1, N=3, bias=False, softplus=False),
        Case(T=19, Dn=37, N=40, bias=False, softplus=False),
    ],
    ids=lambda c: c.id,
)
def test_last_step_equals_the_oracle(c: Case, seed):
    """`scan_last` (every segment's summary, then h_T and y_T from them: a prefill's last
    layer) gives the float64 recurrence's final state and its y at the last step, with
    documents, an initial state, B and C as strided slices, and N over several blocks."""
    from mambakit.ops.selective_scan import launch as K

    inp = make_inputs(c)
    args = [inp[k] for k in ARGS[:-1]]  # delta is given as the scan uses it (no bias)
    z_last = inp["z"][:, -1] if c.z else None  # the gate at the last step, a strided view
    y, hT = K.scan_last(*args[:-1], z_last, inp["initial_state"], inp["seq_idx"])
    yo, hTo = oracle(*args, None, False, inp["initial_state"], inp["seq_idx"])
    assert y.shape == (c.Bsz, c.Dn) and y.dtype == c.dtype
    assert rel(y, yo[:, -1]) < TOL[c.dtype] and rel(hT, hTo) < TOL[F32]


def test_saved_tile_states(seed):
    """The forward's saved states are the true states at every time-tile start."""
    from mambakit.ops.selective_scan import launch as K

    c = Case(T=37)
    inp = make_inputs(c)
    args = [inp[k] for k in ARGS]
    tc = K.state_chunk(c.Dn, DEVICE == "cuda")
    y, hT, states = K.scan_fwd(*args, True, inp["initial_state"], inp["seq_idx"], True)
    yo, hTo = oracle(*args, True, inp["initial_state"], inp["seq_idx"])
    assert rel(y, yo) < TOL[F32] and rel(hT, hTo) < TOL[F32]
    assert states.shape == (c.Bsz, -(-c.T // tc), c.Dn, c.N)
    torch.testing.assert_close(states[:, 0], inp["initial_state"])
    for k in range(1, states.shape[1]):
        first = [a[:, : k * tc] if a is not None and a.dim() == 3 else a for a in args]
        _, h_t = oracle(*first, True, inp["initial_state"], inp["seq_idx"][:, : k * tc])
        assert rel(states[:, k], h_t) < TOL[F32]


def test_replayed_states_are_the_states_at_every_tile_start(seed, monkeypatch):
    """With a state saved every KS = 4 backward tiles, the replay gives the true state at the
    start of every tile (documents cut inside intervals, a last interval past T), in launches
    of one interval each (as beyond the grid's 65535 a launch)."""
    from mambakit.ops.selective_scan import launch as K

    monkeypatch.setattr(K, "MAX_GRID_Y", 1)
    c = Case(T=45)
    inp = make_inputs(c)
    args = [inp[k] for k in ARGS]
    cfg = dataclasses.replace(K.config(c.Dn, DEVICE != "cuda"), bwd_save_tiles=4)
    _, _, saved = K.scan_fwd(*args, True, inp["initial_state"], inp["seq_idx"], True, cfg=cfg)
    tc = cfg.bwd_tile
    assert saved.shape[1] == -(-c.T // (4 * tc))
    u, delta, A, B, _C, _D, _z, bias = args
    states = K.replay_states(u, delta, A.contiguous(), B, bias, True, inp["seq_idx"], saved, cfg)
    assert states.shape == (c.Bsz, -(-c.T // tc), c.Dn, c.N)
    torch.testing.assert_close(states[:, 0], inp["initial_state"])
    for k in range(1, states.shape[1]):
        first = [a[:, : k * tc] if a is not None and a.dim() == 3 else a for a in args]
        _, h_t = oracle(*first, True, inp["initial_state"], inp["seq_idx"][:, : k * tc])
        assert rel(states[:, k], h_t) < TOL[F32], k


@pytest.mark.parametrize("N", [3, 40], ids=["N3", "N40-split"])
@pytest.mark.slow
def test_no_unwritten_elements(N: int, seed, monkeypatch):
    """Every buffer the kernels fill starts as NaN: a skipped element would show up."""
    from mambakit.ops.selective_scan import launch as K

    real_new = K._new
    monkeypatch.setattr(K, "_new", lambda *a: real_new(*a).fill_(float("nan")))
    c = Case(Bsz=2, T=19, Dn=5, N=N)
    y, hT, leaves = run(make_inputs(c), True)
    assert torch.isfinite(y).all() and torch.isfinite(hT).all()
    (y.float().sum() + hT.sum()).backward()
    for k, leaf in leaves.items():
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            assert torch.isfinite(leaf.grad).all(), k


def test_empty_sequence_passes_the_state_through(seed):
    """T = 0: no output rows, final state == initial state, and its gradient reaches the
    initial state unchanged (as with the reference backend)."""
    inp = make_inputs(Case(Bsz=2, T=0, Dn=5, N=3, seq=False))
    args = [inp[k] for k in ARGS]
    for backend in ("triton", "reference"):
        h0 = inp["initial_state"].detach().clone().requires_grad_()
        y, hT = selective_scan(
            *args, True, h0, None, return_final_state=True, backend=backend
        )  # fmt: skip
        assert y.shape == (2, 0, 5) and torch.equal(hT, h0.detach()), backend
        w = torch.randn_like(hT)
        (hT * w).sum().backward()
        assert torch.equal(h0.grad, w), backend
    _, hT = selective_scan(*args, True, None, None, return_final_state=True, backend="triton")
    assert torch.equal(hT, torch.zeros_like(hT))


@pytest.mark.slow
def test_deterministic(seed):
    """Two identical runs give bit-identical outputs and gradients."""
    c = Case(dtype=BF16)
    inp = make_inputs(c)
    grads = []
    for _ in range(2):
        y, hT, leaves = run(inp, True)
        (y.float().square().sum() + hT.sum()).backward()
        grads.append(
            [y, hT] + [v.grad for v in leaves.values() if getattr(v, "grad", None) is not None]
        )
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("N", [3, 40], ids=["N3", "N40-split"])
def test_strided_parameters_match_oracle(N: int, seed):
    """A, D and delta_bias given as strided views (A stored transposed, D and delta_bias
    columns of a stacked tensor) give the oracle's values and gradients: the kernels index
    them densely, so the launchers must not pass the views as they are."""
    c = Case(Bsz=2, T=9, Dn=5, N=N)
    inp = make_inputs(c)
    yo, hTo, oleaves = run(inp, c.softplus, oracle_fn=oracle)
    params = {k: inp[k].detach().clone().requires_grad_() for k in ("A", "D", "delta_bias")}

    def column(v):  # the same values at stride 2
        return torch.stack([v, torch.zeros_like(v)], 1)[:, 0]

    A = params["A"].t().contiguous().t()
    D, bias = column(params["D"]), column(params["delta_bias"])
    assert A.stride(-1) != 1 and D.stride(0) == bias.stride(0) == 2
    y, hT = selective_scan(
        inp["u"], inp["delta"], A, inp["B"], inp["C"], D, inp["z"], bias, c.softplus,
        inp["initial_state"], inp["seq_idx"], return_final_state=True, backend="triton",
    )  # fmt: skip
    assert rel(y, yo) < TOL[F32] and rel(hT, hTo) < TOL[F32]
    wy, wh = torch.randn_like(y), torch.randn_like(hT)
    ((y * wy).sum() + (hT * wh).sum()).backward()
    ((yo * wy.double()).sum() + (hTo * wh.double()).sum()).backward()
    for k, p in params.items():
        assert rel(p.grad, oleaves[k].grad) < TOL[F32], k


def test_chunks_with_carried_state_equal_full(seed):
    """Full sequence == two pieces with the state carried: values and parameter gradients."""
    c = Case(T=30, seq=False, dtype=F32)
    inp = make_inputs(c)
    y, hT, leaves = run(inp, True)
    (y.sum() + hT.sum()).backward()
    params = {k: inp[k].detach().clone().requires_grad_() for k in ("A", "D", "delta_bias")}
    h = inp["initial_state"].detach().clone().requires_grad_()
    state, ys = h, []
    for sl in (slice(0, 13), slice(13, 30)):
        yi, state = selective_scan(
            inp["u"][:, sl], inp["delta"][:, sl], params["A"], inp["B"][:, sl], inp["C"][:, sl],
            params["D"], inp["z"][:, sl], params["delta_bias"], True, state, None,
            return_final_state=True, backend="triton",
        )  # fmt: skip
        ys.append(yi)
    y2 = torch.cat(ys, 1)
    (y2.sum() + state.sum()).backward()
    assert rel(y2, y) < 1e-5 and rel(state, hT) < 1e-5
    for k, p in params.items():
        assert rel(p.grad, leaves[k].grad) < 1e-5, k
    assert rel(h.grad, leaves["initial_state"].grad) < 1e-5


def test_torch_compile_fullgraph(seed):
    """The custom ops trace without graph breaks (fake impls + registered autograd)."""
    c = Case(Bsz=1, T=9, Dn=3, N=2, seq=False)
    inp = make_inputs(c)

    def f(u, delta, A, B, C, D, z, bias, h0):
        y, hT = selective_scan(
            u, delta, A, B, C, D, z, bias, True, h0, None, return_final_state=True,
            backend="triton",
        )  # fmt: skip
        return (y.float() * 2).sum() + hT.square().sum()

    names = ARGS + ("initial_state",)
    eager = [inp[k].detach().clone().requires_grad_() for k in names]
    comp = [inp[k].detach().clone().requires_grad_() for k in names]
    f(*eager).backward()
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend="aot_eager")(*comp).backward()
    for k, a, b in zip(names, eager, comp):
        assert torch.equal(a.grad, b.grad), k


def test_fake_forward_saves_as_many_states_as_the_kernel(seed, monkeypatch):
    """The forward op's fake implementation (what torch.compile traces) gives the saved
    states the shape the kernel writes, where the save interval depends on the width (the
    GPU's config saves fewer at d_inner >= 4096; here a stand-in rule at Dn >= 6)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mambakit.ops.selective_scan import launch as K

    library = K.config
    monkeypatch.setattr(
        K, "config",
        lambda Dn, interpret: dataclasses.replace(
            library(Dn, interpret), bwd_save_tiles=3 if Dn >= 6 else 1
        ),
    )  # fmt: skip
    for Dn in (5, 6):
        inp = make_inputs(Case(T=70, Dn=Dn))
        args = [inp[k] for k in ARGS] + [True, inp["initial_state"], inp["seq_idx"], True]
        real = torch.ops.mambakit.selective_scan_fwd(*args)
        with FakeTensorMode() as mode:
            fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = torch.ops.mambakit.selective_scan_fwd(*fakes)
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real], Dn
    assert real[2].shape[1] == -(-70 // (3 * K.config(6, DEVICE != "cuda").bwd_tile))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_state_update_steps_equal_scan(dtype, seed):
    """T decode steps == one scan over T, and each step == the reference step."""
    from mambakit.ops.selective_scan.reference import selective_state_update_reference

    c = Case(Bsz=2, T=4, Dn=5, N=3, dtype=dtype, seq=False)
    inp = make_inputs(c)
    args = [inp[k] for k in ARGS]
    y_scan, h_scan = selective_scan(
        *args, True, inp["initial_state"], None, return_final_state=True, backend="triton"
    )
    state = inp["initial_state"].clone()
    state_ref = inp["initial_state"].clone()
    for t in range(c.T):
        step = [a[:, t] if a is not None and a.dim() == 3 else a for a in args]
        y_t = selective_state_update(state, *step, delta_softplus=True, backend="triton")
        y_r = selective_state_update_reference(state_ref, *step, delta_softplus=True)
        assert y_t.dtype == dtype and y_t.shape == (c.Bsz, c.Dn)
        assert rel(y_t, y_r) < TOL[dtype]
        assert rel(y_t, y_scan[:, t]) < TOL[dtype]
    assert rel(state, h_scan) < 1e-5 and rel(state, state_ref) < 1e-5


def test_no_grad_forward_keeps_no_states(seed):
    """Without a gradient to compute, the forward returns no chunk states to keep."""
    from mambakit.ops.selective_scan import launch as K

    inp = make_inputs(Case(T=40, seq=False))
    args = [inp[k] for k in ARGS]
    _, _, states = K.scan_fwd(*args, True, inp["initial_state"], None, False)
    assert states.numel() == 0


# ------------------------------------------------------------------ the reference (CPU path)


def _reference_module():
    import importlib

    return importlib.import_module("mambakit.ops.selective_scan.reference")


# the reference's recurrence: its PyTorch body, and the compiled one where numba is
# (compiled: the backward recomputes the states from checkpoints; compiled-kept: the
# forward keeps every state for it, as for windows of at most `scan.KEEP_BYTES`)
BODIES = ["torch", *(["compiled", "compiled-kept"] if importlib.util.find_spec("numba") else [])]


@pytest.fixture
def use_body(numba_on, monkeypatch):
    """`use_body(body, checkpoint)`: run the reference's recurrence on `body`; the compiled
    backward keeps a state every `checkpoint` steps."""

    def use(body: str, checkpoint: int = 4) -> None:
        numba_on(body != "torch")
        if body != "torch":
            from mambakit.ops.cpu_jit import scan

            monkeypatch.setattr(scan, "CHECKPOINT", checkpoint)
            monkeypatch.setattr(scan, "KEEP_BYTES", 1 << 30 if body == "compiled-kept" else 0)

    return use


@pytest.mark.parametrize(
    "T, chunk, group_steps",
    [
        (1, 32, None),
        (7, 32, None),  # one chunk shorter than CHUNK
        (32, 32, None),  # one whole chunk
        (33, 32, None),  # two chunks, the last padded with identity steps
        (45, 8, None),  # six chunks, one group
        (45, 8, 16),  # three groups of two chunks, the last partial
        (45, 4, 4),  # a group per chunk
    ],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("seq", [False, True], ids=["one-doc", "seq_idx"])
@pytest.mark.parametrize("body", BODIES)
def test_reference_matches_oracle_f64(
    T, chunk, group_steps, seq, body, seed, monkeypatch, use_body
):
    """The reference in float64 (every chunking and grouping of time the CPU path takes,
    and the compiled recurrence with its backward's checkpoints as often) against the
    naive loop: y, the final state and the gradient of every input."""
    R = _reference_module()
    c = Case(Bsz=2, T=T, Dn=5, N=3, seq=seq)
    use_body(body, chunk)
    monkeypatch.setattr(R, "CHUNK", chunk)
    if group_steps is not None:
        monkeypatch.setattr(R, "GROUP_ELEMENTS", group_steps * c.Bsz * c.Dn * c.N)
    inp = make_inputs(c, device="cpu")
    inp = {k: v.double() if v is not None and v.is_floating_point() else v for k, v in inp.items()}
    y, hT, leaves = run(inp, True, backend="reference")
    yo, hTo, oleaves = run(inp, True, oracle_fn=oracle)
    wy, wh = torch.randn_like(y), torch.randn_like(hT)
    ((y * wy).sum() + (hT * wh).sum()).backward()
    ((yo * wy).sum() + (hTo * wh).sum()).backward()
    assert rel(y, yo) < 1e-12 and rel(hT, hTo) < 1e-12
    for k, leaf in leaves.items():
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            assert rel(leaf.grad, oleaves[k].grad) < 1e-12, k


@pytest.mark.parametrize("body", BODIES)
def test_reference_gradcheck_across_chunks(body, seed, monkeypatch, use_body):
    """gradcheck of the reference with time cut in chunks and groups (CHUNK 4, groups of 8
    steps over T = 19; the compiled backward's checkpoints every 4 steps), documents and a
    gradient on the final state."""
    R = _reference_module()
    c = Case(Bsz=2, T=19, Dn=3, N=2)
    use_body(body, 4)
    monkeypatch.setattr(R, "CHUNK", 4)
    monkeypatch.setattr(R, "GROUP_ELEMENTS", 8 * c.Bsz * c.Dn * c.N)
    inp = make_inputs(c, device="cpu")
    names = [k for k in (*ARGS, "initial_state") if inp[k] is not None]
    leaves = [inp[k].detach().double().requires_grad_() for k in names]

    def f(*xs):
        kw = dict(zip(names, xs))
        y, hT = selective_scan(
            **kw, delta_softplus=True, seq_idx=inp["seq_idx"], return_final_state=True,
            backend="reference",
        )  # fmt: skip
        return y, hT

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7)


def test_reference_reuses_no_buffer_it_returns(seed, use_body):
    """The CPU workspace is reused across calls, so nothing the op returns may alias it:
    a second call leaves the first call's outputs and gradients unchanged."""
    use_body("torch", 0)  # the workspace is the PyTorch body's
    inp = make_inputs(Case(Bsz=2, T=9, Dn=4, N=3, seq=False), device="cpu")
    y1, h1, leaves1 = run(inp, True, backend="reference")
    (y1.sum() + h1.sum()).backward()
    keep = [y1.detach().clone(), h1.detach().clone()]
    keep += [v.grad.clone() for v in leaves1.values() if getattr(v, "grad", None) is not None]
    other = make_inputs(Case(Bsz=2, T=9, Dn=4, N=3, seq=False), device="cpu")
    y2, h2, _ = run(other, True, backend="reference")
    (y2.sum() + h2.sum()).backward()
    now = [y1, h1] + [v.grad for v in leaves1.values() if getattr(v, "grad", None) is not None]
    for a, b in zip(keep, now):
        assert torch.equal(a, b)


def test_reference_runs_after_inference_mode(seed, use_body):
    """A call under inference mode (evaluation, decoding) then one with autograd (training):
    the second must run and match the oracle, whatever the first left in the workspace."""
    use_body("torch", 0)  # the workspace is the PyTorch body's
    inp = make_inputs(Case(Bsz=2, T=9, Dn=4, N=3, seq=False), device="cpu")
    args = [inp[k] for k in ARGS]
    kw = dict(delta_softplus=True, initial_state=inp["initial_state"], return_final_state=True)
    with torch.inference_mode():
        y0, h0 = selective_scan(*args, **kw, backend="reference")
    y1, h1, _ = run(inp, True, backend="reference")
    yo, ho, _ = run(inp, True, oracle_fn=oracle)
    assert rel(y1, yo) < 1e-5 and rel(h1, ho) < 1e-5
    assert rel(y0, yo) < 1e-5 and rel(h0, ho) < 1e-5


def test_reference_backward_refuses_to_be_differentiated(seed):
    """The hand-written backward is not differentiable: a second-order gradient through it
    raises rather than coming out without its terms."""
    inp = make_inputs(Case(Bsz=1, T=5, Dn=3, N=2, seq=False), device="cpu")
    y, hT, leaves = run(inp, True, backend="reference")
    (gA,) = torch.autograd.grad(y.sum(), leaves["A"], create_graph=True)
    with pytest.raises(RuntimeError):
        (gA.pow(2).sum() + leaves["u"].sum()).backward()


@pytest.mark.skipif("compiled" not in BODIES, reason="needs numba")
def test_compiled_recurrence_is_the_same_on_any_number_of_threads(seed, use_body):
    """Rows in parallel, reductions in one order: 1 and 2 threads give the same bits."""
    use_body("compiled", 4)
    inp = make_inputs(Case(Bsz=5, T=19, Dn=6, N=4), device="cpu")
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y, hT, leaves = run(inp, True, backend="reference")
            ((y * y).sum() + hT.sum()).backward()
            runs.append(
                [y, hT, *(v.grad for v in leaves.values() if getattr(v, "grad", None) is not None)]
            )
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.skipif("compiled" not in BODIES, reason="needs numba")
def test_compiled_backward_kept_states_equal_recomputed(seed, use_body, monkeypatch):
    """The forward that keeps every state and the one that keeps checkpoints (the backward
    recomputing the rest) give the same bits: outputs and every gradient."""
    from mambakit.ops.cpu_jit import scan

    inp = make_inputs(Case(Bsz=3, T=19, Dn=6, N=4, seq=True), device="cpu")
    runs, kept = [], []
    forward_states = scan.forward_states
    monkeypatch.setattr(scan, "forward_states", lambda *a: kept.append(1) or forward_states(*a))
    for body in ("compiled", "compiled-kept"):
        use_body(body, 4)
        y, hT, leaves = run(inp, True, backend="reference")
        assert len(kept) == (body == "compiled-kept")
        ((y * y).sum() + hT.sum()).backward()
        grads = [v.grad for v in leaves.values() if getattr(v, "grad", None) is not None]
        runs.append([y, hT, *grads])
    assert len(runs[0]) == len(runs[1]) > 2
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.skipif("compiled" not in BODIES, reason="needs numba")
def test_compiled_forward_keeps_states_only_for_a_backward(seed, use_body, monkeypatch):
    """Inputs that require grad under no_grad: no backward can run, so the forward keeps no
    state (`forward_states` is not called); with grad mode on it does."""
    from mambakit.ops.cpu_jit import scan

    use_body("compiled-kept", 4)
    kept = []
    forward_states = scan.forward_states
    monkeypatch.setattr(scan, "forward_states", lambda *a: kept.append(1) or forward_states(*a))
    inp = make_inputs(Case(Bsz=2, T=9, Dn=4, N=3), device="cpu")
    with torch.no_grad():
        run(inp, True, backend="reference")
    assert not kept
    run(inp, True, backend="reference")
    assert kept == [1]


@pytest.mark.skipif("compiled" not in BODIES, reason="needs numba")
def test_compiled_recurrence_leaves_torch_thread_count_alone(seed, use_body):
    """numba's thread pool must not change the thread count torch's own ops run on."""
    use_body("compiled", 4)
    inp = make_inputs(Case(Bsz=3, T=9, Dn=4, N=3), device="cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y, hT, _ = run(inp, True, backend="reference")
        (y.sum() + hT.sum()).backward()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- GPU, real shapes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.gpu
class TestGPU:
    @pytest.mark.parametrize(
        "c",
        [
            Case(Bsz=2, T=1000, Dn=256, N=16, dtype=BF16),
            Case(Bsz=2, T=1000, Dn=256, N=16, dtype=F32, strided=True),
            Case(Bsz=2, T=777, Dn=96, N=16, dtype=F16, seq=False),
            Case(Bsz=1, T=300, Dn=64, N=64, dtype=BF16),
            Case(Bsz=1, T=130, Dn=40, N=256, dtype=F32),
            Case(Bsz=3, T=1, Dn=200, N=16, dtype=BF16),
            # the 130m training shape, as the mixer calls it (u, z, B, C slices)
            Case(Bsz=8, T=2048, Dn=1536, N=16, dtype=BF16, strided=True, seq=False),
            # the same width with a partial last time tile in every row
            Case(Bsz=2, T=2047, Dn=1536, N=16, dtype=BF16, strided=True),
        ],
        ids=lambda c: c.id,
    )
    def test_matches_reference(self, c: Case, seed):
        """Against the float64 PyTorch reference (the oracle loop is too slow at these sizes)."""
        from mambakit.ops.selective_scan.reference import selective_scan_reference

        def ref(u, delta, A, B, C, D, z, bias, softplus, h0, seq_idx):
            return selective_scan_reference(
                u, delta, A, B, C, D, z, bias, softplus, h0, seq_idx, return_final_state=True
            )

        inp = make_inputs(c)
        y, hT, leaves = run(inp, c.softplus)
        yo, hTo, oleaves = run(inp, c.softplus, oracle_fn=ref)
        tol = TOL[c.dtype]
        assert rel(y, yo) < tol and rel(hT, hTo) < tol
        wy = torch.randn_like(y)
        wh = torch.randn_like(hT)
        ((y * wy).sum() + (hT * wh).sum()).backward()
        ((yo * wy.double()).sum() + (hTo * wh.double()).sum()).backward()
        for k, leaf in leaves.items():
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                assert rel(leaf.grad, oleaves[k].grad) < tol, k

    def test_large_shape_forward_and_determinism(self, seed):
        c = Case(Bsz=8, T=2048, Dn=1536, N=16, dtype=BF16, seq=False, h0=False)
        inp = make_inputs(c)
        args = [inp[k] for k in ARGS]
        from mambakit.ops.selective_scan.reference import selective_scan_reference

        y = selective_scan(*args, backend="triton")
        yr = selective_scan_reference(*[a.float() if a is not None else a for a in args])
        assert rel(y, yr) < TOL[BF16]
        runs = []
        for _ in range(2):
            y, hT, leaves = run(inp, True)
            (y.float().sum() + hT.sum()).backward()
            runs.append(
                [y] + [v.grad for v in leaves.values() if getattr(v, "grad", None) is not None]
            )
        for a, b in zip(*runs):
            assert torch.equal(a, b)

    @pytest.mark.parametrize(
        "c, over",
        [
            (Case(Bsz=2, T=1000, Dn=256, N=16, dtype=BF16), {"bwd_save_tiles": 2}),
            (Case(Bsz=2, T=1000, Dn=256, N=16, dtype=BF16), {"bwd_save_tiles": 16}),
            (Case(Bsz=1, T=300, Dn=64, N=40, dtype=F32), {"bwd_save_tiles": 4}),
            (Case(Bsz=2, T=777, Dn=96, N=16, dtype=F32), {"bwd_save_tiles": 4, "bwd_warps": 4}),
            # one long row: time in segments
            (Case(Bsz=1, T=20000, Dn=128, N=16, dtype=BF16, seq=False), {"bwd_save_tiles": 8}),
        ],
        ids=lambda x: x.id if isinstance(x, Case) else "-".join(f"{k}{v}" for k, v in x.items()),
    )
    def test_replayed_tile_states_equal_saved_ones(self, c: Case, over: dict, seed):
        """States saved every few tiles and the rest replayed before the backward (one or four
        backward warps, N over two blocks, segments): every output and gradient as with a
        state saved every tile, and two runs bit-identical."""
        from mambakit.ops.selective_scan import launch as K

        inp = make_inputs(c)
        args = [inp[k] for k in ARGS]
        h0, seq = inp["initial_state"], inp["seq_idx"]
        gy = torch.randn(c.Bsz, c.T, c.Dn, device=DEVICE, dtype=c.dtype)
        gT = torch.randn(c.Bsz, c.Dn, c.N, device=DEVICE)
        base = K.config(c.Dn, False)
        outs = []
        for cfg in (base, dataclasses.replace(base, **over), dataclasses.replace(base, **over)):
            y, hT, states = K.scan_fwd(*args, True, h0, seq, True, cfg=cfg)
            assert states.shape[1] == -(-c.T // K.save_interval(cfg))
            grads = K.scan_bwd(gy, gT, *args, True, h0, seq, states, cfg=cfg)
            outs.append([t for t in (y, hT, *grads) if t is not None])
        for a, b in zip(outs[1], outs[2]):
            assert torch.equal(a, b)
        for a, b in zip(outs[0], outs[1]):
            assert rel(b, a) < TOL[c.dtype], rel(b, a)  # du, d delta in u.dtype

    def test_state_update_cuda_graph(self, seed):
        """The decode step captures in a CUDA graph and replays in place."""
        from mambakit.ops.selective_scan.reference import selective_state_update_reference

        c = Case(Bsz=4, T=1, Dn=1536, N=16, dtype=BF16, seq=False)
        inp = make_inputs(c)
        step = {k: (v[:, 0] if v is not None and v.dim() == 3 else v) for k, v in inp.items()}
        args = [step[k] for k in ARGS]
        state = inp["initial_state"].clone()
        selective_state_update(state, *args, backend="triton")  # compile outside the capture
        state.copy_(inp["initial_state"])
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g):
                y = selective_state_update(state, *args, backend="triton")
        torch.cuda.current_stream().wait_stream(s)
        state.copy_(inp["initial_state"])
        ref_state = inp["initial_state"].clone()
        for _ in range(3):
            g.replay()
            y_ref = selective_state_update_reference(ref_state, *args)
            torch.cuda.synchronize()
            assert rel(y, y_ref) < TOL[BF16] and rel(state, ref_state) < 1e-5


def test_unused_final_state_sends_no_gradient(seed, monkeypatch):
    """A loss on y alone hands the backward no final-state gradient (None, not a zero tensor
    that the kernel would load as its carry) and no tensor of the saved states' shape."""
    from mambakit.ops.selective_scan import launch as K

    seen = {}
    real_bwd = K.scan_bwd

    def spy(gy, g_final, *rest, **kw):
        seen["g_final"] = g_final
        return real_bwd(gy, g_final, *rest, **kw)

    monkeypatch.setattr(K, "scan_bwd", spy)
    c = Case(T=20, seq=False, gT=False)
    inp = make_inputs(c)
    y, _hT, leaves = run(inp, c.softplus)
    yo, _hTo, oleaves = run(inp, c.softplus, oracle_fn=oracle)
    wy = torch.randn_like(y)
    (y * wy).sum().backward()
    (yo * wy.double()).sum().backward()
    assert seen["g_final"] is None
    for k, leaf in leaves.items():
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            assert rel(leaf.grad, oleaves[k].grad) < TOL[c.dtype], k


def test_channel_blocks_must_be_powers_of_two():
    """A program's channels are a tl.arange: a block that is not a power of two is refused
    when the config is made, naming the field (bwd_block_d_seg 0: bwd_block_d)."""
    from mambakit.ops.selective_scan import launch as K

    gpu = K.config(1536, interpret=False)
    assert dataclasses.replace(gpu, bwd_block_d_seg=0).bwd_block_d_seg == 0
    for field in ("fwd_block_d", "bwd_block_d", "bwd_block_d_seg"):
        for v in (3, 12, -8):
            with pytest.raises(ValueError, match=field):
                dataclasses.replace(gpu, **{field: v})


def test_save_interval_must_fit_the_forward_tile():
    """The forward stores states at its tiles' starts or at rows inside them: a save interval
    that neither is a multiple of its tile nor divides it (GPU tiles 8 forward, 4 backward:
    an odd bwd_save_tiles above 1) would leave saved states unwritten, so it is refused."""
    from mambakit.ops.selective_scan import launch as K

    gpu = K.config(1536, interpret=False)
    for ks in (1, 2, 4, 16):
        assert K.save_interval(dataclasses.replace(gpu, bwd_save_tiles=ks)) == 4 * ks
    for ks in (0, 3, 5):
        with pytest.raises(ValueError, match="bwd_save_tiles"):
            dataclasses.replace(gpu, bwd_save_tiles=ks)
