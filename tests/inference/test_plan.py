"""The decode plan (`inference.plan`): what decode steps and no-grad forwards read, derived
from the parameters once, re-derived when one changes, refreshed in place for CUDA graphs
and never written into a parameter. The oracle is a fresh copy of the model, which has no
plan: every step and forward of the original must equal the copy's."""

from __future__ import annotations

import copy

import pytest
import torch

from mambakit import MambaBackbone, MambaConfig
from mambakit.inference.plan import derived, refresh


def backbone(dtype=torch.float32, n_layers=2) -> MambaBackbone:
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=16, n_layers=n_layers, d_state=4, input_dim=5)
    return MambaBackbone(cfg).to(dtype)


def step_plan(bb):
    return bb._decode_plan()


def test_a_plan_is_kept_until_a_parameter_or_its_key_changes():
    bb = backbone()
    builds = []

    def build(m):
        builds.append(1)
        return [torch.zeros(3)]

    def key(m):
        return [b.norm.eps for b in m.layers]

    first = derived(bb, "t", build, key)
    assert derived(bb, "t", build, key) is first and len(builds) == 1
    with torch.no_grad():
        bb.layers[1].mixer.out_proj.weight.add_(1.0)  # a version moves
    derived(bb, "t", build, key)
    assert len(builds) == 2
    bb.layers[0].norm.eps = 1e-3  # not a parameter: the key
    derived(bb, "t", build, key)
    assert len(builds) == 3
    bb.layers[0].mixer.D = torch.nn.Parameter(bb.layers[0].mixer.D.detach().clone())  # identity
    derived(bb, "t", build, key)
    assert len(builds) == 4
    assert derived(bb, "t", build, key) is not first and len(builds) == 4


def test_owned_tensors_are_refreshed_in_place_and_parameters_are_never_written():
    """bf16 weights: the plan's A, D and dt bias are f32 tensors it owns, refreshed in the
    same tensors (a captured graph reads those). f32 weights: D and the bias are the
    parameters themselves, no copies, so a graph reads them directly."""
    for dtype in (torch.bfloat16, torch.float32):
        bb = backbone(dtype)
        mixer = bb.layers[0].mixer
        w = step_plan(bb)[0]
        (A, D, bias) = (w.A, w.D, w.dt_bias)
        assert A.dtype == D.dtype == bias.dtype == torch.float32
        if dtype == torch.float32:
            assert D is mixer.D and bias is mixer.dt_proj.bias
        else:
            assert D.data_ptr() != mixer.D.data_ptr()
        with torch.no_grad():
            mixer.A_log.add_(0.25)
            mixer.D.mul_(2.0)
            mixer.dt_proj.bias.sub_(1.0)
        D_now = mixer.D.detach().clone()
        w2 = step_plan(bb)[0]
        (A2, D2, bias2) = (w2.A, w2.D, w2.dt_bias)
        assert A2 is A and D2 is D and bias2 is bias  # the same tensors, new values
        torch.testing.assert_close(A, -torch.exp(mixer.A_log.float()), rtol=0, atol=0)
        torch.testing.assert_close(D, mixer.D.float(), rtol=0, atol=0)
        torch.testing.assert_close(bias, mixer.dt_proj.bias.float(), rtol=0, atol=0)
        assert torch.equal(mixer.D, D_now)  # the refresh wrote nothing into a parameter


def test_parameters_moved_to_new_storage_are_followed_and_the_old_storage_left_alone():
    """`p.data = other` (a weight swap, `vector_to_parameters`) keeps each parameter but
    moves its storage: the plan's views of the old storage are not its own, so the next
    derivation must take new views, never copy into the old storage (someone else's)."""
    for dtype in (torch.float32, torch.bfloat16):
        bb = backbone(dtype)
        x = torch.randn(2, 5, dtype=dtype)
        with torch.no_grad():
            bb.step(x, bb.init_state(2))  # plans made on the first storages
            bb(x[:, None])
        params = list(bb.parameters())
        backup = [p.data for p in params]
        saved = [b.clone() for b in backup]
        for p in params:
            p.data = p.data + 0.05 * torch.randn_like(p)
        fresh = copy.deepcopy(bb)
        with torch.no_grad():
            y1, _ = bb.step(x, bb.init_state(2))
            y2, _ = fresh.step(x, fresh.init_state(2))
            assert torch.equal(y1, y2)
            assert torch.equal(bb(x[:, None])[0], fresh(x[:, None])[0])
        for b, s in zip(backup, saved):
            assert torch.equal(b, s)  # the old storages are as they were


def test_a_replaced_parameter_is_not_written_into():
    """A parameter replaced while the old one lives on (an optimizer holds it): the plan
    follows the new one and leaves the old one as it was."""
    bb = backbone()
    mixer = bb.layers[0].mixer
    D_plan = step_plan(bb)[0].D
    old = mixer.D
    assert D_plan.data_ptr() == old.data_ptr()
    before = old.detach().clone()
    mixer.D = torch.nn.Parameter(old.detach() + 7.0)
    assert torch.equal(step_plan(bb)[0].D, mixer.D)
    assert torch.equal(old, before)


