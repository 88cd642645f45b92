"""Parity with transformers.MambaForCausalLM (its torch path) in f32 on CPU, both
directions of checkpoint conversion: logits and final recurrent states."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import MambaConfig as HFConfig
from transformers import MambaForCausalLM

from mambakit import MambaConfig, MambaLM, MambaState

TOL = dict(rtol=1e-5, atol=2e-5)

HF_CONFIGS = {
    # odd sizes, auto dt rank, tied head
    "d24-N5-K3-L2-tied": dict(
        vocab_size=56, hidden_size=24, state_size=5, conv_kernel=3, num_hidden_layers=2, expand=2
    ),
    # linear biases, no conv bias, explicit dt rank, untied head, large norm eps, K4
    "d20-N3-K4-L3-bias-untied": dict(
        vocab_size=48,
        hidden_size=20,
        state_size=3,
        conv_kernel=4,
        num_hidden_layers=3,
        expand=3,
        time_step_rank=3,
        use_bias=True,
        use_conv_bias=False,
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-2,
    ),
}


def hf_model(randomize, **kw):
    cfg = HFConfig(**kw)
    model = MambaForCausalLM(cfg).eval()
    randomize(model)
    if not cfg.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight) * 0.1)
    return model


def hf_run(model, ids):
    """HF logits and its final cache converted to our layout [L, B, K-1, D] / [L, B, D, N]."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return out.logits, hf_state(out.cache, model.config.num_hidden_layers), out.cache


def hf_state(cache, n_layers):
    # HF conv state: [B, D, K], the last K inputs with the newest last; ours keeps the
    # last K-1 inputs oldest first as [B, K-1, D].
    conv = torch.stack([cache.get_conv_state(i)[:, :, 1:].transpose(1, 2) for i in range(n_layers)])
    ssm = torch.stack([cache.get_recurrent_state(i) for i in range(n_layers)])
    return MambaState(conv.float(), ssm.float())


def assert_state_close(a, b, **t):
    torch.testing.assert_close(a.conv, b.conv, **t)
    torch.testing.assert_close(a.ssm, b.ssm, **t)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
@pytest.mark.parametrize("T", [2, 9])
def test_hf_checkpoint_loads_and_matches(tmp_path, seed, randomize, name, T):
    hf = hf_model(randomize, **HF_CONFIGS[name])
    hf.save_pretrained(tmp_path)
    ours = MambaLM.from_pretrained(tmp_path)
    assert isinstance(ours, MambaLM)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    ids = torch.randint(0, hf.config.vocab_size, (3, T))
    ref_logits, ref_state, _ = hf_run(hf, ids)
    with torch.no_grad():
        out = ours(ids)
    assert out.logits.shape == ref_logits.shape
    torch.testing.assert_close(out.logits, ref_logits, **TOL)
    assert_state_close(out.state, ref_state, **TOL)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_our_checkpoint_loads_in_transformers(tmp_path, seed, randomize, name):
    kw = HF_CONFIGS[name]
    cfg = MambaConfig(
        d_model=kw["hidden_size"],
        n_layers=kw["num_hidden_layers"],
        vocab_size=kw["vocab_size"],
        d_state=kw["state_size"],
        d_conv=kw["conv_kernel"],
        expand=kw["expand"],
        dt_rank=kw.get("time_step_rank"),
        bias=kw.get("use_bias", False),
        conv_bias=kw.get("use_conv_bias", True),
        tie_embeddings=kw.get("tie_word_embeddings", True),
        rms_norm_eps=kw.get("layer_norm_epsilon", 1e-5),
    )
    ours = randomize(MambaLM(cfg)).eval()
    if not cfg.tie_embeddings:
        with torch.no_grad():
            ours.lm_head.weight.copy_(torch.randn_like(ours.lm_head.weight) * 0.1)
    ours.save_pretrained(tmp_path)

    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["model_type"] == "mamba"
    assert meta["architectures"] == ["MambaForCausalLM"]
    assert (tmp_path / "model.safetensors").is_file()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = MambaForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32, output_loading_info=True
        )
    hf.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    ref_logits, ref_state, _ = hf_run(hf, ids)
    with torch.no_grad():
        out = ours(ids)
    torch.testing.assert_close(out.logits, ref_logits, **TOL)
    assert_state_close(out.state, ref_state, **TOL)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_state_dict_keys_and_shapes_equal_transformers(randomize, name):
    hf = hf_model(randomize, **HF_CONFIGS[name])
    kw = HF_CONFIGS[name]
    ours = MambaLM(
        MambaConfig(
            d_model=kw["hidden_size"],
            n_layers=kw["num_hidden_layers"],
            vocab_size=kw["vocab_size"],
            d_state=kw["state_size"],
            d_conv=kw["conv_kernel"],
            expand=kw["expand"],
            dt_rank=kw.get("time_step_rank"),
            bias=kw.get("use_bias", False),
            conv_bias=kw.get("use_conv_bias", True),
            tie_embeddings=kw.get("tie_word_embeddings", True),
        )
    )
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert ours_shapes == hf_shapes


def test_decode_steps_match_transformers(tmp_path, seed, randomize):
    hf = hf_model(randomize, **HF_CONFIGS["d20-N3-K4-L3-bias-untied"])
    hf.save_pretrained(tmp_path)
    ours = MambaLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 48, (2, 8))
    with torch.no_grad():
        hf_out = hf(ids[:, :4], use_cache=True)
        cache = hf_out.cache
        out = ours(ids[:, :4])
        state = out.state
        torch.testing.assert_close(out.logits, hf_out.logits, **TOL)
        for t in range(4, 8):
            hf_out = hf(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = hf_out.cache
            logits_t, state = ours.step(ids[:, t], state)
            torch.testing.assert_close(logits_t, hf_out.logits[:, 0], **TOL)
    assert_state_close(state, hf_state(cache, 3), **TOL)


def test_hf_checkpoint_with_unpadded_vocab(tmp_path, seed, randomize):
    """A vocab that is not a multiple of 8 loads as is: logits have the checkpoint's width."""
    kw = dict(HF_CONFIGS["d24-N5-K3-L2-tied"], vocab_size=50)
    hf = hf_model(randomize, **kw)
    hf.save_pretrained(tmp_path)
    ours = MambaLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 50, (2, 6))
    ref_logits, ref_state, _ = hf_run(hf, ids)
    with torch.no_grad():
        out = ours(ids)
    assert out.logits.shape == (2, 6, 50)
    torch.testing.assert_close(out.logits, ref_logits, **TOL)
    assert_state_close(out.state, ref_state, **TOL)
    # and back out again: transformers reads what we write
    ours.save_pretrained(tmp_path / "again")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf2 = MambaForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    assert hf2.config.vocab_size == 50
    with torch.no_grad():
        torch.testing.assert_close(hf2(ids).logits, ref_logits, **TOL)


def test_from_pretrained_dtype_and_device(tmp_path, seed, randomize):
    hf = hf_model(randomize, **HF_CONFIGS["d24-N5-K3-L2-tied"])
    hf.save_pretrained(tmp_path)
    ours = MambaLM.from_pretrained(tmp_path, device="cpu", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    assert all(p.device.type == "cpu" for p in ours.parameters())
    ids = torch.randint(0, 56, (2, 5))
    ref_logits, ref_state, _ = hf_run(hf, ids)
    with torch.no_grad():
        out = ours(ids)
    assert out.state.ssm.dtype == torch.float64
    torch.testing.assert_close(out.logits.float(), ref_logits, **TOL)
    assert_state_close(out.state.to(torch.float32), ref_state, **TOL)
