"""`MambaBackbone.step` / `MambaLM.step` replayed from CUDA graphs the library captures
(`inference.step_graph`): every replayed step equals the eager step on a copy of the state.

On the CPU the graph is a stand-in whose replay re-runs the captured function, which
checks the bookkeeping (warm calls, keys, the state advanced once per call, outputs not
aliased, parameters updated in place followed, replaced ones recaptured, hooks kept
eager); on the GPU the graphs are real."""

from __future__ import annotations

import copy
import importlib
import weakref

import pytest
import torch

from mambakit import MambaBackbone, MambaConfig, MambaLM
from mambakit.inference import plan, step_graph_status

sg = importlib.import_module("mambakit.inference.step_graph")

MIXERS = {
    "mamba1": {},
    "mamba2": dict(headdim=16, d_state=16),
    "mamba3": dict(headdim=16, d_state=16),
}


def backbone(mixer: str, device="cpu", seed=0) -> MambaBackbone:
    torch.manual_seed(seed)
    cfg = MambaConfig(d_model=32, n_layers=2, input_dim=12, mixer=mixer, **MIXERS[mixer])
    return MambaBackbone(cfg).to(device)


class _FakeGraph:
    def __init__(self, replay):
        self.replay = replay


class _Captures(list):
    """The keys' first captures (one per key captured, and one per input address read in
    place); `graphs`: every graph captured (a key's ring slots and spare too)."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs = []


@pytest.fixture
def fake_graphs(monkeypatch):
    """CUDA graphs on the CPU: capture runs the warm-up, replay re-runs the function into
    the static output buffer. Returns the captures (`_Captures`). A real replay runs no
    Python, so it reads every plan as the step left it: each replay first checks that the
    plans the capture read are current (a stand-in that re-runs the function would bring
    them up to date itself) and hold the constants the capture passed to its kernels (a
    real replay passes them again, whatever the plan holds now)."""
    captures = _Captures()

    def fake_capture(fn, warmup=2, pool=None, warm=None):
        with plan.reads() as read:
            for _ in range(warmup):
                (warm or fn)()
            buf = (warm or fn)().clone()  # the output's static buffer (warm: a scratch state)
        read = [(weakref.ref(m), name, plan.record(m, name).constants) for m, name in read]
        captures.graphs.append(fn)
        ref = weakref.ref(buf)  # as a real graph, the replay holds no reference to it
        where = (buf.data_ptr(), buf.untyped_storage().nbytes())
        reads_at = _inputs(fn)

        def replay():  # a real graph writes where the buffer was at its capture, any mode
            out = ref()
            assert (out.data_ptr(), out.untyped_storage().nbytes()) == where, "buffer moved"
            # and reads its input where it was: the step's input must be there now
            assert _inputs(fn) == reads_at, "input moved"
            for module, name, constants in read:
                module = module()
                if module is not None:
                    now = plan.record(module, name)
                    assert now.fresh(module) and now.constants == constants, name
            # no autograd, as a real replay (inference_mode(False) alone turns grad mode on)
            with torch.inference_mode(out.is_inference()), torch.no_grad():
                out.copy_(fn())

        return _FakeGraph(replay), buf

    first_capture = sg._capture

    def counted_capture(*args, **kw):
        entry = first_capture(*args, **kw)
        captures.append(entry)
        return entry

    caches = {}
    monkeypatch.setattr(sg, "capture", fake_capture)
    monkeypatch.setattr(sg, "_capture", counted_capture)
    monkeypatch.setattr(sg, "use_cuda_graph", lambda flag, device: flag is not False)
    for name in ("mambakit.backbone", "mambakit.model"):
        monkeypatch.setattr(importlib.import_module(name), "use_cuda_graph",
                            lambda flag, device: flag is not False)  # fmt: skip
    monkeypatch.setattr(sg, "graph_cache", lambda m, create=True: caches.setdefault(id(m), {
        "pool": None}) if create or id(m) in caches else None)  # fmt: skip
    return captures


def _inputs(fn) -> list:
    """Where the captured body reads its input (address, strides): the tensor in the
    one-item list its closure holds (`step_graph._capture_slot`)."""
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    return [(t.data_ptr(), t.stride()) for c in cells if isinstance(c, list) for t in c
            if isinstance(t, torch.Tensor)]  # fmt: skip


def run(model, xs, state, **kw):
    """Steps without autograd (in inference mode where the state was made in it), each
    output kept."""
    inference = any(t.is_inference() for t in state._tensors())
    with torch.inference_mode(inference), torch.no_grad():
        return [model.step(x, state, **kw)[0] for x in xs]


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_replayed_steps_equal_eager_steps(fake_graphs, mixer):
    m = backbone(mixer)
    xs = torch.randn(9, 3, 12)
    s_graph, s_eager = m.init_state(3), m.init_state(3)
    outs = run(m, xs, s_graph)
    want = run(m, xs, s_eager, cuda_graph=False)
    assert len(fake_graphs) == 1  # captured at the third call, replayed from then on
    # every output kept (none may be overwritten): a slot per held output, then the spare
    assert len(fake_graphs.graphs) == sg.RING + 1
    assert step_graph_status(m)["cloned"] == len(xs) - sg.WARM_CALLS - sg.RING
    status = step_graph_status(m)
    assert status["replays"] == len(xs) - sg.WARM_CALLS and len(status["graphs"]) == 1
    for got, ref in zip(outs, want):  # each output kept as returned: none aliased
        assert torch.equal(got, ref)
    for a, b in zip(s_graph._tensors(), s_eager._tensors()):
        assert torch.equal(a, b)  # the state advanced once per call, the capture's included


def test_an_output_nothing_holds_is_replayed_into_again_not_copied(fake_graphs):
    """A loop that rebinds its output: the previous one is still bound while the next step
    runs, so two graphs take turns, each step's output one of their tensors, never a copy."""
    m = backbone("mamba1")
    xs = torch.randn(10, 3, 12)
    s_graph, s_eager = m.init_state(3), m.init_state(3)
    want = run(m, xs, s_eager, cuda_graph=False)
    ptrs = []
    with torch.no_grad():
        for i, x in enumerate(xs):
            y, _ = m.step(x, s_graph)
            assert torch.equal(y, want[i]), i
            ptrs.append(y.data_ptr())
    replayed = ptrs[sg.WARM_CALLS :]
    assert len(set(replayed)) == sg.RING == 2 and len(fake_graphs.graphs) == sg.RING
    assert step_graph_status(m)["cloned"] == 0
    assert all(a != b for a, b in zip(replayed, replayed[1:]))  # the two take turns
    assert all(a == b for a, b in zip(replayed, replayed[2:]))


