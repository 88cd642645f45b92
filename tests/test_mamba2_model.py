"""Mamba-2 models (MambaConfig(mixer="mamba2"), the `tiny-mamba2` preset made small): the
model API of the other mixers, on the CPU.

Full forward == TBPTT chunks with the state carried (loss, logits, final state, every
gradient); step() T times == one forward; `last_logits` == the forward's last row; greedy
generate == argmax of full forwards, stream == generate; packed documents == each alone;
Mamba2ModelState's reset_ / detach / clone and checks; a float64 model keeps a float64 state;
MambaBackbone on float inputs; the Trainer's TBPTT == full BPTT and it learns with its state
carried across windows. `-m gpu`: the kernels' forward and gradients against the reference
backend, and greedy decode replayed from a CUDA graph == eager.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mambakit import Mamba2ModelState, Mamba2State, MambaBackbone, MambaConfig, MambaLM
from mambakit.inference import generate
from mambakit.training import TrainConfig, Trainer

V = 32
SMALL = dict(n_layers=2, d_model=16, vocab_size=V, pad_vocab_size_multiple=1, d_state=8,
             headdim=8, ngroups=2, chunk_size=4)  # fmt: skip


def config(**kw) -> MambaConfig:
    return MambaConfig.preset("tiny-mamba2", **{**SMALL, **kw})


def off_init_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every mixer parameter away from its initial value (D and norm weights of ones, conv
    bias of zeros would hide a dropped or swapped term)."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g).to(p)
            if name.endswith((".D", "norm.weight", "conv1d.bias")):
                p.add_(0.3 * noise)
            elif name.endswith("dt_bias"):
                p.add_(0.5 * noise)
    return model


def lm(seed=0, double=True, **kw) -> MambaLM:
    torch.manual_seed(seed)
    model = off_init_(MambaLM(config(**kw)), seed)
    return model.double() if double else model


def random_state(model, batch: int, seed: int = 1) -> Mamba2ModelState:
    g = torch.Generator().manual_seed(seed)
    s = model.init_state(batch)
    return Mamba2ModelState(*(0.5 * torch.randn(t.shape, generator=g).to(t) for t in s._tensors()))


def test_preset_and_config():
    cfg = MambaConfig.preset("tiny-mamba2")
    assert (cfg.mixer, cfg.d_model, cfg.n_layers, cfg.d_state, cfg.headdim) == (
        "mamba2", 192, 4, 32, 32)  # fmt: skip
    assert (cfg.nheads, cfg.conv_dim, cfg.ngroups, cfg.chunk_size) == (12, 384 + 64, 1, 256)
    cfg = MambaConfig.preset("130m-mamba2")
    assert (cfg.d_model, cfg.n_layers, cfg.d_state, cfg.headdim, cfg.nheads) == (
        768, 24, 128, 64, 24)  # fmt: skip
    assert cfg.vocab_size == 50288  # 50277 padded to a multiple of 16
    small = config(d_ssm=16, dt_limit=(0.01, 0.5), D_has_hdim=True)
    assert MambaConfig.from_dict(json.loads(json.dumps(small.to_dict()))) == small
    assert MambaConfig.from_dict(json.loads(json.dumps(config().to_dict()))) == config()
    for kw, match in [
        (dict(headdim=5), "headdim"),
        (dict(ngroups=3), "ngroups"),
        (dict(d_ssm=48), "d_ssm"),
        (dict(dt_limit=(0.2, 0.1)), "dt_limit"),
        (dict(A_init_range=(2.0, 1.0)), "A_init_range"),
        (dict(conv_init=-1.0), "conv_init"),
    ]:
        with pytest.raises(ValueError, match=match):
            config(**kw)


def test_forward_fields_state_shapes_and_dtypes():
    model = lm(double=False)
    ids = torch.randint(0, V, (3, 7))
    out = model(ids, labels=ids)
    assert out.logits.shape == (3, 7, V) and math.isfinite(float(out.loss.detach()))
    st = out.state
    assert isinstance(st, Mamba2ModelState)
    # L 2, K-1 3, C = 32 + 2 * 2 * 8, H 4 of P 8, N 8
    assert st.conv.shape == (2, 3, 3, 64) and st.ssm.shape == (2, 3, 4, 8, 8)
    assert st.dtype == torch.float32 and model.init_state(3).dtype == torch.float32
    assert isinstance(st.layer(1), Mamba2State) and st.layer(1).ssm.shape == (3, 4, 8, 8)
    model = model.double()
    assert model.init_state(2).dtype == torch.float64
    out = model(ids[:2], state=model.init_state(2))
    assert out.state.ssm.dtype == out.state.conv.dtype == torch.float64
    assert out.logits.dtype == torch.float64


@pytest.mark.parametrize("splits", [(6, 1, 6), (2, 11)], ids=["6-1-6", "2-11"])
def test_chunks_with_carried_state_equal_the_whole(splits):
    """TBPTT's invariance (float64): logits, the next-token loss (targets shifted across the
    chunk boundaries), the final state and every parameter's and the initial state's
    gradient of chunks with the state carried equal one forward's; `loss_sum` in chunks
    (what the Trainer calls) gives the whole loss."""
    model = lm()
    T = sum(splits)
    ids = torch.randint(0, V, (2, T))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    s0 = random_state(model, 2)
    w = torch.randn(2, T, V, dtype=torch.float64)

    def run(pieces):
        model.zero_grad()
        st = s0.clone()
        for t in st._tensors():
            t.requires_grad_()
        state, logits, start = st, [], 0
        for n in pieces:
            out = model(ids[:, start : start + n], state=state)
            logits.append(out.logits)
            state, start = out.state, start + n
        logits = torch.cat(logits, 1)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        ((logits * w).sum() + state.ssm.sum() + state.conv.sum() + loss).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        grads.update({f"s0.{k}": t.grad for k, t in st._items()})
        with torch.no_grad():
            state, total, start = s0.clone(), 0.0, 0
            for n in pieces:
                part, state = model.loss_sum(ids[:, start : start + n],
                                             targets[:, start : start + n], state)  # fmt: skip
                total, start = total + part, start + n
        return logits.detach(), loss.detach(), total, state.detach(), grads

    whole = run([T])
    chunks = run(splits)
    torch.testing.assert_close(chunks[0], whole[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(chunks[1], whole[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(chunks[2], whole[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(whole[2], whole[1], rtol=1e-10, atol=1e-10)
    for name in ("conv", "ssm"):
        torch.testing.assert_close(getattr(chunks[3], name), getattr(whole[3], name),
                                   rtol=1e-10, atol=1e-10)  # fmt: skip
    assert all(g.abs().sum() > 0 for g in whole[4].values())
    for k, g in whole[4].items():
        torch.testing.assert_close(chunks[4][k], g, rtol=1e-8, atol=1e-11, msg=k)


@pytest.mark.parametrize("double", [True, False], ids=["f64", "f32"])
def test_step_loop_equals_forward(double):
    """Decode steps (no autograd: the state advanced in place, its buffers kept) equal one
    forward from the same random state; a step with autograd on is functional."""
    model = lm(double=double).eval()
    tol = dict(rtol=1e-10, atol=1e-10) if double else dict(rtol=1e-4, atol=1e-5)
    ids = torch.randint(0, V, (2, 9))
    s0 = random_state(model, 2)
    with torch.no_grad():
        out = model(ids, state=s0.clone())
        state = s0.clone()
        ptrs = [t.data_ptr() for t in state._tensors()]
        steps = []
        for t in range(9):
            logits, st = model.step(ids[:, t], state)
            assert st is state
            steps.append(logits)
    assert [t.data_ptr() for t in state._tensors()] == ptrs
    torch.testing.assert_close(torch.stack(steps, 1), out.logits, **tol)
    torch.testing.assert_close(state.conv, out.state.conv, **tol)
    torch.testing.assert_close(state.ssm, out.state.ssm, **tol)
    state = s0.clone()
    logits, new = model.step(ids[:, 0], state)  # parameters require grad: functional
    assert logits.requires_grad and new is not state and torch.equal(state.ssm, s0.ssm)
    torch.testing.assert_close(logits.detach(), out.logits[:, 0], **tol)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_last_logits_equal_the_forwards_last_row(backend, monkeypatch):
    """A prefill's `last_logits` (norm_f and the head on the last row only; fused on the
    Triton backend) gives the forward's last logits and final state, with and without
    packed documents."""
    model = lm(double=False).eval()
    ids = torch.randint(0, V, (2, 9))
    seq_idx = (torch.arange(9) >= 4).int().expand(2, 9).contiguous()
    for seq in (None, seq_idx):
        with torch.no_grad():
            out = model(ids, seq_idx=seq)
            monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
            last, state = model.last_logits(ids, seq_idx=seq)
            monkeypatch.delenv("MAMBAKIT_BACKEND")
        assert last.shape == (2, V)
        torch.testing.assert_close(last, out.logits[:, -1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.ssm, out.state.ssm, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.conv, out.state.conv, rtol=1e-4, atol=1e-5)
    graded, _ = model.last_logits(ids)  # autograd on: the unfused path
    assert graded.requires_grad
    with torch.no_grad():
        whole = model(ids).logits[:, -1]
    torch.testing.assert_close(graded.detach(), whole, rtol=1e-4, atol=1e-5)


def test_greedy_generate_equals_argmax_and_stream_equals_generate():
    model = lm(double=False).eval()
    ids = torch.randint(0, V, (2, 5))
    got = generate(model, ids, max_new_tokens=6, temperature=0)
    x = ids
    with torch.no_grad():
        for _ in range(6):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, x)
    assert torch.equal(model.generate(ids, 6, temperature=0), got)
    toks = list(model.stream(ids, max_new_tokens=6, temperature=0))
    assert len(toks) == 6 and all(t.shape == (2,) for t in toks)
    assert torch.equal(torch.stack(toks, 1), got[:, 5:])
    kw = dict(max_new_tokens=6, temperature=0.8, top_k=10, seed=3)
    sampled = model.generate(ids, **kw)
    assert torch.equal(torch.stack(list(model.stream(ids, **kw)), 1), sampled[:, 5:])


def test_packed_documents_equal_each_alone():
    model = lm().eval()
    ids = torch.randint(0, V, (2, 12))
    seq_idx = torch.tensor([[0] * 4 + [1] * 6 + [2] * 2, [0] * 1 + [1] * 11], dtype=torch.int32)
    with torch.no_grad():
        out = model(ids, seq_idx=seq_idx)
        for b, bounds in enumerate([[0, 4, 10, 12], [0, 1, 12]]):
            for s, e in zip(bounds[:-1], bounds[1:]):
                alone = model(ids[b : b + 1, s:e])
                torch.testing.assert_close(out.logits[b : b + 1, s:e], alone.logits)
            for name in ("conv", "ssm"):  # the final state is the last document's
                torch.testing.assert_close(getattr(out.state, name)[:, b : b + 1],
                                           getattr(alone.state, name))  # fmt: skip


def test_batch_row_alone_equals_the_row_in_the_batch():
    model = lm().eval()
    ids = torch.randint(0, V, (3, 8))
    s0 = random_state(model, 3)
    with torch.no_grad():
        out = model(ids, state=s0)
        for b in range(3):
            st = Mamba2ModelState(*(t[:, b : b + 1] for t in s0._tensors()))
            alone = model(ids[b : b + 1], state=st)
            torch.testing.assert_close(out.logits[b : b + 1], alone.logits)
            torch.testing.assert_close(out.state.ssm[:, b : b + 1], alone.state.ssm)


def test_state_reset_detach_clone_and_checks():
    model = lm(double=False).eval()
    state = model.init_state(3)
    with torch.no_grad():
        for tok in ([1, 2, 3], [4, 5, 6]):
            model.step(torch.tensor(tok), state)
    assert state.ssm[:, 1].abs().sum() > 0 and state.conv[:, 1].abs().sum() > 0
    ptrs = [t.data_ptr() for t in state._tensors()]
    copy = state.clone()
    state.reset_(torch.tensor([False, True, False]))
    assert [t.data_ptr() for t in state._tensors()] == ptrs  # in place
    assert state.ssm[:, 1].abs().sum() == 0 and state.conv[:, 1].abs().sum() == 0
    torch.testing.assert_close(state.ssm[:, 0], copy.ssm[:, 0], rtol=0, atol=0)
    assert copy.ssm[:, 1].abs().sum() > 0  # the clone is its own
    with pytest.raises(ValueError, match="reset_ mask"):
        state.reset_(torch.tensor([True, False]))
    # with autograd: a state that requires grad is replaced by masked copies, grads exact
    leaf = random_state(model, 3)
    for t in leaf._tensors():
        t.requires_grad_()
    st = Mamba2ModelState(*(t * 1.0 for t in leaf._tensors()))
    st.reset_(torch.tensor([True, False, False]))
    out = model(torch.randint(0, V, (3, 4)), state=st)
    out.logits.sum().backward()
    assert leaf.ssm.grad[:, 0].abs().sum() == 0 and leaf.ssm.grad[:, 1].abs().sum() > 0
    assert leaf.conv.grad[:, 0].abs().sum() == 0 and leaf.conv.grad[:, 2].abs().sum() > 0
    det = out.state.detach()
    assert isinstance(det, Mamba2ModelState) and not det.requires_grad
    assert out.state.requires_grad
    # the model checks the state it is given, naming the field
    ids = torch.randint(0, V, (3, 2))
    bad = model.init_state(3)
    bad.ssm = bad.ssm[..., :-1]
    with pytest.raises(ValueError, match="state.ssm"):
        model(ids, state=bad)
    bad = model.init_state(3)
    bad.conv = bad.conv[:, :, 1:]
    with pytest.raises(ValueError, match="state.conv"):
        model(ids, state=bad)
    with pytest.raises(TypeError, match="Mamba2ModelState"):
        model(ids, state=model.init_state(3).layer(0))  # one layer's state
    with pytest.raises(ValueError, match="Mamba2ModelState"):
        Mamba2ModelState(torch.zeros(2, 3, 3, 64), torch.zeros(2, 3, 4, 8))


def test_backbone_on_float_inputs():
    """MambaBackbone(input_dim=5, mixer mamba2): hidden [B, T, M]; steps == forward; chunks
    == whole; a gradient reaches a given state."""
    torch.manual_seed(0)
    bb = off_init_(MambaBackbone(config(input_dim=5))).double()
    x = torch.randn(2, 10, 5, dtype=torch.float64)
    s0 = random_state(bb, 2)
    with torch.no_grad():
        hidden, final = bb(x, s0.clone())
        assert hidden.shape == (2, 10, 16) and isinstance(final, Mamba2ModelState)
        state = s0.clone()
        steps = [bb.step(x[:, t], state)[0] for t in range(10)]
        torch.testing.assert_close(torch.stack(steps, 1), hidden, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state.ssm, final.ssm, rtol=1e-10, atol=1e-10)
        h1, mid = bb(x[:, :3], s0.clone())
        h2, end = bb(x[:, 3:], mid)
        torch.testing.assert_close(torch.cat([h1, h2], 1), hidden, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(end.conv, final.conv, rtol=1e-10, atol=1e-10)
    st = s0.clone()
    for t in st._tensors():
        t.requires_grad_()
    hidden, _ = bb(x, st)
    hidden.square().sum().backward()
    assert st.ssm.grad.abs().sum() > 0 and st.conv.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="x must have shape"):
        bb(torch.randn(2, 10, 4, dtype=torch.float64))


def test_tbptt_over_packed_documents_equals_full_bptt():
    """The Trainer's TBPTT chunks carry the Mamba-2 state (one graph across chunks) and
    reset it at document starts: the loss and every gradient equal full BPTT."""
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
    assert l1 == pytest.approx(l0, rel=1e-10)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-8, atol=1e-12, msg=n)


def test_trainer_learns_with_the_state_carried_across_windows():
    """A repeating pattern, trained in TBPTT windows of 8 (the state carried between them,
    detached after each backward): every loss finite, the last ones well below the first."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randperm(V, generator=g)[:7]
    stream = pattern.repeat(200)

    class Stream:
        def next(self):
            starts = torch.randint(0, 7 * 150, (4,), generator=g)
            rows = torch.stack([stream[s : s + 25] for s in starts.tolist()])
            return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    model = lm(double=False, d_model=32)
    cfg = TrainConfig(steps=25, batch_size=4, seqlen=24, tbptt_len=8, lr=2e-2, warmup_steps=5,
                      device="cpu")  # fmt: skip
    trainer = Trainer(model, cfg, Stream(), log=lambda s: None)
    losses = [float(trainer.train_step()[0]) for _ in range(25)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > 0.9 * math.log(V)
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0], losses


