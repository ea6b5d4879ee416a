"""The HTTP app: OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`, and `/health`.

Every request is read and checked before the engine sees it (`protocol`, `service`); any refusal
is an HTTP 4xx with an OpenAI error body, and the server keeps serving. With an API key, every
request must carry `Authorization: Bearer KEY` (401 otherwise). Request bodies are bounded
(413 beyond `max_body_bytes`) and must arrive within `body_timeout` seconds (408 after it, so
that a client that stops sending mid-body holds no connection forever). Streaming responses are
server-sent events that carry text as blocks are decided and end with `data: [DONE]`; a client
that disconnects cancels its request, which frees its slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from clover_jax.api.serving.errors import ApiError, bad_request
from clover_jax.api.serving.protocol import read_chat, read_completion
from clover_jax.api.serving.responses import ChoiceText, Message
from clover_jax.api.serving.service import Prepared, Service, Submission
from decoding.engine import EngineEvent

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a whole request body, from its first byte
# engine finish -> OpenAI finish_reason
FINISH = {"eos": "stop", "length": "length"}


def create_app(service: Service, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT) -> FastAPI:
    app = FastAPI(title="clover-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), api_key.encode())):
                return _error(ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'", None,
                                       "invalid_api_key"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return _error(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        message = "not found" if error.status_code == 404 else str(error.detail)
        return _error(ApiError(error.status_code, f"{message}: {request.method} {request.url.path}"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error(ApiError(500, f"internal error: {type(error).__name__}: {error}", None, "internal_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.name, "running": service.engine.running(),
                "queued": service.engine.queued(), "finished": dict(service.engine.finished)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": _STARTED,
                                            "owned_by": "clover-jax", "max_model_len": service.context}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        chat = read_chat(await _read_json(request, max_body_bytes, body_timeout))
        prepared = await run_in_threadpool(service.prepare_chat, chat)
        text = ChoiceText(service.tokenizer, chat.sampling.stop, reasoning=prepared.reasoning_opened, tools=chat.tools)
        submission = service.submit(prepared)
        reply = _Reply("chatcmpl", "chat.completion", service.name, prepared, chat.sampling)
        if chat.sampling.stream:
            return _sse(_chat_stream(reply, submission, text, chat.sampling.include_usage))
        message = Message()
        event = await _collect(request, submission, text, message.add)
        return reply.body([{"index": 0, "message": message.as_openai(), "logprobs": None,
                            "finish_reason": reply.finish(event, text)}], [event])

    @app.post("/v1/completions")
    async def completions(request: Request):
        completion = read_completion(await _read_json(request, max_body_bytes, body_timeout))
        prepared = await run_in_threadpool(service.prepare_completion, completion)
        texts = [ChoiceText(service.tokenizer, completion.sampling.stop) for _ in prepared]
        submissions = []
        try:
            for one in prepared:
                submissions.append(service.submit(one))
        except ApiError:
            for submission in submissions:
                submission.cancel()
            raise
        reply = _Reply("cmpl", "text_completion", service.name, prepared, completion.sampling)
        if completion.sampling.stream:
            return _sse(_completion_stream(reply, submissions, texts, completion.sampling.include_usage))
        messages = [Message() for _ in prepared]
        events = await asyncio.gather(*(_collect(request, s, t, m.add)
                                        for s, t, m in zip(submissions, texts, messages, strict=True)))
        return reply.body([{"index": i, "text": m.text, "logprobs": None, "finish_reason": reply.finish(e, t)}
                           for i, (m, e, t) in enumerate(zip(messages, events, texts, strict=True))], events)

    return app


_STARTED = int(time.time())


# ---------------------------------------------------------------------- bodies
class _Reply:
    """The parts every response body of one request shares: id, object, created, model, usage,
    and Clover's figures."""

    def __init__(self, prefix: str, kind: str, model: str, prepared: Prepared | list[Prepared], sampling):
        self.id, self.kind, self.model = f"{prefix}-{uuid.uuid4().hex}", kind, model
        self.created = int(time.time())
        self.prepared = prepared if isinstance(prepared, list) else [prepared]
        self.sampling = sampling

    def base(self, kind: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": kind or self.kind, "created": self.created, "model": self.model}

    def finish(self, event: EngineEvent, text: ChoiceText) -> str:
        if event.finish == "error":
            raise ApiError(500, f"the request failed in the engine: {event.error}", None, "engine_error")
        reason = "stop" if text.stopped else FINISH.get(event.finish, "stop")
        return "tool_calls" if text.called and reason == "stop" else reason

    def usage(self, events: list[EngineEvent]) -> dict[str, int]:
        prompt = sum(len(p.prompt) for p in self.prepared)
        completion = sum(e.stats.completion_tokens for e in events if e.stats is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def clover(self, events: list[EngineEvent]) -> dict[str, Any]:
        """Clover's own figures: forwards (NFE), tokens per forward, denoising steps per block."""
        stats = [e.stats for e in events if e.stats is not None]
        nfe = sum(s.nfe for s in stats)
        tokens = sum(s.completion_tokens for s in stats)
        first = self.prepared[0]
        figures = {"mode": first.request.mode, "nfe": nfe, "tokens_per_forward": tokens / max(nfe, 1)}
        if first.block_size is not None:
            figures["block_size"] = first.block_size
        if len(stats) == 1:
            figures["steps_per_block"] = stats[0].steps_per_block
        return figures

    def body(self, choices: list[dict], events: list[EngineEvent]) -> dict[str, Any]:
        return {**self.base(), "choices": choices, "usage": self.usage(events), "clover": self.clover(events)}


# ---------------------------------------------------------------------- running a request
async def _collect(request: Request, submission: Submission, text: ChoiceText, sink) -> EngineEvent:
    """Every event of a whole (not streamed) response; a client that leaves cancels it."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, submission))
    try:
        async for event in submission.events():
            sink(text.push(event.tokens))
            if text.stopped:
                submission.cancel()
            if event.finish is not None:
                sink(text.finish())
                return event
    finally:
        watcher.cancel()
        submission.cancel()


async def _cancel_on_disconnect(request: Request, submission: Submission) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
    submission.cancel()


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def encoded():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(encoded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_stream(reply: _Reply, submission: Submission, text: ChoiceText, include_usage: bool):
    chunk = lambda delta, finish=None: {**reply.base("chat.completion.chunk"), "choices": [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in submission.events():
            for delta in text.push(event.tokens):
                yield chunk(delta)
            if text.stopped:
                submission.cancel()
            if event.finish is not None:
                for delta in text.finish():
                    yield chunk(delta)
                try:
                    finish = reply.finish(event, text)
                except ApiError as error:
                    yield error.body()
                    return
                yield {**chunk({}, finish), "clover": reply.clover([event])}
                if include_usage:
                    yield {**reply.base("chat.completion.chunk"), "choices": [], "usage": reply.usage([event])}
    finally:
        submission.cancel()  # the client left, or the stream ended: the slot is freed either way


async def _completion_stream(reply: _Reply, submissions: list[Submission], texts: list[ChoiceText],
                             include_usage: bool):
    chunk = lambda index, piece, finish=None: {**reply.base(), "choices": [
        {"index": index, "text": piece, "logprobs": None, "finish_reason": finish}]}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, submission: Submission):
        async for event in submission.events():
            await queue.put((index, event))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(submissions)]
    finals: dict[int, EngineEvent] = {}
    try:
        while len(finals) < len(submissions):
            index, event = await queue.get()
            text = texts[index]
            piece = "".join(d["content"] for d in text.push(event.tokens))
            if text.stopped:
                submissions[index].cancel()
            if event.finish is None:
                if piece:
                    yield chunk(index, piece)
                continue
            piece += "".join(d["content"] for d in text.finish())
            finals[index] = event
            try:
                finish = reply.finish(event, text)
            except ApiError as error:
                yield error.body()
                return
            yield {**chunk(index, piece, finish), "clover": reply.clover([event])}
        if include_usage:
            yield {**reply.base(), "choices": [], "usage": reply.usage(list(finals.values()))}
    finally:
        for task in pumps:
            task.cancel()
        for submission in submissions:
            submission.cancel()


# ---------------------------------------------------------------------- helpers
async def _read_json(request: Request, limit: int, timeout: float) -> Any:
    """The JSON body, read up to `limit` bytes (413 beyond) within `timeout` seconds (408 after)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit} (--max-body-bytes)")
    body = bytearray()

    async def read() -> None:
        async for piece in request.stream():
            body.extend(piece)
            if len(body) > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes (--max-body-bytes)")

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body was not complete within {timeout:g} s ({len(body)} bytes arrived)",
                       None, "request_timeout") from None
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None


def _error(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)