def test_refresh_brings_every_plan_up_to_date_in_its_tensors():
    """`refresh` (before a graph replay, where no Python runs) re-derives the plans of a
    model and of its submodules into the tensors a graph would have captured: the no-grad
    forward's (prefill graphs) and the step's (decode graphs)."""
    from mambakit.inference import plan as plan_module

    bb = backbone(torch.bfloat16)
    with torch.no_grad():
        bb(torch.randn(2, 3, 5, dtype=torch.bfloat16))  # the forward's plan
        bb.step(torch.randn(2, 5, dtype=torch.bfloat16), bb.init_state(2))  # the step's
    plans = plan_module._PLANS[id(bb)]
    forward_A = [ssm[0] for ssm in plans["forward"].value]
    step_A = [w.A for w in plans["step"].value]
    with torch.no_grad():
        for layer in bb.layers:
            layer.mixer.A_log.add_(0.5)
    refresh(torch.nn.Sequential(bb))
    for i, layer in enumerate(bb.layers):
        want = -torch.exp(layer.mixer.A_log.float())
        assert plans["forward"].value[i][0] is forward_A[i]
        assert plans["step"].value[i].A is step_A[i]
        torch.testing.assert_close(forward_A[i], want, rtol=0, atol=0)
        torch.testing.assert_close(step_A[i], want, rtol=0, atol=0)


def test_steps_and_forwards_follow_parameter_updates():
    """After in-place updates (an optimizer step) every no-grad path equals a fresh copy of
    the model: the reference decode, the per-layer step and the forward."""
    for dtype in (torch.float32, torch.bfloat16):
        bb = backbone(dtype)
        x = torch.randn(3, 4, 5, dtype=dtype)
        with torch.no_grad():
            state = bb.init_state(3)
            bb.step(x[:, 0], state)  # plans made
            bb(x)
            for p in bb.parameters():
                p.add_(0.01 * torch.randn_like(p))
            fresh = copy.deepcopy(bb)
            s1, s2 = bb.init_state(3), fresh.init_state(3)
            for t in range(4):
                y1, _ = bb.step(x[:, t], s1)
                y2, _ = fresh.step(x[:, t], s2)
                assert torch.equal(y1, y2), (dtype, t)
            assert torch.equal(bb(x)[0], fresh(x)[0])


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "mamba3"])
def test_steps_and_forwards_follow_a_fused_optimizer_step(mixer):
    """A user's own loop with a fused optimizer (`AdamW(fused=True)`), whose kernels write
    the parameters without moving their versions: every no-grad path afterwards equals a
    fresh copy of the model (it read the plans derived before the step: A from the old
    A_log, logits off by O(1))."""
    torch.manual_seed(0)
    kw = {} if mixer == "mamba1" else dict(headdim=8)
    cfg = MambaConfig(d_model=16, n_layers=2, d_state=4, input_dim=5, mixer=mixer, **kw)
    bb = MambaBackbone(cfg)
    opt = torch.optim.AdamW(bb.parameters(), lr=0.05, fused=True)
    x = torch.randn(3, 4, 5)
    with torch.no_grad():
        bb.step(x[:, 0], bb.init_state(3))  # plans made
        bb(x)
    bb(x)[0].square().sum().backward()
    opt.step()
    fresh = copy.deepcopy(bb)
    with torch.no_grad():
        assert torch.equal(bb(x)[0], fresh(x)[0])
        s1, s2 = bb.init_state(3), fresh.init_state(3)
        for t in range(4):
            y1, _ = bb.step(x[:, t], s1)
            y2, _ = fresh.step(x[:, t], s2)
            assert torch.equal(y1, y2), t


def test_a_compiled_fused_optimizer_step_is_followed_and_other_models_are_left_alone():
    """The hook after a fused step runs after a compiled one too (traced, it moved no
    version), and moves the versions of watched parameters only: a model without plans in
    the same process keeps its versions, so a second backward through a graph that saved
    its parameters still runs after a fused step, as it did without mambakit."""
    torch.manual_seed(0)
    bb = backbone()
    opt = torch.optim.AdamW(bb.parameters(), lr=0.05, fused=True)
    step = torch.compile(opt.step)
    x = torch.randn(2, 5)
    with torch.no_grad():
        bb.step(x, bb.init_state(2))  # plans made
    bb(x[:, None])[0].square().sum().backward()
    step()
    fresh = copy.deepcopy(bb)
    with torch.no_grad():
        y1, _ = bb.step(x, bb.init_state(2))
        y2, _ = fresh.step(x, fresh.init_state(2))
    assert torch.equal(y1, y2)
    other = torch.nn.Linear(3, 3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1, fused=True)
    loss = other(torch.randn(2, 3, requires_grad=True)).square().sum()  # saves the weight
    loss.backward(retain_graph=True)
    other_opt.step()
    loss.backward()  # raises if the step had moved the weight's version


