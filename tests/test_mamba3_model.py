"""Mamba-3 models (MambaConfig(mixer="mamba3")): the invariances of Mamba-1 models, on the CPU.

step() T times == one forward; chunks with carried state == the whole sequence (values and
gradients); packed documents == each alone; TBPTT over packed rows == full BPTT; greedy
generate == argmax of full forwards; the Trainer learns.
"""

import json
import math

import pytest
import torch

from mambakit import Mamba3ModelState, MambaConfig, MambaLM, MambaState
from mambakit.inference import generate
from mambakit.training import TrainConfig, Trainer

V = 32


def lm(seed=0, double=True, **kw) -> MambaLM:
    torch.manual_seed(seed)
    cfg = dict(d_model=16, n_layers=2, vocab_size=V, pad_vocab_size_multiple=1, mixer="mamba3",
               d_state=8, headdim=8, ngroups=2, chunk_size=4)  # fmt: skip
    model = MambaLM(MambaConfig(**{**cfg, **kw}))
    with torch.no_grad():  # off the initial values (B/C biases of ones, D of ones)
        for name, p in model.named_parameters():
            if "bias" in name or name.endswith(".D"):
                p.add_(0.2 * torch.randn_like(p))
    return model.double() if double else model


def test_config_presets_and_validation():
    cfg = MambaConfig.preset("130m-mamba3")
    assert (cfg.mixer, cfg.d_state, cfg.headdim, cfg.nheads, cfg.n_angles) == (
        "mamba3",
        128,
        64,
        24,
        32,
    )
    assert MambaConfig.preset("tiny-mamba3").mixer == "mamba3"
    with pytest.raises(ValueError, match="mixer"):
        MambaConfig(mixer="mamba4")
    with pytest.raises(ValueError, match="headdim"):
        MambaConfig(d_model=20, mixer="mamba3", headdim=16)
    assert MambaConfig.from_dict(cfg.to_dict()) == cfg


def test_step_loop_equals_forward():
    model = lm().eval()
    ids = torch.randint(0, V, (2, 11))
    out = model(ids)
    state = model.init_state(2)
    assert isinstance(state, Mamba3ModelState)
    with torch.no_grad():
        steps = torch.stack([model.step(ids[:, t], state)[0] for t in range(11)], 1)
    torch.testing.assert_close(steps, out.logits, rtol=1e-10, atol=1e-10)
    for name in ("angle", "ssm", "k", "x"):
        torch.testing.assert_close(getattr(state, name), getattr(out.state, name))


def test_chunks_with_carried_state_equal_the_whole():
    model = lm()
    ids = torch.randint(0, V, (2, 13))
    whole = model(ids)
    whole.logits.pow(2).mean().backward()
    g_whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g.abs().sum() > 0 for g in g_whole.values())
    model.zero_grad()
    a = model(ids[:, :6])
    b = model(ids[:, 6:], state=a.state)
    logits = torch.cat([a.logits, b.logits], 1)
    torch.testing.assert_close(logits, whole.logits, rtol=1e-10, atol=1e-10)
    logits.pow(2).mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_whole[n], rtol=1e-8, atol=1e-12, msg=n)


def test_packed_documents_equal_each_alone():
    model = lm().eval()
    ids = torch.randint(0, V, (1, 12))
    seq_idx = torch.tensor([[0] * 4 + [1] * 8], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, seq_idx=seq_idx).logits
        torch.testing.assert_close(packed[:, :4], model(ids[:, :4]).logits)
        torch.testing.assert_close(packed[:, 4:], model(ids[:, 4:]).logits)


def test_state_reset_and_type_checks():
    model = lm().eval()
    state = model.init_state(3)
    with torch.no_grad():
        model.step(torch.tensor([1, 2, 3]), state)
    assert state.ssm[:, 1].abs().sum() > 0
    state.reset_(torch.tensor([False, True, False]))
    assert state.ssm[:, 1].abs().sum() == 0 and state.angle[:, 1].abs().sum() == 0
    assert state.ssm[:, 0].abs().sum() > 0
    with pytest.raises(TypeError, match="Mamba3ModelState"):
        model(torch.randint(0, V, (3, 2)), state=MambaState.zeros(2, 3, 32, 8, 4))
    bad = state.clone()
    bad.k = bad.k[:, :, :, :-1]
    with pytest.raises(ValueError, match="state.k"):
        model(torch.randint(0, V, (3, 2)), state=bad)


def test_greedy_generate_equals_argmax_of_full_forwards():
    model = lm(double=False).eval()
    ids = torch.randint(0, V, (2, 5))
    got = generate(model, ids, max_new_tokens=6, temperature=0)
    x = ids
    with torch.no_grad():
        for _ in range(6):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, x)


