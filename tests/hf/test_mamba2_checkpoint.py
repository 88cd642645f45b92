"""Mamba-2 checkpoints: parity with transformers.Mamba2ForCausalLM (its torch path, f32, CPU)
both ways, the state-spaces format (pytorch_model.bin or safetensors), the config round trip,
what mamba_ssm runs but transformers cannot (written in mamba_ssm's format), refusals named."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Mamba2Config as HFConfig
from transformers import Mamba2ForCausalLM

from mambakit import MambaConfig, MambaLM
from mambakit.hf import CheckpointError, config_from_json

TOL = dict(rtol=1e-5, atol=2e-5)

HF_CONFIGS = {
    # one B/C group, tied head, transformers' defaults elsewhere; two chunks, the last padded
    "G1-tied": dict(n_groups=1, tie_word_embeddings=True),
    # two groups, untied head, linear biases, no conv bias, K3, a large norm eps (all three
    # norms use it), a dt clamp that binds
    "G2-untied-bias-eps-dtlimit": dict(
        n_groups=2,
        tie_word_embeddings=False,
        use_bias=True,
        use_conv_bias=False,
        conv_kernel=3,
        layer_norm_epsilon=1e-2,
        time_step_limit=(0.05, 0.4),
    ),
}
HF_BASE = dict(
    vocab_size=100,
    hidden_size=64,
    num_hidden_layers=2,
    state_size=16,
    head_dim=16,
    num_heads=8,  # num_heads * head_dim == expand * hidden_size
    expand=2,
    chunk_size=8,
)
OURS = dict(mixer="mamba2", d_model=64, n_layers=2, vocab_size=100, d_state=16, headdim=16,
            chunk_size=8, pad_vocab_size_multiple=1)  # fmt: skip


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def randomize_mamba2(model, randomize):
    """Every tensor off its init: A_log, D, dt_bias, conv bias, every norm weight, and
    dt_bias spread so that a dt clamp binds on some heads."""
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 1.5 - 1.5)
    return model


def hf_model(randomize, **kw):
    cfg = HFConfig(**{**HF_BASE, **kw})
    return randomize_mamba2(Mamba2ForCausalLM(cfg).eval(), randomize)


def our_model(randomize, **kw):
    return randomize_mamba2(MambaLM(MambaConfig(**{**OURS, **kw})), randomize)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def state_dict_as_mamba_ssm(model):
    """A mambakit model's tensors under mamba_ssm's names (tied head stored, as mamba_ssm's
    state_dict has it)."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["backbone.embedding.weight"] = sd.pop("backbone.embeddings.weight")
    return sd


def write_state_spaces(path, sd, config, safetensors=False):
    path.mkdir(parents=True, exist_ok=True)
    if safetensors:
        if config.get("tie_embeddings", True):
            sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    else:
        torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(config))


def state_spaces_config(**ssm):
    return {
        "d_model": 64,
        "d_intermediate": 0,
        "n_layer": 2,
        "vocab_size": 97,  # padded to 112 by pad_vocab_size_multiple, as 50277 -> 50288
        "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "headdim": 16, "chunk_size": 8, **ssm},
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 16,
        "tie_embeddings": True,
    }


def hf_dir(tmp_path, randomize, **kw):
    hf = hf_model(randomize, **kw)
    quiet(hf.save_pretrained, tmp_path)
    return hf


def edit_config(path, **changes):
    meta = json.loads((path / "config.json").read_text())
    meta.update(changes)
    (path / "config.json").write_text(json.dumps(meta))


