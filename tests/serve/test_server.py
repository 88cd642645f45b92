"""The HTTP server, live: uvicorn on 127.0.0.1 started by the test, driven with the
`openai` client and raw httpx. Every token stream is checked against `generate` run
for that request alone on a second copy of the model."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import time
import types

import httpx
import openai
import pytest
import torch

from mambakit.inference import generate
from mambakit.serve import Engine, protocol
from mambakit.serve.chat import ChatTemplate
from mambakit.serve.server import create_app
from mambakit.text import ByteTokenizer

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module", params=["tiny", "tiny-mamba2"])
def server(request, model_dirs, load, running):
    """(base URL, engine, oracle model) of a live server with an API key, 8 rows, chunked
    prefill in blocks of 16, a prefix cache, a chat template and small limits."""
    path = model_dirs[request.param]
    engine = Engine(load(path), tokenizer=ByteTokenizer(), max_batch=8, block_size=16,
                    prefill_tokens=48, cache_bytes=1 << 26, max_prompt_tokens=512)  # fmt: skip
    app = create_app(engine, model_name="tiny", tokenizer=ByteTokenizer(),
                     chat_template=ChatTemplate(TEMPLATE), api_key=KEY,
                     max_body_bytes=64 << 10, max_tokens_limit=100_000)  # fmt: skip
    with running(app) as url:
        yield url, engine, load(path)
    assert not engine._thread.is_alive()


def alone(model, prompt, max_tokens, **kw) -> list[int]:
    out = generate(model, torch.tensor([prompt]), max_new_tokens=max_tokens, **kw)
    return out[0, len(prompt) :].tolist()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^mambakit_{re.escape(name)} (\S+)$", text, flags=re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_16_concurrent_streams_are_generate_alone(server):
    """16 streams at once over 8 rows, prompts of 1 to 120 tokens, 1 to 40 new tokens,
    greedy and seeded sampling: each one token for token what generate gives it alone."""
    url, engine, oracle = server
    rng = random.Random(7)
    jobs = []
    for i in range(16):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 120))]
        kw = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=100 + i)
        if i % 4 == 3:
            kw.update(top_p=0.9)
        jobs.append((prompt, rng.randint(1, 40), kw))

    async def one(client, prompt, max_tokens, kw):
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
            extra_body={"return_token_ids": True}, **kw,
        )  # fmt: skip
        toks, reason, chunks = [], None, 0
        async for chunk in stream:
            # the first chunk says the prompt's ids, as the response does unstreamed
            assert (getattr(chunk, "prompt_token_ids", None) == [prompt]) == (chunks == 0)
            chunks += 1
            for c in chunk.choices:
                toks += c.token_ids
                reason = c.finish_reason or reason
        return toks, reason

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(client, *job) for job in jobs))

    results = asyncio.run(main())
    for (prompt, max_tokens, kw), (toks, reason) in zip(jobs, results):
        assert toks == alone(oracle, prompt, max_tokens, **kw), (len(prompt), max_tokens, kw)
        assert reason == "length"
    assert metric(url, "running") == 0


def test_completion_n_usage_and_text(server):
    url, _, oracle = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=9, n=2,
                                    temperature=0.7, seed=3,
                                    extra_body={"return_token_ids": True})  # fmt: skip
    prompt = list(b"def f(x):")
    ref = generate(oracle, torch.tensor([prompt] * 2), max_new_tokens=9, temperature=0.7, seed=3)
    for c in out.choices:
        assert c.token_ids == ref[c.index, len(prompt) :].tolist()
        assert c.text == bytes(c.token_ids).decode("utf-8", "replace")
    assert out.usage.prompt_tokens == 9 and out.usage.completion_tokens == 18
    assert out.model == "tiny" and out.object == "text_completion"
    # a batch of two prompts: choices 0-1 for the first, 2-3 for the second
    out = client.completions.create(model="tiny", prompt=[[1, 2], [3, 4, 5]], max_tokens=3,
                                    n=2, temperature=0)  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 12


def test_stream_usage_and_stop_string(server):
    url, _, oracle = server
    prompt = list(b"class A:\n  ")
    ref = alone(oracle, prompt, 30, temperature=0.9, seed=1)
    i = next(i for i, t in enumerate(ref) if 33 <= t < 127)
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0.9, "seed": 1, "stream": True,
            "stop": chr(ref[i]), "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    text = "".join(c["text"] for ch in chunks for c in ch["choices"])
    assert text == bytes(ref[: ref.index(ref[i])]).decode("utf-8", "replace")
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == ref.index(ref[i]) + 1
    # the OpenAI API: with include_usage, every other chunk has a usage of null
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])


def test_every_chunk_of_a_stream_has_the_same_created(server, monkeypatch):
    """The OpenAI API: each chunk of a stream has the same `created` (and id), even where
    the stream crosses a second (a clock that ticks at every reading here)."""
    url, *_ = server
    clock = itertools.count(1_700_000_000)
    monkeypatch.setattr(protocol, "time", types.SimpleNamespace(time=lambda: next(clock)))
    for path, body in (
        ("completions", {"prompt": [1, 2, 3]}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        body = {**body, "max_tokens": 4, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/{path}", json=body, headers=AUTH) as r:
            chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert len(chunks) >= 2  # a chunk of tokens or more, and the usage
        assert len({(c["id"], c["created"]) for c in chunks}) == 1, path


def test_chat_completions_with_the_template(server):
    url, _, oracle = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                         temperature=0)  # fmt: skip
    prompt = list(b"<system>Be brief.</system><user>Hi</user><assistant>")
    ref = alone(oracle, prompt, 6, temperature=0.0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == bytes(ref).decode("utf-8", "replace")
    assert out.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                            temperature=0, stream=True)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    )


def test_api_key_and_open_routes(server):
    url, *_ = server
    body = {"prompt": "a", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{url}/v1/models/tiny").status_code == 401
    r = httpx.get(f"{url}/v1/models/other", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # the framework's own errors are the OpenAI error object too
    r = httpx.post(f"{url}/v1/embeddings", json={}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = httpx.get(f"{url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "requests_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "generation_tokens_per_second",
        "batch_occupancy",
        "waiting",
        "prefix_cache_hits_total",
        "prefix_cache_bytes",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_count",
    ):
        assert f"mambakit_{name}" in text, name  # fmt: skip


class _BosTokenizer(ByteTokenizer):
    """Bytes, with a BOS (id 1) put first unless add_special_tokens=False: as an HF
    tokenizer whose post-processor adds one."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + super().encode(text)


