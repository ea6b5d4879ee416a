"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens` (Claude Code,
the `anthropic` SDK).

One pipeline with the chat endpoint: the body is read into its `ChatRequest`
(`anthropic_protocol`), prepared by `Service.prepare_chat` (chat template, tool grammars),
decoded, and parsed by the same `ChoiceText` (stop strings, reasoning, tool calls); only the
deltas it makes are written differently, as Anthropic's content blocks (`ContentBlocks`): a whole
message, or the stream events `message_start`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`. A stream is the chat endpoint's own stream of deltas
(`pipeline.stream`), so a client that leaves, a stop string and an engine failure end it as they end a
chat stream.

Any model name is accepted and served by the one model (Claude Code names Claude models); the
response names the served model. Every error on these paths has Anthropic's shape,
`{"type": "error", "error": {"type", "message"}, "request_id"}`, with the status the server gives
it on its other paths.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from clover_jax.api.serving.anthropic_protocol import read_messages
from clover_jax.api.serving.errors import ApiError
from clover_jax.api.serving.pipeline import Reply, choice_text, collect, read_json, stream
from clover_jax.api.serving.responses import ChoiceText, Delta
from clover_jax.api.serving.service import Service

logger = logging.getLogger(__name__)
PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# the chat pipeline's finish_reason -> stop_reason ("stop" at a stop string: "stop_sequence")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
OVERLOADED = ("server_busy", "server_shutdown")  # error codes of a stream's error event that mean "retry later"


def add_messages_routes(app: FastAPI, service: Service, on_finish, max_body_bytes: int, body_timeout: float) -> None:
    """The Messages routes on `app`, and the layer that gives every error on them Anthropic's
    shape. on_finish: the engine requests' callback (`Metrics.engine_request_done`)."""

    @app.middleware("http")
    async def anthropic_errors(request: Request, call_next):
        response = await call_next(request)
        if request.url.path not in PATHS:
            return response
        if response.status_code >= 400:
            response = await _as_anthropic(request, response)
        response.headers["request-id"] = request.state.request_id  # where Anthropic's clients read it
        return response

    async def read(request: Request, counting: bool):
        return read_messages(await read_json(request, max_body_bytes, body_timeout), service.name, counting)

    @app.post("/v1/messages")
    @_guarded
    async def create_message(request: Request):
        asked = await read(request, counting=False)
        chat = asked.chat
        prepared = await run_in_threadpool(service.prepare_chat, chat)
        text = choice_text(service, chat, prepared[0])
        submissions = service.submit_all(prepared, on_finish)
        reply = Reply("msg", "message", service.name, prepared, chat.sampling)
        message_id = "msg_" + uuid.uuid4().hex
        if chat.sampling.stream:
            chunks = stream(reply, submissions, [text], True, chat=True)
            return _sse(_events(message_id, service.name, len(prepared[0].prompt), chunks, text))
        blocks = ContentBlocks()
        event, _, _ = await collect(request, submissions[0], text, blocks.add)
        finish = reply.finish(event, text)
        return {"id": message_id, "type": "message", "role": "assistant", "model": service.name,
                "content": blocks.finished(), **_stop(finish, text), "usage": _usage(reply.usage([event])),
                "clover": reply.clover([event])}

    @app.post("/v1/messages/count_tokens")
    @_guarded
    async def count_tokens(request: Request):
        chat = (await read(request, counting=True)).chat
        # the prompt is counted as a response would read it; max_tokens 1 leaves the context check
        # of the prompt alone, and nothing is decoded
        chat.sampling.max_tokens, chat.sampling.stream = 1, False
        prepared = await run_in_threadpool(service.prepare_chat, chat)
        return {"input_tokens": len(prepared[0].prompt)}


def _guarded(handler):
    """A failure the handler did not foresee answers 500 through the app's ApiError handler, inside
    the layer that shapes errors (the app's catch-all answers outside every layer)."""
    @functools.wraps(handler)
    async def guarded(request: Request):
        try:
            return await handler(request)
        except ApiError:
            raise
        except Exception as error:
            logger.exception("%s %s failed", request.method, request.url.path)
            raise ApiError(500, f"internal error: {type(error).__name__}: {error}", None, "internal_error") from None
    return guarded


# ---------------------------------------------------------------------- content
class ContentBlocks:
    """A response's deltas (reasoning, text, tool calls) as Anthropic's content blocks, in the order
    they come: `add` returns the stream events of each delta, and `finished()` the blocks, so that a
    whole message and a stream are the same blocks. A block ends when one of another kind begins
    (or another tool call); thinking carries an empty signature (nothing here signs it)."""

    def __init__(self):
        self.blocks: list[dict[str, Any]] = []
        self.arguments: dict[int, str] = {}  # tool_use block index -> its input's JSON text so far
        self.open = False

    def add(self, deltas: list[Delta]) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("text", delta["content"])
            for call in delta.get("tool_calls", ()):
                events += self._call(call)
        return events

    def close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        index = len(self.blocks) - 1
        events = []
        if self.blocks[index]["type"] == "thinking":
            events.append(_delta(index, {"type": "signature_delta", "signature": ""}))
        if index in self.arguments:
            self.blocks[index]["input"] = _input(self.arguments[index])
        return events + [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def finished(self) -> list[dict]:
        self.close()
        return self.blocks

    def _text(self, kind: str, piece: str) -> list[tuple[str, dict]]:
        events = []
        if not (self.open and self.blocks[-1]["type"] == kind):
            events += self._start({"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
        self.blocks[-1][kind] += piece
        return events + [_delta(len(self.blocks) - 1, {"type": f"{kind}_delta", kind: piece})]

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        events = []
        if "id" in call:  # a call begins: its name is known, its input comes in pieces
            tool_id = "toolu_" + call["id"].removeprefix("call_")
            events += self._start({"type": "tool_use", "id": tool_id, "name": call["function"]["name"], "input": {}})
            self.arguments[len(self.blocks) - 1] = ""
        piece = call["function"].get("arguments", "")
        if piece:
            index = len(self.blocks) - 1
            self.arguments[index] += piece
            events.append(_delta(index, {"type": "input_json_delta", "partial_json": piece}))
        return events

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.blocks.append(block)
        self.open = True
        shown = dict(block) | ({"input": {}} if block["type"] == "tool_use" else {})
        return events + [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": shown})]


def _delta(index: int, delta: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _input(arguments: str) -> dict:
    """A call's arguments as its input object ({} for none; the parser writes JSON objects)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        logger.warning("a tool call's arguments are not JSON: %r", arguments[:200])
        return {}
    return value if isinstance(value, dict) else {}


def _stop(finish: str, text: ChoiceText) -> dict[str, Any]:
    if text.stopped:
        return {"stop_reason": "stop_sequence", "stop_sequence": text.stops.found}
    return {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}


def _usage(openai: dict) -> dict[str, int]:
    """Anthropic's usage from the chat pipeline's: as Anthropic counts, `input_tokens` leaves out
    the prompt tokens read from the prefix cache (`cache_read_input_tokens`); their sum is the
    prompt, what count_tokens answers."""
    cached = openai["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": openai["prompt_tokens"] - cached, "output_tokens": openai["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


# ---------------------------------------------------------------------- streaming
async def _events(message_id: str, model: str, prompt_tokens: int, chunks: AsyncIterator[dict],
                  text: ChoiceText) -> AsyncIterator[tuple[str, dict]]:
    """The chat stream's chunks as Anthropic's events. message_start counts the whole prompt as
    input; message_delta gives the final usage (the part read from the prefix cache is known at
    the end)."""
    start = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    yield "ping", {"type": "ping"}
    blocks, finish, figures = ContentBlocks(), "stop", None
    async for chunk in chunks:
        if "error" in chunk:
            for event in blocks.close():
                yield event
            yield "error", _stream_error(chunk["error"])
            return
        for choice in chunk["choices"]:
            for event in blocks.add([choice["delta"]]):
                yield event
            finish = choice["finish_reason"] or finish
        figures = chunk.get("clover", figures)
        if chunk.get("usage"):  # the last chunk
            for event in blocks.close():
                yield event
            yield "message_delta", {"type": "message_delta", "delta": _stop(finish, text),
                                    "usage": _usage(chunk["usage"]), "clover": figures}
            yield "message_stop", {"type": "message_stop"}


def _sse(events: AsyncIterator[tuple[str, dict]]) -> StreamingResponse:
    async def encoded():
        async for name, data in events:
            yield f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    return StreamingResponse(encoded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---------------------------------------------------------------------- errors
def _stream_error(error: dict) -> dict:
    kind = "overloaded_error" if error.get("code") in OVERLOADED else "api_error"
    return {"type": "error", "error": {"type": kind, "message": error.get("message", "")}}


async def _as_anthropic(request: Request, response: Response) -> Response:
    """An error response of the server's (OpenAI's shape) in Anthropic's, with its status and headers."""
    body = b"".join([piece async for piece in response.body_iterator])
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or f"HTTP {response.status_code}"
        error = {}
    if error.get("param") and error["param"] not in message:
        message = f"{error['param']}: {message}"
    kind = ERROR_TYPES.get(response.status_code, "api_error" if response.status_code >= 500 else
                           "invalid_request_error")
    headers = {key: value for key, value in response.headers.items() if key not in ("content-length", "content-type")}
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message},
                         "request_id": getattr(request.state, "request_id", None)},
                        status_code=response.status_code, headers=headers)
