"""Text to token ids and back: UTF-8 bytes, or a Hugging Face `tokenizer.json`.

Used by training (data.py), generation and the CLI alike; nothing is downloaded.
"""

from __future__ import annotations

import codecs
from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to download."""

    vocab_size = 256
    name = "byte"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # bytes have no special tokens

    def decode(self, ids) -> str:
        """The text of the bytes `ids`; an id past the bytes (a vocabulary padded beyond 256)
        decodes to nothing, as an id outside a tokenizer.json's vocabulary does."""
        return bytes(i for i in map(int, ids) if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, read through the `tokenizers` package."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: no tokenizer.json at {str(path)!r}")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError("tokenizer.json needs the tokenizers package") from e
        self.path = path
        self.name = str(path)
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises a bare Exception
            why = " ".join(str(e).split()) or type(e).__name__
            raise ValueError(
                f"tokenizer: {str(path)!r} is not a valid tokenizer.json ({why})"
            ) from e
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens=False` leaves out what the tokenizer's
        post-processor adds (a BOS): a rendered chat template writes its own."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str | Path | None):
    """ "byte" (or None) -> ByteTokenizer; a tokenizer.json file or a folder holding one."""
    if spec is None or str(spec) == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


class TextStream:
    """Turns one sequence's token ids into text as they arrive, after its prompt, holding
    back what is not yet whole: an incomplete UTF-8 sequence (bytes) or a piece the
    tokenizer decodes to U+FFFD. A tokenizer of None gives no text."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        self.byte = isinstance(tokenizer, ByteTokenizer)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # a few prompt tokens decoded along, so that word-initial spaces come out right
        self.ids = list(prompt_ids[-4:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        if self.tok is None:
            return ""
        if self.byte:  # an id past the bytes gives no text (`ByteTokenizer.decode`)
            return self.utf8.decode(bytes([token])) if 0 <= token < 256 else ""
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before) :]
        return ""

    def flush(self) -> str:
        if self.tok is None:
            return ""
        if self.byte:
            return self.utf8.decode(b"", final=True)
        text = self.tok.decode(self.ids[self.prefix :])
        return text[len(self.tok.decode(self.ids[self.prefix : self.read])) :]
