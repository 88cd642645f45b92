"""Text data: tokenizers, the embedded default corpus, packing into fixed-length rows.

A corpus is a list of documents. Tokenised documents are concatenated into one
stream, each token tagged with its document index, and the stream is cut into
rows of `seqlen + 1` tokens (stride `seqlen`, so every row's last input has a
target). A row gives
    input_ids [S]  the tokens 0..S-1
    targets   [S]  the tokens 1..S (-100 where the next token starts a new document)
    seq_idx   [S]  int32 document index inside the row, from 0 (resets the state)
The validation split is held out by a fixed rule, so runs are comparable: every
`val_every`-th document when there are at least `val_every` of them (the embedded corpus),
otherwise about the last 1/val_every of every document (`build_splits` says exactly);
validation text is never trained on.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ..targets import next_token_targets
from ..text import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: F401 (also here)

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".toml", ".cfg", ".csv"}


def default_corpus_files() -> list[Path]:
    """The embedded corpus: the top-level modules of this Python's standard library
    (`<stdlib>/*.py`, sorted by name; 168 files, 4.7 MB on CPython 3.11)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no Python files found in the standard library at {stdlib}")
    return files


def read_documents(paths: list[str | Path] | None) -> list[tuple[str, str]]:
    """(name, text) for each file; folders are walked (text suffixes only, sorted).

    An explicitly named file that is missing or not UTF-8 text is an error; inside a
    folder, files that are not text (not UTF-8, or holding NUL bytes) are skipped."""
    if not paths:
        paths = default_corpus_files()
    docs = []
    binary: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not files:
                raise ValueError(f"data: folder {str(p)!r} holds no text files ({TEXT_SUFFIXES})")
            for f in files:
                text = _read_text(f)
                if text is None:
                    binary.append(f)  # a binary file with a text suffix: skipped
                else:
                    docs.append((str(f), text))
        elif p.is_file():
            text = _read_text(p)
            if text is None:
                raise ValueError(f"data: {str(p)!r} is not UTF-8 text (a binary file?)")
            docs.append((str(p), text))
        else:
            raise FileNotFoundError(f"data: {str(p)!r} does not exist")
    n_empty = sum(1 for _, t in docs if not t)
    docs = [(n, t) for n, t in docs if t]
    if not docs:
        named = ", ".join(repr(str(p)) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
        raise ValueError(
            f"data: no text in {named}: {len(binary)} file(s) are not UTF-8 text "
            f"(binary, skipped) and {n_empty} are empty"
        )
    return docs


def _read_text(path: Path) -> str | None:
    """The file's UTF-8 text; None when it is binary (not UTF-8, or holds NUL bytes)."""
    raw = path.read_bytes()
    if b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass
class PackedRows:
    """A token stream cut into rows; row r covers stream[r*S : r*S + S + 1]."""

    tokens: torch.Tensor  # [n_tokens] int64
    doc: torch.Tensor  # [n_tokens] int64 document index
    seqlen: int
    note: str = ""  # one line on how the rows were chosen (build_splits: the held-out rule)

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seqlen)

    def rows(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Batch of rows [len(index), S]: input_ids, targets, seq_idx."""
        S = self.seqlen
        pos = index.view(-1, 1) * S + torch.arange(S + 1)  # [b, S+1]
        tok, doc = self.tokens[pos], self.doc[pos]
        targets = next_token_targets(tok, doc)
        seq_idx = (doc[:, :-1] - doc[:, :1]).to(torch.int32)
        return {"input_ids": tok[:, :-1], "targets": targets, "seq_idx": seq_idx}


def pack_documents(docs: list[str], tokenizer, seqlen: int) -> PackedRows:
    ids, doc_ids = [], []
    for i, text in enumerate(docs):
        t = tokenizer.encode(text)
        ids.extend(t)
        doc_ids.extend([i] * len(t))
    return PackedRows(torch.tensor(ids, dtype=torch.int64), torch.tensor(doc_ids), seqlen)


def build_splits(
    paths, tokenizer, seqlen: int, val_every: int = 20
) -> tuple[PackedRows, PackedRows]:
    """(train, validation) rows of the documents in `paths` (None: the embedded corpus).

    The validation part is held out by one of two fixed rules:
    - at least `val_every` documents: document i is held out whole when
      i % val_every == val_every // 2 (the rule of the embedded corpus);
    - fewer (one file, a few files): every document is cut in two and its tail held out, so
      every file is validated on. The tail is the last ceil(n / val_every) of its n
      characters, extended back to the start of its line when a line starts within as many
      characters again (so 1/val_every to 2/val_every of the text), else cut mid-line.
    The parts are packed as separate documents: no row of training text reaches into
    validation text. Each part must fill at least one row of seqlen + 1 tokens, else
    ValueError (naming the files and their token count). Both rows carry the rule in
    `note`, one line, e.g. "validation: every 20th document held out (8 of 168 files)".
    """
    if seqlen < 2:
        raise ValueError(f"seqlen must be at least 2, got {seqlen}")
    if val_every < 2:
        raise ValueError(f"val_every must be at least 2, got {val_every}")
    docs = read_documents(paths)
    files = _count(len(docs), "file")
    if len(docs) >= val_every:
        pick = val_every // 2
        train_docs = [t for i, (_, t) in enumerate(docs) if i % val_every != pick]
        val_docs = [t for i, (_, t) in enumerate(docs) if i % val_every == pick]
        rule, need = f"every {_ordinal(val_every)} document", ""
        note = f"validation: {rule} held out ({len(val_docs)} of {files})"
    else:
        cuts = [_tail_start(t, val_every) for _, t in docs]
        train_docs = [t[:c] for (_, t), c in zip(docs, cuts) if c > 0]
        val_docs = [t[c:] for (_, t), c in zip(docs, cuts)]
        rule = f"the last {100 / val_every:.3g}% of each file"
        need = f" (about {val_every * (seqlen + 1):,} tokens)"
        note = f"validation: {rule} held out ({files})"
    train = pack_documents(train_docs, tokenizer, seqlen)
    val = pack_documents(val_docs, tokenizer, seqlen)
    n_train, n_val = train.tokens.numel(), val.tokens.numel()
    source = _source([name for name, _ in docs], n_train + n_val)
    if len(train) == 0:
        raise ValueError(
            f"data: {source}: the {n_train:,} training tokens do not fill one row of "
            f"seqlen + 1 = {seqlen + 1} tokens; give more text or a smaller seqlen"
        )
    if len(val) == 0:
        raise ValueError(
            f"data: {source}: the {n_val:,} tokens held out for validation ({rule}) do not "
            f"fill one row of seqlen + 1 = {seqlen + 1} tokens; give more text{need} or a "
            "smaller seqlen"
        )
    train.note = val.note = note
    return train, val


def _tail_start(text: str, val_every: int) -> int:
    """Where the held-out tail of `text` starts (see `build_splits`)."""
    share = -(-len(text) // val_every)
    cut = len(text) - share
    newline = text.rfind("\n", max(0, cut - share), cut)
    return newline + 1 if newline >= 0 else cut


def _ordinal(n: int) -> str:
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _source(names: list[str], n_tokens: int) -> str:
    """The files in an error message: "'a.txt' (6,000 tokens)", "3 files ('a.txt', ...)"."""
    if len(names) == 1:
        return f"{names[0]!r} ({_count(n_tokens, 'token')})"
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names):,} files ({shown}; {_count(n_tokens, 'token')})"


class RowSampler:
    """Shuffled batches of row indices; its position (epoch, offset) is the data cursor."""

    def __init__(self, n_rows: int, batch_size: int, seed: int) -> None:
        if batch_size > n_rows:
            raise ValueError(
                f"batch_size {batch_size} exceeds the {n_rows} rows of the training data"
            )
        self.n_rows, self.batch_size, self.seed = n_rows, batch_size, seed
        self.epoch, self.offset = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> torch.Tensor:
        # modulo 2**64, the seeds a generator takes (the same value below it as before)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % (1 << 64))
        return torch.randperm(self.n_rows, generator=g)

    def next(self) -> torch.Tensor:
        if self.offset + self.batch_size > self.n_rows:
            self.epoch, self.offset = self.epoch + 1, 0
            self._perm = self._permutation()
        idx = self._perm[self.offset : self.offset + self.batch_size]
        self.offset += self.batch_size
        return idx

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "n_rows": self.n_rows,
            "seed": int(self.seed),
        }

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if sd["n_rows"] != self.n_rows:
            raise ValueError(
                f"resume: the data has {self.n_rows} rows but the checkpoint was "
                f"taken on {sd['n_rows']}"
            )
        # the cursor is a place in the checkpoint's order: its seed's (older checkpoints: none)
        self.seed = int(sd.get("seed", self.seed))
        self.epoch, self.offset = int(sd["epoch"]), int(sd["offset"])
        self._perm = self._permutation()


class RowBatches:
    """Training batches of packed rows; `state_dict` is the data cursor saved in checkpoints."""

    def __init__(self, rows: PackedRows, batch_size: int, seed: int = 0) -> None:
        self.data = rows
        self.sampler = RowSampler(len(rows), batch_size, seed)

    def next(self) -> dict[str, torch.Tensor]:
        return self.data.rows(self.sampler.next())

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.sampler.load_state_dict(sd)


def eval_batches(
    rows: PackedRows, batch_size: int, n_batches: int
) -> list[dict[str, torch.Tensor]]:
    """The first rows in order, so validation losses compare across runs."""
    n = min(len(rows), n_batches * batch_size)
    return [
        rows.rows(torch.arange(start, min(n, start + batch_size)))
        for start in range(0, n, batch_size)
    ]