def test_a_chat_prompt_gets_no_bos_from_the_tokenizer(model_dirs, load, running):
    """A chat template writes the special tokens it wants (a Llama-style one starts with
    {{ bos_token }}): its text is encoded without the tokenizer's own, as transformers'
    apply_chat_template does; a completion's prompt keeps them."""
    tok = _BosTokenizer()
    engine = Engine(load(model_dirs["tiny"]), tokenizer=tok, max_batch=2)
    app = create_app(engine, model_name="tiny", tokenizer=tok,
                     chat_template=ChatTemplate(TEMPLATE))  # fmt: skip
    msgs = [{"role": "user", "content": "Hi"}]
    with running(app) as url:
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": msgs, "max_tokens": 1}).json()  # fmt: skip
        text = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 1}).json()  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == len(b"<user>Hi</user><assistant>")
    assert text["usage"]["prompt_tokens"] == 1 + len(b"Hi")


def test_a_chat_template_renders_off_the_event_loop(model_dirs, load, running):
    """A chat template renders in a worker thread, as the tokenizer encodes: while one
    renders (here it waits until /health has answered), the server answers other requests."""
    import threading

    started, answered = threading.Event(), threading.Event()

    class Waiting(ChatTemplate):
        def render(self, messages):
            started.set()
            answered.wait(timeout=30)  # on the event loop this would hold /health back
            return super().render(messages)

    engine = Engine(load(model_dirs["tiny"]), tokenizer=ByteTokenizer(), max_batch=2)
    app = create_app(engine, model_name="tiny", tokenizer=ByteTokenizer(),
                     chat_template=Waiting(TEMPLATE))  # fmt: skip
    msgs = [{"role": "user", "content": "Hi"}]
    box = {}
    with running(app) as url, httpx.Client(timeout=60) as client:
        chat = threading.Thread(
            target=lambda: box.update(
                r=client.post(
                    f"{url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}
                )
            )
        )
        chat.start()
        try:
            assert started.wait(timeout=30), "the chat request never reached its template"
            health = httpx.get(f"{url}/health", timeout=20)
        finally:
            answered.set()
            chat.join(timeout=60)
    assert health.status_code == 200
    assert box["r"].status_code == 200, box["r"].text


