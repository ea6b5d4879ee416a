"""What the server serves: one model, its tokenizer and the serving engine, and how an OpenAI
request becomes an engine request (chat template, tokens, decoding controls) — checked whole
before the engine sees it, so a bad request costs no compute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence

import anyio
import anyio.to_thread

from clover_jax.api.serving.errors import ApiError, bad_request
from clover_jax.api.serving.protocol import ChatRequest, CompletionRequest, Sampling
from clover_jax.api.serving.structured import Tags, check_compiles, tags_of, tool_constraint
from clover_jax.core.errors import CONTEXT_LENGTH, UNSUPPORTED, FieldError
from decoding.constraints.spec import Constraint
from decoding.engine import Engine, EngineClosed, EngineEvent, EngineRequest, QueueFull
from decoding.layouts import prompt_thinking
from decoding.modes import Mode, strategy
from decoding.scoring import TokenScores, prompt_logprobs, response_logprobs

# The one table from the fields a FieldError names (GenerationConfig fields, `generate`'s and the
# engine's arguments) to the request parameter a client sent; PROMPT: the messages or the prompt,
# as the request spelled it. A field not here is reported without a parameter.
PROMPT = object()
_PARAMS = {"max_new_tokens": "max_tokens", "do_sample": "temperature", "temperature": "temperature",
           "top_p": "top_p", "top_k": "top_k", "threshold": "threshold", "block_size": "block_size",
           "schedule": "schedule", "schedule_params": "schedule_params", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty", "seed": "seed",
           "mode": "mode", "prompts": PROMPT}
# FieldError codes that are OpenAI error codes too; the others are sent without a code.
_CODES = {CONTEXT_LENGTH: "context_length_exceeded"}
# A constraint's field is the request's own path to what gave it (structured outputs)
_REQUEST_PATHS = ("response_format", "tools")


@dataclasses.dataclass
class Prepared:
    """A request ready for the engine: its prompt's token ids and the engine request."""

    prompt: list[int]
    request: EngineRequest
    block_size: int | None          # diffusion and self-speculative: the block size it decodes with
    reasoning_opened: bool = False  # the prompt ends inside <think>
    prompt_text: str | None = None  # completions: the prompt as text (echo)


