"""What agent harnesses and evaluators send, through the real `openai` client against one server of
the two-layer random model: log-probabilities against a plain causal forward, streamed ones against
the whole response's in every mode, `n` against single requests with seed + i, forced tool choices,
the output-neutral fields accepted and the others refused by name, `/metrics` read by
prometheus_client's own parser, request ids, a multi-prompt completion that is all-or-nothing, and a
shutdown that ends requests with its error."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from decoding import generate
from decoding.controls import process, thinking_open
from decoding.layouts import controls_of, prompt_thinking, token_ids_of
from decoding.scoring import MIN_BUCKET

MODEL = "tools-clover"
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name}", "strict": True,
                                           "parameters": {"type": "object", "properties": {"city": {
                                               "type": "string"}}}}}
         for name in ("get_weather", "get_time", "book_table")]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def causal_logits(model, ids: list[int]) -> np.ndarray:
    """float32 [len(ids), V]: one plain causal forward of the model (right-padded to a power of two
    so that few shapes compile; causal, so the padding changes no earlier row)."""
    padded = np.zeros((1, max(MIN_BUCKET, 1 << (len(ids) - 1).bit_length())), np.int32)
    padded[0, :len(ids)] = ids
    return np.asarray(model.forward(padded)[0, :len(ids)], np.float32)


def causal_log_softmax(model, ids: list[int]) -> np.ndarray:
    """float64 [len(ids), V]: log_softmax of `causal_logits`."""
    logits = causal_logits(model, ids).astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def without_mask(logp: np.ndarray, mask: int) -> np.ndarray:
    """The mask-token rule on log-probabilities: the mask token excluded, the rest renormalised."""
    out = logp.copy()
    out[:, mask] = -np.inf
    return out - np.log(np.exp(out).sum(-1, keepdims=True))


def test_prompt_logprobs_with_echo_are_a_causal_forwards(tools_server):
    server, service = tools_server
    prompt = service.tokenizer.encode("weather in paris? sort 3 1 2", add_special_tokens=False)
    response = client(server).completions.create(model=MODEL, prompt=[prompt], max_tokens=2, echo=True, logprobs=3,
                                                 extra_body={"mode": "autoregressive"})
    logprobs = response.choices[0].logprobs
    assert response.choices[0].text.startswith(service.tokenizer.decode(prompt, skip_special_tokens=False))
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = without_mask(causal_log_softmax(service.model, prompt), service.engine.defaults.mask_token_id)
    expected = reference[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(logprobs.token_logprobs[1:len(prompt)], expected, rtol=1e-5, atol=1e-5)
    for position in range(1, len(prompt)):
        best = np.argsort(-reference[position - 1])[:3]
        top = logprobs.top_logprobs[position]
        assert list(top) == [service.tokenizer.decode([int(t)], skip_special_tokens=False) for t in best]
        np.testing.assert_allclose(list(top.values()), reference[position - 1, best], rtol=1e-5, atol=1e-5)
    assert len(logprobs.tokens) == len(prompt) + 2 and logprobs.text_offset[0] == 0


ANSWERS: dict = {}


@pytest.mark.parametrize("mode", ["autoregressive", "self_speculative"])
def test_causal_response_logprobs_are_the_processed_causal_pass_over_prompt_and_response(tools_server, mode):
    """Greedy: every response token is the likeliest of the distribution given for it, which is the
    causal forward over prompt + response, processed with the request's controls (counts so far)."""
    server, service = tools_server
    messages = [{"role": "user", "content": "sort 9 2 7 4"}]
    response = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, logprobs=True,
                                                      top_logprobs=2, extra_body={"mode": mode})
    content = response.choices[0].logprobs.content
    ids = service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    if "tokens" not in ANSWERS:  # greedy self-speculative decoding writes the autoregressive answer
        ANSWERS["tokens"] = [int(t) for t in generate(service.model, [ids], max_new_tokens=12,
                                                      mode="autoregressive").sequences[0]]
    tokens = ANSWERS["tokens"]
    assert [entry.token for entry in content] == [service.tokenizer.decode([t], skip_special_tokens=False)
                                                  for t in tokens]
    config = service.engine.defaults
    logits = causal_logits(service.model, ids + tokens)
    controls, special = controls_of(config), token_ids_of(config)
    counts = np.zeros(logits.shape[-1], np.int32)
    for t, (entry, token) in enumerate(zip(content, tokens, strict=True)):
        opened = thinking_open(counts[None], np.asarray([prompt_thinking(ids, config)]), special)[0]
        processed = np.asarray(process(logits[len(ids) - 1 + t][None], counts, np.asarray([t], np.int32), opened,
                                       controls, special)[0], np.float64)
        top = processed.max()
        logp = processed - top - np.log(np.exp(processed - top).sum())
        assert int(np.argmax(logp)) == token  # the decision was made from this distribution
        assert abs(entry.logprob - logp[token]) <= 1e-4, (t, entry.logprob, logp[token])
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(np.sort(logp)[::-1][:2], abs=1e-4)
        counts[token] += 1