def test_request_faults_name_their_field(model_dirs, load, running):
    """A chat template that fails on a message's shape (a loop over tool_calls: 5) is a 400
    naming messages, not a 500; a chat prompt over the limit is a 413 naming messages; a
    completion without max_tokens takes min(16, the server's limit)."""
    template = ("{% for m in messages %}{% if m.tool_calls %}{% for t in m.tool_calls %}"
                "{{ t }}{% endfor %}{% endif %}{{ m['content'] }}{% endfor %}")  # fmt: skip
    engine = Engine(load(model_dirs["tiny"]), tokenizer=ByteTokenizer(), max_batch=2,
                    max_prompt_tokens=64)  # fmt: skip
    app = create_app(engine, model_name="tiny", tokenizer=ByteTokenizer(),
                     chat_template=ChatTemplate(template), max_tokens_limit=8)  # fmt: skip
    with running(app) as url:
        msgs = [{"role": "assistant", "content": None, "tool_calls": 5}]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"messages": msgs, "max_tokens": 2})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        long = [{"role": "user", "content": "x" * 100}]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"messages": long, "max_tokens": 2})  # fmt: skip
        assert r.status_code == 413 and r.json()["error"]["param"] == "messages", r.text
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": "a"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8


class _TextOnlyTokenizer(ByteTokenizer):
    """A tokenizer written to the older interface: encode(text), no keywords."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def test_a_tokenizer_whose_encode_takes_the_text_alone_serves(model_dirs, load, running):
    tok = _TextOnlyTokenizer()
    engine = Engine(load(model_dirs["tiny"]), tokenizer=tok, max_batch=2)
    app = create_app(engine, model_name="tiny", tokenizer=tok,
                     chat_template=ChatTemplate(TEMPLATE))  # fmt: skip
    with running(app) as url:
        text = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 1})  # fmt: skip
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 1})  # fmt: skip
    assert text.status_code == chat.status_code == 200, (text.text, chat.text)
    assert chat.json()["usage"]["prompt_tokens"] == len(b"<user>Hi</user><assistant>")


def test_chat_templates_render_as_transformers_renders_them():
    """Templates in the forms checkpoints ship (loop controls, tojson of tool schemas with
    non-ASCII and markup, the date from strftime_now, a bos_token first) give the text
    transformers' own renderer gives; one Jinja cannot parse is a ValueError."""
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = [{"role": "system", "content": "skip me"},
            {"role": "user", "content": "a<b> & 'c' é"}]  # fmt: skip
    templates = [
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}"
        "{% endif %}<{{ m['role'] }}>{{ m['content'] | tojson }}{% break %}{% endfor %}",
        "{{ strftime_now('%Y') }}{{ messages | tojson(indent=2) }}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
    ]
    for source in templates:
        got = ChatTemplate(source, bos_token="<s>").render(msgs)
        want = render_jinja_template([msgs], chat_template=source, add_generation_prompt=True,
                                     bos_token="<s>")[0][0]  # fmt: skip
        assert got == want, source
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")