# ---------------------------------------------------------------- transformers, both ways


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_transformers_checkpoint_loads_and_matches(tmp_path, seed, randomize, name):
    hf = hf_dir(tmp_path, randomize, **HF_CONFIGS[name])
    ours = MambaLM.from_pretrained(tmp_path)
    c, h = ours.config, hf.config
    assert c.mixer == "mamba2" and (c.nheads, c.headdim, c.ngroups) == (8, 16, h.n_groups)
    assert c.dt_limit == tuple(h.time_step_limit) and c.rms_norm_eps == h.layer_norm_epsilon
    assert all(b.mixer.norm.eps == h.layer_norm_epsilon for b in ours.backbone.layers)
    assert (ours.lm_head.weight is ours.backbone.embeddings.weight) is h.tie_word_embeddings
    ids = torch.randint(0, 100, (2, 13))
    with torch.no_grad():
        ref = hf(ids, use_cache=True)
        out = ours(ids)
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    # the final state in transformers' cache layout: conv [B, C, K] (newest last), ssm [B, H, P, N]
    for i in range(2):
        conv = ref.cache.get_conv_state(i)[:, :, 1:].transpose(1, 2)
        torch.testing.assert_close(out.state.conv[i], conv.float(), **TOL)
        torch.testing.assert_close(out.state.ssm[i], ref.cache.get_recurrent_state(i), **TOL)


@pytest.mark.parametrize(
    "kw",
    [
        dict(ngroups=1),
        dict(
            ngroups=2,
            tie_embeddings=False,
            bias=True,
            conv_bias=False,
            d_conv=3,
            rms_norm_eps=1e-2,
            dt_limit=(0.05, 0.4),
            vocab_size=99,
            pad_vocab_size_multiple=4,
            extra={"eos_token_id": 7},
        ),
    ],
    ids=["G1-tied", "G2-untied-bias-eps-dtlimit-padded"],
)
def test_our_checkpoint_loads_in_transformers(tmp_path, seed, randomize, kw):
    ours = our_model(randomize, **kw)
    ours.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    c = ours.config
    expected = {
        "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": 64, "num_hidden_layers": 2, "state_size": 16, "expand": 2,
        "conv_kernel": c.d_conv, "num_heads": 8, "head_dim": 16, "n_groups": c.ngroups,
        "chunk_size": 8, "use_bias": c.bias, "use_conv_bias": c.conv_bias,
        "layer_norm_epsilon": c.rms_norm_eps, "tie_word_embeddings": c.tie_embeddings,
        "time_step_limit": list(c.dt_limit), "time_step_min": c.dt_min,
        "time_step_max": c.dt_max, "time_step_floor": c.dt_init_floor, "hidden_act": "silu",
        "residual_in_fp32": True, "rescale_prenorm_residual": False,
        "eos_token_id": c.extra.get("eos_token_id"), "bos_token_id": None, "pad_token_id": None,
    }  # fmt: skip
    assert {k: meta.get(k) for k in expected} == expected
    hf = quiet(Mamba2ForCausalLM.from_pretrained, tmp_path, dtype=torch.float32).eval()
    assert hf.config.time_step_limit[1] == c.dt_limit[1]
    assert hf.backbone.layers[0].mixer.norm.variance_epsilon == c.rms_norm_eps
    ids = torch.randint(0, 99, (3, 11))
    torch.testing.assert_close(logits(hf, ids), logits(ours, ids), **TOL)


def test_round_trip_is_exact(tmp_path, seed, randomize):
    ours = our_model(randomize, ngroups=2, tie_embeddings=False, rms_norm_eps=1e-3,
                     dt_limit=(0.01, 2.0), bias=True, dt_min=0.002, dt_max=0.2,
                     dt_init_floor=1e-3)  # fmt: skip
    ours.save_pretrained(tmp_path)
    again = MambaLM.from_pretrained(tmp_path)
    names = ("mixer", "d_model", "n_layers", "vocab_size", "d_state", "d_conv", "expand",
             "headdim", "ngroups", "chunk_size", "rms_norm_eps", "bias", "conv_bias",
             "tie_embeddings", "dt_min", "dt_max", "dt_init_floor", "dt_limit", "d_ssm",
             "D_has_hdim", "rmsnorm", "norm_before_gate", "nheads")  # fmt: skip
    for n in names:
        assert getattr(again.config, n) == getattr(ours.config, n), n
    sa, sb = ours.state_dict(), again.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=0, msg=k)
    ids = torch.randint(0, 100, (2, 9))
    torch.testing.assert_close(logits(again, ids), logits(ours, ids), rtol=0, atol=0)