def test_tbptt_over_packed_documents_equals_full_bptt():
    """Trainer TBPTT chunks carry the Mamba-3 state and reset it at document starts."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 25), generator=g)
    seq_idx = torch.tensor([[0] * 13 + [1] * 12, [0] * 8 + [1] * 17], dtype=torch.int32)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "seq_idx": seq_idx[:, :-1]}
    results = []
    for kw in ({}, dict(tbptt_len=8, tbptt_grad_chunks=0)):
        model = lm()
        cfg = TrainConfig(steps=1, batch_size=2, seqlen=24, warmup_steps=0, device="cpu", **kw)
        trainer = Trainer(model, cfg, None, log=lambda s: None)
        loss = float(trainer._forward_backward([batch]))
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert l1 == pytest.approx(l0, rel=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-8, atol=1e-12, msg=n)


def test_trainer_learns_a_repeating_pattern():
    g = torch.Generator().manual_seed(0)
    pattern = torch.randperm(V, generator=g)[:7]
    stream = pattern.repeat(200)

    class Stream:
        def next(self):
            starts = torch.randint(0, 7 * 150, (4,), generator=g)
            rows = torch.stack([stream[s : s + 25] for s in starts.tolist()])
            return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    model = lm(double=False, d_model=32)
    cfg = TrainConfig(steps=30, batch_size=4, seqlen=24, lr=2e-2, warmup_steps=5, device="cpu")
    trainer = Trainer(model, cfg, Stream(), log=lambda s: None)
    losses = [float(trainer.train_step()[0]) for _ in range(30)]
    assert losses[0] > 0.9 * math.log(V)
    assert sum(losses[-3:]) / 3 < 0.3 * losses[0], losses


def test_save_and_load_round_trip(tmp_path):
    model = lm(double=False).eval()
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "mambakit_mamba3" and cfg["head_dim"] == 8
    back = MambaLM.from_pretrained(tmp_path)
    assert back.config.mixer == "mamba3" and back.config.ngroups == 2
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert set(model.state_dict()) == set(back.state_dict())


@pytest.mark.parametrize("batch", [1, 3])
def test_triton_decode_blocks_equal_reference(monkeypatch, batch):
    """A decode step's Triton path (interpreter on the CPU): the add, the norm and in_proj
    as one streaming kernel that also stores the residual (batch 1; above, a norm launch
    first), the step kernel, out_proj. Logits and every state field over 5 tokens equal the
    reference backend's, and the kernel path ran once a layer and token."""
    from mambakit.ops.mamba_step import launch

    model = lm(double=False, d_state=6).eval()  # odd pairs: 3 of them, n_angles 1
    ids = torch.randint(0, V, (batch, 5))
    calls = []
    linear = launch.linear
    monkeypatch.setattr(
        launch, "linear", lambda *a, **k: calls.append(k.get("return_residual")) or linear(*a, **k)
    )
    runs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
        state = model.init_state(batch)
        with torch.no_grad():
            logits = torch.stack([model.step(ids[:, t], state)[0] for t in range(5)], 1)
        runs[backend] = logits, state
    # a token: in_proj (with the residual) and out_proj in each layer, the LM head
    assert calls.count(True) == 5 * 2 and calls.count(None) == 5 * 3
    (ref, ref_state), (got, state) = runs["reference"], runs["triton"]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for name in ("ssm", "k", "x"):
        torch.testing.assert_close(getattr(state, name), getattr(ref_state, name), rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
    for f in (torch.cos, torch.sin):
        torch.testing.assert_close(f(state.angle), f(ref_state.angle), rtol=1e-4, atol=1e-5)


# --- GPU: the decode step kernel and graph replay ---------------------------------------


@pytest.mark.gpu
def test_cuda_step_kernel_equals_forward_and_graph_replay_equals_eager(monkeypatch):
    """On CUDA the forward runs ops/mamba3/chunk.py's kernels (fused outside autograd, with
    the backward kernel under it) and the decode step ops/mamba3/step.py's: both forwards
    and the loss gradients equal the reference backend's, T steps equal one forward, and
    greedy generation replayed from a CUDA graph equals eager generation token for token."""
    model = lm(double=False, d_model=64, headdim=16, d_state=16).cuda().eval()
    ids = torch.randint(0, V, (3, 37), device="cuda")
    runs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
        model.zero_grad(set_to_none=True)
        out = model(ids)  # parameters require grad: the differentiable path
        out.logits.float().logsumexp(-1).mean().backward()
        runs[backend] = (out.logits.detach(), {k: p.grad for k, p in model.named_parameters()})
    monkeypatch.delenv("MAMBAKIT_BACKEND")
    with torch.no_grad():
        out = model(ids)
    ref_logits, ref_grads = runs["reference"]
    torch.testing.assert_close(out.logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runs["triton"][0], ref_logits, rtol=1e-4, atol=1e-4)
    for k, g in ref_grads.items():
        torch.testing.assert_close(runs["triton"][1][k], g, rtol=1e-3, atol=1e-5, msg=k)
    ids = ids[:, :13]
    with torch.no_grad():
        out = model(ids)
        state = model.init_state(3)
        steps = torch.stack([model.step(ids[:, t], state)[0] for t in range(13)], 1)
    torch.testing.assert_close(steps, out.logits, rtol=1e-4, atol=1e-4)
    for name in ("ssm", "k", "x"):
        torch.testing.assert_close(getattr(state, name), getattr(out.state, name), rtol=1e-4,
                                   atol=1e-4)  # fmt: skip
    for f in (torch.cos, torch.sin):  # angles mod 2 pi: compared where they wrap, too
        torch.testing.assert_close(f(state.angle), f(out.state.angle), rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # batch 1: in_proj and out_proj stream their weights, chained by PDL
        state = model.init_state(1)
        steps = torch.stack([model.step(ids[:1, t], state)[0] for t in range(13)], 1)
    torch.testing.assert_close(steps, out.logits[:1], rtol=1e-4, atol=1e-4)
    eager = generate(model, ids, max_new_tokens=32, temperature=0, cuda_graph=False)
    graph = generate(model, ids, max_new_tokens=32, temperature=0, cuda_graph=True)
    torch.testing.assert_close(graph, eager, rtol=0, atol=0)