def test_an_hf_tokenizer_leaves_out_its_special_tokens_when_asked(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    from mambakit.text import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["hello world"] * 10, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    plain = hf.encode("hello", add_special_tokens=False)
    assert hf.encode("hello") == [bos, *plain] and bos not in plain


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "a", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "a", "top_p": 2}, 400, "top_p"),
        ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "a", "n": 0}, 400, "n"),
        ({"prompt": "a", "stop": 5}, 400, "stop"),
        ({"prompt": "a", "stop": ["x"] * 17}, 400, "stop"),
        ({"prompt": "a", "top_k": 2.5}, 400, "top_k"),
        ({"prompt": "a", "n": 9}, 400, "n"),  # more choices than slots
        ({"prompt": "a", "seed": -1}, 400, "seed"),
        ({"prompt": "a", "logprobs": 2}, 400, "logprobs"),
        ({"prompt": "a", "logprobs": 0}, 400, "logprobs"),  # the sampled token's, in OpenAI's
        ({"prompt": "a", "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"prompt": "a", "tool_choice": "auto"}, 400, "tool_choice"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "a", "stream": "yes"}, 400, "stream"),
        ({"prompt": "a", "stop_token_ids": 0}, 400, "stop_token_ids"),  # not a list, though falsy
        ({"prompt": "a", "stop_token_ids": False}, 400, "stop_token_ids"),
        ({"prompt": "a", "stop_token_ids": {}}, 400, "stop_token_ids"),
        ({"prompt": "a", "presence_penalty": False}, 400, "presence_penalty"),  # not a number
        ({"prompt": "a", "frequency_penalty": True}, 400, "frequency_penalty"),
        ({"prompt": "a", "best_of": True}, 400, "best_of"),  # True == 1, the accepted value
        ({"prompt": "a", "echo": 0}, 400, "echo"),  # 0 == False, the accepted value
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": [1, 999]}, 400, "prompt"),
        ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "a", "model": 5}, 400, "model"),  # not a name at all
        ({"prompt": list(range(200)) * 3}, 413, "prompt"),
        ({"prompt": "a" * (512 * 64 + 1)}, 413, "prompt"),  # refused before it is encoded
    ],
    ids=lambda v: str(v)[:24] if isinstance(v, dict) else str(v),
)
def test_bad_requests_get_their_codes(server, body, status, param):
    url, *_ = server
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_body_limits_json_and_a_full_queue(server):
    url, engine, _ = server
    deep = b"[" * 20_000  # nested past the parser's recursion limit, under the body limit
    for content in (b"{not json", b"[1, 2]", b'{"prompt": "a", "temperature": NaN}', deep):
        r = httpx.post(f"{url}/v1/completions", content=content, headers=AUTH)
        assert r.status_code == 400, content
        assert r.json()["error"]["param"] == ("temperature" if b"NaN" in content else "body")
    # a lone surrogate (valid JSON, no UTF-8 for it): the field named, not a 500
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "a\\ud800"}', headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * (70 << 10)}, headers=AUTH)
    assert r.status_code == 413
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": "hi"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with engine._lock:  # a queue full now: as many waiting as it holds
        engine._n_waiting += engine.max_queue
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, headers=AUTH)
    finally:
        with engine._lock:
            engine._n_waiting -= engine.max_queue
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert metric(url, 'requests_rejected_total{reason="queue_full"}') >= 1