# ---------------------------------------------------------------- state-spaces format

SS_VARIANTS = {
    # mamba_ssm's defaults but the sizes; two groups
    "defaults-G2": dict(ngroups=2),
    # what transformers cannot run: D per channel, the norm before the gate; a dt clamp
    "Dhdim-normfirst-dtlimit": dict(D_has_hdim=True, norm_before_gate=True, dt_limit=[0.01, 0.5]),
    # d_ssm == d_inner written out (the same model as None)
    "dssm-full": dict(d_ssm=128),
    # no gated norm: y * silu(z)
    "no-gated-norm": dict(rmsnorm=False, expand=3, headdim=32),
}


@pytest.mark.parametrize("safetensors", [False, True], ids=["bin", "safetensors"])
@pytest.mark.parametrize("variant", list(SS_VARIANTS))
def test_state_spaces_format_loads_to_identical_logits(
    tmp_path, seed, randomize, variant, safetensors
):
    ssm = SS_VARIANTS[variant]
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in ssm.items()}
    ref = our_model(randomize, vocab_size=97, pad_vocab_size_multiple=16, **fields)
    assert ref.backbone.embeddings.weight.shape[0] == 112
    config = state_spaces_config(**ssm)
    write_state_spaces(tmp_path, state_dict_as_mamba_ssm(ref), config, safetensors)
    ours = MambaLM.from_pretrained(tmp_path)
    for k, v in fields.items():
        assert getattr(ours.config, k) == v, k
    assert ours.config.vocab_size == 112 and ours.lm_head.weight is ours.backbone.embeddings.weight
    ids = torch.randint(0, 97, (2, 13))
    torch.testing.assert_close(logits(ours, ids), logits(ref, ids), rtol=0, atol=0)


def test_state_spaces_gated_mlp_beside_the_ssm(tmp_path, seed, randomize):
    """d_ssm < d_inner: in_proj's rows and out_proj's columns include mamba_ssm's gated MLP
    (d_mlp = d_inner - d_ssm; transformers cannot run it)."""
    ref = our_model(randomize, vocab_size=97, pad_vocab_size_multiple=16, d_ssm=96)
    write_state_spaces(tmp_path, state_dict_as_mamba_ssm(ref), state_spaces_config(d_ssm=96))
    ours = MambaLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 97, (2, 13))
    torch.testing.assert_close(logits(ours, ids), logits(ref, ids), rtol=0, atol=0)


def test_released_state_spaces_config_reads_as_the_preset():
    released = {"d_model": 768, "d_intermediate": 0, "n_layer": 24, "vocab_size": 50277,
                "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {},
                "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
                "pad_vocab_size_multiple": 16, "tie_embeddings": True}  # fmt: skip
    cfg, fmt = config_from_json(released)
    preset = MambaConfig.preset("130m-mamba2")
    assert fmt == "state-spaces"
    for n in ("mixer", "d_model", "n_layers", "vocab_size", "d_state", "d_conv", "expand",
              "headdim", "ngroups", "chunk_size", "d_ssm", "D_has_hdim", "rmsnorm",
              "norm_before_gate", "dt_limit", "A_init_range", "bias", "conv_bias",
              "tie_embeddings", "rms_norm_eps"):  # fmt: skip
        assert getattr(cfg, n) == getattr(preset, n), n
    assert cfg.vocab_size == 50288 and cfg.dt_limit == (0.0, math.inf)


