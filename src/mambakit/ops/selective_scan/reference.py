"""Selective scan in plain PyTorch: the CPU path and the oracle of the Triton kernels.

Glossary (Mamba paper, Algorithm 2): B batch, T time, D = d_inner channels,
N = d_state. For every row, channel d and state n:

    delta_t = softplus(delta_raw_t + delta_bias)          (when delta_softplus)
    a_t     = exp(delta_t * A[d, n])                      (discretised A, ZOH)
    b_t     = delta_t * u_t * B_t[n]                      (discretised B, Euler)
    h_t     = a_t * h_{t-1} + b_t                         h_0 = initial_state
    y_t     = sum_n h_t[n] * C_t[n] + D * u_t,  then  y_t * silu(z_t)

A document start (seq_idx changes between t-1 and t) sets a_t = 0, so nothing
flows across it. The recurrence h_t = a_t h_{t-1} + b_t is a first-order linear
one, solved in place on time-major [T, B, D, N] buffers: time is cut in groups
small enough to stay in cache and groups in chunks of `CHUNK` steps (one chunk
when T <= CHUNK); inside the chunks the steps run in order, one whole-tensor op
per step for all chunks at once, then one short loop over chunks carries the
state across and one op adds each chunk's carry. A step costs one `addcmul_`
over [B, D, N] (no concatenation, no copy); a T = 32 window is 32 such ops.
No exp of a positive number is ever taken, so it is stable for any delta. Where numba
is, the recurrence runs compiled instead (`cpu_jit.scan`: the same math in one walk
through time per row, the rows in parallel).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from .._checks import state_dtype
from ..cpu_jit import compiles

CHUNK = 32  # timesteps per chunk: the steps inside a chunk run one op each, all chunks at once
GROUP_ELEMENTS = 1 << 22  # [group, B, D, N] buffers are kept near this size (16 MB in f32)


LOG2E = 1.4426950408889634  # log2(e)
_workspace = threading.local()  # role -> flat buffer, per thread


def _buffer(role: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `shape` (like's dtype and device) that later calls reuse.

    On the CPU each thread keeps one flat buffer per role and dtype, grown as needed: a
    fresh [T, B, D, N] buffer costs a page fault per 4 KB at first touch (~3 us each on the
    2-core machine, 6 ms for 8 MB), more than the arithmetic done in it. Nothing that
    leaves the op may be a view of one."""
    if like.device.type != "cpu" or type(like) is not torch.Tensor or torch.compiler.is_compiling():
        return like.new_empty(shape)  # a GPU, or a trace (its fake tensors are not kept)
    numel = math.prod(shape)
    # a buffer made under inference mode cannot be written outside it: one set per mode
    key = (role, like.dtype, torch.is_inference_mode_enabled())
    buf = _workspace.__dict__.get(key)
    if buf is None or buf.numel() < numel:
        buf = like.new_empty(numel)
        _workspace.__dict__[key] = buf
    return buf[:numel].view(shape)


def _compiled(dt: torch.Tensor) -> bool:
    """Whether the recurrence runs compiled (`cpu_jit.scan`): numba there, a plain CPU
    tensor of float32/float64 (not a trace's), outside torch.compile. (On the 2-core
    machine, 2 threads, a layer's scan forward + backward: 1.07 ms against 1.36 for the
    PyTorch body at 1 x 32 x 256 x 16, 25.8 against 55.5 at 64 x 32 x 256 x 16, 36.8
    against 66.3 at 8 x 256 x 384 x 16, level at 1 x 2048 x 384 x 16, one row.)"""
    return (
        type(dt) is torch.Tensor
        and not torch.compiler.is_compiling()  # (first: a trace never reaches the cached check)
        and dt.numel() > 0
        and compiles(dt)
    )


