"""MambaConfig: presets match the released checkpoints, validation names the field."""

from __future__ import annotations

import math

import pytest
import torch

from mambakit import MambaConfig, MambaLM


def expected_lm_params(d_model, n_layers, vocab, d_state=16, d_conv=4, expand=2, tied=True):
    """Parameter count of a Mamba-1 LM (conv bias, no linear bias), derived by hand."""
    D = expand * d_model
    R = math.ceil(d_model / 16)
    layer = (
        d_model * 2 * D  # in_proj
        + D * d_conv
        + D  # conv1d weight + bias
        + (R + 2 * d_state) * D  # x_proj
        + R * D
        + D  # dt_proj weight + bias
        + D * d_state  # A_log
        + D  # D
        + D * d_model  # out_proj
        + d_model  # norm
    )
    head = 0 if tied else vocab * d_model
    return vocab * d_model + n_layers * layer + d_model + head


def count_params(model):
    return sum(p.numel() for p in model.parameters())  # shared (tied) params counted once


def meta_model(cfg):
    with torch.device("meta"):
        return MambaLM(cfg)


RELEASED = {
    "130m": (768, 24),
    "370m": (1024, 48),
    "790m": (1536, 48),
    "1.4b": (2048, 48),
    "2.8b": (2560, 64),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_presets(name):
    cfg = MambaConfig.preset(name)
    assert (cfg.d_model, cfg.n_layers) == RELEASED[name]
    assert (cfg.d_state, cfg.d_conv, cfg.expand) == (16, 4, 2)
    assert cfg.vocab_size == 50280
    assert cfg.dt_rank == math.ceil(cfg.d_model / 16)
    assert cfg.d_inner == 2 * cfg.d_model
    assert cfg.tie_embeddings is True


def test_130m_parameter_count():
    cfg = MambaConfig.preset("130m")
    n = count_params(meta_model(cfg))
    assert n == expected_lm_params(768, 24, 50280) == 129_135_360


def test_tiny_preset_is_about_one_million_params():
    cfg = MambaConfig.preset("tiny")
    assert cfg.vocab_size == 256
    model = MambaLM(cfg)
    n = count_params(model)
    assert 500_000 <= n <= 2_000_000, n
    assert n == expected_lm_params(
        cfg.d_model, cfg.n_layers, 256, cfg.d_state, cfg.d_conv, cfg.expand
    )


def test_preset_overrides_and_unknown_name():
    cfg = MambaConfig.preset("tiny", n_layers=1, d_state=4)
    assert cfg.n_layers == 1 and cfg.d_state == 4 and cfg.vocab_size == 256
    with pytest.raises(ValueError, match="3b"):
        MambaConfig.preset("3b")


def test_derived_fields():
    cfg = MambaConfig(d_model=100, n_layers=1, vocab_size=50277, d_state=4)
    assert cfg.dt_rank == 7  # ceil(100 / 16)
    assert cfg.vocab_size == 50280  # padded to a multiple of 8
    assert cfg.d_inner == 200
    assert (
        MambaConfig(d_model=8, n_layers=1, vocab_size=13, pad_vocab_size_multiple=1).vocab_size
        == 13
    )
    assert (
        MambaConfig(d_model=8, n_layers=1, vocab_size=13, pad_vocab_size_multiple=16).vocab_size
        == 16
    )
    assert MambaConfig(d_model=8, n_layers=1, vocab_size=16, dt_rank=3).dt_rank == 3


@pytest.mark.parametrize(
    "field, value",
    [
        ("d_model", -4),
        ("d_model", 0),
        ("n_layers", -1),
        ("vocab_size", 0),
        ("d_state", -16),
        ("d_conv", 1),
        ("d_conv", -3),
        ("expand", 0),
        ("dt_rank", 0),
        ("input_dim", -3),
        ("rms_norm_eps", 0.0),
        ("rms_norm_eps", float("nan")),
        ("pad_vocab_size_multiple", 0),
        ("dt_init", "xavier"),
        ("dt_scale", -1.0),
        ("initializer_range", None),
        ("d_model", 2.5),
        ("n_layers", True),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        MambaConfig(**{"d_model": 8, "n_layers": 1, "vocab_size": 16, field: value})


def test_dt_range_validation():
    with pytest.raises(ValueError, match="dt_min"):
        MambaConfig(d_model=8, n_layers=1, vocab_size=16, dt_min=0.2, dt_max=0.1)
    with pytest.raises(ValueError, match="dt_min"):
        MambaConfig(d_model=8, n_layers=1, vocab_size=16, dt_min=-0.1)
    with pytest.raises(ValueError, match="dt_init_floor"):
        MambaConfig(d_model=8, n_layers=1, vocab_size=16, dt_init_floor=0.0)


def test_dict_and_file_round_trip(tmp_path):
    cfg = MambaConfig(
        d_model=24, n_layers=3, vocab_size=50, d_state=5, d_conv=3, input_dim=7, bias=True
    )
    again = MambaConfig.from_dict(cfg.to_dict())
    assert again == cfg
    cfg.save(tmp_path / "c.json")
    assert MambaConfig.load(tmp_path / "c.json") == cfg
    extra = MambaConfig.from_dict({**cfg.to_dict(), "some_future_key": 1})
    assert extra.extra == {"some_future_key": 1} and extra.d_model == 24


def test_file_round_trip_keeps_extra(tmp_path):
    """`load` puts unknown keys in `extra` (a checkpoint's token ids); `save` writes them, so
    a saved config loads back equal."""
    extra = {"eos_token_id": 0, "bos_token_id": None}
    cfg = MambaConfig(d_model=24, n_layers=3, vocab_size=50, extra=dict(extra))
    cfg.save(tmp_path / "c.json")
    again = MambaConfig.load(tmp_path / "c.json")
    assert again.extra == extra and again == cfg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]  # no temporary left


@pytest.mark.parametrize(
    "field, value, message",
    [("norm_before_gate", "false", "True or False"), ("rmsnorm", 1, "True or False"),
     ("dt_limit", ("x", 1.0), "pair of numbers"), ("dt_limit", (0.5, 0.1), "dt_limit")],
)  # fmt: skip
def test_mamba2_fields_are_checked_by_name(field, value, message):
    with pytest.raises(ValueError, match=f"{field}.*{message}|{message}"):
        MambaConfig.preset("tiny-mamba2", **{field: value})


def test_mamba3_refuses_the_bias_it_has_no_place_for():
    """bias (in_proj and out_proj) is a field every mixer reads but Mamba-3's, whose
    projections have none (mamba_ssm's Mamba3): asking for it is an error, not a model
    built and saved without it."""
    with pytest.raises(ValueError, match="bias"):
        MambaConfig.preset("tiny-mamba3", bias=True)
    model = MambaLM(MambaConfig.preset("tiny-mamba3", n_layers=1))
    assert not any(n.endswith(".bias") for n, _ in model.named_parameters())
