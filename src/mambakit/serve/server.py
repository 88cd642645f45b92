"""The OpenAI-compatible HTTP server over an `Engine` (FastAPI; the `[serve]` extra).

    app = create_app(engine, model_name="mamba-130m", tokenizer=tok)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (when a chat template is
given), `GET /v1/models`, and outside /v1 `GET /health` and `GET /metrics` (Prometheus
text). With `api_key`, every /v1 route wants `Authorization: Bearer <key>` (compared in
constant time) and answers 401 without it.

Errors are the OpenAI JSON error object: 400 naming the bad field, 401, 404 for another
model's name, 413 for a body or prompt over its limit, 429 with Retry-After when the
engine's queue is full, 503 while shutting down, 500 when the request failed inside the
engine (in a stream: an `error` event, then the stream ends).

The engine runs on its own thread; its events reach the asyncio loop once per engine
iteration (`loop.call_soon_threadsafe`) and are sorted there into one asyncio queue per
request. A client that disconnects cancels its request, which frees its rows at the next
iteration. On shutdown (SIGTERM) the server stops accepting connections, lets running
requests finish for up to `drain_timeout` seconds, then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import signal
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .engine import Engine
from .params import EngineStopped, Event, QueueFull
from .protocol import (
    APIError,
    bad,
    envelope,
    new_id,
    parse_messages,
    parse_prompts,
    parse_request,
    usage,
)
from .request import PromptTooLong

MAX_BODY_BYTES = 4 << 20
# a text prompt longer than this many characters a token of the prompt limit is refused
# before it is encoded (no tokenizer's token spans more)
MAX_CHARS_PER_TOKEN = 64
DISCONNECT_CHECK = 0.25  # seconds between checks that a non-streaming client is still there


def create_app(
    engine: Engine,
    *,
    model_name: str = "mambakit",
    tokenizer=None,
    chat_template=None,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_tokens_limit: int = 4096,
    drain_timeout: float = 30.0,
) -> FastAPI:
    """The FastAPI app serving `engine` (module docstring). The app starts the engine's
    thread at startup and drains and stops it at shutdown. `tokenizer` encodes text
    prompts (None: token-id prompts only); `chat_template` (`chat.ChatTemplate`) enables
    /v1/chat/completions."""
    state: dict = {}

    def deliver(outbox: list[tuple]) -> None:
        loop = state.get("loop")
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(dispatch, outbox)

    def dispatch(outbox: list[tuple]) -> None:
        for req, ev in outbox:
            try:
                req.sink(ev)
            except Exception:
                engine.cancel(req)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state["loop"] = asyncio.get_running_loop()
        engine.deliver = deliver
        engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, drain_timeout)

    app = FastAPI(title="mambakit", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        """The framework's own errors (an unknown route, a method a route does not take) as
        the OpenAI error object too, with their headers (405's Allow)."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return await api_error(request, APIError(e.status_code, str(e.detail), code=code,
                                                 headers=e.headers))  # fmt: skip

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, api_key.encode()):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer KEY)",
                           kind="authentication_error", code="invalid_api_key")  # fmt: skip

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise APIError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise APIError(413, f"request body over {max_body_bytes} bytes",
                               code="body_too_large")  # fmt: skip
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # (nested too deep)
            raise bad("body", f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise bad("body", "the request body must be a JSON object")
        return body

    def check_model(body: dict) -> None:
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise bad("model", f"model must be a string, got {name!r}")
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    async def encode(prompt, field: str, special: bool = True) -> list[int]:
        """Token ids of a prompt; text is encoded off the event loop (the running streams
        are not held up), after a bound on its length in characters. `special=False`: none
        of the special tokens the tokenizer would add (a chat template writes its own BOS,
        as transformers' apply_chat_template encodes)."""
        if isinstance(prompt, list):
            return prompt
        if tokenizer is None:
            raise bad(field, "this model has no tokenizer: send the prompt as token ids")
        limit = engine.max_prompt_tokens * MAX_CHARS_PER_TOKEN
        if len(prompt) > limit:
            raise APIError(413, f"{field}: over {limit} characters", param=field,
                           code="prompt_too_long")  # fmt: skip
        try:
            if special:
                ids = await asyncio.to_thread(tokenizer.encode, prompt)
            else:
                try:
                    ids = await asyncio.to_thread(tokenizer.encode, prompt,
                                                  add_special_tokens=False)  # fmt: skip
                except TypeError:  # a tokenizer whose encode takes the text alone
                    ids = await asyncio.to_thread(tokenizer.encode, prompt)
        except (ValueError, UnicodeError) as e:  # e.g. a lone surrogate
            raise bad(field, f"the text cannot be encoded: {e}") from None
        if not ids:
            raise bad(field, "the prompt encodes to no tokens")
        return ids

    def submit_all(prompts: list[list[int]], params, field: str) -> tuple[list, asyncio.Queue]:
        """The engine's requests, all or none, and one asyncio queue of (prompt number,
        event); `field`: the request's field the prompts came from, named in errors (the
        prompt's number with it where there are several: `prompt[1]`)."""
        events: asyncio.Queue = asyncio.Queue()
        sinks = [functools.partial(_put, events, k) for k in range(len(prompts))]
        try:
            reqs = engine.submit_many(prompts, params, sinks)
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is busy: {e}",
                kind="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except EngineStopped as e:
            raise APIError(503, str(e), kind="server_error", code="shutting_down") from None
        except PromptTooLong as e:
            named = str(e).split(" ")[0]  # prompt[1] where there are several
            param = field + named[len("prompt") :] if named.startswith("prompt[") else field
            raise APIError(413, str(e), param=param, code="prompt_too_long") from None
        except ValueError as e:  # "prompt[1] token ids must ...", "n must be ..."
            named = str(e).split(" ")[0]
            if named.startswith("prompt["):
                param = field + named[len("prompt") :]
            else:
                param = named if named in ("n", "stop") else field
            raise bad(param, str(e)) from None
        return reqs, events

    async def completion(request: Request, chat: bool):
        body = await read_json(request)
        check_model(body)
        default = max_tokens_limit if chat else min(16, max_tokens_limit)
        params, opts = parse_request(body, chat, default, max_tokens_limit, engine.max_batch)
        if chat:
            if chat_template is None:
                raise bad("messages", "this model's tokenizer has no chat template: "
                                      "use /v1/completions")  # fmt: skip
            try:  # off the event loop, as the tokenizer's encode: a template's loops are
                # the user's (over the messages, inside a body of up to the size limit)
                text = await asyncio.to_thread(chat_template.render, parse_messages(body))
            except ValueError as e:
                raise bad("messages", str(e)) from None
            prompts = [await encode(text, "messages", special=False)]
        else:
            texts = parse_prompts(body)
            if len(texts) > engine.max_queue:  # never fits: a retry would not help
                raise bad("prompt", f"{len(texts)} prompts in one request, more than the "
                                    f"server's queue holds ({engine.max_queue})")  # fmt: skip
            # errors name the prompt's number where there are several, as `submit_all`'s
            names = [f"prompt[{k}]" if len(texts) > 1 else "prompt" for k in range(len(texts))]
            prompts = [await encode(p, name) for p, name in zip(texts, names)]
        reqs, events = submit_all(prompts, params, "messages" if chat else "prompt")
        rid = new_id("chatcmpl" if chat else "cmpl")
        if opts.stream:
            return StreamingResponse(stream(reqs, events, params, opts, rid, chat),
                                     media_type="text/event-stream")  # fmt: skip
        return await collect(request, reqs, events, params, opts, rid, chat)

    def choice(index: int, text: str, reason, chat: bool, delta: bool, first: bool = False):
        if chat and delta:
            d = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": d, "logprobs": None, "finish_reason": reason}
        if chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": reason}  # fmt: skip
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

    async def collect(request, reqs, events, params, opts, rid, chat) -> Response:
        n = params.n
        texts = [""] * (n * len(reqs))
        ids: list[list[int]] = [[] for _ in texts]
        reasons: list = [None] * len(texts)
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_CHECK
        left = len(texts)
        try:
            while left:
                if loop.time() > next_check:  # a client that left cancels its request
                    if await request.is_disconnected():  # (499: nginx's "client closed
                        return Response(status_code=499)  # request"; nothing reads it)
                    next_check = loop.time() + DISCONNECT_CHECK
                try:
                    k, ev = await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK)
                except asyncio.TimeoutError:
                    continue
                i = k * n + ev.index
                if ev.finish_reason == "error":
                    raise APIError(500, f"the request failed: {ev.error}",
                                   kind="server_error", code="internal_error")  # fmt: skip
                texts[i] += ev.text
                ids[i] += ev.token_ids
                if ev.finish_reason is not None:
                    reasons[i] = ev.finish_reason
                    left -= 1
        finally:
            for req in reqs:
                if not req.done:
                    engine.cancel(req)
        out = envelope(rid, model_name, chat, chunk=False)
        out["choices"] = [choice(i, t, r, chat, False) for i, (t, r) in
                          enumerate(zip(texts, reasons))]  # fmt: skip
        if opts.return_token_ids:
            for c, t in zip(out["choices"], ids):
                c["token_ids"] = t
            out["prompt_token_ids"] = [r.prompt for r in reqs]
        out["usage"] = usage(sum(len(r.prompt) for r in reqs), sum(map(len, ids)))
        return JSONResponse(out)

    async def stream(reqs, events, params, opts, rid, chat):
        """Server-sent events: the events waiting when the stream gets to write are merged
        per choice into one chunk (a client that reads slowly gets fewer, larger chunks).
        Every chunk has the same id and `created`, as the OpenAI API's; with
        `include_usage`, each has a `usage`, null but in the last."""
        n = params.n
        head = envelope(rid, model_name, chat, chunk=True)
        if opts.include_usage:
            head["usage"] = None
        completion_tokens = 0
        started = set()
        left = n * len(reqs)
        failed = None
        try:
            while left and failed is None:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                merged: dict[int, list] = {}
                for k, ev in batch:
                    if ev.finish_reason == "error":
                        failed = ev.error
                        break
                    i = k * n + ev.index
                    m = merged.setdefault(i, ["", [], None])
                    m[0] += ev.text
                    m[1] += ev.token_ids
                    if ev.finish_reason is not None:
                        m[2] = ev.finish_reason
                        left -= 1
                for i, (text, ids, reason) in merged.items():
                    completion_tokens += len(ids)
                    if not text and not ids and reason is None:
                        continue
                    out = dict(head)
                    first = i not in started
                    c = choice(i, text, reason, chat, True, first=first)
                    started.add(i)
                    if opts.return_token_ids:
                        c["token_ids"] = ids
                        if len(started) == 1 and first:  # the stream's first chunk
                            out["prompt_token_ids"] = [r.prompt for r in reqs]
                    out["choices"] = [c]
                    yield f"data: {json.dumps(out)}\n\n"
            if failed is not None:
                err = APIError(500, f"the request failed: {failed}", kind="server_error",
                               code="internal_error")  # fmt: skip
                yield f"data: {json.dumps(err.body())}\n\n"
            elif opts.include_usage:
                out = dict(head)
                out["choices"] = []
                out["usage"] = usage(sum(len(r.prompt) for r in reqs), completion_tokens)
                yield f"data: {json.dumps(out)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away, or the stream ended: nothing keeps running
            for req in reqs:
                if not req.done:
                    engine.cancel(req)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        return await completion(request, chat=True)

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "mambakit"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str):
        authorize(request)
        check_model({"model": name})
        return model_card

    @app.get("/health")
    async def health():
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(engine.gauges(), engine.cache)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _put(events: asyncio.Queue, k: int, ev: Event) -> None:
    events.put_nowait((k, ev))


# seconds uvicorn waits past the drain for the streams to send their last events and close
CLOSE_GRACE = 5.0


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
          drain_timeout: float = 30.0, log_level: str = "info") -> None:  # fmt: skip
    """Run `app` with uvicorn until SIGTERM or SIGINT: both stop new connections, let the
    running requests finish for up to `drain_timeout` seconds, end the rest with
    finish_reason "abort" (sent on their streams), then return (exit 0).

    The engine's drain starts at the signal, on a thread of its own: uvicorn's graceful
    shutdown only waits for the connections (and cancels them when it gives up), so the
    requests must end first, within its timeout (the drain's, plus `CLOSE_GRACE`)."""
    import uvicorn

    engine: Engine = app.state.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.begin_drain()
            if sig in (signal.SIGTERM, signal.SIGINT) and not self.should_exit:
                self.should_exit = True  # a drain, not a signal to re-raise after it
                threading.Thread(target=engine.shutdown, args=(drain_timeout,),
                                 name="mambakit-drain", daemon=True).start()  # fmt: skip
                return
            super().handle_exit(sig, frame)  # a second one: stop without waiting

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout + CLOSE_GRACE)  # fmt: skip
    Server(config).run()