def test_more_prompts_than_the_queue_holds_are_refused_whole(server):
    """A list of prompts the queue could never hold is a 400 naming the prompt, not a 429
    a client would retry for ever; and none of its prompts runs or is counted. A list that
    fits runs whole."""
    url, engine, _ = server
    requests = metric(url, "requests_total")
    body = {"prompt": ["a"] * (engine.max_queue + 1), "max_tokens": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert metric(url, "requests_total") == requests
    r = httpx.post(f"{url}/v1/completions", headers=AUTH,
                   json={"prompt": [[1, 2], [1, 999]], "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
    assert metric(url, "requests_total") == requests
    # text prompts too: the one that encodes to nothing, or is too long to encode
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": ["a", ""]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
    long = "a" * (engine.max_prompt_tokens * 64 + 1)
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": ["a", long]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt[1]", r.text
    assert metric(url, "requests_total") == requests
    body = {"prompt": ["a", "b", "c"], "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert metric(url, "requests_total") == requests + 3


def test_disconnect_frees_the_slot(server):
    url, engine, _ = server
    aborted = metric(url, 'requests_finished_total{reason="abort"}')
    body = {"prompt": [5, 6, 7], "max_tokens": 90_000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) > 5:
                break
        # a stream that ended by itself would show why here
        assert len(lines) > 5 and len(engine.rows) == 1, (lines, engine.rows)
    deadline = time.monotonic() + 10
    while engine.rows and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.rows
    assert metric(url, 'requests_finished_total{reason="abort"}') == aborted + 1
    # without streaming: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=0.5,
                   json={**body, "stream": False})  # fmt: skip
    deadline = time.monotonic() + 10
    while engine.rows and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.rows


def test_cache_hits_are_exact_and_counted(server):
    url, _, oracle = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    hits = metric(url, "prefix_cache_hits_total")
    saved = metric(url, "prefix_cache_hit_tokens_total")
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(48)]
    # longer than the engine's prefill budget (48), the first runs block by block and
    # keeps the states at 16, 32, 48 and its end: the second hits its end, the others 48
    prompts = [shared + [1, 2], shared + [1, 2], shared + [9], shared + [5]]
    got = []
    for p in prompts:
        out = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})  # fmt: skip
        got.append(out.choices[0].token_ids)
    assert got == [alone(oracle, p, 12, temperature=0.0) for p in prompts]
    assert metric(url, "prefix_cache_hits_total") == hits + 3
    assert metric(url, "prefix_cache_hit_tokens_total") == saved + 50 + 48 + 48
    assert metric(url, "prefix_cache_bytes") > 0


def test_the_server_survives_a_request_that_raises(server):
    url, engine, oracle = server

    def hook(seq, tok):
        if seq.request.prompt[:2] == [250, 251] and len(seq.tokens) == 3:
            raise RuntimeError("injected fault")

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

        async def faulty():
            stream = await client.completions.create(model="tiny", prompt=[250, 251, 1],
                                                     max_tokens=20, stream=True)  # fmt: skip
            async for _ in stream:
                pass

        async def good():
            out = await client.completions.create(
                model="tiny", prompt=[3, 1, 4], max_tokens=25, temperature=0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            return out.choices[0].token_ids

        return await asyncio.gather(faulty(), good(), return_exceptions=True)

    engine.on_token = hook
    try:
        err, toks = asyncio.run(main())
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).completions.create(
                model="tiny", prompt=[250, 251, 1], max_tokens=20
            )
    finally:
        engine.on_token = None
    assert isinstance(err, openai.APIError) and "injected fault" in str(err)
    assert toks == alone(oracle, [3, 1, 4], 25, temperature=0.0)
    assert engine._thread.is_alive() and not engine.rows
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [250, 251, 1], "max_tokens": 5},
                   headers=AUTH)  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_without_tokenizer_or_template(model_dirs, load, running):
    """Token-id prompts work without a tokenizer (the text is then empty); text prompts and
    chat are refused with 400 naming the field."""
    engine = Engine(load(model_dirs["tiny-mamba3"]), max_batch=2)
    oracle = load(model_dirs["tiny-mamba3"])
    app = create_app(engine, model_name="m3", tokenizer=None)
    with running(app) as url:
        chat = httpx.post(f"{url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        text = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
        ids = httpx.post(f"{url}/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 6,
                         "temperature": 0, "return_token_ids": True})  # fmt: skip
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    assert text.status_code == 400 and "token ids" in text.json()["error"]["message"]
    assert text.json()["error"]["param"] == "prompt"
    c = ids.json()["choices"][0]
    assert c["text"] == "" and c["token_ids"] == alone(oracle, [7, 8, 9], 6, temperature=0.0)