def test_a_model_with_plans_copies_and_pickles_without_them(tmp_path):
    """Plans live beside the model: torch.save of the whole module and copy.deepcopy (an
    RL target network) carry none, and the copy derives its own, equal ones; updating the
    copy leaves the original's plan alone."""
    bb = backbone()
    x = torch.randn(2, 5)
    with torch.no_grad():
        y0, _ = bb.step(x, bb.init_state(2))
    A = step_plan(bb)[0].A
    torch.save(bb, tmp_path / "bb.pt")  # raises if the module holds a weak reference
    c = copy.deepcopy(bb)
    A_c = step_plan(c)[0].A
    assert A_c is not A and torch.equal(A_c, A)
    with torch.no_grad():
        c.layers[0].mixer.D.add_(1.0)
        c.layers[0].mixer.A_log.add_(1.0)
        y_c, _ = c.step(x, c.init_state(2))
        y, _ = bb.step(x, bb.init_state(2))
    assert not torch.equal(y_c, y0) and torch.equal(y, y0)
    assert step_plan(bb)[0].A is A and torch.equal(A, -torch.exp(bb.layers[0].mixer.A_log))


def test_plans_die_with_their_model():
    import gc

    from mambakit.inference import plan as plan_module

    bb = backbone()
    with torch.no_grad():
        bb.step(torch.randn(2, 5), bb.init_state(2))
    refresh(bb)
    key = id(bb)
    assert key in plan_module._PLANS and key in plan_module._ROOTS
    del bb
    gc.collect()
    assert key not in plan_module._PLANS and key not in plan_module._ROOTS


def test_clear_cuda_graphs_drops_the_plans():
    """The step plan holds views of the weights: `clear_cuda_graphs` lets them go, so a
    model moved elsewhere frees its old storage; the next step derives anew."""
    from mambakit.inference import clear_cuda_graphs
    from mambakit.inference import plan as plan_module

    bb = backbone()
    x = torch.randn(2, 5)
    with torch.no_grad():
        y, _ = bb.step(x, bb.init_state(2))
    assert id(bb) in plan_module._PLANS
    clear_cuda_graphs(bb)
    assert id(bb) not in plan_module._PLANS
    with torch.no_grad():
        y2, _ = bb.step(x, bb.init_state(2))
    assert torch.equal(y, y2) and id(bb) in plan_module._PLANS


def _plan_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _plan_tensors(v)]
    return []


STEP_MIXERS = {"mamba1": {}, "mamba2": dict(headdim=8), "mamba3": dict(headdim=8)}


def test_the_step_plan_follows_each_parameter_alone():
    """The step plan holds most weights as views of the parameters (`derived(in_place=True)`):
    an update of one of those is read through the view, the plan kept; an update of one it
    derives from (A_log, or D in bf16) derives it again, also where all parameters share one
    storage. The oracle: after an in-place update of any one parameter, the plan equals one
    built from scratch, and a step (the compiled CPU body on its own plan, and the per-layer
    bodies on this one) equals a fresh copy's."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from mambakit.backbone import _step_plan
    from mambakit.inference.plan import record

    for mixer, extra in STEP_MIXERS.items():
        for dtype, flat in ((torch.float32, False), (torch.bfloat16, False),
                            (torch.float64, False), (torch.float32, True)):  # fmt: skip
            torch.manual_seed(0)
            cfg = MambaConfig(d_model=16, n_layers=2, d_state=4, input_dim=5, mixer=mixer,
                              **extra)  # fmt: skip
            bb = MambaBackbone(cfg).to(dtype)
            if flat:  # every parameter a piece of one storage
                flat_params = parameters_to_vector(bb.parameters()).detach().clone()
                vector_to_parameters(flat_params, bb.parameters())
            x = torch.randn(2, 5, dtype=dtype)
            kept = rederived = 0
            with torch.no_grad():
                for name, p in bb.named_parameters():
                    bb._decode_plan()
                    before = record(bb, "step")
                    p.add_(0.125 * torch.randn_like(p))
                    value = bb._decode_plan()
                    if record(bb, "step") is before:
                        kept += 1
                    else:
                        rederived += 1
                    got, want = _plan_tensors(value), _plan_tensors(_step_plan(bb))
                    assert len(got) == len(want), (mixer, dtype, name)
                    for a, b in zip(got, want):
                        assert torch.equal(a, b), (mixer, dtype, name)
                    fresh = copy.deepcopy(bb)
                    s1, s2 = bb.init_state(2), fresh.init_state(2)
                    for _ in range(2):
                        y1, _ = bb.step(x, s1, cuda_graph=False)
                        y2, _ = fresh.step(x, s2, cuda_graph=False)
                        assert torch.equal(y1, y2), (mixer, dtype, name)
            # the GEMM weights are views: kept; A_log at least is derived from
            assert kept >= 4 and rederived >= 1, (mixer, dtype, kept, rederived)
