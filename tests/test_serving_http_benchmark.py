"""The pieces of `benchmarks/serving_http.py` that a run of it trusts, cheaply: the closed loop of
`openai` clients against the bundled model's server (in this process) gives each request the text
of `generate`'s tokens for it, and the word-level tokenizer written for a random checkpoint names
every token, so that equal text is equal tokens. (The script end to end starts a server that
precompiles every mode's 41 programs, over a minute: `python benchmarks/serving_http.py --quick`.)"""

from __future__ import annotations

import pytest

import clover_jax


def test_http_closed_loop_answers_every_request_with_generate_alone_text():
    openai = pytest.importorskip("openai")
    from benchmarks.engine_traffic import bundled_requests
    from benchmarks.serving_http import http_closed_loop, one_at_a_time
    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import ServerThread, build_service

    requests = bundled_requests(3, max_new_tokens=16)
    for request in requests:
        request.overrides["do_sample"] = False
    service = build_service(str(clover_jax.bundled_model_path()), name="tiny", max_running=2, prefix_cache_bytes=0)
    try:
        with ServerThread(create_app(service)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            run = http_closed_loop(client, "tiny", [list(r.prompt) for r in requests], max_tokens=16, concurrency=2)
            client.close()
    finally:
        service.engine.close()
    alone = one_at_a_time(service.model, requests)["tokens"]
    assert run["wall"] > 0 and (run["times"][:, 1] >= run["times"][:, 0]).all()
    assert run["tokens"] == [len(tokens) for tokens in alone]
    assert run["texts"] == [service.tokenizer.decode(list(t), skip_special_tokens=True) for t in alone]
    assert any(run["texts"])  # the task's answers are digits: an empty text everywhere would compare nothing


def test_word_tokenizer_names_every_token_and_skips_the_special_ones(tmp_path):
    from benchmarks.serving_http import write_word_tokenizer
    from clover_jax.api.serving.text import IncrementalDecoder
    from clover_jax.text.tokenizer import Tokenizer

    write_word_tokenizer(str(tmp_path), 1000, special=[1, 999])
    tokenizer = Tokenizer.from_pretrained(str(tmp_path))
    ids = [5, 1, 999, 300, 2, 998, 17]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert whole == "<5> <300> <2> <998> <17>"
    assert tokenizer.encode(whole, add_special_tokens=False) == [5, 300, 2, 998, 17]
    decoder = IncrementalDecoder(tokenizer)  # the server's streaming detokenizer gives the same text
    assert "".join(decoder.push(ids[i:i + 2]) for i in range(0, len(ids), 2)) + decoder.flush() == whole
