"""MambaLM invariances: chunks == full, step == forward, packing == one by one,
row alone == row in batch; loss; gradients through the state (gradcheck)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mambakit import MambaLM, MambaState

DTYPES = [torch.float64, torch.float32]
IDS = ["f64", "f32"]


def tol(dtype):
    if dtype == torch.float64:
        return dict(rtol=1e-9, atol=1e-10)
    return dict(rtol=2e-4, atol=2e-5)


def make_model(tiny_config, randomize, dtype, **kw):
    model = randomize(MambaLM(tiny_config(**kw)))
    return model.to(dtype)


def random_state(model, batch, dtype):
    s = model.init_state(batch)
    return MambaState(torch.randn_like(s.conv), torch.randn_like(s.ssm) * 0.5)


def assert_state_close(a, b, **t):
    torch.testing.assert_close(a.conv, b.conv, **t)
    torch.testing.assert_close(a.ssm, b.ssm, **t)


def test_forward_output_fields(seed, tiny_config):
    model = MambaLM(tiny_config())
    ids = torch.randint(0, 24, (2, 7))
    out = model(ids)
    assert out.logits.shape == (2, 7, 24) and out.logits.dtype == torch.float32
    assert out.loss is None
    assert isinstance(out.state, MambaState)
    assert out.state.conv.shape == (2, 2, 2, 24) and out.state.ssm.shape == (2, 2, 24, 3)
    assert out.state.ssm.dtype == torch.float32


def test_lm_head_tied_by_default(tiny_config):
    model = MambaLM(tiny_config())
    assert model.lm_head.weight is model.backbone.embeddings.weight
    untied = MambaLM(tiny_config(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.backbone.embeddings.weight


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_loss_shifted_ignores_minus_100(seed, tiny_config, randomize, dtype):
    model = make_model(tiny_config, randomize, dtype)
    ids = torch.randint(0, 24, (3, 9))
    labels = ids.clone()
    labels[0, 2:5] = -100
    labels[2, -1] = -100
    out = model(ids, labels=labels)
    ref = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, 24).double(), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    assert out.loss.dim() == 0
    torch.testing.assert_close(out.loss.double(), ref, **tol(dtype))
    out.loss.backward()
    assert model.backbone.layers[0].mixer.A_log.grad.abs().sum() > 0


@pytest.mark.parametrize("case", ["all-ignored", "T1", "B0"])
def test_loss_with_nothing_to_predict_is_zero(seed, tiny_config, randomize, case):
    """No label to predict gives loss 0 and zero gradients, not NaN (a mean over nothing)."""
    model = make_model(tiny_config, randomize, torch.float32)
    shape = {"all-ignored": (2, 6), "T1": (3, 1), "B0": (0, 5)}[case]
    ids = torch.randint(0, 24, shape)
    labels = torch.full_like(ids, -100) if case == "all-ignored" else ids
    out = model(ids, labels=labels)
    assert out.loss.dim() == 0 and out.loss.item() == 0.0
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()), name


def test_loss_with_seq_idx_equals_documents_one_by_one(seed, tiny_config, randomize):
    """Packed loss == token-weighted mean of each document's own loss: the first token of
    a document is not predicted from the end of the previous one."""
    model = make_model(tiny_config, randomize, torch.float64)
    lens = [3, 6, 2]
    ids = torch.randint(0, 24, (1, 11))
    seq_idx = torch.tensor([[0] * 3 + [1] * 6 + [2] * 2], dtype=torch.int32)
    packed = model(ids, seq_idx=seq_idx, labels=ids)
    total, count, start = 0.0, 0, 0
    for n in lens:
        doc = ids[:, start : start + n]
        logits = model(doc).logits
        total = total + F.cross_entropy(logits[0, :-1].double(), doc[0, 1:], reduction="sum")
        count += n - 1
        start += n
    torch.testing.assert_close(packed.loss.double(), total / count, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("splits", [(5, 1, 7), (1, 1, 11)], ids=["5-1-7", "1-1-11"])
def test_chunks_equal_full_sequence(seed, tiny_config, randomize, dtype, splits):
    model = make_model(tiny_config, randomize, dtype, d_conv=4)
    T = sum(splits)
    ids = torch.randint(0, 24, (2, T))
    s0 = random_state(model, 2, dtype)
    w_logits = torch.randn(2, T, 24, dtype=dtype)
    w_conv = torch.randn_like(s0.conv)
    w_ssm = torch.randn_like(s0.ssm)

    def loss_of(logits, state):
        return (logits * w_logits).sum() + (state.conv * w_conv).sum() + (state.ssm * w_ssm).sum()

    model.zero_grad()
    full = model(ids, state=s0.clone())
    loss_of(full.logits, full.state).backward()
    g_full = {k: p.grad.clone() for k, p in model.named_parameters()}

    model.zero_grad()
    state, logits, start = s0.clone(), [], 0
    for n in splits:
        out = model(ids[:, start : start + n], state=state)
        logits.append(out.logits)
        state, start = out.state, start + n
    logits = torch.cat(logits, dim=1)
    loss_of(logits, state).backward()  # gradient flows back through every chunk

    torch.testing.assert_close(logits, full.logits, **tol(dtype))
    assert_state_close(state, full.state, **tol(dtype))
    gt = dict(rtol=1e-8, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-3, atol=1e-4)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_full[k], **gt, msg=k)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_step_equals_forward(seed, tiny_config, randomize, dtype):
    model = make_model(tiny_config, randomize, dtype)
    ids = torch.randint(0, 24, (3, 8))
    s0 = random_state(model, 3, dtype)
    with torch.no_grad():
        full = model(ids, state=s0.clone())
        state = s0.clone()
        ptrs = (state.conv.data_ptr(), state.ssm.data_ptr())
        steps = []
        for t in range(8):
            logits_t, state2 = model.step(ids[:, t], state)
            assert logits_t.shape == (3, 24)
            assert (state2.conv.data_ptr(), state2.ssm.data_ptr()) == ptrs  # in place
            steps.append(logits_t)
            state = state2
    torch.testing.assert_close(torch.stack(steps, dim=1), full.logits, **tol(dtype))
    assert_state_close(state, full.state, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prefill_then_step_equals_forward(seed, tiny_config, randomize, dtype):
    model = make_model(tiny_config, randomize, dtype, d_conv=4)
    ids = torch.randint(0, 24, (2, 9))
    with torch.no_grad():
        full = model(ids)
        out = model(ids[:, :2])  # shorter than d_conv - 1: conv state partly from zeros
        state, logits = out.state, [out.logits]
        for t in range(2, 9):
            lt, state = model.step(ids[:, t], state)
            logits.append(lt[:, None])
    torch.testing.assert_close(torch.cat(logits, dim=1), full.logits, **tol(dtype))
    assert_state_close(state, full.state, **tol(dtype))


def test_step_is_differentiable(seed, tiny_config, randomize):
    """step() with autograd on: same gradients as the full forward."""
    model = make_model(tiny_config, randomize, torch.float64)
    ids = torch.randint(0, 24, (2, 5))
    model.zero_grad()
    model(ids).logits.pow(2).sum().backward()
    g_full = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    state, total = model.init_state(2), 0.0
    for t in range(5):
        lt, state = model.step(ids[:, t], state)
        total = total + lt.pow(2).sum()
    total.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_full[k], rtol=1e-8, atol=1e-10, msg=k)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_step_records_a_trainable_head_over_a_frozen_backbone(
    seed, tiny_config, randomize, monkeypatch, backend
):
    """Head-only fine-tuning through step(): an untied trainable head over a frozen
    backbone, grad mode on. The logits carry the head's gradient, that of the float64
    model's full forward, on every backend (the Triton one fused the head into a kernel
    that records nothing: the logits came back without a gradient)."""
    monkeypatch.setenv("MAMBAKIT_BACKEND", backend)
    model = make_model(tiny_config, randomize, torch.float32, tie_embeddings=False)
    model.backbone.requires_grad_(False)
    oracle = make_model(tiny_config, randomize, torch.float64, tie_embeddings=False)
    oracle.load_state_dict(model.state_dict())
    ids = torch.randint(0, 24, (2, 4))
    oracle(ids).logits.pow(2).sum().backward()
    g_full = oracle.lm_head.weight.grad.float()
    state, total = model.init_state(2), 0.0
    for t in range(4):
        lt, state = model.step(ids[:, t], state)
        assert lt.requires_grad
        total = total + lt.pow(2).sum()
    total.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, g_full, **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_seq_idx_packing_equals_documents_one_by_one(seed, tiny_config, randomize, dtype):
    model = make_model(tiny_config, randomize, dtype, d_conv=4)
    docs = [[4, 1, 6], [7, 4]]  # document lengths per row, T = 11
    T = 11
    ids = torch.randint(0, 24, (2, T))
    seq_idx = torch.zeros(2, T, dtype=torch.int32)
    for r, lens in enumerate(docs):
        start = 0
        for j, n in enumerate(lens):
            seq_idx[r, start : start + n] = 3 + 2 * j  # any non-decreasing labels
            start += n
    s0 = random_state(model, 2, dtype)
    with torch.no_grad():
        packed = model(ids, state=s0.clone(), seq_idx=seq_idx)
        for r, lens in enumerate(docs):
            start = 0
            for j, n in enumerate(lens):
                row_state = None
                if j == 0:  # the given state applies to the first document only
                    row_state = MambaState(s0.conv[:, r : r + 1], s0.ssm[:, r : r + 1]).clone()
                alone = model(ids[r : r + 1, start : start + n], state=row_state)
                torch.testing.assert_close(
                    packed.logits[r : r + 1, start : start + n], alone.logits, **tol(dtype)
                )
                start += n
            # final state of the row = final state of its last document
            torch.testing.assert_close(
                packed.state.ssm[:, r : r + 1], alone.state.ssm, **tol(dtype)
            )
            torch.testing.assert_close(
                packed.state.conv[:, r : r + 1], alone.state.conv, **tol(dtype)
            )


def test_seq_idx_with_chunks_and_gradients(seed, tiny_config, randomize):
    """Packed rows in chunks with state carried (TBPTT over packed data) == one pass."""
    model = make_model(tiny_config, randomize, torch.float64)
    ids = torch.randint(0, 24, (2, 12))
    seq_idx = torch.tensor([[0] * 5 + [1] * 7, [0] * 2 + [1] * 2 + [2] * 8], dtype=torch.int32)
    model.zero_grad()
    full = model(ids, seq_idx=seq_idx)
    full.logits.pow(2).sum().backward()
    g_full = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    state, logits = None, []
    for a, b in [(0, 3), (3, 7), (7, 12)]:  # chunk edges fall inside documents
        out = model(ids[:, a:b], state=state, seq_idx=seq_idx[:, a:b])
        logits.append(out.logits)
        state = out.state
    logits = torch.cat(logits, dim=1)
    logits.pow(2).sum().backward()
    torch.testing.assert_close(logits, full.logits, rtol=1e-9, atol=1e-10)
    assert_state_close(state, full.state, rtol=1e-9, atol=1e-10)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_full[k], rtol=1e-8, atol=1e-10, msg=k)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_row_alone_equals_row_in_batch(seed, tiny_config, randomize, dtype):
    model = make_model(tiny_config, randomize, dtype)
    ids = torch.randint(0, 24, (4, 7))
    s0 = random_state(model, 4, dtype)
    with torch.no_grad():
        batch = model(ids, state=s0.clone())
        for r in range(4):
            rs = MambaState(s0.conv[:, r : r + 1].clone(), s0.ssm[:, r : r + 1].clone())
            alone = model(ids[r : r + 1], state=rs)
            torch.testing.assert_close(batch.logits[r : r + 1], alone.logits, **tol(dtype))
            torch.testing.assert_close(batch.state.ssm[:, r : r + 1], alone.state.ssm, **tol(dtype))
            torch.testing.assert_close(
                batch.state.conv[:, r : r + 1], alone.state.conv, **tol(dtype)
            )


def test_forward_does_not_modify_given_state(seed, tiny_config, randomize):
    model = make_model(tiny_config, randomize, torch.float32)
    s0 = random_state(model, 2, torch.float32)
    keep = s0.clone()
    out = model(torch.randint(0, 24, (2, 5)), state=s0)
    assert_state_close(s0, keep, rtol=0, atol=0)
    assert not torch.allclose(out.state.ssm, keep.ssm)


def test_gradcheck_whole_model_wrt_state_and_parameters(seed, tiny_config, randomize):
    """Final state and logits are differentiable w.r.t. the given state and parameters."""
    cfg = dict(d_model=4, n_layers=2, vocab_size=8, d_state=2, d_conv=2, expand=1)
    model = make_model(tiny_config, randomize, torch.float64, **cfg)
    ids = torch.randint(0, 8, (2, 3))
    s = random_state(model, 2, torch.float64)
    conv0 = s.conv.clone().requires_grad_(True)
    ssm0 = s.ssm.clone().requires_grad_(True)
    names = ["backbone.layers.0.mixer.A_log", "backbone.layers.1.mixer.dt_proj.bias"]
    params = [
        dict(model.named_parameters())[k].detach().clone().requires_grad_(True) for k in names
    ]

    def f(conv0, ssm0, *ps):
        out = torch.func.functional_call(
            model, dict(zip(names, ps)), (ids,), dict(state=MambaState(conv0, ssm0))
        )
        return out.logits, out.state.conv, out.state.ssm

    assert torch.autograd.gradcheck(f, (conv0, ssm0, *params), eps=1e-6, atol=1e-5)
