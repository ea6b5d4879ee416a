"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is translated into the chat request it means (`responses_input`) and runs as the chat
endpoint runs one: `Service.prepare_chat` (template, grammar), the engine, and `ChoiceText` (the
reasoning split, the tool-call parser). The chat deltas that come out become output items —
`reasoning` (Clover's thinking, as `reasoning_text` content; no summary is written), `message`,
`function_call` — through one `_Output`, which also writes the stream's events: a whole response is
the stream's last event, by construction.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from clover_jax.api.serving.errors import ApiError
from clover_jax.api.serving.pipeline import Reply, choice_text, collect, read_json
from clover_jax.api.serving.responses import Delta
from clover_jax.api.serving.responses_input import ResponsesRequest, read_responses, responses_params
from clover_jax.api.serving.responses_store import DEFAULT_STORE_BYTES, ResponseStore
from clover_jax.api.serving.service import Prepared, Service, Submission
from decoding.engine import EngineEvent

logger = logging.getLogger(__name__)
Event = dict[str, Any]


def add_responses_routes(app: FastAPI, service: Service, metrics, max_body_bytes: int, body_timeout: float,
                         store_bytes: int = DEFAULT_STORE_BYTES) -> None:
    """The Responses routes on `app`; its store is `app.state.responses_store`."""
    store = app.state.responses_store = ResponseStore(store_bytes)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        asked = read_responses(await read_json(request, max_body_bytes, body_timeout), store.items)
        with responses_params(asked.tool_positions):
            prepared = await run_in_threadpool(service.prepare_chat, asked.chat)
        run = _Run(service, asked, prepared[0])
        submission = service.submit_all(prepared, metrics.engine_request_done)[0]
        if asked.stream:
            return _sse(run.events(submission, store))
        event, tokens, _ = await collect(request, submission, run.text, run.output.add)  # (text finished too)
        response = run.finish(event, tokens)[-1]["response"]
        if asked.store:
            store.put(response, asked.items + response["output"])
        return response

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return store.response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        store.response(response_id)  # 404 for an unknown id
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Run:
    """One response under way: its text, its output items, and the response object they make."""

    def __init__(self, service: Service, asked: ResponsesRequest, prepared: Prepared):
        self.service, self.asked, self.prepared = service, asked, prepared
        self.text = choice_text(service, asked.chat, prepared)
        self.output = _Output()
        self.reply = Reply("resp", "response", service.name, prepared, asked.chat.sampling)
        self.id = "resp_" + uuid.uuid4().hex

    def body(self, status: str, event: EngineEvent | None = None, tokens: list[int] | None = None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.reply.created, "status": status,
                "error": None, "incomplete_details": None, "model": self.service.name, "output": self.output.items,
                "background": False, "service_tier": "default", **self.asked.echo}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if event is not None:  # OpenAI's schema has no null usage: none until the response ends
            body["usage"] = self.usage(event, tokens or [])
            body["clover"] = self.reply.clover([event])
            body["completed_at"] = int(time.time())
        return body

    def usage(self, event: EngineEvent, tokens: list[int]) -> dict:
        chat = self.reply.usage([event])
        return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
                "total_tokens": chat["total_tokens"],
                "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(tokens)}}

    def reasoning_tokens(self, tokens: list[int]) -> int:
        """The response tokens up to and with `</think>` (all of them when thinking never closed);
        a vocabulary without a `</think>` token: the reasoning text's tokens."""
        thought = self.output.has("reasoning")
        close = self.service.tokenizer.token_to_id("</think>")
        if close is not None:
            return tokens.index(close) + 1 if close in tokens else len(tokens) if thought else 0
        reasoning = "".join(item["content"][0]["text"] for item in self.output.items if item["type"] == "reasoning")
        return min(len(self.service.tokenizer.encode(reasoning, add_special_tokens=False)), len(tokens))

    def finish(self, event: EngineEvent, tokens: list[int]) -> list[Event]:
        """The last events of a response whose engine request ended with `event` (its text
        finished): the open item closed, and `response.completed` (or `.incomplete`) with the whole
        response. Raises ApiError for a request the engine failed."""
        status = "incomplete" if self.reply.finish(event, self.text) == "length" else "completed"
        events = self.output.finish(status)
        body = self.body(status, event, tokens)
        return events + [{"type": f"response.{status}", "response": body}]

    async def events(self, submission: Submission, store: ResponseStore) -> AsyncIterator[Event]:
        """The stream's events; a failure after the start ends it with an `error` event."""
        try:
            for status in ("created", "in_progress"):
                yield {"type": f"response.{status}", "response": self.body("in_progress")}
            tokens: list[int] = []
            async for event in submission.events():
                tokens += event.tokens
                deltas = self.text.push(event.tokens) + (self.text.finish() if event.finish is not None else [])
                for item_event in self.output.add(deltas):
                    yield item_event
                if event.finish is not None:
                    for last in self.finish(event, tokens):
                        yield last
                    if self.asked.store:
                        store.put(last["response"], self.asked.items + last["response"]["output"])
                    return
        except ApiError as error:
            yield _error_event(error)
        except Exception as error:  # the 200 is sent: a failure can only end the stream
            logger.exception("a streamed response failed")
            yield _error_event(ApiError(500, f"internal error: {type(error).__name__}: {error}", None,
                                        "internal_error"))
        finally:
            submission.cancel()  # the client left, or the stream ended: the slot is freed either way


class _Output:
    """Chat deltas -> output items, and the stream events that build them: an item opens when a
    delta of another kind than the open item's comes (reasoning, text, a new tool call), and the
    open item closes then, or at the end."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None

    def has(self, kind: str) -> bool:
        return any(item["type"] == kind for item in self.items)

    def add(self, deltas: list[Delta]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    events += self._begin({"id": "fc_" + uuid.uuid4().hex, "type": "function_call",
                                           "call_id": call["id"], "name": call["function"]["name"], "arguments": "",
                                           "status": "in_progress"})
                if call["function"].get("arguments"):
                    self.open["arguments"] += call["function"]["arguments"]
                    events.append(self._about({"type": "response.function_call_arguments.delta",
                                               "delta": call["function"]["arguments"]}))
        return events

    def finish(self, status: str) -> list[Event]:
        """The open item's last events; a response without a message or a call gets an empty
        message (what chat's `content: ""` says)."""
        events = self._close(status)
        if not (self.has("message") or self.has("function_call")):
            events += self._text("message", "") + self._close(status)
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        item, self.open, events = self.open, None, []
        if item is None:
            return events
        item["status"] = status
        part = item["content"][0] if item["type"] != "function_call" else None
        if item["type"] == "function_call":
            events.append(self._about({"type": "response.function_call_arguments.done", "name": item["name"],
                                       "arguments": item["arguments"]}, item))
        elif item["type"] == "reasoning":
            events.append(self._about({"type": "response.reasoning_text.done", "content_index": 0,
                                       "text": part["text"]}, item))
        else:
            events.append(self._about({"type": "response.output_text.done", "content_index": 0, "text": part["text"],
                                       "logprobs": []}, item))
        if part is not None:
            events.append(self._about({"type": "response.content_part.done", "content_index": 0, "part": part}, item))
        return events + [{"type": "response.output_item.done", "output_index": self.items.index(item), "item": item}]

    def _text(self, kind: str, piece: str) -> list[Event]:
        events = [] if self.open is not None and self.open["type"] == kind else self._begin(_empty(kind))
        part = self.open["content"][0]
        part["text"] += piece
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._about({"type": delta, "content_index": 0, "delta": piece, **extra})] if piece else events

    def _begin(self, item: dict) -> list[Event]:
        events = self._close()
        self.open = item
        self.items.append(item)
        shown = json.loads(json.dumps(item))  # as it stands now: its parts come with their own events
        parts = shown.pop("content", None)
        if parts is not None:
            shown["content"] = []
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": shown})
        for part in parts or ():
            events.append(self._about({"type": "response.content_part.added", "content_index": 0, "part": part}))
        return events

    def _about(self, event: Event, item: dict | None = None) -> Event:
        item = item or self.open
        return {**event, "item_id": item["id"], "output_index": self.items.index(item)}


def _empty(kind: str) -> dict:
    if kind == "reasoning":
        return {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "status": "in_progress",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}


def _error_event(error: ApiError) -> Event:
    # the Responses stream's `error` event, and OpenAI's error body the SDK raises on
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param, **error.body()}


def _sse(events: AsyncIterator[Event]) -> StreamingResponse:
    """Server-sent events as the Responses API sends them: `event: TYPE` and `data: JSON` with a
    `sequence_number` (no `[DONE]`)."""
    async def encoded():
        number = 0
        async for event in events:
            event["sequence_number"] = number
            number += 1
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    return StreamingResponse(encoded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