def _chunking(T: int) -> tuple[int, int]:
    """(chunks, steps per chunk) for T steps: one chunk up to CHUNK steps, else chunks of
    CHUNK (the last padded with identity steps)."""
    if T <= CHUNK:
        return 1, T
    return -(-T // CHUNK), CHUNK


def _scan_(m: torch.Tensor, s: torch.Tensor, nc: int, L: int, reverse: bool) -> None:
    """Solve a first-order linear recurrence in place along dim 0.

    Forward: s[i+1] += m[i] * s[i] for i = 0 .. nc*L-1, from the carry s[0]; reverse:
    s[i] += m[i] * s[i+1] for i = nc*L-1 .. 0, from the carry s[nc*L]. s holds the added
    terms on entry and the solution on exit ([nc*L + 1, ...]); m is [nc*L, ...].

    Time is cut in nc chunks of L steps. Inside the chunks the steps run in order, one op
    per step for all chunks at once (each chunk from a zero carry, the first from the real
    one), with the running products of m beside them; then a loop over chunks passes the
    carry on, and one op adds each chunk's carry times the running products.
    """
    n = nc * L
    out = s[:n] if reverse else s[1:]  # [n, ...] the solution
    if reverse:
        out[n - 1].addcmul_(m[n - 1], s[n])
    else:
        out[0].addcmul_(m[0], s[0])
    if nc == 1:  # one chunk: the steps in order, nothing to carry
        steps = range(n - 2, -1, -1) if reverse else range(1, n)
        prev = 1 if reverse else -1
        for i in steps:
            out[i].addcmul_(m[i], out[i + prev])
        return
    o = out.view(nc, L, *out.shape[1:])
    mc = m.view(nc, L, *m.shape[1:])
    # the chunks that take a carry: all but the first in time (the last in memory if reverse)
    late = slice(0, nc - 1) if reverse else slice(1, nc)
    early = slice(1, nc) if reverse else slice(0, nc - 1)
    P = _buffer("products", mc[late].shape, m)  # running products of m in those chunks
    first = L - 1 if reverse else 0
    P[:, first] = mc[late, first]
    pos = range(L - 2, -1, -1) if reverse else range(1, L)
    prev = 1 if reverse else -1
    for p in pos:
        o[:, p].addcmul_(mc[:, p], o[:, p + prev])
        torch.mul(mc[late, p], P[:, p + prev], out=P[:, p])
    last = 0 if reverse else L - 1  # a chunk's last step in time
    order = range(nc - 2, -1, -1) if reverse else range(1, nc)
    for c in order:  # the carry: chunk c's last step, from the last step of the one before
        k = c if reverse else c - 1  # c's row in P
        o[c, last].addcmul_(P[k, last], o[c + prev, last])
    rest = slice(1, L) if reverse else slice(0, L - 1)
    carry = o[early, last : last + 1]
    o[late, rest].addcmul_(P[:, rest], carry)


def _group_size(T: int, Bsz: int, D: int, N: int) -> int:
    """Steps per group: all T when [T, B, D, N] fits GROUP_ELEMENTS, else whole chunks."""
    if T * Bsz * D * N <= GROUP_ELEMENTS:
        return T
    return max(1, GROUP_ELEMENTS // (CHUNK * Bsz * D * N)) * CHUNK


def _sum_last(t: torch.Tensor) -> torch.Tensor:
    """t [..., N] summed over its last dim, as a matrix-vector product (for N = 16 about twice
    as fast as `sum(-1)` on the CPU)."""
    N = t.shape[-1]
    return torch.mv(t.view(-1, N), t.new_ones(N)).view(t.shape[:-1])


class _Group:
    """One group's time-major buffers: decays a [n + 1, B, D, N] (a[t] for t < steps, 1
    after) and the states h [n + 1, B, D, N] (h[0] the group's initial state, h[t + 1] the
    state after step t), n = chunks * steps per chunk >= steps (the rest identity steps)."""

    def __init__(self, dt, x, A, Bm, keep, h0):
        T, Bsz, D = dt.shape  # time-major views [t, B, D]
        N = A.shape[1]
        self.T = T
        self.nc, self.L = _chunking(T)
        n = self.nc * self.L
        self.a = _buffer("decays", (n + 1, Bsz, D, N), dt)
        a = self.a[:T]
        # exp(dt A) as exp2(dt A log2(e)): on the CPU exp2 costs half of exp
        torch.mul(dt.unsqueeze(-1), A * LOG2E, out=a).exp2_()
        if keep is not None:
            a.mul_(keep[..., None, None])
        self.a[T:].fill_(1)
        self.h = _buffer("states", (n + 1, Bsz, D, N), dt)
        self.h[0].copy_(h0)
        torch.mul(x.unsqueeze(-1), Bm.unsqueeze(2), out=self.h[1 : T + 1])
        self.h[T + 1 :].zero_()
        _scan_(self.a[:n], self.h, self.nc, self.L, reverse=False)

    def states(self) -> torch.Tensor:
        return self.h[1 : self.T + 1]  # [T, B, D, N] h_t

    def final(self) -> torch.Tensor:
        return self.h[self.T].clone()


class _Scan(torch.autograd.Function):
    """The core recurrence with a hand-written backward (DESIGN.md section 6).

    Inputs: dt [B, T, D] (after softplus), x = dt * u [B, T, D], A [D, N],
    B, C [B, T, N], keep [B, T] (0 at document starts) or None, h0 [B, D, N].
    Outputs: y_t = sum_n h_t C_t [B, T, D] and h_T. Only the states at group
    boundaries are kept (compiled, `cpu_jit.scan`: every state of a short window where a
    backward can run, `grad`); the backward recomputes each group's states, then runs
    the reverse scan g_h_t = C_t gy_t + a_{t+1} g_h_{t+1} with the same machinery.
    Inside, tensors are time-major ([T, B, ...]): a step is one contiguous slice.
    """

    @staticmethod
    def forward(ctx, dt, x, A, Bm, C, keep, h0, grad=True):
        with torch.autocast(dt.device.type, enabled=False):  # the scan is f32 (f64) throughout
            return _Scan._forward(ctx, dt, x, A, Bm, C, keep, h0, grad)

    @staticmethod
    def _forward(ctx, dt, x, A, Bm, C, keep, h0, grad):
        # detached: the out= ops below take no input that needs grad, also where a trace
        # inlines this body into a graph run with autograd on (torch.export)
        dt, x, A, Bm, C, h0 = (t.detach() for t in (dt, x, A, Bm, C, h0))
        if _compiled(dt):  # the recurrence compiled (`cpu_jit.scan`)
            from ..cpu_jit import scan

            args = [t.contiguous() for t in (dt, x, A, Bm, C)]
            keep = keep.contiguous() if keep is not None else None
            h0 = h0.contiguous()
            ctx.group = None
            # a short window keeps every state for a backward that will run (`grad`: the
            # caller's grad mode and inputs; autograd turns grad mode off in here)
            if grad and scan.keeps(dt, A):
                y, hT, states = scan.forward_states(*args, keep, h0)
                ctx.save_for_backward(*args, keep, states)
            else:
                y, hT = scan.forward(*args, keep, h0)
                ctx.save_for_backward(*args, keep, h0)
            return y, hT
        Bsz, T, D = dt.shape
        group = _group_size(T, Bsz, D, A.shape[1])
        dtT, xT, BT, CT = (t.transpose(0, 1) for t in (dt, x, Bm, C))
        keepT = None if keep is None else keep.t()
        y = dt.new_empty(T, Bsz, D)
        h, h_bounds = h0, []
        for t0 in range(0, T, group):
            sl = slice(t0, min(T, t0 + group))
            h_bounds.append(h)
            g = _Group(dtT[sl], xT[sl], A, BT[sl], None if keep is None else keepT[sl], h)
            h = g.final()
            # y_t = sum_n h_t C_t: the states are not needed again, so C multiplies them in place
            y[sl] = _sum_last(g.states().mul_(CT[sl].unsqueeze(2)))
        ctx.save_for_backward(dt, x, A, Bm, C, keep, *h_bounds)
        ctx.group = group
        return y.transpose(0, 1), h

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward is not differentiable itself
    def backward(ctx, gy, g_hT):
        with torch.autocast(gy.device.type if gy is not None else "cpu", enabled=False):
            return _Scan._backward(ctx, gy, g_hT)

    @staticmethod
    def _backward(ctx, gy, g_hT):
        dt, x, A, Bm, C, keep, *h_bounds = ctx.saved_tensors
        f = dt.dtype
        Bsz, T, D = dt.shape
        group = ctx.group
        if group is None:  # the forward ran compiled: so does the backward
            from ..cpu_jit import scan

            gy = gy.to(f).contiguous() if gy is not None else dt.new_zeros(Bsz, T, D)
            # h0 [B, D, N], or every state [B, T + 1, N, D] where the forward kept them
            h = h_bounds[0]
            g_hT = g_hT.to(f).contiguous() if g_hT is not None else dt.new_zeros(Bsz, *A.shape)
            g_dt, g_x, g_A, g_B, g_C, g_h0 = scan.backward(dt, x, A, Bm, C, keep, h, gy, g_hT)
            return g_dt, g_x, g_A, g_B, g_C, None, g_h0, None
        gy = gy.to(f) if gy is not None else dt.new_zeros(Bsz, T, D)
        dtT, xT, BT, CT, gyT = (t.transpose(0, 1) for t in (dt, x, Bm, C, gy))
        keepT = None if keep is None else keep.t()
        g_dt, g_x = dt.new_empty(T, Bsz, D), dt.new_empty(T, Bsz, D)
        g_B, g_C = dt.new_empty(T, Bsz, A.shape[1]), dt.new_empty(T, Bsz, A.shape[1])
        g_A = torch.zeros_like(A)
        # G: dL/dh at the end of the current group, from everything after it
        G = g_hT.to(f) if g_hT is not None else torch.zeros_like(h_bounds[0])
        starts = list(range(0, T, group))
        for gi in reversed(range(len(starts))):
            sl = slice(starts[gi], min(T, starts[gi] + group))
            g = _Group(
                dtT[sl], xT[sl], A, BT[sl], None if keep is None else keepT[sl], h_bounds[gi]
            )
            n, t = g.nc * g.L, g.T
            # reverse scan g_h_t = C_t gy_t + a_{t+1} g_h_{t+1} from g_h after the group = G;
            # a[t] = 1 past the group's steps, so the last step takes G itself
            gh = _buffer("state_grads", g.h.shape, dt)
            torch.mul(gyT[sl].unsqueeze(-1), CT[sl].unsqueeze(2), out=gh[:t])
            gh[t:n].zero_()
            gh[n].copy_(G)
            _scan_(g.a[1:], gh, g.nc, g.L, reverse=True)
            g_h, a = gh[:t], g.a[:t]  # [t, B, D, N]
            tmp = _buffer("products", g_h.shape, dt)
            g_C[sl] = torch.mul(g.states(), gyT[sl].unsqueeze(-1), out=tmp).sum(2)
            g_B[sl] = torch.mul(g_h, xT[sl].unsqueeze(-1), out=tmp).sum(2)
            g_x[sl] = _sum_last(torch.mul(g_h, BT[sl].unsqueeze(2), out=tmp))
            # dL/d(dt A) through a = exp(dt A) (keep folded into a): g_h_t a_t h_{t-1}
            dz = torch.mul(g_h, g.h[:t], out=tmp).mul_(a)
            g_A += torch.mul(dz, dtT[sl].unsqueeze(-1), out=g.h[:t]).flatten(0, 1).sum(0)
            g_dt[sl] = _sum_last(dz.mul_(A))
            G = a[0] * g_h[0]  # the carry past the group's first step
        return (
            g_dt.transpose(0, 1), g_x.transpose(0, 1), g_A, g_B.transpose(0, 1),
            g_C.transpose(0, 1), None, G, None,
        )  # fmt: skip


def selective_scan_reference(
    u: torch.Tensor,  # [B, T, D]
    delta: torch.Tensor,  # [B, T, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [B, T, N]
    C: torch.Tensor,  # [B, T, N]
    D: torch.Tensor | None = None,  # [D]
    z: torch.Tensor | None = None,  # [B, T, D]
    delta_bias: torch.Tensor | None = None,  # [D]
    delta_softplus: bool = True,
    initial_state: torch.Tensor | None = None,  # [B, D, N]
    seq_idx: torch.Tensor | None = None,  # [B, T] int32
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Inputs are checked by `mambakit.ops.selective_scan`; see the module docstring."""
    f = state_dtype(u)
    Bsz, T, Dn = u.shape
    N = A.shape[1]
    uf, dt = u.to(f), delta.to(f)
    if delta_bias is not None:
        dt = dt + delta_bias.to(f)
    if delta_softplus:
        dt = F.softplus(dt)
    keep = None
    if seq_idx is not None:  # 0 where a new document starts at t
        keep = torch.ones(Bsz, T, device=u.device, dtype=f)
        keep[:, 1:] = (seq_idx[:, 1:] == seq_idx[:, :-1]).to(f)
    h0 = (
        initial_state.to(f)
        if initial_state is not None
        else torch.zeros(Bsz, Dn, N, device=u.device, dtype=f)
    )
    if T == 0:  # nothing to scan: the state passes through (a copy, gradient unchanged)
        y, h = uf.new_zeros(Bsz, 0, Dn), h0.clone()
    else:
        x, Af, Bf, Cf = dt * uf, A.to(f), B.to(f), C.to(f)
        grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (dt, x, Af, Bf, Cf, h0)
        )  # a backward can run: the compiled forward may keep every state for it
        y, h = _Scan.apply(dt, x, Af, Bf, Cf, keep, h0, grad)
    if D is not None:
        y = y + uf * D.to(f)
    if z is not None:
        y = y * F.silu(z.to(f))
    y = y.to(u.dtype)
    return (y, h) if return_final_state else y


def selective_state_update_reference(
    ssm_state: torch.Tensor,  # [B, D, N], updated in place
    u: torch.Tensor,  # [B, D]
    delta: torch.Tensor,  # [B, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [B, N]
    C: torch.Tensor,  # [B, N]
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = True,
) -> torch.Tensor:
    """One timestep of the scan (decode): updates `ssm_state` in place, returns y [B, D].

    Written with few, fused ops: at batch 1 a decode step is bound by per-op overhead."""
    f = ssm_state.dtype
    dt = delta if delta.dtype == f else delta.to(f)
    if delta_bias is not None:
        dt = dt + delta_bias
    if delta_softplus:
        dt = F.softplus(dt)
    uf = u if u.dtype == f else u.to(f)
    dA = torch.exp(dt.unsqueeze(-1) * (A if A.dtype == f else A.to(f)))  # [B, D, N]
    Bf = B if B.dtype == f else B.to(f)
    ssm_state.mul_(dA).addcmul_((dt * uf).unsqueeze(-1), Bf.unsqueeze(1))  # + delta u B
    y = torch.bmm(ssm_state, (C if C.dtype == f else C.to(f)).unsqueeze(-1)).squeeze(-1)
    if D is not None:
        y = torch.addcmul(y, uf, D)
    if z is not None:
        y = y * F.silu(z if z.dtype == f else z.to(f))
    return y if y.dtype == u.dtype else y.to(u.dtype)


def selective_scan_states_at_reference(
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, seq_idx, positions
):  # fmt: skip
    """(y, final state, the states after the steps `positions` [B, k] as [B, k, D, N]): the
    scan of each row cut after every step asked for, each piece from the state the one before
    it left, or from zeros where a document starts at the piece's first step (inside a piece
    `seq_idx` resets it as in one pass). Inputs are checked by `mambakit.ops.selective_scan`."""
    Bsz, T, Dn = u.shape
    ys, finals, states = [], [], []
    for b in range(Bsz):
        row = slice(b, b + 1)
        h = initial_state[row] if initial_state is not None else None
        at: dict[int, torch.Tensor] = {}
        pieces, start = [], 0
        for stop in [*sorted(set(positions[b].tolist())), T - 1]:
            if stop < start:
                continue
            if start > 0 and seq_idx is not None and seq_idx[b, start] != seq_idx[b, start - 1]:
                h = None  # a document starts here: the carried state does not enter it
            sl = slice(start, stop + 1)
            y, h = selective_scan_reference(
                u[row, sl], delta[row, sl], A, B[row, sl], C[row, sl], D,
                None if z is None else z[row, sl], delta_bias, delta_softplus, h,
                None if seq_idx is None else seq_idx[row, sl], return_final_state=True,
            )  # fmt: skip
            pieces.append(y)
            at[stop] = h
            start = stop + 1
        ys.append(torch.cat(pieces, dim=1))
        finals.append(h)
        states.append([at[p][0] for p in positions[b].tolist()])
    k = positions.shape[1]
    at_states = (
        torch.stack([torch.stack(s) for s in states])
        if k
        else finals[0].new_zeros(Bsz, 0, Dn, A.shape[1])
    )
    return torch.cat(ys), torch.cat(finals), at_states
