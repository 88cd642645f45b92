"""Checkpoint formats: original state-spaces files, sharded safetensors, near relatives
refused, round trip, corrupt files named in the error, atomic save."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file
from transformers import MambaConfig as HFConfig
from transformers import MambaForCausalLM

from mambakit import MambaConfig, MambaLM

TOL = dict(rtol=1e-5, atol=2e-5)
HF_KW = dict(
    vocab_size=56, hidden_size=24, state_size=5, conv_kernel=3, num_hidden_layers=2, expand=2
)


def hf_model(randomize, **kw):
    model = MambaForCausalLM(HFConfig(**{**HF_KW, **kw})).eval()
    return randomize(model)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def write_original(path, hf, config):
    """The state-spaces/mamba layout: config.json (mamba_ssm fields) + pytorch_model.bin."""
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["backbone.embedding.weight"] = sd.pop("backbone.embeddings.weight")
    sd["lm_head.weight"] = sd["backbone.embedding.weight"].clone()
    torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(config))


def original_config(**kw):
    cfg = dict(
        d_model=24,
        n_layer=2,
        vocab_size=53,  # padded to 56 by pad_vocab_size_multiple
        ssm_cfg={"d_state": 5, "d_conv": 3, "expand": 2},
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=8,
        tie_embeddings=True,
        d_intermediate=0,
        attn_layer_idx=[],
        attn_cfg={},
    )
    cfg.update(kw)
    return cfg


def save_ours(path, seed_value=0, **kw):
    torch.manual_seed(seed_value)
    cfg = MambaConfig(d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=3, **kw)
    model = MambaLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


# ---------------------------------------------------------------- formats that load


def test_original_state_spaces_format(tmp_path, seed, randomize):
    hf = hf_model(randomize)
    write_original(tmp_path, hf, original_config())
    ours = MambaLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 53, (2, 7))
    with torch.no_grad():
        out = ours(ids)
    assert out.logits.shape == (2, 7, 56)
    torch.testing.assert_close(out.logits, hf_logits(hf, ids), **TOL)
    assert ours.lm_head.weight is ours.backbone.embeddings.weight


def test_original_format_empty_ssm_cfg_means_mamba1_defaults(tmp_path, seed, randomize):
    hf = hf_model(randomize, hidden_size=16, num_hidden_layers=1, state_size=16, conv_kernel=4)
    write_original(tmp_path, hf, original_config(d_model=16, n_layer=1, ssm_cfg={}))
    ours = MambaLM.from_pretrained(tmp_path)
    mixer = ours.backbone.layers[0].mixer
    assert mixer.A_log.shape == (32, 16) and mixer.conv1d.weight.shape == (32, 1, 4)
    ids = torch.randint(0, 53, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_logits(hf, ids), **TOL)


def test_sharded_safetensors(tmp_path, seed, randomize):
    hf = hf_model(randomize, tie_word_embeddings=False)
    with torch.no_grad():
        hf.lm_head.weight.copy_(torch.randn_like(hf.lm_head.weight) * 0.1)
    hf.save_pretrained(tmp_path, max_shard_size="10KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    ours = MambaLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 56, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_logits(hf, ids), **TOL)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_round_trip_is_exact(tmp_path, tie):
    model = save_ours(tmp_path, bias=True, tie_embeddings=tie, rms_norm_eps=1e-3)
    again = MambaLM.from_pretrained(tmp_path)
    assert_same_weights(model, again)
    for name in ("d_model", "n_layers", "vocab_size", "d_state", "d_conv", "expand", "dt_rank"):
        assert getattr(again.config, name) == getattr(model.config, name), name
    assert again.config.bias is True and again.config.tie_embeddings is tie
    assert again.config.rms_norm_eps == pytest.approx(1e-3)
    assert (again.lm_head.weight is again.backbone.embeddings.weight) is tie
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


# ---------------------------------------------------------------- refused relatives


def test_mamba1_weights_under_a_mamba2_original_config_refused(tmp_path, randomize):
    hf = hf_model(randomize)  # Mamba-1 tensors: they do not fit the Mamba-2 layer
    write_original(tmp_path, hf, original_config(ssm_cfg={"layer": "Mamba2", "d_state": 5}))
    with pytest.raises((ValueError, NotImplementedError), match=r"(?i)mamba-?2"):
        MambaLM.from_pretrained(tmp_path)


def test_hybrid_attention_original_format_refused(tmp_path, randomize):
    hf = hf_model(randomize)
    write_original(tmp_path, hf, original_config(attn_layer_idx=[1], attn_cfg={"num_heads": 2}))
    with pytest.raises((ValueError, NotImplementedError), match=r"(?i)attn|attention"):
        MambaLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "model_type, pattern",
    [("falcon_mamba", r"(?i)falcon"), ("mamba2", r"(?i)mamba-?2")],
    ids=["falcon_mamba", "mamba1-config-relabelled-mamba2"],
)
def test_hf_relatives_and_mislabelled_configs_refused(tmp_path, randomize, model_type, pattern):
    hf_model(randomize).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["model_type"] = model_type
    if model_type == "falcon_mamba":
        meta["mixer_rms_eps"] = 1e-6
        meta["architectures"] = ["FalconMambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises((ValueError, NotImplementedError), match=pattern):
        MambaLM.from_pretrained(tmp_path)


def test_a_mamba1_activation_other_than_silu_refused(tmp_path, randomize):
    """transformers' MambaForCausalLM with hidden_act gelu computes gelu where mambakit's
    layer computes silu: its weights would load and give other logits."""
    hf_model(randomize, hidden_act="gelu").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"hidden_act 'gelu'"):
        MambaLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "field, value",
    [("layer_norm_epsilon", None), ("layer_norm_epsilon", "1e-5"), ("time_step_min", None),
     ("hidden_size", None), ("hidden_size", "24"), ("time_step_scale", "x"),
     ("initializer_range", None)],
)  # fmt: skip
def test_a_config_value_of_the_wrong_type_is_a_checkpoint_error(tmp_path, randomize, field,
                                                                value):  # fmt: skip
    from mambakit.hf.errors import CheckpointError

    hf_model(randomize).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta[field] = value
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"config\.json"):
        MambaLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------- corrupt checkpoints


def rewrite_weights(path, edit):
    sd = load_file(path / "model.safetensors")
    edit(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_named(tmp_path):
    save_ours(tmp_path)
    rewrite_weights(tmp_path, lambda sd: sd.pop("backbone.layers.1.mixer.D"))
    with pytest.raises(ValueError, match=r"backbone\.layers\.1\.mixer\.D"):
        MambaLM.from_pretrained(tmp_path)


def test_misshaped_tensor_named(tmp_path):
    save_ours(tmp_path)

    def edit(sd):
        sd["backbone.layers.0.mixer.A_log"] = torch.zeros(32, 5)

    rewrite_weights(tmp_path, edit)
    with pytest.raises(ValueError, match=r"backbone\.layers\.0\.mixer\.A_log"):
        MambaLM.from_pretrained(tmp_path)


def test_extra_tensor_named(tmp_path):
    save_ours(tmp_path)

    def edit(sd):
        sd["backbone.layers.0.mixer.mystery"] = torch.zeros(3)

    rewrite_weights(tmp_path, edit)
    with pytest.raises(ValueError, match=r"backbone\.layers\.0\.mixer\.mystery"):
        MambaLM.from_pretrained(tmp_path)


def test_missing_untied_lm_head_named(tmp_path):
    save_ours(tmp_path, tie_embeddings=False)
    rewrite_weights(tmp_path, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        MambaLM.from_pretrained(tmp_path)


def test_truncated_safetensors_named(tmp_path):
    save_ours(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception, match=r"model\.safetensors") as info:
        MambaLM.from_pretrained(tmp_path)
    assert isinstance(info.value, (ValueError, OSError, RuntimeError)), type(info.value)


def test_malformed_shard_index_named(tmp_path, randomize):
    """An index that is not an object, or whose weight_map names no file for a tensor: a
    CheckpointError naming the index, not an AttributeError or TypeError from inside."""
    from mambakit.hf import CheckpointError

    hf_model(randomize).save_pretrained(tmp_path, max_shard_size="10KB")
    index = tmp_path / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    for bad in ([meta], {**meta, "weight_map": {**meta["weight_map"], "lm_head.weight": 3}}):
        index.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
            MambaLM.from_pretrained(tmp_path)


def test_config_json_read_as_utf8_whatever_the_locale(tmp_path, randomize):
    """config.json is JSON, so UTF-8 (a byte-order mark too) whatever the locale's encoding;
    bytes that are not UTF-8 are a CheckpointError naming the file."""
    from mambakit.hf import CheckpointError

    hf = hf_model(randomize)
    hf.save_pretrained(tmp_path)
    cfg = tmp_path / "config.json"
    text = cfg.read_text(encoding="utf-8")
    cfg.write_bytes(text.encode("utf-8-sig"))
    ids = torch.randint(0, 56, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(
            MambaLM.from_pretrained(tmp_path)(ids).logits, hf_logits(hf, ids), **TOL
        )
    cfg.write_bytes(text.replace('"mamba"', '"mamba\xe9"').encode("latin-1"))
    with pytest.raises(CheckpointError, match=r"config\.json"):
        MambaLM.from_pretrained(tmp_path)


def test_missing_files_named(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError, OSError), match="config.json|nope"):
        MambaLM.from_pretrained(tmp_path / "nope")
    save_ours(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises((FileNotFoundError, ValueError, OSError), match=r"safetensors|\.bin"):
        MambaLM.from_pretrained(tmp_path / "ckpt")


class _Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_pickle_checkpoint_loaded_with_weights_only(tmp_path, randomize):
    """pytorch_model.bin is never unpickled with arbitrary code execution."""
    hf = hf_model(randomize)
    write_original(tmp_path, hf, original_config())
    marker = tmp_path / "pwned"
    sd = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    sd["evil"] = _Evil(str(marker))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do; the marker is the check
        MambaLM.from_pretrained(tmp_path)
    assert not marker.exists()


# ---------------------------------------------------------------- atomic save


def _failing_writes(monkeypatch):
    """Make every safetensors write in mambakit write half a file, then fail."""

    def bad_save_file(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"\x00partial")
        raise OSError("simulated disk full")

    def bad_save(*args, **kwargs):
        raise OSError("simulated disk full")

    real = {safetensors.torch.save_file: bad_save_file, safetensors.torch.save: bad_save}
    monkeypatch.setattr(safetensors.torch, "save_file", bad_save_file)
    monkeypatch.setattr(safetensors.torch, "save", bad_save)
    patched = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("mambakit") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            for orig, fake in real.items():
                if value is orig:
                    monkeypatch.setattr(mod, attr, fake)
                    patched += 1
    return patched


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    old = save_ours(tmp_path, seed_value=1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    _failing_writes(monkeypatch)
    torch.manual_seed(2)
    new = MambaLM(MambaConfig(d_model=20, n_layers=3, vocab_size=40, d_state=2, d_conv=4))
    with pytest.raises(OSError, match="simulated"):
        new.save_pretrained(tmp_path)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before  # no temporary leftovers, nothing half-overwritten
    assert_same_weights(MambaLM.from_pretrained(tmp_path), old)


def test_failed_config_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    """Disk full while writing config.json (a Python-level file write; safetensors writes
    from Rust and succeeds): the directory must still hold the old, loadable checkpoint."""
    import builtins
    import io

    old = save_ours(tmp_path, seed_value=1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_open = io.open
    calls = []

    def failing_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            calls.append(file)
            raise OSError("simulated disk full")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", failing_open)
    monkeypatch.setattr(builtins, "open", failing_open)
    torch.manual_seed(2)
    new = MambaLM(MambaConfig(d_model=20, n_layers=3, vocab_size=40, d_state=2, d_conv=4))
    with pytest.raises(OSError, match="simulated"):
        new.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert calls
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(after) == sorted(before)
    assert after == before, "files of the previous checkpoint were replaced"
    assert_same_weights(MambaLM.from_pretrained(tmp_path), old)


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
@pytest.mark.parametrize("first", [True, False], ids=["over-a-checkpoint", "first-save"])
def test_save_interrupted_between_its_renames_keeps_both_old_files(tmp_path, monkeypatch, first,
                                                                   links):  # fmt: skip
    """Ctrl-C after the first of the two files was renamed into place: the folder holds the
    previous checkpoint (both files as they were; nothing at all on a first save), never the
    new weights beside the old config, and no temporary file."""
    from mambakit import files as hio  # the atomic write, whose os calls are patched

    target = tmp_path / "ckpt"
    old = save_ours(target, seed_value=1) if first else None
    before = {p.name: p.read_bytes() for p in target.iterdir()} if first else {}
    real, calls = os.replace, []

    def interrupted(a, b):
        if str(a).endswith(".tmp"):  # a new file going into place (not an old one aside)
            calls.append(b)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return real(a, b)

    def no_link(a, b):
        raise OSError("hard links not supported here")

    monkeypatch.setattr(hio.os, "replace", interrupted)
    if not links:
        monkeypatch.setattr(hio.os, "link", no_link)
    torch.manual_seed(2)
    new = MambaLM(MambaConfig(d_model=20, n_layers=3, vocab_size=40, d_state=2, d_conv=4))
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(target)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in target.iterdir()} if target.exists() else {}
    assert after == before
    if first:
        assert_same_weights(MambaLM.from_pretrained(target), old)


def test_failed_first_save_leaves_no_weights_file(tmp_path, monkeypatch):
    _failing_writes(monkeypatch)
    model = MambaLM(MambaConfig(d_model=16, n_layers=1, vocab_size=32, d_state=2))
    target = tmp_path / "ckpt"
    with pytest.raises(OSError, match="simulated"):
        model.save_pretrained(target)
    monkeypatch.undo()
    left = sorted(p.name for p in target.iterdir()) if target.exists() else []
    assert set(left) <= {"config.json"}, left  # no weights file, no temporary leftovers


def test_save_pretrained_creates_directory_and_replaces(tmp_path):
    target = tmp_path / "a" / "b"
    save_ours(target, seed_value=3)
    m2 = save_ours(target, seed_value=4, bias=True)
    assert_same_weights(MambaLM.from_pretrained(target), m2)
    names = sorted(os.listdir(target))
    assert "config.json" in names and "model.safetensors" in names
    assert all(not n.startswith(".") and "tmp" not in n for n in names), names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = MambaForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert hf.config.use_bias is True


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_saved_files_get_the_modes_the_umask_gives(tmp_path, mask):
    """save_pretrained writes through temporary files (mkstemp's mode is 0600): the files in
    place have the modes any new file gets under the process umask."""
    import os

    old = os.umask(mask)
    try:
        save_ours(tmp_path / "out")
        (tmp_path / "plain").write_text("")
    finally:
        os.umask(old)
    want = (tmp_path / "plain").stat().st_mode & 0o777
    assert want == 0o666 & ~mask
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == want, name


def test_a_float64_checkpoint_loads_as_float64_exactly(tmp_path):
    """A float64 model saved and read back with dtype=float64: every weight bit for bit (not
    rounded through float32 on the way)."""
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layers=2, vocab_size=32, d_state=4)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    model.save_pretrained(tmp_path)
    again = MambaLM.from_pretrained(tmp_path, dtype=torch.float64)
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert b.dtype == torch.float64 and torch.equal(a, b), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_saved_config_names_the_weights_dtype(tmp_path, dtype):
    """config.json's torch_dtype is the dtype the weights were written in, so transformers
    loads a bf16 checkpoint in bf16 (as for one it saved itself), not at twice the memory."""
    model = MambaLM(MambaConfig(d_model=16, n_layers=2, vocab_size=32, d_state=4)).to(dtype)
    model.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {dtype}
    assert MambaForCausalLM.from_pretrained(tmp_path).dtype == dtype


def test_from_pretrained_dtype_by_name_auto_and_refused(tmp_path):
    """dtype as a torch dtype's name, "auto" (the stored one), and what is not a floating
    dtype refused by name before anything is read."""
    model = MambaLM(MambaConfig(d_model=16, n_layers=2, vocab_size=32, d_state=4))
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    for dtype, want in [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                        ("auto", torch.bfloat16), (None, torch.float32)]:  # fmt: skip
        got = MambaLM.from_pretrained(tmp_path, dtype=dtype)
        assert {p.dtype for p in got.parameters()} == {want}, dtype
    assert_same_weights(MambaLM.from_pretrained(tmp_path, dtype="auto"), model)
    got = MambaLM.from_pretrained(tmp_path, dtype="torch.bfloat16")
    assert {p.dtype for p in got.parameters()} == {torch.bfloat16}
    for bad in ("int8", "nonsense", "Tensor", torch.int32, 16, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="dtype must be"):
            MambaLM.from_pretrained(tmp_path / "absent", dtype=bad)


def test_mamba3_config_of_a_wrong_type_is_a_checkpoint_error(tmp_path):
    from mambakit.hf import CheckpointError

    MambaLM(MambaConfig(d_model=16, n_layers=2, vocab_size=32, d_state=4, mixer="mamba3",
                        headdim=8)).save_pretrained(tmp_path)  # fmt: skip
    meta = json.loads((tmp_path / "config.json").read_text())
    key = next(k for k in meta if "eps" in k)
    meta[key] = None
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="config.json"):
        MambaLM.from_pretrained(tmp_path)
