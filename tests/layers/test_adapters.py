"""The model computes what its modules say: peft's LoRA adapters and forward hooks on the
projections take part in the forward, `step`, `last_logits`, `generate` and its CUDA-graph
decode, on every backend and mixer. The oracle is the same model with the adapters merged
into its weights (`merge_and_unload`), or with the hook's effect written into the weight."""

from __future__ import annotations

import copy

import pytest
import torch

from mambakit import MambaConfig, MambaLM

peft = pytest.importorskip("peft")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = {
    "mamba1": ["in_proj", "x_proj", "dt_proj", "out_proj"],
    "mamba3": ["in_proj", "out_proj"],
}
CONFIGS = {
    "mamba1": dict(d_model=16, n_layers=2, vocab_size=40, d_state=4, pad_vocab_size_multiple=1),
    "mamba3": dict(d_model=32, n_layers=2, vocab_size=40, d_state=16, headdim=16,
                   mixer="mamba3", pad_vocab_size_multiple=1),
}  # fmt: skip
# the fused paths these tests guard: the Triton backend (the interpreter on a CPU), and the
# reference one with its own decode runner
BACKENDS = ["reference", "triton"]


def lora_model(mixer: str, seed: int = 0, dtype=torch.float32):
    """(a tiny MambaLM with random LoRA adapters on its projections, its merged twin)."""
    torch.manual_seed(seed)
    base = MambaLM(MambaConfig(**CONFIGS[mixer])).to(DEVICE, dtype)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[mixer],
                          init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    merged = copy.deepcopy(model).merge_and_unload()
    return model, merged


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("MAMBAKIT_BACKEND", request.param)
    return request.param


def _ids(vocab: int, T: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (2, T), generator=g).to(DEVICE)


@pytest.mark.parametrize("mixer", list(TARGETS))
def test_adapters_change_every_path_as_the_merged_weights_do(mixer, backend):
    model, merged = lora_model(mixer)
    lm, ref = model.base_model.model, merged
    ids = _ids(lm.config.vocab_size)
    with torch.no_grad():
        want = ref(ids).logits
        got = lm(ids).logits
        plain = copy.deepcopy(model).unload()(ids).logits  # the adapters dropped
        assert (want - plain).abs().max() > 1e-2  # the adapters matter
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

        last, state = lm.last_logits(ids)
        torch.testing.assert_close(last, want[:, -1], rtol=1e-4, atol=1e-4)

        state = lm.init_state(2)
        for t in range(ids.shape[1]):
            logits, state = lm.step(ids[:, t], state)
            torch.testing.assert_close(logits, want[:, t], rtol=1e-4, atol=1e-4)

        kw = dict(max_new_tokens=6, temperature=0)
        assert torch.equal(lm.generate(ids[:, :4], **kw), ref.generate(ids[:, :4], **kw))


@pytest.mark.parametrize("mixer", list(TARGETS))
def test_gradients_reach_every_adapter(mixer, backend):
    model, _ = lora_model(mixer)
    lm = model.base_model.model
    ids = _ids(lm.config.vocab_size)
    lm(ids, labels=ids).loss.backward()
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * len(TARGETS[mixer]) * lm.config.n_layers
    for name, p in adapters.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("mixer", list(TARGETS))
def test_training_loss_sees_the_adapters(mixer):
    """`loss_sum` (what the Trainer calls) equals the merged model's."""
    model, merged = lora_model(mixer)
    lm = model.base_model.model
    ids = _ids(lm.config.vocab_size)
    targets = ids.roll(-1, 1)
    got, _ = lm.loss_sum(ids, targets)
    want, _ = merged.loss_sum(ids, targets)  # about 82: the x_proj adapters move it by 3e-4
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-5)


def forward_and_steps_match(lm, ref, ids) -> torch.Tensor:
    """`lm`'s forward and its steps over `ids` give `ref`'s logits; returns them."""
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(lm(ids).logits, want, rtol=1e-4, atol=1e-4)
        state = lm.init_state(ids.shape[0])
        for t in range(ids.shape[1]):
            logits, state = lm.step(ids[:, t], state)
            torch.testing.assert_close(logits, want[:, t], rtol=1e-4, atol=1e-4)
    return want


def test_a_forward_hook_on_a_projection_is_honoured(backend):
    """A hook doubling x_proj's output computes what doubling its weight does."""
    torch.manual_seed(0)
    lm = MambaLM(MambaConfig(**CONFIGS["mamba1"])).to(DEVICE)
    ref = copy.deepcopy(lm)
    with torch.no_grad():
        for layer in ref.backbone.layers:
            layer.mixer.x_proj.weight.mul_(2)
    ids = _ids(lm.config.vocab_size)
    with torch.no_grad():
        before = lm(ids).logits
    handles = [
        layer.mixer.x_proj.register_forward_hook(lambda m, args, out: out * 2)
        for layer in lm.backbone.layers
    ]
    want = forward_and_steps_match(lm, ref, ids)
    assert (want - before).abs().max() > 1e-3
    for h in handles:
        h.remove()
    with torch.no_grad():  # without the hooks: the plain model again, the fused paths
        torch.testing.assert_close(lm(ids).logits, before, rtol=0, atol=0)


def test_a_hook_on_the_conv_is_honoured_where_it_can_be():
    """conv1d called as a module (no seq_idx): its hook takes part in forward and step; with
    seq_idx the model says it cannot reset the module's window at document starts."""
    torch.manual_seed(0)
    lm = MambaLM(MambaConfig(**CONFIGS["mamba1"])).to(DEVICE)
    ref = copy.deepcopy(lm)
    with torch.no_grad():
        for layer in ref.backbone.layers:
            layer.mixer.conv1d.weight.mul_(0.5)
            layer.mixer.conv1d.bias.mul_(0.5)
    for layer in lm.backbone.layers:
        layer.mixer.conv1d.register_forward_hook(lambda m, args, out: out * 0.5)
    ids = _ids(lm.config.vocab_size)
    forward_and_steps_match(lm, ref, ids)
    seq_idx = torch.zeros_like(ids, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="seq_idx"), torch.no_grad():
        lm(ids, seq_idx=seq_idx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mixer", list(TARGETS))
def test_cuda_graph_decode_with_adapters_equals_the_merged_model(mixer):
    model, merged = lora_model(mixer, dtype=torch.bfloat16)
    lm = model.base_model.model
    ids = _ids(lm.config.vocab_size)
    kw = dict(max_new_tokens=16, temperature=0, cuda_graph=True)
    with torch.no_grad():
        first = lm.generate(ids[:, :4], **kw)
        assert torch.equal(first, merged.generate(ids[:, :4], **kw))
        # the graphs were captured on the adapters: unloading them, or a hook registered
        # afterwards, makes them stale
        plain = model.unload()
        eager = {**kw, "cuda_graph": False}
        assert torch.equal(plain.generate(ids[:, :4], **kw), plain.generate(ids[:, :4], **eager))
        out_proj = plain.backbone.layers[0].mixer.out_proj
        out_proj.register_forward_hook(lambda m, args, out: -out)
        hooked = plain.generate(ids[:, :4], **kw)
        assert torch.equal(hooked, plain.generate(ids[:, :4], **eager))
        assert not torch.equal(hooked, first)
