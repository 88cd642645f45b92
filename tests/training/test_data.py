"""Text data: tokenizers, reading files, packing into rows with seq_idx, the validation
split, the shuffled row sampler and its cursor."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from mambakit.text import ByteTokenizer, HFTokenizer, TextStream, load_tokenizer
from mambakit.training import (
    PackedRows,
    RowBatches,
    build_splits,
    default_corpus_files,
    eval_batches,
    read_documents,
)
from mambakit.training.data import RowSampler, pack_documents

# -- tokenizers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["", "hello, world\n", "naïve café — 日本語 🐍", "tabs\tand\r\nnewlines\x00"]
)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids) and tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text  # tensors of ids decode too


def test_byte_tokenizer_decodes_a_cut_character_without_raising():
    ids = ByteTokenizer().encode("é")[:1]
    assert ByteTokenizer().decode(ids) == "\ufffd"


def test_byte_tokenizer_skips_ids_past_the_bytes():
    """A byte-level model with a padded vocabulary (`mambakit train --preset 130m`: 50280)
    can draw an id past 255: it decodes to nothing, as an id outside a tokenizer.json's
    vocabulary does, in `decode` and in a `TextStream` alike."""
    tok = ByteTokenizer()
    ids = [*"é".encode(), 300, *b"a", 50279]
    assert tok.decode(ids) == "éa"
    stream = TextStream(tok, [])
    assert "".join(stream.push(t) for t in ids) + stream.flush() == "éa"


def test_load_tokenizer_byte():
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def write_bpe_tokenizer(path: Path) -> Path:
    """A tiny byte-level BPE trained on a few strings with the `tokenizers` package."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = ["def f(x):\n    return x + 1\n", "the quick brown fox", "def g(): pass"] * 5
    tok.train_from_iterator(corpus, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def test_hf_tokenizer_from_file_and_folder(tmp_path):
    file = write_bpe_tokenizer(tmp_path / "tok")
    for spec in (file, file.parent, str(file)):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        text = "def f(x):\n    return the fox\n"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode())  # merges were learned and are used
        assert 256 < tok.vocab_size <= 300
        assert max(ids) < tok.vocab_size


def test_hf_tokenizer_packs_rows(tmp_path):
    tok = load_tokenizer(write_bpe_tokenizer(tmp_path / "tok"))
    docs = ["def f(x):\n    return x + 1\n" * 3, "the quick brown fox " * 4]
    rows = pack_documents(docs, tok, seqlen=5)
    assert rows.tokens.tolist() == tok.encode(docs[0]) + tok.encode(docs[1])
    assert len(rows) == (rows.tokens.numel() - 1) // 5


def test_hf_tokenizer_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere" / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)  # a folder without one


# -- reading documents ----------------------------------------------------------------------