def test_diffusion_logprobs_are_the_deciding_steps_choice(tools_server):
    """Greedy diffusion decides each position with the argmax of its step's processed distribution:
    each token is its position's likeliest alternative, and its log-probability that alternative's."""
    server, _ = tools_server
    response = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=16, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens > 0
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def chat_figures(content) -> list[tuple]:
    """Chat `logprobs.content` entries as comparable tuples: token, bytes, logprob, alternatives."""
    return [(e.token, e.bytes, e.logprob, [(a.token, a.bytes, a.logprob) for a in e.top_logprobs]) for e in content]


def assert_same_figures(streamed: list[tuple], whole: list[tuple]) -> None:
    """The same tokens and alternatives, in order, with the same float32 figures (a causal mode's
    stream scores each prefix in a pass of its own length: float rounding apart)."""
    values = lambda rows: [[row[2]] + [alt[2] for alt in row[3]] for row in rows]
    strip = lambda rows: [(row[0], row[1], [alt[:2] for alt in row[3]]) for row in rows]
    assert strip(streamed) == strip(whole)
    np.testing.assert_allclose(values(streamed), values(whole), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["diffusion", "autoregressive", "self_speculative"])
def test_streamed_logprobs_put_together_are_the_whole_responses(tools_server, mode):
    """Chat and completions (with echo), through the openai client: the figures of every chunk, in
    order, are the whole response's, token for token; none comes before its text is read, and no
    text before its figures: a completion's text so far is a prefix of its figures' tokens so far."""
    server, _ = tools_server
    body = dict(model=MODEL, messages=[{"role": "user", "content": "sort 9 2 7 4"}], max_tokens=12, logprobs=True,
                top_logprobs=2, extra_body={"mode": mode})
    whole = client(server).chat.completions.create(**body).choices[0]
    streamed, text, reasoning, finish = [], "", "", None
    for chunk in client(server).chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed += chat_figures(choice.logprobs.content) if choice.logprobs else []
            finish = choice.finish_reason or finish
    assert (text, reasoning, finish) == (whole.message.content or "",
                                         whole.message.model_extra.get("reasoning_content") or "", whole.finish_reason)
    assert len(streamed) > 0
    assert_same_figures(streamed, chat_figures(whole.logprobs.content))

    prompt = dict(model=MODEL, prompt="sort 3 1 2", max_tokens=16, logprobs=2, echo=True, extra_body={"mode": mode})
    reference = client(server).completions.create(**prompt).choices[0].logprobs
    tokens, values, tops, offsets, text = [], [], [], [], ""
    for chunk in client(server).completions.create(stream=True, **prompt):
        for choice in chunk.choices:
            figures = choice.logprobs
            if figures is not None:
                tokens, values = tokens + figures.tokens, values + figures.token_logprobs
                tops, offsets = tops + figures.top_logprobs, offsets + figures.text_offset
            text += choice.text
            assert "".join(tokens).startswith(text) or "\ufffd" in "".join(tokens), (text, tokens)
    assert (tokens, offsets) == (reference.tokens, reference.text_offset) and len(tokens) > 2
    assert values[0] is None and tops[0] is None and reference.token_logprobs[0] is None
    np.testing.assert_allclose(values[1:], reference.token_logprobs[1:], rtol=1e-6, atol=1e-6)
    assert [list(top) for top in tops[1:]] == [list(top) for top in reference.top_logprobs[1:]]
    np.testing.assert_allclose([list(top.values()) for top in tops[1:]],
                               [list(top.values()) for top in reference.top_logprobs[1:]], rtol=1e-6, atol=1e-6)


