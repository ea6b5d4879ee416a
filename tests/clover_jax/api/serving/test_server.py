"""The server through the real `openai` client, against `generate` on each request alone: chat and
completions, streaming equal to the whole response, concurrent requests equal to their sequential
answers, every decoding mode, tools through a chat template, injected reasoning and tool calls
through the stream protocol, a client that leaves mid-stream, and every refusal."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from decoding import generate

# A prompt the random two-layer model answers with over a thousand tokens before an EOS (greedy,
# autoregressive, neutral controls): a request that is still running when the test acts on it.
LONG = "abc"
SORTS = ["sort 3 1 4 1 5", "sort 9 2 7 4", "sort 8 1 6 0 2 2", "sort 5 5 1", "sort 7 3 9 1 0 4 2",
         "sort 6 2 8 4", "sort 1 9 3 7 5", "sort 0 4 4 2 8"]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected_chat(service, content: str, max_tokens: int, **overrides):
    """The bundled model's answer from `generate` alone, split as the Qwen format says: (reasoning, content)."""
    ids = service.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                return_dict=False)
    out = generate(service.model, [ids], max_new_tokens=max_tokens, **overrides)
    text = service.tokenizer.decode(out.sequences[0], skip_special_tokens=True)
    reasoning, _, answer = text.partition("</think>")
    return reasoning.replace("<think>", "").strip("\n"), answer.lstrip("\n"), out


