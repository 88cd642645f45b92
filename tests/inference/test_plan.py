"""The decode plan (`inference.plan`): what decode steps and no-grad forwards read, derived
from the parameters once, re-derived when one changes, refreshed in place for CUDA graphs
and never written into a parameter. The oracle is a fresh copy of the model, which has no
plan: every step and forward of the original must equal the copy's."""

from __future__ import annotations

import copy

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
    parameters themselves, which a refresh must leave alone."""
    for dtype in (torch.bfloat16, torch.float32):
        bb = backbone(dtype)
        mixer = bb.layers[0].mixer
        (A, D, bias) = step_plan(bb)[0][0].ssm
        assert A.dtype == D.dtype == bias.dtype == torch.float32
        assert (D.data_ptr() == mixer.D.data_ptr()) == (dtype == torch.float32)
        D0 = mixer.D.detach().clone()
        with torch.no_grad():
            mixer.A_log.add_(0.25)
            mixer.dt_proj.bias.sub_(1.0)
        (A2, D2, bias2) = step_plan(bb)[0][0].ssm
        assert A2 is A  # owned: refreshed in place
        torch.testing.assert_close(A, -torch.exp(mixer.A_log.float()), rtol=0, atol=0)
        torch.testing.assert_close(bias2, mixer.dt_proj.bias.float(), rtol=0, atol=0)
        assert torch.equal(mixer.D, D0)  # nothing written into a parameter
        assert bias2 is bias  # bf16: refreshed in place; f32: the parameter itself


def test_a_replaced_parameter_is_not_written_into():
    """A parameter replaced while the old one lives on (an optimizer holds it): the plan
    follows the new one and leaves the old one as it was."""
    bb = backbone()
    mixer = bb.layers[0].mixer
    D_plan = step_plan(bb)[0][0].ssm[1]
    old = mixer.D
    assert D_plan.data_ptr() == old.data_ptr()
    before = old.detach().clone()
    mixer.D = torch.nn.Parameter(old.detach() + 7.0)
    assert torch.equal(step_plan(bb)[0][0].ssm[1], mixer.D)
    assert torch.equal(old, before)


def test_refresh_brings_every_plan_up_to_date_in_its_tensors():
    """`refresh` (before a graph replay, where no Python runs) re-derives the plans of a
    model and of its submodules into the tensors a graph would have captured."""
    bb = backbone(torch.bfloat16)
    with torch.no_grad():
        bb(torch.randn(2, 3, 5, dtype=torch.bfloat16))  # a no-grad forward makes the plan
    cached = [layer[0].ssm[0] for layer in step_plan(bb)]
    with torch.no_grad():
        for layer in bb.layers:
            layer.mixer.A_log.add_(0.5)
    outer = torch.nn.Sequential(bb)
    refresh(outer)
    from mambakit.inference import plan as plan_module

    now = plan_module._PLANS[id(bb)]["step"].value
    for layer, A, (w, _) in zip(bb.layers, cached, now):
        assert w.ssm[0] is A
        torch.testing.assert_close(A, -torch.exp(layer.mixer.A_log.float()), rtol=0, atol=0)


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


def test_a_model_with_plans_copies_and_pickles_without_them(tmp_path):
    """Plans live beside the model, keyed weakly: torch.save of the whole module and
    copy.deepcopy (an RL target network) carry none, and the copy derives its own."""
    bb = backbone()
    with torch.no_grad():
        bb.step(torch.randn(2, 5), bb.init_state(2))
    A = step_plan(bb)[0][0].ssm[0]
    c = copy.deepcopy(bb)
    torch.save(bb, tmp_path / "bb.pt")
    assert (tmp_path / "bb.pt").stat().st_size > 0
    A_c = step_plan(c)[0][0].ssm[0]
    assert A_c is not A and torch.equal(A_c, A)


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