@pytest.mark.parametrize("holder", ["view", "inference view", "storage", "dlpack", "list"])
def test_an_output_still_referenced_is_never_replayed_into(fake_graphs, holder):
    """Whatever still reaches an output's memory (a view of it, its storage, a DLPack
    export, a container) keeps its values through later steps. An inference-mode view
    records no base: only its storage's owners show it."""
    m = backbone("mamba1")
    xs = torch.randn(8, 2, 12)
    inference = holder == "inference view"
    with torch.inference_mode(inference):
        state = m.init_state(2)
    run(m, xs[:3], state)  # captured
    with torch.inference_mode(inference), torch.no_grad():
        y, _ = m.step(xs[3], state)
    kept = y.clone()
    if holder in ("view", "inference view"):
        with torch.inference_mode(inference):
            held = y[1:]
        assert held._base is (None if inference else y)
        expect = kept[1:]
    elif holder == "storage":
        held = y.untyped_storage()
        expect = kept.untyped_storage()
    elif holder == "dlpack":
        held = torch.utils.dlpack.to_dlpack(y)
        expect = None
    else:
        held = [y]
        expect = [kept]
    del y
    run(m, xs[4:], state)
    if holder == "dlpack":
        assert torch.equal(torch.utils.dlpack.from_dlpack(held), kept)
    elif holder == "storage":
        assert held.tolist() == expect.tolist()
    elif holder in ("view", "inference view"):
        assert torch.equal(held, expect)
    else:
        assert torch.equal(held[0], expect[0])