def test_read_documents_files_and_folders(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bee")
    (folder / "a.py").write_text("print('a')")
    (folder / "sub" / "c.md").write_text("# see")
    (folder / "image.png").write_bytes(b"\x89PNG\r\n")  # not a text suffix: ignored
    (folder / "binary.txt").write_bytes(b"\xff\xfe\x00bad")  # not UTF-8 inside a folder: skipped
    (folder / "empty.txt").write_text("")  # empty: dropped
    single = tmp_path / "single.txt"
    single.write_text("one")
    docs = read_documents([folder, single])
    names = [Path(n).relative_to(tmp_path).as_posix() for n, _ in docs]
    assert names == ["corpus/a.py", "corpus/b.txt", "corpus/sub/c.md", "single.txt"]
    assert [t for _, t in docs] == ["print('a')", "bee", "# see", "one"]


def test_read_documents_missing_path(tmp_path):
    missing = tmp_path / "no_such_file.txt"
    with pytest.raises(FileNotFoundError, match="no_such_file.txt"):
        read_documents([missing])


def test_read_documents_non_utf8_file_named_explicitly(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt.*UTF-8"):
        read_documents([bad])


def test_read_documents_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        read_documents([tmp_path / "empty"])
    (tmp_path / "only_images").mkdir()
    (tmp_path / "only_images" / "x.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="only_images.*no text files"):
        read_documents([tmp_path / "only_images"])


def test_read_documents_all_empty(tmp_path):
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_documents([tmp_path / "a.txt"])


def test_default_corpus_is_the_stdlib_top_level():
    files = default_corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files) and len(files) > 50
    assert all(f.parent == stdlib and f.suffix == ".py" for f in files)
    assert stdlib / "os.py" in files
    assert read_documents(files[:2]) == read_documents(None)[:2]  # None -> the default


# -- packing --------------------------------------------------------------------------------


def expected_row(stream: list[int], doc: list[int], r: int, S: int):
    """Row r written out by hand: the slice, its shifted targets, its document indices."""
    tok, dd = stream[r * S : r * S + S + 1], doc[r * S : r * S + S + 1]
    targets = [tok[t + 1] if dd[t + 1] == dd[t] else -100 for t in range(S)]
    seq_idx, cur = [], 0
    for t in range(S):
        if t > 0 and dd[t] != dd[t - 1]:
            cur += 1
        seq_idx.append(cur)
    return tok[:S], targets, seq_idx


@pytest.mark.parametrize("S", [4, 7, 16])
def test_packing_targets_and_seq_idx(S):
    docs = ["abc", "defghij", "k", "lmnopqrstuvwxyz", "0123", "56", "789abcdefghijklmnop"]
    tok = ByteTokenizer()
    rows = pack_documents(docs, tok, S)
    stream = [i for d in docs for i in tok.encode(d)]
    doc = [k for k, d in enumerate(docs) for _ in d]
    assert rows.tokens.tolist() == stream
    assert len(rows) == (len(stream) - 1) // S
    batch = rows.rows(torch.arange(len(rows)))
    assert batch["input_ids"].dtype == torch.int64 and batch["seq_idx"].dtype == torch.int32
    for r in range(len(rows)):
        ids, targets, seq_idx = expected_row(stream, doc, r, S)
        assert batch["input_ids"][r].tolist() == ids
        assert batch["targets"][r].tolist() == targets
        assert batch["seq_idx"][r].tolist() == seq_idx
    # every token but the first of a document is a target somewhere (stride S, rows S + 1)
    n_targets = int((batch["targets"] != -100).sum())
    covered = len(rows) * S
    boundaries = sum(1 for t in range(1, covered + 1) if doc[t] != doc[t - 1])
    assert n_targets == covered - boundaries


def test_packing_a_row_inside_one_document():
    rows = pack_documents(["x" * 40], ByteTokenizer(), 8)
    b = rows.rows(torch.tensor([2]))
    assert (b["seq_idx"] == 0).all() and (b["targets"] != -100).all()


def test_packed_rows_feed_the_model_consistently():
    """A packed row with seq_idx gives the same per-document losses as the documents
    run one by one (the contract the targets' -100s and seq_idx exist for)."""
    from mambakit import MambaConfig, MambaLM
    from mambakit.training import lm_loss

    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layers=2, vocab_size=256, d_state=4)).double()
    docs = ["hello there", "general kenobi!", "abc"]
    rows = PackedRows(*_stream(docs), seqlen=len("".join(docs)) - 1)
    batch = rows.rows(torch.tensor([0]))
    with torch.no_grad():
        packed, _ = lm_loss(model, batch, None)
        alone = 0.0
        for d in docs:
            ids = torch.tensor([list(d.encode())])
            one = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
            alone += float(lm_loss(model, one, None)[0])
    assert float(packed) == pytest.approx(alone, rel=1e-6)  # lm_loss sums in f32


def _stream(docs):
    tok = ByteTokenizer()
    ids = [i for d in docs for i in tok.encode(d)]
    doc = [k for k, d in enumerate(docs) for _ in tok.encode(d)]
    return torch.tensor(ids), torch.tensor(doc)


# -- the validation split -------------------------------------------------------------------