class Service:
    """model: a `CloverModel`; tokenizer: its `Tokenizer`; engine: the `Engine` over the model;
    name: the model's name in the API; block_sizes: the block sizes a request may ask for."""

    def __init__(self, model, tokenizer, engine: Engine, name: str, block_sizes: tuple[int, ...]):
        self.model, self.tokenizer, self.engine, self.name = model, tokenizer, engine, name
        self.block_sizes = tuple(sorted(set(block_sizes)))
        self.context = engine.max_context
        self._scoring = threading.Lock()  # one scoring pass at a time beside the engine (memory)
        self._scoring_limiter: anyio.CapacityLimiter | None = None  # made in the server's event loop
        self._tags: Tags | None = None

    @property
    def tags(self) -> Tags:
        """The tool-call tags as the grammar writes them (`structured.tags_of`)."""
        if self._tags is None:
            self._tags = tags_of(self.tokenizer)
        return self._tags

    async def run_scoring(self, function, *args):
        """`function(*args)`, a scoring pass, on a worker thread, one at a time: requests wait
        for their turn here rather than each on a thread of the server's shared pool (40 streams
        waiting on the lock would hold every thread, and no new request could be prepared), and a
        request whose client leaves stops waiting at once (a pass it started finishes alone)."""
        if self._scoring_limiter is None:
            self._scoring_limiter = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(functools.partial(function, *args), limiter=self._scoring_limiter,
                                              abandon_on_cancel=True)

    # ------------------------------------------------------------------ requests
    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.name!r}", "model",
                           "model_not_found")

    def prepare_chat(self, chat: ChatRequest) -> list[Prepared]:
        """Render the conversation with the chat template (its tools, `chat_template_kwargs`) and
        make the engine requests, one per choice (`n`); raises ApiError (400) for anything the
        template or the checks refuse. The response is decoded under the grammar of its tool calls
        and response_format (`structured.tool_constraint`), if any; a forced tool choice closes thinking."""
        self.check_model(chat.model)
        constraint = chat.sampling.response_format
        if constraint is not None:  # its own errors name its own field
            check_compiles(constraint)
        if chat.tools:
            constraint = tool_constraint(chat.tools, chat.forced, chat.parallel_tool_calls, chat.strict, self.tags,
                                         constraint)
        kwargs = dict(chat.template_kwargs)
        if chat.forced is not None:
            kwargs["enable_thinking"] = False
        try:
            text = self.tokenizer.apply_chat_template(chat.messages, tools=chat.tools, add_generation_prompt=True,
                                                      tokenize=False, **kwargs)
        except ValueError as error:
            raise bad_request(f"the chat template refused the messages: {error}", "messages") from None
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        if chat.forced is not None and prompt_thinking(prompt, self.engine.defaults):
            # a template that ignores enable_thinking: thinking is closed here
            prompt = prompt + self.tokenizer.encode("\n</think>\n\n", add_special_tokens=False)
        choices = self._prepared(prompt, chat.sampling, "messages", constraint)
        for prepared in choices:
            prepared.reasoning_opened = prompt_thinking(prompt, self.engine.defaults)
        return choices

    def prepare_completion(self, completion: CompletionRequest) -> list[Prepared]:
        """One engine request per prompt and choice: prompt p's choice i is element p * n + i."""
        self.check_model(completion.model)
        prepared = []
        for index, prompt in enumerate(completion.prompts):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise bad_request(f"prompt {index} has no tokens", "prompt")
            for one in self._prepared(ids, completion.sampling, "prompt", completion.sampling.response_format):
                one.prompt_text = prompt if isinstance(prompt, str) else None
                prepared.append(one)
        return prepared

    def _prepared(self, prompt: list[int], sampling: Sampling, where: str,
                  constraint: Constraint | None = None) -> list[Prepared]:
        """The engine requests of one prompt: `sampling.n` of them, choice i with seed + i, under
        `constraint` (its grammar checked first, so that a bad one costs no compute)."""
        overrides = self._overrides(sampling)
        if constraint is not None:
            check_compiles(constraint)
            overrides["constraint"] = constraint
        decoder = strategy(sampling.mode)  # the protocol accepted only mode names
        config = self.engine.defaults.replace(**{k: v for k, v in overrides.items() if k != "max_new_tokens"})
        if sampling.max_tokens is None:
            overrides["max_new_tokens"] = self._default_max_tokens(len(prompt), config, decoder)
        seed = sampling.seed if sampling.seed is not None else (secrets.randbits(63) if config.do_sample else 0)
        top = sampling.top_logprobs if sampling.logprobs else None
        # diffusion records each token's figure at the denoising step that decides it; the causal
        # modes are scored afterwards by one causal pass (decoding.scoring)
        record = top if decoder.mode == Mode.DIFFUSION else None
        requests = [EngineRequest(prompt, decoder.mode, overrides=overrides, seed=(seed + i) % 2**63,
                                  logprobs=record) for i in range(sampling.n)]
        try:
            self.engine.check(requests[0])
        except ValueError as error:
            raise _refusal(error, where) from None
        return [Prepared(prompt, request, config.block_size if decoder.decodes_blocks else None)
                for request in requests]

    # ------------------------------------------------------------------ log-probabilities
    def prompt_scores(self, prompt: list[int], top: int) -> TokenScores:
        """Scores of prompt[1:] (`decoding.scoring.prompt_logprobs`)."""
        with self._scoring:
            return prompt_logprobs(self.model, prompt, self.engine.defaults.mask_token_id, top)

    def response_scores(self, prepared: Prepared, tokens: list[int], top: int) -> TokenScores:
        """Scores of an autoregressive or self-speculative response (`decoding.scoring.response_logprobs`)."""
        config = self.engine.check(prepared.request).config
        with self._scoring:
            return response_logprobs(self.model, prepared.prompt, tokens, config,
                                     prompt_thinking(prepared.prompt, config), top)

    def _overrides(self, sampling: Sampling) -> dict[str, Any]:
        overrides: dict[str, Any] = {}
        if sampling.temperature is not None:
            overrides["do_sample"] = sampling.temperature > 0
            if sampling.temperature > 0:
                overrides["temperature"] = sampling.temperature
        if sampling.top_k is not None:
            overrides["top_k"] = max(sampling.top_k, 0)  # -1 (vLLM) and 0 both turn top-k off
        for name in ("top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "threshold", "schedule",
                     "schedule_params"):
            if getattr(sampling, name) is not None:
                overrides[name] = getattr(sampling, name)
        if sampling.block_size is not None:
            if sampling.block_size not in self.block_sizes:
                raise bad_request(f"block_size must be one of {list(self.block_sizes)} on this server (--block-sizes), "
                                  f"got {sampling.block_size}", "block_size")
            overrides["block_size"] = sampling.block_size
        if sampling.max_tokens is not None:
            overrides["max_new_tokens"] = sampling.max_tokens
        try:
            self.engine.defaults.replace(**overrides)
        except ValueError as error:
            raise _refusal(error, "") from None
        return overrides

    def _default_max_tokens(self, prompt_length: int, config, decoder) -> int:
        """max_tokens left out: the checkpoint's max_new_tokens, or all the context left, whichever
        is less (`ModeStrategy.room`: whole blocks for diffusion, a draft for self-speculative)."""
        room = decoder.room(self.context, prompt_length, config.block_size)
        if room < 1:
            raise bad_request(f"the prompt has {prompt_length} tokens: no room is left in the context of "
                              f"{self.context} for a response", "messages", "context_length_exceeded")
        return min(room, config.max_new_tokens or room)

    # ------------------------------------------------------------------ running
    def submit(self, prepared: Prepared) -> "Submission":
        return self.submit_all([prepared])[0]

    def submit_all(self, prepared: Sequence[Prepared],
                   on_finish: Callable[["Submission", EngineEvent], None] | None = None) -> list["Submission"]:
        """Queue every request together (`Engine.submit_all`): all of them, or none and one 503.
        on_finish(submission, last event) is called on the event loop as each one finishes."""
        submissions = [Submission(on_finish) for _ in prepared]
        try:
            handles = self.engine.submit_all([one.request for one in prepared], [s.listen for s in submissions])
        except QueueFull as error:
            raise ApiError(503, f"the server is at capacity ({error}); retry later", None, "server_busy") from None
        except EngineClosed:
            raise shutting_down() from None
        except ValueError as error:
            raise _refusal(error, "") from None
        for submission, handle in zip(submissions, handles, strict=True):
            submission.handle = handle
        return submissions


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; the request did not complete", None, "server_shutdown")