def test_outputs_saved_by_autograd_are_not_replayed_into(fake_graphs):
    """No-grad steps feeding a trainable head, one backward at the end: the head's graph
    saves each step's output (a C++ reference only), which a later step must not overwrite."""

    def head_grad(m, xs, state, head, **kw):
        loss = 0
        for x in xs:
            with torch.no_grad():
                y, _ = m.step(x, state, **kw)
            loss = loss + head(y).square().sum()  # y saved for the weight's gradient
            del y
        head.zero_grad()
        loss.backward()
        return head.weight.grad.clone()

    m = backbone("mamba1")
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 4)
    xs = torch.randn(8, 3, 12)
    got = head_grad(m, xs, m.init_state(3), head)
    want = head_grad(m, xs, m.init_state(3), head, cuda_graph=False)
    assert len(fake_graphs) == 1 and step_graph_status(m)["replays"] == len(xs) - sg.WARM_CALLS
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_what_a_caller_does_to_an_output_stays_with_it(fake_graphs):
    """Each step returns a tensor object of its own: a caller's in-place change of its
    shape, flags or data pointer does not reach later steps."""
    m = backbone("mamba1")
    xs = torch.randn(8, 3, 12)
    s_graph, s_eager = m.init_state(3), m.init_state(3)
    want = run(m, xs, s_eager, cuda_graph=False)
    objects = set()
    with torch.no_grad():
        for i, x in enumerate(xs):
            y, _ = m.step(x, s_graph)
            assert y.shape == (3, 32) and not y.requires_grad and torch.equal(y, want[i]), i
            objects.add(id(y))
            y.unsqueeze_(1)
            y.requires_grad_()
            y.data = torch.zeros(1)
            del y
    assert len(fake_graphs) == 1 and step_graph_status(m)["replays"] == len(xs) - sg.WARM_CALLS


def test_a_failed_later_capture_falls_back_to_the_eager_step(fake_graphs, monkeypatch):
    """Every slot's output held and the spare's capture failing: the step runs eagerly,
    with the reason kept, and stays right."""
    m = backbone("mamba1")
    xs = torch.randn(8, 3, 12)
    s_graph, s_eager = m.init_state(3), m.init_state(3)
    want = run(m, xs, s_eager, cuda_graph=False)
    got = run(m, xs[:4], s_graph)  # captured at the third call; two slots, both held

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(sg, "capture", fail)
    got += run(m, xs[4:], s_graph)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    status = step_graph_status(m)
    assert "capture failed: RuntimeError: out of memory" in status["reason"]
    assert status["replays"] == 2  # the slots' first replays; eager from then on


@pytest.mark.parametrize("how", ["freed", "grown"])
def test_an_output_resized_through_its_alias_retires_its_graph(fake_graphs, how):
    """A caller freeing the output's memory early (`untyped_storage().resize_(0)`) or growing
    it (`resize_`) moves the storage the graph writes: that graph is never replayed again
    (a new one takes its place) and later steps stay right."""
    m = backbone("mamba1")
    xs = torch.randn(9, 3, 12)
    s_graph, s_eager = m.init_state(3), m.init_state(3)
    want = run(m, xs, s_eager, cuda_graph=False)
    with torch.no_grad():
        for i, x in enumerate(xs):
            y, _ = m.step(x, s_graph)
            assert torch.equal(y, want[i]), i
            if i == 4:
                if how == "freed":
                    y.untyped_storage().resize_(0)
                else:
                    y.resize_(6, 32)
            del y  # each output dropped: one slot serves every step
    # the first graph, and the one that took its place after the resize
    assert len(fake_graphs) == 1 and len(fake_graphs.graphs) == 2
    assert step_graph_status(m)["cloned"] == 0


