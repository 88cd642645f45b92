"""`MambaBackbone.step` on the CPU compiled end to end (`inference.cpu_step`: input_proj,
the mixer's compiled stack body, norm_f as numba calls) against the same step with numba
off (the PyTorch bodies, themselves checked against the op-by-op reference and float64
elsewhere): outputs and every state field over a run of steps, for every mixer with a
compiled body; and the general path wherever the compiled one would not compute what
the modules say (a hook, an adapter, autocast, more rows than it takes), with weights
changed in place by an optimizer followed. `MambaLM.step` on token ids too: the same
against numba off, each row's logits independent of the batch, bad ids refused."""

from __future__ import annotations

import importlib

import pytest
import torch

from mambakit import MambaBackbone, MambaConfig, MambaLM
from mambakit.inference import cpu_step
from mambakit.inference.plan import drop
from mambakit.ops import cpu_jit

pytest.importorskip("numba")

MIXERS = {
    "mamba1": {},
    "mamba3": dict(mixer="mamba3", headdim=16),
}
for _name, _kw in (("mamba2", dict(mixer="mamba2", headdim=32)),):
    if importlib.util.find_spec("mambakit.ops.cpu_jit." + _name) is not None:
        MIXERS[_name] = _kw


def _counted_compiled_rows(monkeypatch, module: str) -> list[bool]:
    """Each call of `cpu_step.compiled_rows` from `module`: whether it returned rows."""
    calls = []
    run = cpu_step.compiled_rows

    def counted(*args):
        out = run(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(importlib.import_module(module), "compiled_rows", counted)
    return calls


@pytest.fixture
def compiled_calls(monkeypatch):
    """The backbone's compiled whole-step calls (`cpu_step.compiled_rows` returning rows)."""
    return _counted_compiled_rows(monkeypatch, "mambakit.backbone")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def backbone(name: str, dtype=torch.float32, input_dim: int | None = 64) -> MambaBackbone:
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=128, n_layers=3, input_dim=input_dim, **MIXERS[name])
    bb = MambaBackbone(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in bb.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return bb


def run(bb, xs, numba_on, on: bool, state=None):
    numba_on(on)
    drop(bb)  # the plans hold the compiled weights: derive them again
    state = bb.init_state(xs.shape[1]) if state is None else state
    with torch.no_grad():
        outs = [bb.step(x, state)[0] for x in xs]
    return outs, state


def assert_close(got, want, tol):
    (outs, state), (outs_w, state_w) = got, want
    for t, (a, b) in enumerate(zip(outs, outs_w)):
        assert rel(a, b) < tol, f"step {t}: output relative error {rel(a, b):.1e}"
    for (f, a), (_, b) in zip(state._items(), state_w._items()):
        assert rel(a, b) < tol, f"state.{f} relative error {rel(a, b):.1e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("batch", [1, 3, 16], ids=["B1", "B3", "B16"])
@pytest.mark.parametrize("name", list(MIXERS))
def test_compiled_step_equals_the_torch_step(name, batch, dtype, numba_on, compiled_calls):
    """16 rows: compiled where the stack takes them (float32: 1.4 MiB of weights, up to
    SMALL_STACK_MAX_ROWS), the PyTorch path where it does not (float64: 2.8 MiB, 8 rows)."""
    bb = backbone(name, dtype)
    xs = torch.randn(6, batch, 64, dtype=dtype)
    got = run(bb, xs, numba_on, True)
    small = dtype == torch.float32
    assert bb._stack_weights().compiled.rows_max == (cpu_jit.SMALL_STACK_MAX_ROWS if small
                                                     else cpu_jit.COMPILED_MAX_ROWS)  # fmt: skip
    compiled = batch <= bb._stack_weights().compiled.rows_max
    assert compiled_calls == [compiled] * len(xs)
    compiled_calls.clear()
    want = run(bb, xs, numba_on, False)
    assert not any(compiled_calls)
    assert_close(got, want, 1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("name", list(MIXERS))
def test_without_input_proj(name, numba_on, compiled_calls):
    """input_dim None: x is the residual stream's first rows as they are."""
    bb = backbone(name, input_dim=None)
    xs = torch.randn(5, 2, 128)
    got = run(bb, xs, numba_on, True)
    assert all(compiled_calls)
    assert_close(got, run(bb, xs, numba_on, False), 1e-5)


def test_a_hook_or_an_adapter_takes_the_general_path(numba_on, compiled_calls):
    bb = backbone("mamba1")
    xs = torch.randn(4, 1, 64)
    want = run(bb, xs, numba_on, False)
    seen = []
    handle = bb.input_proj.register_forward_hook(lambda *a: seen.append(1))
    got = run(bb, xs, numba_on, True)
    assert len(seen) == len(xs) and not any(compiled_calls)
    assert_close(got, want, 1e-5)
    handle.remove()
    compiled_calls.clear()
    run(bb, xs, numba_on, True)
    assert all(compiled_calls)  # plain again: compiled again
    mixer = bb.layers[1].mixer
    inner = mixer.out_proj
    mixer.out_proj = torch.nn.Sequential(inner)  # an adapter in the projection's place
    compiled_calls.clear()
    got = run(bb, xs, numba_on, True)
    assert not any(compiled_calls)
    assert_close(got, want, 1e-5)


def test_autocast_and_many_rows_take_the_general_path(numba_on, compiled_calls):
    bb = backbone("mamba1")
    numba_on(True)
    rows = bb._stack_weights().compiled.rows_max  # a 1.4 MiB stack: SMALL_STACK_MAX_ROWS
    assert rows == cpu_jit.SMALL_STACK_MAX_ROWS
    run(bb, torch.randn(2, rows + 1, 64), numba_on, True)
    assert not any(compiled_calls)
    numba_on(True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bb.step(torch.randn(1, 64), bb.init_state(1))
    assert not any(compiled_calls)


def test_weights_changed_in_place_are_followed(numba_on, compiled_calls):
    """An optimizer-like update between steps (in place: version counters move): the next
    compiled steps read the new weights, input_proj and norm_f included, as the general
    path does on a copy of the model."""
    xs = torch.randn(3, 1, 64)
    runs = []
    for on in (True, False):
        bb = backbone("mamba1")
        numba_on(on)
        state = bb.init_state(1)
        with torch.no_grad():
            bb.step(xs[0], state)
            for p in (bb.input_proj.weight, bb.norm_f.weight, bb.layers[0].mixer.in_proj.weight):
                p.mul_(1.5)
            runs.append(([bb.step(x, state)[0] for x in xs[1:]], state))
    assert compiled_calls == [True] * len(xs) + [False] * len(xs)
    assert_close(runs[0], runs[1], 1e-5)


def test_the_compiled_step_keeps_no_model_alive(numba_on):
    """What the compiled step keeps beside a model (its watch list, weights) dies with it."""
    import gc
    import weakref

    bb = backbone("mamba1")
    run(bb, torch.randn(2, 1, 64), numba_on, True)
    assert bb in cpu_step._ENTRIES
    ref, entries = weakref.ref(bb), len(cpu_step._ENTRIES)  # (models of other tests live on)
    del bb
    gc.collect()
    assert ref() is None and len(cpu_step._ENTRIES) <= entries - 1  # (others may die too)


@pytest.mark.parametrize("name", list(MIXERS))
def test_a_new_norm_eps_or_a_norm_subclass_is_followed(name, numba_on, compiled_calls):
    """norm_f's eps changed after the first steps: the compiled step uses the new one. A
    subclass of RMSNorm in norm_f's place (its own forward): the general path calls it."""
    xs = torch.randn(4, 1, 64)
    runs = []
    for on in (True, False):
        bb = backbone(name)
        numba_on(on)
        state = bb.init_state(1)
        with torch.no_grad():
            bb.step(xs[0], state)
            bb.norm_f.eps = 0.5
            runs.append(([bb.step(x, state)[0] for x in xs[1:]], state))
    assert all(compiled_calls[: len(xs)])
    assert_close(runs[0], runs[1], 1e-5)

    class Doubled(type(bb.norm_f)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            return (2 * out[0], *out[1:]) if isinstance(out, tuple) else 2 * out

    bb = backbone(name)
    numba_on(True)
    plain_out = bb.step(xs[0], bb.init_state(1))[0]
    bb.norm_f.__class__ = Doubled
    compiled_calls.clear()
    with torch.no_grad():
        doubled = bb.step(xs[0], bb.init_state(1))[0]
    assert compiled_calls == [False]
    assert rel(doubled, 2 * plain_out) < 1e-5


@pytest.mark.parametrize("name", list(MIXERS))
def test_states_switched_or_fields_replaced_are_followed(name, numba_on, compiled_calls):
    """The compiled step keeps the last state's numpy views: two states stepped in turn, a
    field replaced by a copy (the copy advances, the old tensor does not) and a field of
    another dtype (the general path) all step as the PyTorch path does."""
    bb = backbone(name)
    xs = torch.randn(8, 2, 64)

    def loop(on: bool):
        numba_on(on)
        drop(bb)
        a, b = bb.init_state(2), bb.init_state(2)
        outs, old = [], None
        with torch.no_grad():
            for t, x in enumerate(xs):
                if t == 4:  # a field replaced by its copy: the copy is what advances
                    old = a.ssm
                    a.ssm = a.ssm.clone()
                    frozen = old.clone()
                outs.append(bb.step(x, a if t % 2 else b)[0])
                outs.append(bb.step(x.flip(0), a)[0])
        assert torch.equal(old, frozen)
        return outs, a, b

    got, want = loop(True), loop(False)
    assert compiled_calls[: 2 * len(xs)] == [True] * (2 * len(xs))
    for t, (u, v) in enumerate(zip(got[0], want[0])):
        assert rel(u, v) < 1e-5, f"call {t}: output relative error {rel(u, v):.1e}"
    for s_got, s_want in zip(got[1:], want[1:]):
        for (f, u), (_, v) in zip(s_got._items(), s_want._items()):
            assert rel(u, v) < 1e-5, f"state.{f} relative error {rel(u, v):.1e}"
    numba_on(True)
    drop(bb)
    compiled_calls.clear()
    state = bb.init_state(1)
    with torch.no_grad():
        bb.step(xs[0, :1], state)
        first = [f for f in state.layer_type._fields if f != "ssm"][0]
        setattr(state, first, getattr(state, first).double())  # not the weights' dtype
        out = bb.step(xs[1, :1], state)[0]
    assert compiled_calls == [True, False]
    assert out.dtype == torch.float32


@pytest.mark.parametrize("name", list(MIXERS))
def test_rows_on_threads_equal_each_row_stepped_alone(name, numba_on, monkeypatch):
    """With two torch threads and five rows the compiled step runs its rows on numba's
    threads (`common.run_rows`): every row's output and state bit for bit those of that row
    stepped alone on one thread."""
    common = importlib.import_module("mambakit.ops.cpu_jit.common")
    parallel = []

    def spied(serial, rows, r, *args):
        parallel.append(r.shape[0] >= common.PARALLEL_ROWS and torch.get_num_threads() > 1)
        common.run_rows(serial, rows, r, *args)

    for module in ("mamba1", "packed"):
        monkeypatch.setattr(importlib.import_module(f"mambakit.ops.cpu_jit.{module}"),
                            "run_rows", spied)  # fmt: skip
    bb = backbone(name)
    numba_on(True)
    drop(bb)
    xs = torch.randn(4, 5, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        state = bb.init_state(5)
        with torch.no_grad():
            outs = [bb.step(x, state)[0] for x in xs]
    finally:
        torch.set_num_threads(threads)
    assert parallel == [True] * len(xs)
    for b in range(5):
        alone = bb.init_state(1)
        with torch.no_grad():
            for t, x in enumerate(xs):
                assert torch.equal(bb.step(x[b : b + 1], alone)[0], outs[t][b : b + 1])
        for (f, u), (_, v) in zip(state._items(), alone._items()):
            assert torch.equal(u[:, b : b + 1], v), f"row {b}: state.{f}"
    assert parallel[len(xs) :] == [False] * (5 * len(xs))


def test_the_state_version_moves_so_autograd_sees_the_write(numba_on):
    """A graph that saved the state, then a no-grad step that advances it in place: the
    backward raises, as it does on the PyTorch path (the write is not silent)."""
    for on in (True, False):
        bb = backbone("mamba1")
        numba_on(on)
        state = bb.init_state(1)
        w = torch.ones_like(state.ssm, requires_grad=True)
        loss = (w * state.ssm).pow(2).sum()
        with torch.no_grad():
            bb.step(torch.randn(1, 64), state)
        with pytest.raises(RuntimeError, match="inplace"):
            loss.backward()


def test_numba_that_cannot_work_turns_the_compiled_steps_off(monkeypatch):
    """numba importable but failing (a read-only install with no cache folder raises at
    import): a warning, and the PyTorch bodies."""
    import importlib.abc
    import sys

    class Failing(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname == "mambakit.ops.cpu_jit.mamba1":
                raise RuntimeError("cannot cache function: no locator available")
            return None

    monkeypatch.setenv("MAMBAKIT_NUMBA", "1")
    monkeypatch.delitem(sys.modules, "mambakit.ops.cpu_jit.mamba1", raising=False)
    monkeypatch.delattr(cpu_jit, "mamba1", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Failing(), *sys.meta_path])
    cpu_jit.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="compiled CPU steps are off"):
            assert not cpu_jit.available()
        bb = backbone("mamba1")
        with torch.no_grad():
            out, _ = bb.step(torch.randn(1, 64), bb.init_state(1))
        assert torch.isfinite(out).all()
    finally:
        monkeypatch.undo()
        cpu_jit.available.cache_clear()


def lm(name: str, dtype=torch.float32, tie: bool = True) -> MambaLM:
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=128, n_layers=3, vocab_size=97, pad_vocab_size_multiple=1,
                      tie_embeddings=tie, **MIXERS[name])  # fmt: skip
    model = MambaLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture
def lm_compiled_calls(monkeypatch):
    """The compiled calls under `MambaLM.step` (rows returned or not)."""
    return _counted_compiled_rows(monkeypatch, "mambakit.model")


@pytest.mark.parametrize("name", list(MIXERS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("batch, tie", [(1, True), (3, False)], ids=["B1-tied", "B3-untied"])
def test_lm_step_compiled_equals_the_torch_step(name, dtype, batch, tie, numba_on,
                                                lm_compiled_calls):  # fmt: skip
    """`MambaLM.step` on token ids: the embedding rows, the compiled blocks and norm_f, the
    head row by row, against the same steps with numba off (the PyTorch bodies): logits
    and every state field over 6 tokens."""
    model = lm(name, dtype, tie)
    ids = torch.randint(0, 97, (6, batch))
    runs = []
    for on in (True, False):
        numba_on(on)
        drop(model)
        state = model.init_state(batch)
        with torch.no_grad():
            runs.append(([model.step(t, state)[0] for t in ids], state))
    assert lm_compiled_calls[: len(ids)] == [True] * len(ids)
    assert not any(lm_compiled_calls[len(ids) :])
    assert_close(runs[0], runs[1], 1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("name", list(MIXERS))
def test_lm_step_logits_of_a_row_do_not_depend_on_the_batch(name, numba_on, lm_compiled_calls):
    """Four rows stepped together give, bit for bit, what each gives stepped alone (as the
    server needs: a request's tokens must not depend on the requests beside it)."""
    model = lm(name)
    numba_on(True)
    ids = torch.randint(0, 97, (5, 4))
    with torch.no_grad():
        state = model.init_state(4)
        together = [model.step(t, state)[0] for t in ids]
        for row in range(4):
            alone = model.init_state(1)
            for t, want in zip(ids, together):
                assert torch.equal(model.step(t[row : row + 1], alone)[0][0], want[row])
    assert all(lm_compiled_calls)


@pytest.mark.parametrize("head", ["tied", "untied", "bias"])
def test_lm_step_leaves_the_parameters_resizable(head, numba_on, lm_compiled_calls):
    """The compiled step and head read the weights without marking their storage as never
    resizable (`.numpy()` on them would; FSDP frees and regrows a sharded parameter's), and
    a head with a bias gives the logits of nn.Linear on the same rows."""
    model = lm("mamba1", tie=head == "tied")
    if head == "bias":
        torch.manual_seed(1)
        model.lm_head = torch.nn.Linear(128, 97)
    numba_on(True)
    state = model.init_state(2)
    ids = torch.randint(0, 97, (3, 2))
    with torch.no_grad():
        got = [model.step(t, state)[0] for t in ids]
    assert lm_compiled_calls and all(lm_compiled_calls)
    numba_on(False)
    drop(model)
    state = model.init_state(2)
    with torch.no_grad():
        want = [model.step(t, state)[0] for t in ids]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for p in model.parameters():
        p.untyped_storage().resize_(0)  # raises where the storage was marked


def test_lm_step_ids_outside_the_vocabulary_raise_and_leave_the_state(numba_on):
    model = lm("mamba1")
    numba_on(True)
    state = model.init_state(2)
    with torch.no_grad():
        model.step(torch.tensor([3, 4]), state)
        before = state.clone()
        for bad in ([3, 97], [-1, 4]):
            with pytest.raises(ValueError, match="input_ids must lie in"):
                model.step(torch.tensor(bad), state)
            assert all(torch.equal(a, b) for a, b in zip(state._tensors(), before._tensors()))


def test_lm_step_records_a_trainable_head_and_refuses_a_misshapen_one(numba_on):
    """A frozen backbone under a trainable untied head (head-only fine-tuning): the step
    in grad mode gives logits whose gradient reaches the head, as with numba off. A head
    whose width is not the model's raises as nn.Linear does (not read past the rows)."""
    grads = []
    for on in (True, False):
        model = lm("mamba1", tie=False)
        numba_on(on)
        model.backbone.requires_grad_(False)
        state = model.init_state(2)
        logits = model.step(torch.tensor([3, 4]), state)[0]
        assert logits.requires_grad
        logits.square().sum().backward()
        grads.append(model.lm_head.weight.grad)
    assert rel(grads[0], grads[1]) < 1e-5
    model = lm("mamba1", tie=False)
    numba_on(True)
    model.lm_head = torch.nn.Linear(32, 97, bias=False)
    with torch.no_grad(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model.step(torch.tensor([3]), model.init_state(1))


def test_the_kernels_asked_for_by_name_keep_the_compiled_step_off(monkeypatch, numba_on):
    """MAMBAKIT_BACKEND read as the ops read it: "Triton" (any case) runs the kernels, not
    the compiled step; a value that names no backend is an error, not ignored."""
    model = lm("mamba1")
    numba_on(True)
    state, ids = model.init_state(1), torch.tensor([3])
    with torch.no_grad():
        monkeypatch.setenv("MAMBAKIT_BACKEND", " Triton")
        assert (
            cpu_step.compiled_rows(model.backbone, ids, state, model.backbone._stack_weights)
            is None
        )
        monkeypatch.setenv("MAMBAKIT_BACKEND", "bogus")
        with pytest.raises(ValueError, match="MAMBAKIT_BACKEND"):
            model.step(ids, state)
