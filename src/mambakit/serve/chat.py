"""Chat templates: a checkpoint's Jinja template that turns messages into a prompt.

The template comes from the checkpoint folder, as Hugging Face stores it: the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates whose
"default" is used) or a `chat_template.jinja` file. It is rendered in Jinja's sandbox, with
the environment transformers renders it in: `trim_blocks` and `lstrip_blocks`, the loop
controls (`{% break %}`, `{% continue %}`), a `tojson` filter that keeps non-ASCII text and
`<`, `>`, `&` and quotes as they are, the variables `messages`, `add_generation_prompt`,
`bos_token`, `eos_token` and the functions `raise_exception` and `strftime_now`. Nothing is
downloaded.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


def _token(v) -> str:
    if isinstance(v, dict):  # an AddedToken as tokenizer_config.json writes it
        return str(v.get("content", ""))
    return v if isinstance(v, str) else ""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:
            raise ImportError("chat templates need jinja2 (pip install 'mambakit[serve]')") from e

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # Jinja's own escapes <, >, & and ' for HTML: a prompt wants the text as it is
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)  # fmt: skip

        def strftime_now(format: str) -> str:
            return datetime.now().strftime(format)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])  # fmt: skip
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not parse: {e}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict]) -> str:
        """The prompt of `messages`, ending where the assistant's reply starts. Raises
        ValueError with the template's message when it refuses the messages or fails on
        them."""
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ArithmeticError) as e:
            # a message of a shape the template does not expect (tool_calls: 5 where it
            # loops over them): the request's fault, not the server's
            name = type(e).__name__
            raise ValueError(f"the chat template failed on the messages: {name}: {e}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint folder; None when it has none."""
        folder = Path(folder)
        source = None
        cfg = {}
        path = folder / "tokenizer_config.json"
        if path.is_file():
            cfg = json.loads(path.read_text())
            t = cfg.get("chat_template")
            if isinstance(t, list):
                named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
                t = named.get("default")
            if isinstance(t, str):
                source = t
        jinja = folder / "chat_template.jinja"
        if source is None and jinja.is_file():
            source = jinja.read_text()
        if source is None:
            return None
        return cls(source, _token(cfg.get("bos_token")), _token(cfg.get("eos_token")))