def test_triton_decode_equals_the_reference(monkeypatch):
    """Decode steps on the Triton backend (the interpreter on a CPU: the fused step kernels)
    equal the reference backend's: logits and both state fields over 4 tokens."""
    model = lm(double=False).eval()
    ids = torch.randint(0, V, (2, 4))
    runs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
        state = random_state(model, 2)
        with torch.no_grad():
            logits = torch.stack([model.step(ids[:, t], state)[0] for t in range(4)], 1)
        runs[backend] = logits, state
    (ref, ref_state), (got, state) = runs["reference"], runs["triton"]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.conv, ref_state.conv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.ssm, ref_state.ssm, rtol=1e-4, atol=1e-5)


def test_lora_adapters_take_part_in_every_path():
    """peft LoRA on every layer's in_proj and out_proj (the blocks no longer fusable): the
    forward, `last_logits`, the decode steps and greedy generate equal the model with the
    adapters merged into its weights (which decodes through the fused step). The reference
    backend (the layer test runs LoRA on the Triton one)."""
    import copy

    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj", "out_proj"],
                          init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(lm(double=False), cfg)
    merged = copy.deepcopy(model).merge_and_unload()
    adapted = model.base_model.model
    ids = torch.randint(0, V, (2, 6))
    with torch.no_grad():
        want = merged(ids).logits
        plain = copy.deepcopy(model).unload()(ids).logits
        assert (want - plain).abs().max() > 1e-2  # the adapters matter
        torch.testing.assert_close(adapted(ids).logits, want, rtol=1e-4, atol=1e-4)
        last, _ = adapted.last_logits(ids)
        torch.testing.assert_close(last, want[:, -1], rtol=1e-4, atol=1e-4)
        state = adapted.init_state(2)
        for t in range(ids.shape[1]):
            logits, state = adapted.step(ids[:, t], state)
            torch.testing.assert_close(logits, want[:, t], rtol=1e-4, atol=1e-4)
    kw = dict(max_new_tokens=4, temperature=0)
    assert torch.equal(adapted.generate(ids[:, :3], **kw), merged.generate(ids[:, :3], **kw))


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "mamba3"])
def test_steps_with_only_adapters_trainable_record_their_gradients(mixer):
    """Base weights frozen (as peft leaves them), LoRA trainable, grad mode on: `step` must
    record the adapters' gradients (run functionally, not update the state in place under
    autograd), and they equal those of the same loss through one forward."""
    peft = pytest.importorskip("peft")
    kw = dict(d_state=4, headdim=8, chunk_size=4) if mixer != "mamba1" else dict(d_state=4)
    torch.manual_seed(0)
    base = MambaLM(MambaConfig(mixer=mixer, d_model=16, n_layers=2, vocab_size=V, **kw))
    cfg = peft.LoraConfig(r=2, target_modules=["in_proj", "out_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, cfg).base_model.model
    lora = [p for n, p in model.named_parameters() if "lora" in n]
    assert lora and all(p.requires_grad for p in lora)
    ids = torch.randint(0, V, (2, 4))
    state, loss = model.init_state(2), 0.0
    for t in range(ids.shape[1]):
        logits, state = model.step(ids[:, t], state)
        loss = loss + logits.square().sum()
    stepped = torch.autograd.grad(loss, lora)
    full = torch.autograd.grad(model(ids).logits.square().sum(), lora)
    for a, b in zip(stepped, full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_decode_plan_follows_the_gated_norms_eps():
    """The decode plan holds the gated norm's eps: changing it after a step changes the
    next step as it changes the forward."""
    model = lm(double=False)
    ids = torch.randint(0, V, (2, 3))
    with torch.no_grad():
        model.step(ids[:, 0], model.init_state(2))  # builds the plan
        for block in model.backbone.layers:
            block.mixer.norm.eps = 10.0
        want = model(ids).logits
        state = model.init_state(2)
        for t in range(ids.shape[1]):
            logits, state = model.step(ids[:, t], state)
            torch.testing.assert_close(logits, want[:, t], rtol=1e-4, atol=1e-5)


def test_a_wrapped_projection_without_a_weight_is_called():
    """A projection wrapped in a module that has no `.weight` (a quantized layer, say): the
    layer's init_state, forward and step call it and never read its weight."""

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    model = lm(double=False)
    ids = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        want = model(ids).logits
        for block in model.backbone.layers:
            block.mixer.in_proj = Wrap(block.mixer.in_proj)
            block.mixer.out_proj = Wrap(block.mixer.out_proj)
        torch.testing.assert_close(model(ids).logits, want)
        state = model.init_state(2)
        for t in range(ids.shape[1]):
            logits, state = model.step(ids[:, t], state)
            torch.testing.assert_close(logits, want[:, t], rtol=1e-4, atol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    model = lm(double=False).eval()
    model.save_pretrained(tmp_path)
    back = MambaLM.from_pretrained(tmp_path)
    assert back.config.mixer == "mamba2" and back.config.ngroups == 2
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)


# --- GPU: the kernels and graph replay ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_equal_the_reference_and_graph_decode_equals_eager(monkeypatch):
    """On CUDA: the forward and every loss gradient on the Triton backend equal the
    reference backend's; T decode steps (the fused step kernels) equal one forward; greedy
    generation replayed from a CUDA graph equals eager generation token for token, at
    batch 1 and 3."""
    model = lm(double=False, d_model=64, headdim=16, d_state=16).cuda().eval()
    ids = torch.randint(0, V, (3, 37), device="cuda")
    runs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
        model.zero_grad(set_to_none=True)
        out = model(ids)
        out.logits.float().logsumexp(-1).mean().backward()
        runs[backend] = out.logits.detach(), {k: p.grad for k, p in model.named_parameters()}
    monkeypatch.delenv("MAMBAKIT_BACKEND")
    ref_logits, ref_grads = runs["reference"]
    torch.testing.assert_close(runs["triton"][0], ref_logits, rtol=1e-4, atol=1e-4)
    for k, g in ref_grads.items():
        torch.testing.assert_close(runs["triton"][1][k], g, rtol=1e-3, atol=1e-5, msg=k)
    with torch.no_grad():
        out = model(ids[:, :13])
        state = model.init_state(3)
        steps = torch.stack([model.step(ids[:, t], state)[0] for t in range(13)], 1)
    torch.testing.assert_close(steps, out.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.ssm, out.state.ssm, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.conv, out.state.conv, rtol=1e-4, atol=1e-4)
    for rows in (ids[:1, :7], ids[:, :7]):
        eager = generate(model, rows, max_new_tokens=32, temperature=0, cuda_graph=False)
        graph = generate(model, rows, max_new_tokens=32, temperature=0, cuda_graph=True)
        torch.testing.assert_close(graph, eager, rtol=0, atol=0)
        again = generate(model, rows, max_new_tokens=32, temperature=0, cuda_graph=True)
        torch.testing.assert_close(again, eager, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_cuda_graph_step_equals_eager_with_the_state_carried():
    """The Trainer on CUDA (bf16 autocast, TBPTT windows of 16 with the state carried): the
    step captured in a CUDA graph and replayed gives the eager steps' losses and weights;
    the loss falls."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randperm(V, generator=g)[:7]
    rows = pattern.repeat(40)
    batches = []
    for _ in range(12):
        starts = torch.randint(0, 7 * 30, (4,), generator=g)
        ids = torch.stack([rows[s : s + 49] for s in starts.tolist()])
        batches.append({"input_ids": ids[:, :-1], "targets": ids[:, 1:]})

    class Data:
        def __init__(self):
            self.i = 0

        def next(self):
            self.i += 1
            return batches[(self.i - 1) % len(batches)]

    runs = {}
    for graph in (False, True):
        model = lm(double=False, d_model=64, headdim=16, d_state=16)
        cfg = TrainConfig(steps=12, batch_size=4, seqlen=48, tbptt_len=16, lr=1e-2,
                          warmup_steps=2, device="cuda", cuda_graph=graph)  # fmt: skip
        trainer = Trainer(model, cfg, Data(), log=lambda s: None)
        losses = [float(trainer.train_step()[0]) for _ in range(12)]
        assert trainer.use_graph == graph, trainer.graph_status()
        runs[graph] = losses, {k: p.detach().clone() for k, p in model.named_parameters()}
    (l_eager, w_eager), (l_graph, w_graph) = runs[False], runs[True]
    assert all(math.isfinite(x) for x in l_graph)
    assert l_graph == pytest.approx(l_eager, rel=1e-3), (l_graph, l_eager)
    for k, w in w_eager.items():
        torch.testing.assert_close(w_graph[k], w, rtol=1e-3, atol=1e-4, msg=k)
    assert sum(l_graph[-3:]) / 3 < 0.7 * l_graph[0], l_graph
