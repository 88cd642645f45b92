"""The model computes what its modules say: peft's LoRA adapters and forward hooks on the
projections take part in the forward, `step`, `last_logits`, `generate` and its CUDA-graph
decode, on every backend and mixer. The oracle is the same model with the adapters merged
into its weights (`merge_and_unload`), or with the hook's effect written into the weight;
where an adapter cannot be merged (peft's LoRA on the depthwise conv), the layer's chain of
modules in float64 with the scan stepped (`selective_scan_naive`)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mambakit import Mamba, MambaConfig, MambaLM
from mambakit.ops.selective_scan.naive import selective_scan_naive

peft = pytest.importorskip("peft")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = {
    "mamba1": ["in_proj", "x_proj", "dt_proj", "out_proj"],
    "mamba2": ["in_proj", "out_proj"],
    "mamba3": ["in_proj", "out_proj"],
}
CONFIGS = {
    "mamba1": dict(d_model=16, n_layers=2, vocab_size=40, d_state=4, pad_vocab_size_multiple=1),
    "mamba2": dict(d_model=16, n_layers=2, vocab_size=40, d_state=8, headdim=8, chunk_size=4,
                   mixer="mamba2", pad_vocab_size_multiple=1),
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


def chain(m: Mamba, x: torch.Tensor) -> torch.Tensor:
    """A Mamba-1 layer over x [B, T, M] in float64, every projection and the conv called as
    a module (mamba_ssm's slow path: the conv over x padded K-1 both sides, its first T
    outputs), the scan stepped."""
    Dn, N, R, T = m.d_inner, m.d_state, m.dt_rank, x.shape[1]
    x_in, z = m.in_proj(x).split([Dn, Dn], dim=-1)
    u = F.silu(m.conv1d(x_in.mT)[..., :T].mT)
    dt_r, B, C = m.x_proj(u).split([R, N, N], dim=-1)
    A = -torch.exp(m.A_log.double())
    y, _ = selective_scan_naive(u, m.dt_proj(dt_r), A, B, C, m.D, z, delta_softplus=True)
    return m.out_proj(y)


def test_a_lora_adapter_on_the_conv_is_honoured(backend):
    """peft's LoRA on conv1d (its module in the conv's place has no `kernel_size`): the
    layer's forward, its adapters' gradients and its steps equal the chain of modules;
    the model's forward, `last_logits`, steps and generate agree with each other."""
    torch.manual_seed(0)
    m = Mamba(d_model=8, d_state=4, d_conv=3).to(DEVICE)
    D = m.d_inner
    # (peft takes a rank that is a multiple of the conv's groups)
    cfg = peft.LoraConfig(r=D, lora_alpha=D, target_modules=["conv1d"], init_lora_weights=False)
    m = peft.get_peft_model(m, cfg).base_model.model
    m64 = copy.deepcopy(m).double()
    x = torch.randn(2, 7, 8, device=DEVICE)
    y = m(x)
    y.double().pow(2).sum().backward()
    want = chain(m64, x.double())
    want.pow(2).sum().backward()
    bare = copy.deepcopy(m64)
    bare.conv1d = bare.conv1d.base_layer  # the adapter dropped
    assert (want - chain(bare, x.double())).abs().max() > 1e-2
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    grads = {k: p.grad for k, p in m.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(k for k, _ in m.named_parameters() if "lora_" in k)
    for k, g in dict(m64.named_parameters()).items():
        if "lora_" in k:
            torch.testing.assert_close(grads[k].double(), g.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        conv, ssm = torch.zeros(2, 2, D, device=DEVICE), torch.zeros(2, D, 4, device=DEVICE)
        steps = torch.stack([m.step(x[:, t], conv, ssm) for t in range(7)], 1)
        torch.testing.assert_close(steps.double(), want, rtol=1e-5, atol=1e-5)

    torch.manual_seed(0)
    lm = MambaLM(MambaConfig(**CONFIGS["mamba1"])).to(DEVICE)
    D = lm.backbone.layers[0].mixer.d_inner
    cfg = peft.LoraConfig(r=D, lora_alpha=D, target_modules=["conv1d"], init_lora_weights=False)
    lm = peft.get_peft_model(lm, cfg).base_model.model
    ids = _ids(lm.config.vocab_size)
    want = forward_and_steps_match(lm, lm, ids)
    with torch.no_grad():
        torch.testing.assert_close(lm.last_logits(ids)[0], want[:, -1], rtol=1e-4, atol=1e-4)
        out = lm.generate(ids[:, :4], max_new_tokens=3, temperature=0)
        torch.testing.assert_close(lm(out[:, :-1]).logits[:, 3:].argmax(-1), out[:, 4:])


@pytest.mark.parametrize("mixer", list(TARGETS))
def test_merged_adapters_after_the_base_model_decoded(mixer):
    """A base model that decoded once (its decode plans derived, with copies of the weights
    on the CPU's reference body), then given adapters and merged (peft writes the merged
    weights through `p.data`, which moves no version counter): its steps give what its
    forward and the merged model in float64 give, not the base model's logits."""
    torch.manual_seed(0)
    lm = MambaLM(MambaConfig(**CONFIGS[mixer])).to(DEVICE)
    ids = _ids(lm.config.vocab_size, T=6)
    with torch.no_grad():
        lm.generate(ids, max_new_tokens=3, temperature=0)
        base = lm(ids).logits
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[mixer],
                          init_lora_weights=False)  # fmt: skip
    merged = peft.get_peft_model(lm, cfg).merge_and_unload()
    ref = copy.deepcopy(merged).double()
    with torch.no_grad():
        want = ref(ids).logits.float()
        assert (want - base).abs().max() > 1e-2  # the adapters matter
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-4)
        state = merged.init_state(ids.shape[0])
        for t in range(ids.shape[1]):
            logits, state = merged.step(ids[:, t], state)
            torch.testing.assert_close(logits, want[:, t], rtol=1e-4, atol=1e-4)
        out = merged.generate(ids, max_new_tokens=3, temperature=0)
        torch.testing.assert_close(ref(out[:, :-1]).logits[:, 5:].argmax(-1), out[:, 6:])


def test_a_wrapped_head_gives_a_float64_loss_for_a_float64_model():
    """The loss of a head that is not a plain Linear (LoRA on lm_head: its logits, not the
    chunked loss on its weight) is computed in float64 for a float64 model, as the chunked
    loss is (f32 is a floor, not a ceiling)."""
    torch.manual_seed(0)
    lm = MambaLM(MambaConfig(**CONFIGS["mamba1"])).to(DEVICE, torch.float64)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False)
    lm = peft.get_peft_model(lm, cfg).base_model.model
    ids = _ids(lm.config.vocab_size)
    out = lm(ids, labels=ids)
    want = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, want, rtol=1e-13, atol=0)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    got, _ = lm.loss_sum(ids, targets)
    torch.testing.assert_close(got, want * ids[:, 1:].numel(), rtol=1e-13, atol=0)


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
