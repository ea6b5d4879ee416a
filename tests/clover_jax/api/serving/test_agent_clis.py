"""Codex CLI and Claude Code, the versions `make test` installs (pinned in the Makefile), each running a
turn against the server on the real-vocabulary test model (Qwen's 248K-token vocabulary and tags; its
answers end after a few tokens), offline on 127.0.0.1, the API key required: the CLI exits 0, the
request it sent was answered 200, and what it printed as its answer is the text the server streamed.
The CLIs missing fail these tests (`make test` installs them), they are not skipped."""

from __future__ import annotations

import json
import uuid

import pytest

from clover_jax.api.serving.app import create_app
from clover_jax.api.serving.server import ServerThread, build_service
from tests.clover_jax.api.serving.agent_clis import (
    FIXTURES,
    MAX_OUTPUT_TOKENS,
    MODEL,
    Exchange,
    Recorder,
    finished,
    load,
    run_claude,
    run_codex,
    version,
)

KEY = "agent-test-key"


@pytest.fixture(scope="module")
def served(qwen_vocab_checkpoint):
    # one request decoding at a time: Claude Code's first request then has the CPU alone, its warmup
    # requests wait behind it and are cancelled when it is answered and the CLI leaves
    service = build_service(qwen_vocab_checkpoint, name=MODEL, max_running=1)
    recorder = Recorder(create_app(service, api_key=KEY))
    with ServerThread(recorder) as server:
        yield server, recorder
    service.engine.close()


def test_the_installed_clis_are_the_versions_the_fixtures_were_captured_from():
    """A new pin in the Makefile needs the fixtures captured again, or the replay tests would test
    the old clients' requests."""
    captured = {load(path)["client"] for path in FIXTURES.glob("*.json")}
    installed = {"codex-cli " + version("codex").split()[-1], "claude-cli/" + version("claude").split()[0]}
    assert installed == captured, ("capture agent_requests/ again: python -m tests.clover_jax.api.serving.agent_clis",
                                   installed, captured)


def test_codex_exec_runs_a_turn(served, tmp_path):
    server, recorder = served
    prompt = f"Say hi ({uuid.uuid4().hex[:8]})"
    start = len(recorder.exchanges)
    finished(run_codex(server.url, KEY, prompt, tmp_path))
    asked = answered(recorder.exchanges[start:], "/v1/responses", prompt)
    assert asked.headers["authorization"] == f"Bearer {KEY}" and asked.body["model"] == MODEL
    assert asked.body["stream"] is True and asked.body["store"] is False
    events = [data for _, data in asked.events()]
    assert events[-1]["type"] == "response.completed", [event["type"] for event in events]
    output = events[-1]["response"]["output"]
    said = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    assert (tmp_path / "codex-last-message.txt").read_text().strip() == said.strip()


def test_claude_code_print_runs_a_turn(served, tmp_path):
    server, recorder = served
    prompt = f"Say hi ({uuid.uuid4().hex[:8]})"
    start = len(recorder.exchanges)
    done = finished(run_claude(server.url, KEY, prompt, tmp_path))
    made = recorder.exchanges[start:]
    asked = answered(made, "/v1/messages", prompt)
    assert asked.headers["x-api-key"] == KEY and asked.body["max_tokens"] == MAX_OUTPUT_TOKENS
    assert asked.body["stream"] is True and asked.body["tools"], "the main request carries the tools"
    # its warmup and background requests too (those it dropped before their answer began aside)
    assert all(exchange.status in (200, None) for exchange in made), [(e.path, e.status) for e in made]
    events = [data for _, data in asked.events()]
    said = "".join(event["delta"].get("text", "") for event in events if event["type"] == "content_block_delta")
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert result["result"].strip() == said.strip()
    last = next(event for event in events if event["type"] == "message_delta")
    assert result["usage"]["output_tokens"] == last["usage"]["output_tokens"]


def answered(exchanges: list[Exchange], path: str, prompt: str) -> Exchange:
    """The last request to `path` that carried `prompt`, answered 200."""
    asked = [exchange for exchange in exchanges if exchange.path == path and exchange.mentions(prompt)]
    assert asked, f"the server saw no {path} request with the prompt: {[(e.method, e.path) for e in exchanges]}"
    assert asked[-1].status == 200, asked[-1].response[-2000:]
    return asked[-1]