def test_n_choices_are_single_requests_with_seed_plus_i(tools_server):
    server, _ = tools_server
    body = dict(model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=8, temperature=1.0)
    together = client(server).chat.completions.create(n=2, seed=11, **body)
    alone = [client(server).chat.completions.create(seed=11 + i, **body) for i in range(2)]
    said = lambda choice: (choice.message.content, choice.message.model_extra.get("reasoning_content"))
    assert [c.index for c in together.choices] == [0, 1]
    assert [said(c) for c in together.choices] == [said(a.choices[0]) for a in alone]
    assert len({said(c) for c in together.choices}) > 1  # the seeds differ
    assert together.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt is read once
    completion = client(server).completions.create(model=MODEL, prompt=["a"], n=2, max_tokens=2, seed=3,
                                                   temperature=1.0)
    assert [c.index for c in completion.choices] == [0, 1]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_choice_is_a_call_of_that_tool(tools_server, choice):
    """Decoded under the tool-call grammar (tests/clover_jax/api/serving/test_structured_outputs.py has
    the grammar's own tests): one call, of the named tool or of any, with thinking closed."""
    server, service = tools_server
    messages = [{"role": "user", "content": "what time is it in paris?"}]
    tools = [{"type": "function", "function": {**tool["function"], "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 4}}}}} for tool in TOOLS]
    names = [tool["function"]["name"] for tool in tools]
    tool_choice = {"type": "function", "function": {"name": "book_table"}} if choice == "named" else "required"
    for stream in (False, True):
        request = dict(model=MODEL, messages=messages, tools=tools, max_tokens=96, tool_choice=tool_choice,
                       parallel_tool_calls=False)
        if stream:
            with client(server).chat.completions.stream(**request) as events:
                final = events.get_final_completion().choices[0]
        else:
            final = client(server).chat.completions.create(**request).choices[0]
        assert final.finish_reason == "tool_calls"
        [call] = final.message.tool_calls
        assert call.function.name == "book_table" if choice == "named" else call.function.name in names
        assert set(json.loads(call.function.arguments)) <= {"city"}
        assert not (final.message.model_extra or {}).get("reasoning_content")  # thinking closed


# output-neutral fields, all in one request (n, logprobs and tools are the tests' above)
ACCEPTED = {"store": True, "metadata": {"run": "7"}, "user": "u1", "service_tier": "auto", "prompt_cache_key": "k",
            "safety_identifier": "s", "parallel_tool_calls": False, "modalities": ["text"]}
REFUSED = [({"logit_bias": {"5": 1}}, "logit_bias", "unsupported_parameter"),
           ({"reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter"),
           ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
           ({"top_logprobs": 2}, "top_logprobs", None), ({"n": 9}, "n", None),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name", None),
           ({"tool_choice": "required"}, "tool_choice", None), ({"metadata": {"a": 1}}, "metadata", None),
           ({"stroe": True}, "stroe", "unknown_parameter")]


def test_output_neutral_fields_are_accepted_and_the_others_refused_by_name(tools_server):
    server, service = tools_server
    url = server.url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(url, json={**base, **ACCEPTED}, timeout=300)
    assert response.status_code == 200, response.text
    steps = service.engine.steps
    for change, param, code in REFUSED:
        response = httpx.post(url, json={**base, **change}, timeout=60)
        assert response.status_code == 400, (change, response.text)
        assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, code), change
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for change, param in (({"logprobs": 6}, "logprobs"), ({"echo": "yes"}, "echo"), ({"suffix": "x"}, "suffix")):
        response = httpx.post(server.url + "/v1/completions", json={**completion, **change}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert service.engine.steps == steps  # refused before any compute


def test_metrics_parse_and_count_requests_and_request_ids_are_echoed(tools_server):
    server, service = tools_server

    def samples() -> dict:
        text = httpx.get(server.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    label = ("clover_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
    before = samples()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answered = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"},
                          timeout=300)
    assert answered.headers["x-request-id"] == "trace-42"
    made = httpx.post(server.url + "/v1/chat/completions", json={**body, "bogus": 1}, timeout=60)
    assert made.status_code == 400 and len(made.headers["x-request-id"]) == 32
    after = samples()
    assert after[label] == before.get(label, 0) + 1
    refused = ("clover_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))
    assert after[refused] == before.get(refused, 0) + 1
    for name in ("clover_time_to_first_block_seconds_count", "clover_time_per_output_token_seconds_count",
                 "clover_tokens_per_forward_count"):
        assert after[(name, ())] >= before.get((name, ()), 0) + 1, name
    assert after[("clover_queue_length", ())] == 0 and after[("clover_running_requests", ())] == 0
    # nothing running now: the pages in use are the prefix cache's, whole pages of the pool
    engine = service.engine
    capacity, in_use = after[("clover_kv_cache_bytes", ())], after[("clover_kv_cache_bytes_in_use", ())]
    assert capacity == (engine.shapes.num_pages - 1) * engine.page_bytes
    assert in_use == engine.kv_pages_in_use() * engine.page_bytes and in_use % engine.page_bytes == 0
    assert ("clover_prefix_cache_hits_total", ()) in after


@pytest.fixture
def small_engine_server(tools_server):
    """A server of its own over the shared model: one running request, one queued."""
    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import ServerThread
    from clover_jax.api.serving.service import Service
    from decoding.engine import Engine

    _, shared = tools_server
    engine = Engine(shared.model, max_running=1, max_queue=1)
    service = Service(shared.model, shared.tokenizer, engine, MODEL, shared.block_sizes)
    try:
        with ServerThread(create_app(service)) as server:
            yield server, service
    finally:
        engine.close()


LONG = {"model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3000, "mode": "autoregressive",
        "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1.0}


def test_a_multi_prompt_completion_is_all_or_nothing_and_shutdown_ends_requests_with_its_error(small_engine_server):
    server, service = small_engine_server
    engine = service.engine
    completion = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2}
    busy = httpx.post(server.url + "/v1/completions", json=completion, timeout=60)  # 3 > 1 running + 1 queued
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
    assert sum(engine.finished.values()) == 0 and engine.steps == 0  # none of them ran
    two = httpx.post(server.url + "/v1/completions", json={**completion, "prompt": ["a", "b"]}, timeout=300)
    assert two.status_code == 200 and len(two.json()["choices"]) == 2

    # shutdown as `serve` runs it (SIGTERM to its uvicorn server closes the engine first): a streamed
    # request ends with an OpenAI error event, a whole one with a 503 body, and later ones get 503s
    import uvicorn

    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import _ClosingServer

    closing = _ClosingServer(uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning",
                                            lifespan="off", timeout_graceful_shutdown=5), engine)
    runner = threading.Thread(target=closing.run, daemon=True)
    runner.start()
    while not closing.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{closing.servers[0].sockets[0].getsockname()[1]}/v1/chat/completions"
    results: dict = {}

    def streamed():
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=300) as response:
            results["events"] = [line for line in response.iter_lines() if line.startswith("data: ")]

    def whole():
        results["whole"] = httpx.post(url, json=LONG, timeout=300)

    threads = [threading.Thread(target=streamed), threading.Thread(target=whole)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while engine.running() + engine.queued() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    closing.handle_exit(signal.SIGTERM, None)
    for thread in threads + [runner]:
        thread.join(timeout=60)
    error = json.loads(results["events"][-2][len("data: "):])
    assert results["events"][-1] == "data: [DONE]" and error["error"]["code"] == "server_shutdown", results["events"]
    assert not any('"finish_reason": "stop"' in line for line in results["events"])
    assert results["whole"].status_code == 503 and results["whole"].json()["error"]["code"] == "server_shutdown"
    assert not runner.is_alive()  # uvicorn finished the connections and exited
    after = httpx.post(server.url + "/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=60)
    assert after.status_code == 503 and after.json()["error"]["code"] == "server_shutdown"