def write_docs(folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(n):
        text = f"<document {i:03d}> " + "lorem ipsum " * (2 + i % 3)
        (folder / f"doc_{i:03d}.txt").write_text(text)
        texts.append(text)
    return texts


def decoded_docs(rows: PackedRows) -> list[str]:
    tok = ByteTokenizer()
    out = []
    for k in rows.doc.unique().tolist():
        out.append(tok.decode(rows.tokens[rows.doc == k].tolist()))
    return out


def write_lines(path: Path, n_lines: int, tag: str = "") -> str:
    """A file of distinct numbered lines, so a held-out tail cannot occur in the rest."""
    text = "".join(f"{tag}line {i:04d}: value = {i * 7919 % 10007}\n" for i in range(n_lines))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def test_validation_split_rule(tmp_path):
    """At least val_every documents: every val_every-th is held out whole (the embedded
    corpus's rule, unchanged so runs stay comparable)."""
    texts = write_docs(tmp_path / "c", 45)
    train, val = build_splits([tmp_path / "c"], ByteTokenizer(), seqlen=16)
    want_val = [t for i, t in enumerate(texts) if i % 20 == 10]  # documents 10, 30
    assert decoded_docs(val) == want_val
    assert decoded_docs(train) == [t for i, t in enumerate(texts) if i % 20 != 10]
    assert val.note == train.note == "validation: every 20th document held out (2 of 45 files)"
    train5, val5 = build_splits([tmp_path / "c"], ByteTokenizer(), seqlen=16, val_every=5)
    assert decoded_docs(val5) == [t for i, t in enumerate(texts) if i % 5 == 2]
    assert len(decoded_docs(train5)) == 45 - 9
    assert val5.note == "validation: every 5th document held out (9 of 45 files)"
    texts = write_docs(tmp_path / "d", 20)  # exactly val_every documents: still the rule
    train, val = build_splits([tmp_path / "d"], ByteTokenizer(), seqlen=16)
    assert decoded_docs(val) == [texts[10]]
    assert decoded_docs(train) == texts[:10] + texts[11:]


def test_one_file_holds_out_its_tail(tmp_path):
    """One file: its last lines (about 1/val_every) are validated on and never trained on."""
    text = write_lines(tmp_path / "one.txt", 300)
    train, val = build_splits([tmp_path / "one.txt"], ByteTokenizer(), seqlen=64)
    assert len(train) > 0 and len(val) > 0 and val.seqlen == 64
    (head,), (tail,) = decoded_docs(train), decoded_docs(val)
    assert head + tail == text
    assert tail not in head and tail.splitlines()[0] not in head
    assert head.endswith("\n")  # cut at a line start
    assert len(text) / 20 <= len(tail) < 2 * len(text) / 20
    assert val.note == train.note == "validation: the last 5% of each file held out (1 file)"


@pytest.mark.parametrize("n_files", [2, 5, 19])
def test_several_small_files_each_hold_out_a_tail(tmp_path, n_files):
    """Fewer files than val_every: every file contributes its tail to validation."""
    texts = [
        write_lines(tmp_path / "c" / f"f{k:02d}.txt", 40, tag=f"f{k} ") for k in range(n_files)
    ]
    train, val = build_splits([tmp_path / "c"], ByteTokenizer(), seqlen=32)
    heads, tails = decoded_docs(train), decoded_docs(val)
    assert len(heads) == len(tails) == n_files
    all_train = "".join(heads)
    for text, head, tail in zip(texts, heads, tails):
        assert head + tail == text and head.endswith("\n")
        assert tail and tail not in all_train
    assert val.note == f"validation: the last 5% of each file held out ({n_files} files)"


def test_a_file_too_small_to_split_names_it(tmp_path):
    """Its held-out tail would not fill one row: an error, not validation on training text."""
    text = write_lines(tmp_path / "small.txt", 20)
    n = len(text)
    with pytest.raises(
        ValueError, match=rf"^data: '.*small\.txt' \({n:,} tokens\).*seqlen \+ 1 = 65"
    ):
        build_splits([tmp_path / "small.txt"], ByteTokenizer(), seqlen=64)
    train, val = build_splits([tmp_path / "small.txt"], ByteTokenizer(), seqlen=8)
    assert len(val) > 0  # a smaller seqlen fits


def test_held_out_documents_shorter_than_a_row_are_an_error(tmp_path):
    """The validation rows are as long as the training rows, never shortened to fit."""
    write_docs(tmp_path / "c", 20)
    (tmp_path / "c" / "doc_010.txt").write_text("short")  # the one held out
    with pytest.raises(ValueError, match=r"^data: 20 files .*5 tokens held out.*every 20th"):
        build_splits([tmp_path / "c"], ByteTokenizer(), seqlen=8)


def test_split_errors(tmp_path):
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(ValueError, match="seqlen"):
        build_splits([tmp_path / "short.txt"], ByteTokenizer(), seqlen=1)
    with pytest.raises(ValueError, match="short.txt.*training tokens"):
        build_splits([tmp_path / "short.txt"], ByteTokenizer(), seqlen=64)
    with pytest.raises(ValueError, match="val_every"):
        build_splits([tmp_path / "short.txt"], ByteTokenizer(), seqlen=2, val_every=1)


def test_eval_batches_are_the_first_rows_in_order():
    rows = pack_documents(["abcdefghijklmnopqrstuvwxyz" * 3], ByteTokenizer(), 4)
    n = len(rows)
    batches = eval_batches(rows, batch_size=3, n_batches=2)
    got = torch.cat([b["input_ids"] for b in batches])
    assert got.tolist() == rows.rows(torch.arange(6))["input_ids"].tolist()
    many = eval_batches(rows, batch_size=5, n_batches=100)
    assert sum(b["input_ids"].shape[0] for b in many) == n
    assert (
        torch.cat([b["input_ids"] for b in many]).tolist()
        == rows.rows(torch.arange(n))["input_ids"].tolist()
    )


# -- sampling rows --------------------------------------------------------------------------


def test_row_sampler_covers_each_row_once_per_epoch():
    s = RowSampler(12, batch_size=4, seed=3)
    epochs = []
    for _ in range(3):
        epochs.append(torch.cat([s.next() for _ in range(3)]).tolist())
    for e in epochs:
        assert sorted(e) == list(range(12))
    assert epochs[0] != epochs[1]  # reshuffled every epoch
    assert s.state_dict()["epoch"] == 2


def test_row_sampler_with_a_remainder_never_repeats_within_an_epoch():
    s = RowSampler(10, batch_size=4, seed=0)
    seen = []
    for _ in range(2 * 5):  # 2 batches of 4 per epoch; the 2 left over wait for a reshuffle
        seen.append(s.next())
    for epoch in range(5):
        e = torch.cat(seen[2 * epoch : 2 * epoch + 2]).tolist()
        assert len(set(e)) == 8


def test_row_sampler_depends_on_the_seed_only():
    a = [RowSampler(20, 5, seed=1).next().tolist() for _ in range(2)]
    b = RowSampler(20, 5, seed=2).next().tolist()
    assert a[0] == a[1] and a[0] != b


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5], ids=lambda k: f"after{k}")
def test_row_sampler_state_round_trip(k):
    a = RowSampler(9, batch_size=3, seed=7)
    for _ in range(k):
        a.next()
    sd = a.state_dict()
    b = RowSampler(9, batch_size=3, seed=7)
    b.load_state_dict(dict(sd))
    assert b.state_dict() == sd
    for _ in range(7):
        assert torch.equal(a.next(), b.next())


