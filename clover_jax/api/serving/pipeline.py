"""The request pipeline every endpoint shares: bodies read within their bounds, a choice's text
(`choice_text`), engine events collected into whole responses (`collect`) or streamed as chat
chunks (`stream`), and the parts of a response body (`Reply`, the log-probabilities).

`app` (OpenAI's chat and completions), `responses_api` (OpenAI's Responses) and
`anthropic_messages` (Anthropic's Messages) translate their requests into this pipeline and its
results back; none decodes on its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from clover_jax.api.serving.errors import ApiError, bad_request
from clover_jax.api.serving.logprobs import StreamedLogprobs, completion_logprobs, no_scores
from clover_jax.api.serving.protocol import ChatRequest
from clover_jax.api.serving.responses import ChoiceText, Message, prompt_tokens_details
from clover_jax.api.serving.service import Prepared, Service, Submission, shutting_down
from decoding.engine import EngineEvent
from decoding.modes import Mode
from decoding.scoring import TokenScores

logger = logging.getLogger(__name__)
# engine finish -> OpenAI finish_reason
FINISH = {"eos": "stop", "length": "length"}

STARTED = int(time.time())


def choice_text(service: Service, chat: ChatRequest, prepared: Prepared) -> ChoiceText:
    """How a chat choice's tokens become its text, reasoning and tool calls (every chat-shaped API)."""
    return ChoiceText(service.tokenizer, chat.sampling.stop, reasoning=prepared.reasoning_opened, tools=chat.tools,
                      first_call_only=not chat.parallel_tool_calls)