def test_what_transformers_cannot_run_is_saved_in_mamba_ssm_format(tmp_path, seed, randomize):
    ours = our_model(randomize, D_has_hdim=True, norm_before_gate=True)
    ours.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in meta  # transformers could not run it
    mamba_ssm_fields = {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg",
                        "attn_layer_idx", "attn_cfg", "rms_norm", "residual_in_fp32",
                        "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"}  # fmt: skip
    assert set(meta) == mamba_ssm_fields
    ssm = meta["ssm_cfg"]
    assert ssm["layer"] == "Mamba2" and ssm["D_has_hdim"] is True and ssm["d_ssm"] is None
    assert ssm["norm_before_gate"] is True and ssm["ngroups"] == 1
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert "backbone.embedding.weight" in keys and "lm_head.weight" not in keys
    again = MambaLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 100, (2, 9))
    torch.testing.assert_close(logits(again, ids), logits(ours, ids), rtol=0, atol=0)


def test_unwritable_config_refused_before_anything_is_written(tmp_path, randomize):
    target = tmp_path / "ckpt"
    ours = MambaLM(MambaConfig(**OURS, D_has_hdim=True, rms_norm_eps=1e-3))
    with pytest.raises(CheckpointError, match=r"rms_norm_eps.*D_has_hdim|D_has_hdim.*rms_norm_eps"):
        ours.save_pretrained(target)
    assert not target.exists() or not any(target.iterdir())
    old = our_model(randomize)
    old.save_pretrained(target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(CheckpointError, match="rms_norm_eps"):
        ours.save_pretrained(target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


# ---------------------------------------------------------------- bad input, named


def test_missing_tensor_named(tmp_path, seed, randomize):
    hf_dir(tmp_path, randomize)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["backbone.layers.1.mixer.dt_bias"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.1\.mixer\.dt_bias"):
        MambaLM.from_pretrained(tmp_path)


def test_misshaped_tensor_named(tmp_path, seed, randomize):
    hf_dir(tmp_path, randomize)
    sd = load_file(tmp_path / "model.safetensors")
    sd["backbone.layers.0.mixer.conv1d.weight"] = torch.zeros(192, 1, 3)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.0\.mixer\.conv1d\.weight"):
        MambaLM.from_pretrained(tmp_path)


def test_misshaped_state_spaces_tensor_named(tmp_path, seed, randomize):
    """A file whose D is per channel under a config that says per head."""
    ref = our_model(randomize, D_has_hdim=True, vocab_size=97, pad_vocab_size_multiple=16)
    write_state_spaces(tmp_path, state_dict_as_mamba_ssm(ref), state_spaces_config())
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.0\.mixer\.D\b"):
        MambaLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(d_intermediate=256), "d_intermediate"),
        (dict(attn_layer_idx=[1], attn_cfg={"num_heads": 2}), "attn_layer_idx"),
        (dict(rms_norm=False), "rms_norm"),
        (dict(ssm_cfg={"layer": "Mamba3"}), r"ssm_cfg\.layer 'Mamba3'"),
        (
            dict(ssm_cfg={"layer": "Mamba2", "learnable_init_states": True}),
            "learnable_init_states",
        ),
        (dict(norm_epsilon=1e-6), "norm_epsilon"),
        (dict(ssm_cfg={"layer": "Mamba2", "headdim": 48}), "headdim"),
    ],
    ids=["mlp", "attention", "layernorm", "layer-Mamba3", "unknown-kwarg", "eps", "headdim"],
)
def test_state_spaces_refusals_named(tmp_path, seed, randomize, changes, pattern):
    ref = our_model(randomize, vocab_size=97, pad_vocab_size_multiple=16)
    write_state_spaces(tmp_path, state_dict_as_mamba_ssm(ref), {**state_spaces_config(), **changes})
    with pytest.raises(CheckpointError, match=pattern):
        MambaLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(num_heads=4), "num_heads 4"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rms_norm=False), "rms_norm"),
        (dict(norm_before_gate=True), "norm_before_gate"),
        (dict(n_groups=3), "ngroups"),
    ],
    ids=["num_heads", "hidden_act", "rms_norm", "norm_before_gate", "n_groups"],
)
def test_transformers_refusals_named(tmp_path, seed, randomize, changes, pattern):
    hf_dir(tmp_path, randomize)
    edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=pattern):
        MambaLM.from_pretrained(tmp_path)