def _refill_loop(m, xs, state, buffers):
    """Steps whose inputs are `buffers` refilled in turn with the rows of `xs` (an input read
    where it is must be read at each step, not as it was at the capture)."""
    outs = []
    with torch.no_grad():
        for i, x in enumerate(xs):
            buf = buffers[i % len(buffers)]
            buf.copy_(x)
            y, _ = m.step(buf, state)
            outs.append(y.clone())
    return outs


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_an_input_refilled_in_place_is_read_where_it_is(fake_graphs, mixer):
    """A loop that refills the same two buffers: each address seen the third time on the
    copying graph gets a graph reading it in place; every step equals the eager step and
    the state advances once per call."""
    m = backbone(mixer)
    xs = torch.randn(16, 3, 12)
    s_graph, s_eager = m.init_state(3), m.init_state(3)
    buffers = [torch.empty(3, 12), torch.empty(3, 12)]
    got = _refill_loop(m, xs, s_graph, buffers)
    want = run(m, xs, s_eager, cuda_graph=False)
    status = step_graph_status(m)
    assert status["direct"] == 2 and len(status["graphs"]) == 1, status
    assert len(fake_graphs) == 3  # the copying graph, then one per buffer
    assert status["replays"] == len(xs) - sg.WARM_CALLS
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(s_graph._tensors(), s_eager._tensors()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_input_addresses_read_in_place_are_bounded_and_not_kept_alive(fake_graphs):
    """More buffers than `DIRECT`: only that many get graphs of their own (the rest are
    copied in, right as well); a graph reading an input in place holds no reference to it."""
    m = backbone("mamba1")
    n = sg.DIRECT + 2
    xs = torch.randn(4 * n, 2, 12)
    s_graph, s_eager = m.init_state(2), m.init_state(2)
    buffers = [torch.empty(2, 12) for _ in range(n)]
    got = _refill_loop(m, xs, s_graph, buffers)
    want = run(m, xs, s_eager, cuda_graph=False)
    assert step_graph_status(m)["direct"] == sg.DIRECT
    assert len(fake_graphs) == 1 + sg.DIRECT
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    gone = [weakref.ref(b) for b in buffers]
    del buffers
    assert all(r() is None for r in gone)


def test_replaced_parameters_recapture_the_graphs_reading_the_input_in_place(fake_graphs):
    """A weight replaced (`.data =`) after the graphs reading a buffer in place were
    captured: they are stale, the steps stay right, and the buffer gets a graph of its own
    again on the new weights (however often that happens)."""
    m = backbone("mamba1")
    xs = torch.randn(8 * (sg.DIRECT + 1), 2, 12)
    s_graph, s_eager = m.init_state(2), m.init_state(2)
    buf = torch.empty(2, 12)
    w = m.layers[0].mixer.in_proj.weight
    for i in range(sg.DIRECT + 1):
        if i:
            w.data = w.data * 0.9
        chunk = xs[8 * i : 8 * (i + 1)]
        got = _refill_loop(m, chunk, s_graph, [buf])
        want = run(m, chunk, s_eager, cuda_graph=False)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert step_graph_status(m)["direct"] >= 1, i


def test_an_input_at_a_known_address_with_other_strides_is_not_read_in_place(fake_graphs):
    """The same memory read with other strides (a transposed view) is another input: it
    goes through the copying graph, never a graph captured on the first layout."""
    m = backbone("mamba1")
    xs = torch.randn(8, 4, 12)
    s_graph, s_eager = m.init_state(4), m.init_state(4)
    buf = torch.empty(4, 12)
    got = _refill_loop(m, xs[:6], s_graph, [buf])
    assert step_graph_status(m)["direct"] == 1
    flat = buf.view(-1)
    other = flat.view(12, 4).t()  # [4, 12] at the same address, strides (1, 4)
    assert other.data_ptr() == buf.data_ptr() and other.stride() != buf.stride()
    with torch.no_grad():
        for x in xs[6:]:
            other.copy_(x)
            got.append(m.step(other, s_graph)[0].clone())
    want = run(m, xs, s_eager, cuda_graph=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert step_graph_status(m)["direct"] == 1


def test_a_state_made_in_inference_mode_steps_under_no_grad(fake_graphs):
    """The graphs of a state made in inference mode are inference tensors (their input too);
    a caller stepping it under no_grad alone still replays them."""
    m = backbone("mamba1")
    xs = torch.randn(6, 2, 12)
    with torch.inference_mode():
        s_graph, s_eager = m.init_state(2), m.init_state(2)
    with torch.no_grad():
        got = [m.step(x, s_graph)[0].clone() for x in xs]
    want = run(m, xs, s_eager, cuda_graph=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert step_graph_status(m)["replays"] == len(xs) - sg.WARM_CALLS


def test_parameters_updated_in_place_are_followed_and_replaced_ones_recaptured(fake_graphs):
    m = backbone("mamba1")
    xs = torch.randn(12, 2, 12)
    s_graph, s_eager = m.init_state(2), m.init_state(2)
    run(m, xs[:4], s_graph)
    run(m, xs[:4], s_eager, cuda_graph=False)
    with torch.no_grad():  # an optimizer step: A_log feeds the plan's own A = -exp(A_log)
        for p in m.parameters():
            p.mul_(1.01)
    got = run(m, xs[4:8], s_graph)
    want = run(m, xs[4:8], s_eager, cuda_graph=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(fake_graphs) == 1  # followed without a new capture
    w = m.layers[0].mixer.in_proj.weight
    w.data = w.data * 0.5  # replaced: the graph read the old storage
    got = run(m, xs[8:], s_graph)
    want = run(m, xs[8:], s_eager, cuda_graph=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(fake_graphs) == 2


def test_a_new_state_is_warmed_and_captured_and_graphs_are_bounded(fake_graphs, monkeypatch):
    monkeypatch.setattr(sg, "MAX_GRAPHS", 2)
    m = backbone("mamba1")
    x = torch.randn(2, 12)
    states = [m.init_state(2) for _ in range(3)]
    for s in states:
        run(m, [x] * (sg.WARM_CALLS + 1), s)
    assert len(fake_graphs) == 3
    assert len(step_graph_status(m)["graphs"]) == 2  # the least recently used dropped
    run(m, [x], states[-1])
    assert len(fake_graphs) == 3  # the latest is still kept


def test_a_hooked_module_keeps_the_step_eager_and_says_why(fake_graphs):
    m = backbone("mamba1")
    calls = []
    m.input_proj.register_forward_hook(lambda mod, args, out: calls.append(1))
    s = m.init_state(2)
    run(m, torch.randn(5, 2, 12), s)
    assert not fake_graphs and len(calls) == 5
    assert "input_proj" in step_graph_status(m)["reason"]


def test_a_hook_or_adapter_after_the_capture_drops_the_graph(fake_graphs):
    m = backbone("mamba2")
    s_graph, s_eager = m.init_state(2), m.init_state(2)
    xs = torch.randn(12, 2, 12)
    run(m, xs[:4], s_graph)
    run(m, xs[:4], s_eager, cuda_graph=False)
    calls = []
    handle = m.layers[1].mixer.out_proj.register_forward_hook(lambda *a: calls.append(1))
    got = run(m, xs[4:6], s_graph)
    assert len(calls) == 2 and "layers.1" in step_graph_status(m)["reason"]
    handle.remove()
    mixer = m.layers[0].mixer
    inner = mixer.in_proj
    mixer.in_proj = torch.nn.Sequential(inner)  # an adapter in the projection's place
    got += run(m, xs[6:8], s_graph)
    assert "layers.0" in step_graph_status(m)["reason"]
    mixer.in_proj = inner
    got += run(m, xs[8:], s_graph)
    want = run(m, xs[4:], s_eager, cuda_graph=False)
    # the hooked steps run the op-by-op body, the others the CPU's whole-stack body: the
    # same math in another order of float operations
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(fake_graphs) == 2  # captured again once the modules were plain again


def test_cuda_graph_true_captures_at_the_first_call_and_false_never(fake_graphs):
    m = backbone("mamba3")
    s = m.init_state(1)
    run(m, torch.randn(3, 1, 12), s, cuda_graph=False)
    assert not fake_graphs
    run(m, torch.randn(1, 1, 12), s, cuda_graph=True)
    assert len(fake_graphs) == 1


@pytest.mark.parametrize("tie", [True, False])
def test_lm_step_replays_equal_eager(fake_graphs, tie):
    torch.manual_seed(0)
    lm = MambaLM(MambaConfig(d_model=32, n_layers=2, vocab_size=50, tie_embeddings=tie))
    assert lm.lm_head.bias is None  # a head without a bias (a None parameter slot)
    ids = torch.randint(0, 50, (7, 3))
    s_graph, s_eager = lm.init_state(3), lm.init_state(3)
    got = run(lm, ids, s_graph)
    want = run(lm, ids, s_eager, cuda_graph=False)
    assert len(fake_graphs) == 1
    status = step_graph_status(lm)
    assert status["replays"] == len(ids) - sg.WARM_CALLS and status["reason"] is None, status
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_an_optimizer_step_reaches_every_plan_a_replay_reads(fake_graphs, mixer):
    """The CPU's step runs the whole-stack body on weights of its own (the "stack" plan,
    copies stacked over the layers), as the reference bodies do on a GPU (float64, or
    MAMBAKIT_BACKEND=reference): after an optimizer step, replays read those copies
    brought up to date, not only the step plan (the stand-in checks before each replay)."""
    m = backbone(mixer)
    xs = torch.randn(10, 2, 12)
    s_graph, s_eager = m.init_state(2), m.init_state(2)
    got = run(m, xs[:5], s_graph)
    want = run(m, xs[:5], s_eager, cuda_graph=False)
    assert plan.record(m, "stack") is not None  # the body read the stacked copies
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for second in (False, True):  # the first moves every weight; the second all but A_log,
        out, _ = m(xs.transpose(0, 1)[:, :4])  # D and the dt bias (the step plan's own
        out.square().mean().backward()  # copies stay fresh, the stacked ones do not)
        if second:
            for name, p in m.named_parameters():
                if name.endswith(("A_log", "D", "dt_bias")):
                    p.grad = None
        opt.step()
        opt.zero_grad()
        got += run(m, xs[5:], s_graph)
        want += run(m, xs[5:], s_eager, cuda_graph=False)
    assert len(fake_graphs) == 1  # the same graph replayed throughout
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# what the decode plans pass to their kernels besides tensors, changed after a capture:
# (module path, attribute, new value); Mamba-3's B norm eps alone leaves its layer unfusable
CONSTANTS = {
    "mamba1": [("layers.1.norm", "eps", 0.5), ("norm_f", "eps", 0.5)],
    "mamba2": [("layers.0.mixer", "dt_limit", (0.0, 0.02)), ("layers.1.mixer.norm", "eps", 0.5)],
    "mamba3": [("layers.0.mixer", "A_floor", 2.0), ("layers.1.mixer.B_norm", "eps", 0.5),
               ("layers.1.mixer.C_norm", "eps", 0.5), ("layers.0.mixer.B_norm", "eps", 0.5)],
}  # fmt: skip


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_a_constant_changed_after_the_capture_is_followed(fake_graphs, mixer):
    """A norm's eps, Mamba-2's dt_limit or Mamba-3's A_floor set after the graph was
    captured (each passed to the step's kernels as a number): every later step, replayed
    or eager, equals a fresh copy of the changed model (which derives its plans anew)
    stepped from the same state, and differs from the model as it was."""
    m = backbone(mixer)
    xs = torch.randn(6, 2, 12)
    state = m.init_state(2)
    graphs = sg._tables(m).graphs
    for path, attr, value in CONSTANTS[mixer]:
        run(m, xs[:4], state)  # (re)captured at the third call, replayed at the fourth
        kept = set(map(id, graphs.values()))
        assert len(kept) == (sg._not_plain(m) is None)  # none while B and C eps differ
        before = copy.deepcopy(m)
        setattr(m.get_submodule(path), attr, value)
        fresh, s_fresh, s_before = copy.deepcopy(m), state.clone(), state.clone()
        steps = xs[4:]
        run(m, steps[:1], state)  # the stand-in re-runs Python: see that the graph went
        assert not kept & set(map(id, graphs.values())), (path, attr)
        got = run(m, steps[1:], state)
        want = run(fresh, steps, s_fresh, cuda_graph=False)[1:]
        old = run(before, steps, s_before, cuda_graph=False)[1:]
        for a, b, c in zip(got, want, old):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert (a - c).abs().max() > 1e-4, (path, attr)  # the change matters
        torch.testing.assert_close(state.ssm, s_fresh.ssm, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_generate_graphs_are_stale_after_a_constant_changes(mixer):
    """generate's cached graphs are kept while `params_signature` is unchanged: it must move
    with every constant the step's and forward's kernels take from the modules."""
    from mambakit.inference.cuda_graph import params_signature

    torch.manual_seed(0)
    cfg = MambaConfig(d_model=32, n_layers=2, vocab_size=40, mixer=mixer, **MIXERS[mixer])
    lm = MambaLM(cfg)
    sig = params_signature(lm)
    assert params_signature(lm) == sig
    for path, attr, value in CONSTANTS[mixer] + [("norm_f", "eps", 0.25)]:
        setattr(lm.backbone.get_submodule(path), attr, value)
        now = params_signature(lm)
        assert now != sig, (path, attr)
        sig = now


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_bad_cuda_graph_argument(flag):
    m = backbone("mamba1")
    with pytest.raises(ValueError, match="cuda_graph"):
        m.step(torch.randn(1, 12), m.init_state(1), cuda_graph=flag)


def test_cuda_graph_true_needs_a_cuda_device():
    m = backbone("mamba1")
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
        m.step(torch.randn(1, 12), m.init_state(1), cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", list(MIXERS))
@pytest.mark.parametrize("mode", ["f32", "bf16", "f64"])
def test_gpu_graph_steps_equal_eager_steps(mixer, mode):
    # float64: the reference bodies' whole-stack step on its stacked weight copies
    dtype = torch.float64 if mode == "f64" else torch.float32
    autocast = mode == "bf16"
    m = backbone(mixer, "cuda").to(dtype)
    xs = torch.randn(10, 4, 12, device="cuda", dtype=dtype)
    s_graph, s_eager = m.init_state(4), m.init_state(4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    acting = torch.autocast("cuda", torch.bfloat16, enabled=autocast)
    with acting:  # a rollout; autocast's cached casts end with the region
        got = run(m, xs[:6], s_graph)
        want = run(m, xs[:6], s_eager, cuda_graph=False)
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):  # a training step
        out, _ = m(xs.transpose(0, 1)[:, :3])
        out.float().square().mean().backward()
    opt.step()
    done = torch.tensor([True, False, True, False], device="cuda")
    s_graph.reset_(done)
    s_eager.reset_(done)
    with acting:  # the next rollout, on the new weights
        got += run(m, xs[6:], s_graph)
        want += run(m, xs[6:], s_eager, cuda_graph=False)
    status = step_graph_status(m)
    assert status["replays"] == len(xs) - sg.WARM_CALLS, status
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.isfinite().all() and b.isfinite().all(), (i, a.isfinite().all(), status)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(s_graph._tensors(), s_eager._tensors()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_gpu_inputs_read_in_place_equal_eager_steps(mixer):
    """Real graphs reading the input where it is: a buffer refilled in place each step, and
    inputs made anew each step (the allocator hands out the same few blocks): every step
    equals the eager one."""
    m = backbone(mixer, "cuda")
    xs = torch.randn(24, 4, 12, device="cuda")
    s_graph, s_eager = m.init_state(4), m.init_state(4)
    buf = torch.empty(4, 12, device="cuda")
    got = _refill_loop(m, xs[:12], s_graph, [buf])
    assert step_graph_status(m)["direct"] >= 1
    with torch.no_grad():
        for x in xs[12:]:
            fresh = x * 1.0  # a new tensor, freed after the step
            got.append(m.step(fresh, s_graph)[0].clone())
            del fresh
    want = run(m, xs, s_eager, cuda_graph=False)
    status = step_graph_status(m)
    assert status["replays"] == len(xs) - sg.WARM_CALLS, status  # every later step replayed
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda e, i=i: f"{i}: {e}")
    for a, b in zip(s_graph._tensors(), s_eager._tensors()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_gpu_lm_graph_steps_equal_eager_steps():
    torch.manual_seed(0)
    lm = MambaLM(MambaConfig(d_model=64, n_layers=2, vocab_size=100)).cuda()
    ids = torch.randint(0, 100, (8, 2), device="cuda")
    s_graph, s_eager = lm.init_state(2), lm.init_state(2)
    with torch.inference_mode():
        got = [lm.step(t, s_graph)[0] for t in ids]
        want = [lm.step(t, s_eager, cuda_graph=False)[0] for t in ids]
    status = step_graph_status(lm)
    assert status["replays"] == len(ids) - sg.WARM_CALLS, status
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_gpu_rebinding_loop_hands_outputs_out_without_clones():
    """On real graphs too, `y, state = model.step(x, state)` takes the two slots in turn:
    no step's output is cloned (the counts of a free output match the probe's on CUDA)."""
    m = backbone("mamba1", "cuda")
    xs = torch.randn(10, 4, 12, device="cuda")
    s_graph, s_eager = m.init_state(4), m.init_state(4)
    want = run(m, xs, s_eager, cuda_graph=False)
    with torch.no_grad():
        for i, x in enumerate(xs):
            y, _ = m.step(x, s_graph)
            torch.testing.assert_close(y, want[i], rtol=1e-6, atol=1e-6)
    status = step_graph_status(m)
    assert status["replays"] == len(xs) - sg.WARM_CALLS and status["cloned"] == 0, status


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_gpu_graph_outputs_handed_out_equal_eager_steps(mixer):
    """The real graphs' turn-taking, two states (two keys) stepped in turn: outputs rebound
    each step, every third one kept to the end; each equals the eager step when returned
    and still does after every later replay (no graph writes over another's output)."""
    m = backbone(mixer, "cuda")
    xs = torch.randn(2, 15, 4, 12, device="cuda")
    graph_states = [m.init_state(4), m.init_state(4)]
    want = [run(m, xs[k], m.init_state(4), cuda_graph=False) for k in range(2)]
    kept = []
    with torch.no_grad():
        for i in range(xs.shape[1]):
            for k in range(2):
                y, _ = m.step(xs[k, i], graph_states[k])
                torch.testing.assert_close(y, want[k][i], rtol=1e-6, atol=1e-6)
                if i % 3 == 0:
                    kept.append((k, i, y))
    for k, i, y in kept:
        torch.testing.assert_close(y, want[k][i], rtol=1e-6, atol=1e-6, msg=f"{k} {i}")
    status = step_graph_status(m)
    assert status["replays"] == 2 * (xs.shape[1] - sg.WARM_CALLS), status


def test_a_superseded_plan_is_not_replayed_on(fake_graphs):
    """A graph's plan derived again in between (a parameter's data swapped for a step and
    swapped back, as an EMA swap does, moving no version): the plan then holds the values
    of the swapped weights in its own tensors, however fresh it looks; the graph must see
    the plan derived again, its tensors the values of the weights it reads."""
    from mambakit.backbone import _step_plan
    from mambakit.inference.plan import _tensors, record

    m = backbone("mamba1")
    state = m.init_state(2)
    xs = torch.randn(4, 2, 12)
    run(m, xs[:3], state)  # captured at the third call
    entry = next(iter(sg._tables(m).graphs.values()))
    A_log = m.layers[0].mixer.A_log
    kept = A_log.data
    A_log.data = kept + 1.0  # a new storage: no version moves
    run(m, xs[3:], state, cuda_graph=False)  # derived again, into the plan's own tensors
    A_log.data = kept
    assert sg._stands(m, m, None, entry)
    assert entry.plan is record(m, "step")
    with torch.no_grad():
        want = _tensors(_step_plan(m))
    got = _tensors(entry.plan.value)
    assert len(got) == len(want) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _doubled(mod, args, out):
    """A forward hook that doubles a module's output (the first item of a tuple)."""
    return (2 * out[0], *out[1:]) if isinstance(out, tuple) else 2 * out


@pytest.mark.parametrize("where", ["layers.1", "layers.0.mixer"])
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_a_hook_on_a_block_or_mixer_runs_in_every_step(fake_graphs, mixer, where):
    """A forward hook on a block or on its mixer (which `step` would not call: it runs
    their decode methods): every step, graph-eligible or not, equals the forward over the
    whole sequence, which calls them, and the hook ran once a step; the LM's steps and its
    last-position logits likewise."""
    m = backbone(mixer)
    calls = []
    m.get_submodule(where).register_forward_hook(
        lambda *a: calls.append(1) or _doubled(*a))  # fmt: skip
    xs = torch.randn(2, 6, 12)
    with torch.no_grad():
        want = m(xs)[0]
        state = m.init_state(2)
        got = torch.stack(run(m, xs.transpose(0, 1), state), 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1 + xs.shape[1] and not fake_graphs
    assert where.split(".mixer")[0] in step_graph_status(m)["reason"]
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=32, n_layers=2, vocab_size=40, mixer=mixer, **MIXERS[mixer])
    lm = MambaLM(cfg)
    lm.backbone.get_submodule(where).register_forward_hook(_doubled)
    ids = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        want = lm(ids).logits
        state = lm.init_state(2)
        got = torch.stack([lm.step(t, state)[0] for t in ids.T], 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lm.last_logits(ids)[0], want[:, -1], rtol=1e-5, atol=1e-5)