class Submission:
    """One engine request seen from the event loop: its events as an async iterator, and when
    they came (`submitted`, `first` tokens, `ended`: `time.perf_counter()`)."""

    def __init__(self, on_finish: Callable[["Submission", EngineEvent], None] | None = None):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.finished = False
        self.handle = None
        self.on_finish = on_finish
        self.submitted, self.first, self.ended = time.perf_counter(), None, None

    def listen(self, event: EngineEvent) -> None:  # on the engine's thread
        if not self.loop.is_closed():  # a closed loop: the server stopped, nobody waits for the event
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self) -> AsyncIterator[EngineEvent]:
        while not self.finished:
            event = await self.queue.get()
            if event.tokens and self.first is None:
                self.first = time.perf_counter()
            self.finished = event.finish is not None
            if self.finished:
                self.ended = time.perf_counter()
                if self.on_finish is not None:
                    self.on_finish(self, event)
            yield event

    def cancel(self) -> None:
        """Free the request's slot (a client that left, a stop string found); idempotent."""
        if not self.finished:
            self.handle.cancel()


def _refusal(error: ValueError, where: str) -> ApiError:
    """The engine's or the generation config's ValueError as a 400 naming the request parameter
    (`_PARAMS`, from the error's field; `where`: "messages" or "prompt"). A combination of values
    (code UNSUPPORTED) names no single parameter."""
    field = getattr(error, "field", None) if isinstance(error, FieldError) else None
    code = getattr(error, "code", None)
    param = None if code == UNSUPPORTED else _PARAMS.get(field)
    if isinstance(field, str) and field.startswith(_REQUEST_PATHS):
        param = field
    if param is PROMPT or code == CONTEXT_LENGTH:
        param = where or "messages"
    return bad_request(str(error), param, _CODES.get(code))
