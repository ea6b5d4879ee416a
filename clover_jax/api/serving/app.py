"""The HTTP app: OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`, and `/health`.

Every request is read and checked before the engine sees it (`protocol`, `service`); any refusal
is an HTTP 4xx with an OpenAI error body, and the server keeps serving. With an API key, every
request must carry `Authorization: Bearer KEY` or `x-api-key: KEY` (401 otherwise). Request bodies are bounded
(413 beyond `max_body_bytes`) and must arrive within `body_timeout` seconds (408 after it, so
that a client that stops sending mid-body holds no connection forever). Streaming responses are
server-sent events that carry text as blocks are decided (with its tokens' log-probabilities,
when asked) and end with `data: [DONE]`; a client
that disconnects cancels its request, which frees its slot at the engine's next step.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from clover_jax.api.serving.anthropic_messages import add_messages_routes
from clover_jax.api.serving.errors import ApiError
from clover_jax.api.serving.logprobs import chat_logprobs
from clover_jax.api.serving.metrics import CONTENT_TYPE, Metrics
from clover_jax.api.serving.pipeline import (
    STARTED,
    Reply,
    choice_text,
    collect_all,
    completion_scores,
    echo_text,
    echoed_scores,
    read_json,
    response_scores,
    sse,
    stream,
    streamed_scores,
)
from clover_jax.api.serving.protocol import read_chat, read_completion
from clover_jax.api.serving.responses import ChoiceText
from clover_jax.api.serving.responses_api import add_responses_routes
from clover_jax.api.serving.service import Service

logger = logging.getLogger(__name__)
request_log = logging.getLogger("clover_jax.api.serving.requests")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/v1/responses",
             "/v1/messages", "/v1/messages/count_tokens")
STORED_RESPONSE = "/v1/responses/{id}"  # the endpoint label of GET and DELETE /v1/responses/ID, whatever the id
MAX_REQUEST_ID = 200  # characters of a client's X-Request-Id kept; a longer or unprintable one is replaced

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a whole request body, from its first byte


def create_app(service: Service, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, log_requests: bool = False) -> FastAPI:
    """log_requests: one line per answered request on the `clover_jax.api.serving.requests` logger
    (INFO): method, path, status, seconds to the response's start, request id."""
    app = FastAPI(title="clover-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    metrics = app.state.metrics = Metrics(service.engine)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None and not _authorized(request, api_key):
            return _error(ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' or "
                                   "'x-api-key: <key>'", None, "invalid_api_key"))
        return await call_next(request)

    @app.middleware("http")
    async def identify(request: Request, call_next):
        """The outermost layer: the request id (the client's X-Request-Id, or a new one) on every
        response, the request counted by endpoint and status, and the log line."""
        started = time.perf_counter()
        given = request.headers.get("x-request-id", "")
        request_id = given if 0 < len(given) <= MAX_REQUEST_ID and given.isprintable() else uuid.uuid4().hex
        request.state.request_id = request_id
        response = await call_next(request)
        response.headers["X-Request-Id"] = request_id
        endpoint = _endpoint(request.url.path)
        metrics.request_done(endpoint, response.status_code)
        if log_requests:
            request_log.info("%s %s %d %.3fs id=%s", request.method, request.url.path, response.status_code,
                             time.perf_counter() - started, request_id)
        return response

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

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": STARTED,
                                            "owned_by": "clover-jax", "max_model_len": service.context}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        chat = read_chat(await read_json(request, max_body_bytes, body_timeout))
        prepared = await run_in_threadpool(service.prepare_chat, chat)
        texts = [choice_text(service, chat, one) for one in prepared]
        submissions = service.submit_all(prepared, metrics.engine_request_done)
        reply = Reply("chatcmpl", "chat.completion", service.name, prepared, chat.sampling)
        if chat.sampling.stream:
            scores = streamed_scores(service, prepared, chat.sampling, chat=True)
            return sse(stream(reply, submissions, texts, chat.sampling.include_usage, chat=True, scores=scores,
                              run_scoring=service.run_scoring))
        messages, collected = await collect_all(request, submissions, texts)
        choices = []
        for index, (message, (event, tokens, logprobs), text) in enumerate(zip(messages, collected, texts,
                                                                               strict=True)):
            finish = reply.finish(event, text)
            scores = None
            if chat.sampling.logprobs:
                scores = await service.run_scoring(response_scores, service, prepared[index], tokens, logprobs,
                                                 chat.sampling.top_logprobs)
            choices.append({"index": index, "message": message.as_openai(),
                            "logprobs": None if scores is None else chat_logprobs(service.tokenizer, tokens, scores),
                            "finish_reason": finish})
        return reply.body(choices, [event for event, _, _ in collected])

    @app.post("/v1/completions")
    async def completions(request: Request):
        completion = read_completion(await read_json(request, max_body_bytes, body_timeout))
        sampling = completion.sampling
        prepared = await run_in_threadpool(service.prepare_completion, completion)
        texts = [ChoiceText(service.tokenizer, sampling.stop) for _ in prepared]
        echoes = [echo_text(service, one) if sampling.echo else "" for one in prepared]
        submissions = service.submit_all(prepared, metrics.engine_request_done)  # all prompts, or one 503
        reply = Reply("cmpl", "text_completion", service.name, prepared, sampling)
        if sampling.stream:
            scores = streamed_scores(service, prepared, sampling, chat=False)
            prompt_scores = None
            if sampling.logprobs and sampling.echo:
                try:
                    prompt_scores = [await service.run_scoring(echoed_scores, service, one, sampling.top_logprobs,
                                                               scores[i]) for i, one in enumerate(prepared)]
                except BaseException:  # no stream will end the submitted requests: free their slots here
                    for submission in submissions:
                        submission.cancel()
                    raise
            return sse(stream(reply, submissions, texts, sampling.include_usage, chat=False, echoes=echoes,
                              scores=scores, echo_scores=prompt_scores, run_scoring=service.run_scoring))
        messages, collected = await collect_all(request, submissions, texts)
        choices = []
        for index, (message, (event, tokens, logprobs), text) in enumerate(zip(messages, collected, texts,
                                                                               strict=True)):
            finish = reply.finish(event, text)
            scores = None
            if sampling.logprobs:
                scores = await service.run_scoring(completion_scores, service, prepared[index], tokens, logprobs,
                                                 sampling.top_logprobs, sampling.echo)
            choices.append({"index": index, "text": echoes[index] + message.text, "logprobs": scores,
                            "finish_reason": finish})
        return reply.body(choices, [event for event, _, _ in collected])

    add_responses_routes(app, service, metrics, max_body_bytes, body_timeout)
    add_messages_routes(app, service, metrics.engine_request_done, max_body_bytes, body_timeout)
    return app


def _endpoint(path: str) -> str:
    """The metrics label of a path: the route's own (one label for every response id, so that the
    labels stay few), else "other"."""
    if path in ENDPOINTS:
        return path
    response_id = path.removeprefix("/v1/responses/")
    if response_id != path and response_id and "/" not in response_id:
        return STORED_RESPONSE
    return "other"


def _authorized(request: Request, api_key: str) -> bool:
    """The key as OpenAI's clients send it (`Authorization: Bearer`) or Anthropic's (`x-api-key`)."""
    given = request.headers.get("authorization", "")
    keys = [given[7:]] if given.startswith("Bearer ") else []
    keys += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
    return any(hmac.compare_digest(key.encode(), api_key.encode()) for key in keys)


def _error(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)