def test_row_sampler_takes_every_seed_and_keeps_the_order_of_small_ones():
    """A large seed shuffles (its mix overflowed torch's 64-bit seed); a small one keeps the
    order it always had, so runs resume into the same batches."""
    big = RowSampler(9, batch_size=3, seed=(1 << 63) - 2)
    assert sorted(torch.cat([big.next() for _ in range(3)]).tolist()) == list(range(9))
    small = RowSampler(9, batch_size=3, seed=7)
    g = torch.Generator().manual_seed(7 * 1_000_003)
    assert torch.equal(torch.cat([small.next() for _ in range(3)]), torch.randperm(9, generator=g))


def test_row_sampler_resumed_with_another_seed_continues_the_checkpoints_order():
    """The cursor (epoch, offset) is a place in one seed's order: loaded into a sampler of
    another seed (a resume with another --seed) it trained some rows of the epoch twice and
    others never. It carries its seed; the oracle is the uninterrupted sampler."""
    a = RowSampler(12, batch_size=4, seed=7)
    first = a.next()
    b = RowSampler(12, batch_size=4, seed=8)
    b.load_state_dict(a.state_dict())
    rest = [b.next() for _ in range(5)]
    assert sorted(torch.cat([first, *rest[:2]]).tolist()) == list(range(12))  # one epoch
    for got in rest:
        assert torch.equal(got, a.next())
    old = {k: v for k, v in a.state_dict().items() if k != "seed"}  # older checkpoints
    c = RowSampler(12, batch_size=4, seed=7)
    c.load_state_dict(old)
    assert torch.equal(c.next(), a.next())


def test_row_batches_state_round_trip():
    rows = pack_documents(["the quick brown fox jumps over the lazy dog " * 5], ByteTokenizer(), 8)
    a = RowBatches(rows, 3, seed=4)
    for _ in range(4):
        a.next()
    b = RowBatches(rows, 3, seed=4)
    b.load_state_dict(a.state_dict())
    for _ in range(6):
        x, y = a.next(), b.next()
        assert x.keys() == y.keys() == {"input_ids", "targets", "seq_idx"}
        for key in x:
            assert torch.equal(x[key], y[key])


def test_row_sampler_errors():
    with pytest.raises(ValueError, match="batch_size 5 exceeds the 4 rows"):
        RowSampler(4, batch_size=5, seed=0)
    s = RowSampler(9, batch_size=3, seed=0)
    with pytest.raises(ValueError, match="9 rows.*taken on 8"):
        s.load_state_dict({"epoch": 0, "offset": 3, "n_rows": 8})