# ---------------------------------------------------------------------- bodies
class Reply:
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
        """The choice's finish_reason; a request the engine failed or the shutdown ended raises
        ApiError (500, 503): it is never reported as "stop"."""
        if event.finish == "error":
            raise ApiError(500, f"the request failed in the engine: {event.error}", None, "engine_error")
        if event.finish == "shutdown":
            raise shutting_down()
        reason = "stop" if text.stopped else FINISH.get(event.finish, "stop")
        return "tool_calls" if text.called and reason == "stop" else reason

    def usage(self, events: list[EngineEvent]) -> dict[str, Any]:
        # n choices of a prompt read it once
        prompt = sum(len(p.prompt) for p in self.prepared[::self.sampling.n])
        completion = sum(e.stats.completion_tokens for e in events if e.stats is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": prompt_tokens_details([e.stats for e in events])}

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
async def collect_all(request: Request, submissions, texts) -> tuple[list, list]:
    """Every choice's `Message` and its (last event, tokens, logprobs), collected side by side."""
    messages = [Message() for _ in submissions]
    collected = await asyncio.gather(*(collect(request, s, t, m.add)
                                       for s, t, m in zip(submissions, texts, messages, strict=True)))
    return messages, collected


async def collect(request: Request, submission: Submission, text: ChoiceText,
                   sink) -> tuple[EngineEvent, list[int], list | None]:
    """Every event of a whole (not streamed) response; a client that leaves cancels it. Returns the
    last event, the response tokens read (up to a stop string), and the engine's log-probabilities
    of those tokens (diffusion requests that asked for them; else None)."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, submission))
    tokens: list[int] = []
    logprobs: list | None = None
    try:
        async for event in submission.events():
            if not text.stopped:
                tokens.extend(event.tokens)
                if event.logprobs is not None:
                    logprobs = (logprobs or []) + event.logprobs
            sink(text.push(event.tokens))
            if text.stopped:
                submission.cancel()
            if event.finish is not None:
                sink(text.finish())
                return event, tokens, logprobs
    finally:
        watcher.cancel()
        submission.cancel()


async def _cancel_on_disconnect(request: Request, submission: Submission) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
    submission.cancel()


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def encoded():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(encoded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def stream(reply: Reply, submissions: list[Submission], texts: list[ChoiceText], include_usage: bool, *,
                  chat: bool, echoes: list[str] | None = None, scores: list[StreamedLogprobs] | None = None,
                  echo_scores: list[dict | None] | None = None, run_scoring=None):
    """The chunks of every choice, as each one's events come (choice i: index i). A choice the
    engine failed or the shutdown ended ends the stream with an OpenAI error event.

    scores: per choice, its log-probabilities (`logprobs` asked for). The events that came
    meanwhile are read together, and the figures of the tokens read since the last chunk that
    carried some go with the first chunk made of them, so a token's figures come with the chunk
    that carries its text, or before it (text held back: a partial character, a possible stop
    string or tag), never after; a causal mode's chunk waits for its scoring pass. echo_scores:
    completions with echo, the prompt's figures (the echo chunk's). run_scoring: how a causal
    mode's scoring pass runs (`Service.run_scoring`; by default on the server's thread pool)."""
    run_scoring = run_scoring or run_in_threadpool
    def chunk(index: int, delta: dict, finish: str | None = None) -> dict:
        if chat:
            return {**reply.base("chat.completion.chunk"), "choices": [
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return {**reply.base(), "choices": [{"index": index, "text": delta.get("content", ""), "logprobs": None,
                                             "finish_reason": finish}]}

    def pieces(index: int, deltas: list[dict]):
        if chat:
            return [chunk(index, delta) for delta in deltas]
        text = "".join(d["content"] for d in deltas)
        return [chunk(index, {"content": text})] if text else []

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, submission: Submission):
        async for event in submission.events():
            await queue.put((index, event))

    async def with_figures(index: int, out: list[dict]) -> list[dict]:
        """The figures due go with the first chunk of `out`."""
        if scores is None or not out or not scores[index].due:
            return out
        one = scores[index]
        try:
            figures = await run_scoring(one.take) if one.causal else one.take()
        except Exception as error:  # the stream has begun (200 sent): it ends with an error event
            logger.exception("scoring a streamed response failed")
            raise ApiError(500, f"internal error: scoring the response failed: {type(error).__name__}: {error}",
                           None, "internal_error") from None
        out[0]["choices"][0]["logprobs"] = figures
        return out

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(submissions)]
    finals: dict[int, EngineEvent] = {}
    try:
        for index in range(len(submissions)):
            if chat:
                yield chunk(index, {"role": "assistant", "content": ""})
            elif echoes and (echoes[index] or echo_scores and echo_scores[index] and echo_scores[index]["tokens"]):
                # a prompt whose text is "" (token ids that decode to nothing) still sends its figures
                echoed = chunk(index, {"content": echoes[index]})
                echoed["choices"][0]["logprobs"] = echo_scores[index] if echo_scores else None
                yield echoed
        while len(finals) < len(submissions):
            batch = [await queue.get()]
            while not queue.empty():  # what came while the last chunks were made and sent
                batch.append(queue.get_nowait())
            for index in dict.fromkeys(i for i, _ in batch):
                text, out, final = texts[index], [], None
                for event in (e for i, e in batch if i == index):
                    if scores is not None and not text.stopped:  # as a whole response reads them
                        scores[index].read(event.tokens, event.logprobs)
                    out += pieces(index, text.push(event.tokens))
                    if text.stopped:
                        submissions[index].cancel()
                    if event.finish is not None:
                        final = event
                        break
                if not chat and len(out) > 1:  # a completion's text of the events together: one chunk
                    out = [chunk(index, {"content": "".join(c["choices"][0]["text"] for c in out)})]
                if final is None:
                    for piece in await with_figures(index, out):
                        yield piece
                    continue
                deltas = text.finish()
                finals[index] = final
                try:
                    finish = reply.finish(final, text)
                except ApiError as error:
                    for piece in out:
                        yield piece
                    yield error.body()
                    return
                if chat:
                    out += pieces(index, deltas) + [{**chunk(index, {}, finish), "clover": reply.clover([final])}]
                else:
                    words = "".join(c["choices"][0]["text"] for c in out) + "".join(d["content"] for d in deltas)
                    out = [{**chunk(index, {"content": words}, finish), "clover": reply.clover([final])}]
                for piece in await with_figures(index, out):
                    yield piece
        if include_usage:
            kind = "chat.completion.chunk" if chat else None
            yield {**reply.base(kind), "choices": [], "usage": reply.usage([finals[i] for i in sorted(finals)])}
    except ApiError as error:
        yield error.body()
    except Exception as error:  # the 200 is sent: any failure ends the stream with an error event
        logger.exception("a streamed response failed")
        yield ApiError(500, f"internal error: {type(error).__name__}: {error}", None, "internal_error").body()
    finally:
        for task in pumps:
            task.cancel()
        for submission in submissions:
            submission.cancel()  # the client left, or the stream ended: the slots are freed either way


# ---------------------------------------------------------------------- log-probabilities
def response_scores(service: Service, prepared: Prepared, tokens: list[int], engine_logprobs: list | None,
                     top: int) -> TokenScores:
    """The response tokens' scores: the engine's (diffusion: the deciding step's), or one causal
    pass (autoregressive, self-speculative)."""
    if prepared.request.mode in (Mode.DIFFUSION, "diffusion"):
        rows = (engine_logprobs or [])[:len(tokens)]
        return TokenScores(np.array([r[0] for r in rows], np.float32),
                           np.array([r[1] for r in rows], np.int32).reshape(len(rows), top),
                           np.array([r[2] for r in rows], np.float32).reshape(len(rows), top))
    return service.response_scores(prepared, tokens, top)


def completion_scores(service: Service, prepared: Prepared, tokens: list[int], engine_logprobs: list | None,
                       top: int, echo: bool) -> dict:
    response = response_scores(service, prepared, tokens, engine_logprobs, top)
    prompt = service.prompt_scores(prepared.prompt, top) if echo else None
    return completion_logprobs(service.tokenizer, prepared.prompt if echo else [], prompt, tokens, response)


def streamed_scores(service: Service, prepared: list[Prepared], sampling, chat: bool) -> list | None:
    """Per choice of a stream that asked for log-probabilities, its `StreamedLogprobs` (else None)."""
    if not sampling.logprobs:
        return None

    def one(choice: Prepared) -> StreamedLogprobs:
        score = lambda tokens, rows: response_scores(service, choice, tokens, rows, sampling.top_logprobs)
        causal = choice.request.mode not in (Mode.DIFFUSION, "diffusion")
        return StreamedLogprobs(service.tokenizer, chat, score, causal)

    return [one(choice) for choice in prepared]


def echoed_scores(service: Service, prepared: Prepared, top: int, scores: StreamedLogprobs) -> dict:
    """The echoed prompt's figures (a stream's echo chunk); the response's offsets continue after it."""
    out = completion_logprobs(service.tokenizer, prepared.prompt, service.prompt_scores(prepared.prompt, top), [],
                              no_scores(top))
    if out["tokens"]:
        scores.offset = out["text_offset"][-1] + len(out["tokens"][-1])
    return out


def echo_text(service: Service, prepared: Prepared) -> str:
    if prepared.prompt_text is not None:
        return prepared.prompt_text
    return service.tokenizer.decode(prepared.prompt, skip_special_tokens=False)


# ---------------------------------------------------------------------- helpers
async def read_json(request: Request, limit: int, timeout: float) -> Any:
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


