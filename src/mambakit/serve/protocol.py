"""The OpenAI API's request bodies, checked field by field, and its response objects.

`parse_request` turns the JSON body of `/v1/completions` or `/v1/chat/completions` into
`SamplingParams` and the server's options, raising `APIError` (400) that names the field
of the first bad value. Parameters the engine does not implement (`logprobs`, `echo`,
`best_of`, non-zero `presence_penalty` and `frequency_penalty`, a `logit_bias`, a
`suffix`, tools and tool choice, a `response_format` other than text) are refused by
name rather than silently ignored; unknown fields are ignored, as the OpenAI API does.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from .params import SamplingParams

MAX_STOPS = 16  # stop strings (and stop token ids) per request at most
MAX_STOP_CHARS = 256  # characters of one stop string at most


class APIError(Exception):
    """An error answered as the OpenAI API's JSON error object with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass
class Options:
    """What the server does with a request besides sampling."""

    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    return_token_ids: bool = False  # each choice carries its token ids (and the prompt's)


_REFUSED = {  # field -> the values that mean "off", which are accepted
    # (chat's logprobs is a boolean; the completions API's an int, where 0 still returns
    # the sampled token's logprob: there only null is off, `parse_request`)
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "suffix": (None, ""),
    "logit_bias": (None,),
    "tools": (None,),
    "functions": (None,),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None,),  # and {"type": "text"}, the default (`parse_request`)
}


def parse_request(body, chat: bool, default_max_tokens: int, max_tokens_limit: int,
                  max_n: int) -> tuple[SamplingParams, Options]:  # fmt: skip
    """The sampling parameters and options of a request body (a JSON object)."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    for name, off in _REFUSED.items():
        v = body.get(name)
        if (name == "logit_bias" and v == {}) or (
            name == "response_format" and v == {"type": "text"}
        ):
            continue
        if name == "logprobs" and not chat and v is not None:
            raise bad(name, f"logprobs is not supported by this server (got {json.dumps(v)})")
        # `False == 0` and `True == 1`: a value matches an off value of its own kind only
        # (a bool a bool, false for echo; a number a number)
        is_off = (
            v is None
            or not isinstance(v, dict | list)
            and any(
                o == v and isinstance(o, bool) == isinstance(v, bool) for o in off if o is not None
            )
        )
        if not is_off:
            allowed = " or ".join(json.dumps(o) for o in off)
            raise bad(name, f"{name} is not supported by this server: it must be {allowed} "
                            f"(got {json.dumps(v)})")  # fmt: skip
    max_tokens = body.get("max_completion_tokens") if chat else None
    name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if not _is_int(max_tokens) or not 1 <= max_tokens <= max_tokens_limit:
        raise bad(name, f"{name} must be an int in [1, {max_tokens_limit}], got {max_tokens!r}")
    fields = {}
    for key, default, check, what in (
        ("temperature", 1.0, _is_num, "a number >= 0"),
        ("top_p", 1.0, _is_num, "a number in (0, 1]"),
        ("top_k", 0, _is_int, "an int >= 0 (0 or -1: off)"),
        ("min_p", 0.0, _is_num, "a number in [0, 1)"),
        ("repetition_penalty", 1.0, _is_num, "a number > 0"),
    ):
        v = body.get(key)
        if v is None:
            v = default
        if not check(v):
            raise bad(key, f"{key} must be {what}, got {v!r}")
        fields[key] = v
    n = body.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= max_n:
        raise bad("n", f"n must be an int in [1, {max_n}], got {n!r}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < (1 << 63) - n):
        raise bad("seed", f"seed must be an int in [0, 2**63 - n), got {seed!r}")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "stop must be a string or a list of non-empty strings")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad("stop", f"stop takes at most {MAX_STOPS} strings of {MAX_STOP_CHARS} "
                          "characters each")  # fmt: skip
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(_is_int(i) and i >= 0 for i in stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of ints >= 0")
    if len(stop_ids) > MAX_STOPS:
        raise bad("stop_token_ids", f"stop_token_ids takes at most {MAX_STOPS} ids")
    flags = {}
    for key in ("stream", "ignore_eos", "return_token_ids"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            raise bad(key, f"{key} must be a boolean, got {v!r}")
        flags[key] = bool(v)
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options", "stream_options must be an object")
        if not flags["stream"]:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise bad("stream_options.include_usage", "include_usage must be a boolean")
        include_usage = iu
    try:
        params = SamplingParams(
            max_tokens=max_tokens, n=n, seed=seed, stop=tuple(stop),
            stop_token_ids=tuple(stop_ids), ignore_eos=flags["ignore_eos"], **fields,
        )  # fmt: skip
    except ValueError as e:  # "top_p must lie in (0, 1], got 2": the field comes first
        raise bad(str(e).split(" ")[0], str(e)) from None
    return params, Options(flags["stream"], include_usage, flags["return_token_ids"])


def parse_prompts(body: dict) -> list[str | list[int]]:
    """`prompt` of a completions body: a string, a list of token ids, or a list of either."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(_is_int(t) for t in p):
            return [p]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
            return list(p)
    raise bad("prompt", "prompt must be a string, a non-empty list of token ids, or a list "
                        "of strings or of token-id lists")  # fmt: skip


def parse_messages(body: dict) -> list[dict]:
    """`messages` of a chat body: role and content (a string or text parts) each."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # text parts
            if not all(isinstance(c, dict) and c.get("type") == "text"
                       and isinstance(c.get("text"), str) for c in content):  # fmt: skip
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(c["text"] for c in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", "content must be a string or text parts")
        out.append({**m, "content": content})
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def envelope(rid: str, model: str, chat: bool, chunk: bool) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}