def streamed(stream) -> dict:
    """A chat stream put together: content, reasoning, finish reason, usage, Clover's figures."""
    content, reasoning, finish, usage, clover = [], [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            finish = choice.finish_reason or finish
        clover = (chunk.model_extra or {}).get("clover") or clover
    return {"content": "".join(content), "reasoning": "".join(reasoning), "finish": finish, "usage": usage,
            "clover": clover}


# ---------------------------------------------------------------------- the bundled model
def test_models_and_health(bundled_server):
    server, service = bundled_server
    assert [model.id for model in client(server).models.list().data] == ["tiny-clover"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny-clover"


def test_chat_equals_generate_and_the_stream_equals_the_whole(bundled_server):
    server, service = bundled_server
    reasoning, answer, out = expected_chat(service, SORTS[0], 32)
    response = client(server).chat.completions.create(model="tiny-clover", max_tokens=32,
                                                      messages=[{"role": "user", "content": SORTS[0]}])
    message = response.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == (answer, reasoning) \
        == ("1 1 3 4 5", "5 digits")
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == len(out.sequences[0])
    clover = response.model_extra["clover"]
    assert (clover["nfe"], clover["steps_per_block"], clover["block_size"]) == (out.nfe[0], out.steps_per_block[0], 16)
    stream = streamed(client(server).chat.completions.create(
        model="tiny-clover", max_tokens=32, messages=[{"role": "user", "content": SORTS[0]}], stream=True,
        stream_options={"include_usage": True}))
    assert (stream["content"], stream["reasoning"], stream["finish"]) == (answer, reasoning, "stop")
    assert stream["usage"].model_dump() == response.usage.model_dump() and stream["clover"] == clover


def test_completions_with_stop_and_several_prompts(bundled_server):
    server, service = bundled_server
    prompts = [service.tokenizer.apply_chat_template([{"role": "user", "content": s}], add_generation_prompt=True,
                                                     tokenize=False) for s in SORTS[1:3]]
    outs = [generate(service.model, [service.tokenizer.encode(p, add_special_tokens=False)], max_new_tokens=24)
            for p in prompts]
    texts = [service.tokenizer.decode(out.sequences[0], skip_special_tokens=True) for out in outs]
    response = client(server).completions.create(model="tiny-clover", prompt=prompts, max_tokens=24)
    assert [choice.text for choice in sorted(response.choices, key=lambda c: c.index)] == texts
    # a stop string: the text up to it, finish_reason "stop"; the stream says the same
    stop = "</think>"
    cut = client(server).completions.create(model="tiny-clover", prompt=prompts[0], max_tokens=24, stop=[stop])
    assert cut.choices[0].text == texts[0].split(stop)[0] and cut.choices[0].finish_reason == "stop"
    pieces = list(client(server).completions.create(model="tiny-clover", prompt=prompts[0], max_tokens=24,
                                                    stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in pieces) == cut.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_eight_concurrent_requests_equal_their_sequential_answers(bundled_server):
    server, service = bundled_server
    sequential = [client(server).chat.completions.create(
        model="tiny-clover", max_tokens=32, messages=[{"role": "user", "content": s}]).choices[0].message
        for s in SORTS]

    async def concurrently():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(aclient.chat.completions.create(
                model="tiny-clover", max_tokens=32, messages=[{"role": "user", "content": s}]) for s in SORTS))

    together = [r.choices[0].message for r in asyncio.run(concurrently())]
    assert [(m.content, m.model_extra["reasoning_content"]) for m in together] == \
        [(m.content, m.model_extra["reasoning_content"]) for m in sequential]
    for sort, message in zip(SORTS, together, strict=True):
        digits = sorted(int(d) for d in sort.split()[1:])
        assert message.content == " ".join(map(str, digits))  # the bundled model's task, answered
    assert service.engine.running() == 0


@pytest.mark.parametrize("mode", ["autoregressive", "self_speculative"])
def test_other_decoding_modes_equal_generate(bundled_server, mode):
    server, service = bundled_server
    reasoning, answer, out = expected_chat(service, SORTS[3], 24, mode=mode)
    response = client(server).chat.completions.create(model="tiny-clover", max_tokens=24, extra_body={"mode": mode},
                                                      messages=[{"role": "user", "content": SORTS[3]}])
    assert (response.choices[0].message.content, response.model_extra["clover"]["nfe"]) == (answer, out.nfe[0])


def test_a_client_that_leaves_mid_stream_frees_its_slot(endless_server):
    """The client reads the first chunks and leaves: the request is cancelled and its slot freed at once.
    (On a server whose requests cannot end by themselves: the random model's greedy answer to LONG
    ends after 1,082 tokens, which a loaded machine has passed before the server saw the client leave.)"""
    server, service = endless_server
    body = {"model": "tools-clover", "messages": [{"role": "user", "content": LONG}], "max_tokens": 3000,
            "stream": True, "mode": "autoregressive", "presence_penalty": 0, "frequency_penalty": 0,
            "repetition_penalty": 1.0}
    cancelled, steps = service.engine.finished["cancelled"], service.engine.steps
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the stream began
            next(lines), next(lines)
        # the connection is closed here
    deadline = time.monotonic() + 30
    while service.engine.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.engine.running() == 0
    assert service.engine.finished["cancelled"] == cancelled + 1
    # One step per token: well short of the 3,000 asked for. How far the engine gets before the server
    # notices the closed connection depends on the machine's load (332 steps seen with the suite on 2 cores).
    assert service.engine.steps - steps < 1500
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0
    assert client(server).chat.completions.create(model="tools-clover", max_tokens=4, messages=[
        {"role": "user", "content": "hello"}]).choices


BAD = [
    ({"model": "nope"}, 404, "model", "model_not_found"),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0]", None),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, 400, "messages[0].tool_calls[0].function.arguments", None),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, 400, "tools[0].function.name", None),
    ({"tools": "all of them"}, 400, "tools", None),
    ({"tool_choice": "required"}, 400, "tool_choice", None),  # forces a call: needs tools
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": "sort <|mask|> 1"}]}, 400, "messages", None),
    ({"max_tokens": 5000}, 400, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "sort " + "1 " * 1100}]}, 400, "messages", "context_length_exceeded"),
    ({"threshold": 1.5}, 400, "threshold", None),
    ({"block_size": 7}, 400, "block_size", None),
    ({"schedule": "fastest"}, 400, "schedule", None),
    ({"schedule": "fixed_k", "schedule_params": {"tokens_per_step": -1}}, 400, "schedule_params", None),
    ({"mode": "beam"}, 400, "mode", None),
    ({"temperature": 3}, 400, "temperature", None),
    ({"top_p": 0}, 400, "top_p", None),
    ({"presence_penalty": -1}, 400, "presence_penalty", None),
    ({"mode": "self_speculative", "temperature": 0.7}, 400, None, None),
    ({"n": 9}, 400, "n", None),
    ({"response_format": {"type": "yaml"}}, 400, "response_format.type", None),
    ({"frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
]


@pytest.mark.parametrize("change, status, param, code", BAD)
def test_bad_requests_get_openai_errors_before_compute(bundled_server, change, status, param, code):
    server, service = bundled_server
    body = {"model": "tiny-clover", "messages": [{"role": "user", "content": "sort 3 1"}], "max_tokens": 8, **change}
    steps = service.engine.steps
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    assert service.engine.steps == steps  # refused before any compute


def test_usage_reports_prompt_tokens_read_from_the_prefix_cache(bundled_server):
    """A transcript sent again (as agent harnesses do each turn) reads its prompt from the prefix
    cache, reports the reuse in `usage.prompt_tokens_details.cached_tokens`, and answers the same."""
    server, service = bundled_server
    prompt = service.tokenizer.apply_chat_template(
        [{"role": "user", "content": " ".join(SORTS * 2)}], add_generation_prompt=True, tokenize=False)
    length = len(service.tokenizer.encode(prompt, add_special_tokens=False))
    assert length > 2 * 32, "the prompt must span at least two grid chunks"
    first, again = (client(server).completions.create(model="tiny-clover", prompt=prompt, max_tokens=16,
                                                      extra_body={"mode": "autoregressive"}) for _ in range(2))
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.model_dump()["prompt_tokens_details"]["cached_tokens"]
    # autoregressive: the last prompt token is run again (its logits start the response)
    assert cached == (length - 1) // 32 * 32 and cached > 0
    assert again.usage.prompt_tokens == first.usage.prompt_tokens == length


def test_malformed_json_and_completion_refusals(bundled_server):
    server, _ = bundled_server
    post = lambda path, content: httpx.post(server.url + path, content=content, timeout=60,
                                            headers={"Content-Type": "application/json"})
    assert post("/v1/chat/completions", b"{not json").status_code == 400
    assert post("/v1/chat/completions", b"[1, 2]").json()["error"]["message"] == \
        "the request body must be a JSON object"
    for change, param in [({"echo": 1}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
                          ({"prompt": []}, "prompt"), ({"prompt": [[1, 2], "x", 3]}, "prompt")]:
        body = {"model": "tiny-clover", "prompt": "sort 3 1", "max_tokens": 4, **change}
        response = post("/v1/completions", json.dumps(body).encode())
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    # and the server keeps serving
    assert client(server).completions.create(model="tiny-clover", prompt="sort 3 1", max_tokens=4).choices


def test_a_request_that_fails_in_the_engine_fails_alone(bundled_server, monkeypatch):
    """A request whose admission raises (injected for one prompt) fails with a 500 error body; the
    requests around it are answered."""
    server, service = bundled_server
    from decoding.engine import Engine

    real = Engine.entry_for

    def failing(self, prepared):
        if 127 in prepared.prompt:  # the token "digits": only the injected prompt holds it
            raise RuntimeError("injected failure")
        return real(self, prepared)

    monkeypatch.setattr(Engine, "entry_for", failing)
    doomed = {"model": "tiny-clover", "max_tokens": 8,
              "messages": [{"role": "user", "content": "sort digits digits digits 1 2"}]}

    async def together():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                http.post(server.url + "/v1/chat/completions", json=doomed),
                *(http.post(server.url + "/v1/chat/completions", json={
                    "model": "tiny-clover", "max_tokens": 32, "messages": [{"role": "user", "content": s}]})
                  for s in SORTS[:3]))

    failed, *answered = asyncio.run(together())
    assert failed.status_code == 500 and "injected failure" in failed.json()["error"]["message"]
    assert [r.json()["choices"][0]["message"]["content"] for r in answered] == ["1 1 3 4 5", "2 4 7 9", "0 1 2 2 6 8"]
    assert httpx.get(server.url + "/health").json()["running"] == 0


# ---------------------------------------------------------------------- tools through a chat template
def test_tools_tool_calls_and_tool_results_render_through_the_template(tools_server):
    server, service = tools_server
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "weather in paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = client(server).chat.completions.create(model="tools-clover", messages=messages, tools=tools,
                                                      max_tokens=8, extra_body={"block_size": 16})
    rendered = service.tokenizer.apply_chat_template(
        [dict(m, tool_calls=[{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])
         if m["role"] == "assistant" else m for m in messages], tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<parameter=city>\nParis\n</parameter>" in rendered and "<tool_response>\nsunny" in rendered
    assert response.usage.prompt_tokens == len(service.tokenizer.encode(rendered, add_special_tokens=False))
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the template opened <think>: what the random model wrote before any </think> is reasoning
    assert response.choices[0].message.model_extra.get("reasoning_content") or response.choices[0].message.content


def test_injected_reasoning_and_tool_calls_stream_as_openai_chunks():
    """The SSE path on injected text (no model): the chunks parse as the openai library's own types,
    and the library's stream accumulator puts together the message the whole response says, and,
    with log-probabilities, the whole response's `logprobs.content`, however the tokens are cut."""
    from openai.lib.streaming.chat._completions import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from clover_jax.api.serving.logprobs import StreamedLogprobs, chat_logprobs
    from clover_jax.api.serving.pipeline import Reply, response_scores, stream
    from clover_jax.api.serving.protocol import Sampling
    from clover_jax.api.serving.responses import ChoiceText, Message
    from clover_jax.api.serving.service import Prepared
    from decoding.engine import EngineEvent, EngineRequest, RequestStats
    from tests.clover_jax.api.serving.test_parsers import TOOLS, XML_CALLS, CharTokenizer

    class Script:
        """Delivers the injected text's tokens in the pieces given, as the engine would."""

        def __init__(self, ids, cuts):
            bounds = list(zip([0] + cuts, cuts + [len(ids)], strict=True))
            stats = RequestStats(3, len(ids), 4, [2, 2])
            rows = [(-0.01 * (i % 50), [ids[i], 32], [-0.01 * (i % 50), -5.0]) for i in range(len(ids))]
            self.items = [EngineEvent(ids[a:b], logprobs=rows[a:b]) for a, b in bounds[:-1]] + \
                [EngineEvent(ids[bounds[-1][0]:], "eos", stats, logprobs=rows[bounds[-1][0]:])]

        async def events(self):
            for event in self.items:
                yield event

        def cancel(self):
            pass

    ids = CharTokenizer.encode(XML_CALLS)
    prepared = Prepared([1, 2, 3], EngineRequest([1, 2, 3]), 16)
    whole = Message()
    text = ChoiceText(CharTokenizer(), [], False, TOOLS)
    whole.add(text.push(ids) + text.finish())
    reference = ChatCompletion.model_validate({
        "id": "x", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": whole.as_openai(), "finish_reason": "tool_calls"}]})

    script = Script(ids, [])
    figures = chat_logprobs(CharTokenizer(), ids, response_scores(None, prepared, ids, script.items[0].logprobs, 2))

    def broken(tokens, rows):
        raise RuntimeError("no memory left")

    async def chunks(cuts, logprobs, score=lambda tokens, rows: response_scores(None, prepared, tokens, rows, 2)):
        reply = Reply("chatcmpl", "chat.completion", "m", prepared, Sampling())
        scores = [StreamedLogprobs(CharTokenizer(), True, score, causal=score is broken)] if logprobs else None
        return [chunk async for chunk in stream(reply, [Script(ids, cuts)], [ChoiceText(CharTokenizer(), [], False,
                                                                                          TOOLS)], True, chat=True,
                                                 scores=scores)]

    cuts_tried = ([], [5], [40, 41, 200], list(range(1, len(ids), 7)), list(range(1, len(ids))))
    for cuts, logprobs in [(cuts, False) for cuts in cuts_tried] + [(cuts, True) for cuts in cuts_tried]:
        state = ChatCompletionStreamState()
        for chunk in asyncio.run(chunks(cuts, logprobs)):
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
        final = state.get_final_completion().choices[0]
        if logprobs:
            assert [entry.model_dump() for entry in final.logprobs.content] == figures["content"]
        else:
            assert final.logprobs is None
        assert final.finish_reason == "tool_calls"
        assert final.message.content == reference.choices[0].message.content == "Let me look that up."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in reference.choices[0].message.tool_calls]
    # a scoring pass that fails mid-stream ends the stream with an error event, as an engine failure does
    failed = asyncio.run(chunks([5], True, broken))
    assert failed[-1]["error"]["code"] == "internal_error" and "no memory left" in failed[-1]["error"]["message"]
    assert all(choice["logprobs"] is None for chunk in failed[:-1] for choice in chunk["choices"])

    # so does any other failure inside the stream (here the text's parser), logged, never a cut connection
    class BrokenText(ChoiceText):
        def push(self, tokens):
            raise RuntimeError("parser broke")

    async def broken_text_chunks():
        reply = Reply("chatcmpl", "chat.completion", "m", prepared, Sampling())
        return [chunk async for chunk in stream(reply, [Script(ids, [5])], [BrokenText(CharTokenizer(), [], False,
                                                                                        TOOLS)], True, chat=True)]

    failed = asyncio.run(broken_text_chunks())
    assert failed[-1]["error"]["code"] == "internal_error" and "parser broke" in failed[-1]["error"]["message"]


# ---------------------------------------------------------------------- safety
def test_api_key_body_limit_and_capacity(tools_server):
    """With an API key every request needs it (401); bodies are bounded (413); past the running
    requests and the queue the server answers 503, and keeps serving."""
    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import ServerThread
    from clover_jax.api.serving.service import Service
    from decoding.engine import Engine

    _, shared = tools_server
    engine = Engine(shared.model, max_running=1, max_queue=0)
    service = Service(shared.model, shared.tokenizer, engine, "tools-clover", shared.block_sizes)
    key = "s3cret"
    try:
        with ServerThread(create_app(service, api_key=key, max_body_bytes=4096)) as server:
            url = server.url + "/v1/chat/completions"
            body = {"model": "tools-clover", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                response = httpx.post(url, json=body, headers=headers, timeout=60)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(server.url + "/health").status_code == 401
            authorized = {"Authorization": f"Bearer {key}"}
            big = dict(body, messages=[{"role": "user", "content": "x" * 5000}])
            assert httpx.post(url, json=big, headers=authorized, timeout=60).status_code == 413
            # one long request holds the only slot; the next one finds no room
            long = dict(body, messages=[{"role": "user", "content": LONG}], max_tokens=3000, stream=True,
                        mode="autoregressive", presence_penalty=0,
                        frequency_penalty=0, repetition_penalty=1.0)
            with httpx.Client(timeout=60, headers=authorized) as http:
                with http.stream("POST", url, json=long) as stream:
                    lines = stream.iter_lines()
                    first = next(lines)
                    busy = http.post(url, json=body)
                    if busy.status_code != 503:  # say what the long request did instead of holding its slot
                        pytest.fail(f"not refused ({busy.status_code}) while the long request streamed "
                                    f"{first[:200]!r} ... {[line[:300] for line in lines if line][-3:]}")
                    assert busy.json()["error"]["code"] == "server_busy"
                    assert busy.headers["retry-after"] == "1"
            deadline = time.monotonic() + 30  # the stream's client left: its slot is freed at the next step
            while engine.running() and time.monotonic() < deadline:
                time.sleep(0.05)
            answered = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0).chat.completions.create(
                model="tools-clover", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert answered.choices[0].message is not None
    finally:
        engine.close()
