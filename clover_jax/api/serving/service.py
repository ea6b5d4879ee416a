"""What the server serves: one model, its tokenizer and the serving engine, and how an OpenAI
request becomes an engine request (chat template, tokens, decoding controls) — checked whole
before the engine sees it, so a bad request costs no compute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Any, AsyncIterator

from clover_jax.api.serving.errors import ApiError, bad_request
from clover_jax.api.serving.protocol import ChatRequest, CompletionRequest, Sampling
from clover_jax.core.errors import CONTEXT_LENGTH, UNSUPPORTED, FieldError
from decoding.engine import Engine, EngineEvent, EngineRequest, QueueFull
from decoding.layouts import prompt_thinking
from decoding.modes import strategy

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


@dataclasses.dataclass
class Prepared:
    """A request ready for the engine: its prompt's token ids and the engine request."""

    prompt: list[int]
    request: EngineRequest
    block_size: int | None          # diffusion and self-speculative: the block size it decodes with
    reasoning_opened: bool = False  # the prompt ends inside <think>


class Service:
    """model: a `CloverModel`; tokenizer: its `Tokenizer`; engine: the `Engine` over the model;
    name: the model's name in the API; block_sizes: the block sizes a request may ask for."""

    def __init__(self, model, tokenizer, engine: Engine, name: str, block_sizes: tuple[int, ...]):
        self.model, self.tokenizer, self.engine, self.name = model, tokenizer, engine, name
        self.block_sizes = tuple(sorted(set(block_sizes)))
        self.context = engine.max_context

    # ------------------------------------------------------------------ requests
    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.name!r}", "model",
                           "model_not_found")

    def prepare_chat(self, chat: ChatRequest) -> Prepared:
        """Render the conversation with the chat template (its tools, `chat_template_kwargs`) and
        make the engine request; raises ApiError (400) for anything the template or the checks refuse."""
        self.check_model(chat.model)
        kwargs = dict(chat.template_kwargs)
        try:
            text = self.tokenizer.apply_chat_template(chat.messages, tools=chat.tools, add_generation_prompt=True,
                                                      tokenize=False, **kwargs)
        except ValueError as error:
            raise bad_request(f"the chat template refused the messages: {error}", "messages") from None
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        prepared = self._prepared(prompt, chat.sampling, "messages")
        prepared.reasoning_opened = prompt_thinking(prompt, self.engine.defaults)
        return prepared

    def prepare_completion(self, completion: CompletionRequest) -> list[Prepared]:
        self.check_model(completion.model)
        prepared = []
        for index, prompt in enumerate(completion.prompts):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise bad_request(f"prompt {index} has no tokens", "prompt")
            prepared.append(self._prepared(ids, completion.sampling, "prompt"))
        return prepared

    def _prepared(self, prompt: list[int], sampling: Sampling, where: str) -> Prepared:
        overrides = self._overrides(sampling)
        decoder = strategy(sampling.mode)  # the protocol accepted only mode names
        config = self.engine.defaults.replace(**{k: v for k, v in overrides.items() if k != "max_new_tokens"})
        if sampling.max_tokens is None:
            overrides["max_new_tokens"] = self._default_max_tokens(len(prompt), config, decoder)
        seed = sampling.seed if sampling.seed is not None else (secrets.randbits(63) if config.do_sample else 0)
        request = EngineRequest(prompt, decoder.mode, overrides=overrides, seed=seed)
        try:
            self.engine.check(request)
        except ValueError as error:
            raise _refusal(error, where) from None
        return Prepared(prompt, request, config.block_size if decoder.decodes_blocks else None)

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
        try:
            return Submission(self.engine, prepared.request)
        except QueueFull as error:
            raise ApiError(503, f"the server is at capacity ({error}); retry later", None, "server_busy") from None
        except ValueError as error:
            raise _refusal(error, "") from None


class Submission:
    """One engine request seen from the event loop: its events as an async iterator."""

    def __init__(self, engine: Engine, request: EngineRequest):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.finished = False
        self.handle = engine.submit(request, self._listen)

    def _listen(self, event: EngineEvent) -> None:  # on the engine's thread
        if not self.loop.is_closed():  # a closed loop: the server stopped, nobody waits for the event
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self) -> AsyncIterator[EngineEvent]:
        while not self.finished:
            event = await self.queue.get()
            self.finished = event.finish is not None
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
    if param is PROMPT or code == CONTEXT_LENGTH:
        param = where or "messages"
    return bad_request(str(error), param, _CODES.get(code))
