"""What Codex CLI and Claude Code really send (agent_requests/: captured from the pinned versions by
`python -m tests.clover_jax.api.serving.agent_clis`), replayed against the server on the
real-vocabulary test model, no npm needed: each request is answered 200, a stream's events are in
order and parse as the clients' SDK types, the deltas add up to what the stream ends with; and every
top-level field, header and query parameter the clients send is in the docs' tables
(docs/serving.md, Agents), so that the tables cannot fall behind the clients."""

from __future__ import annotations

import fnmatch
import json
import re

import anthropic
import httpx
import openai
import pydantic
import pytest

from tests.clover_jax.api.serving.agent_clis import API_KEY, FIXTURES, MODEL, ROOT, SAME_AS, load, sse_events
from tests.clover_jax.api.serving.conftest import start

KEY = "replay-key"
# each client's fixture whose fields the others refer to first: a greedy request prefills the long
# prefix they share, and the prefix cache serves it to the rest
REQUESTS = sorted(FIXTURES.glob("*.json"), key=lambda path: (SAME_AS in path.read_text(), path.name))
ENDPOINTS = ("/v1/responses", "/v1/messages")
# headers of the connection the capture saw, which the replaying client sets for its own
TRANSPORT = ("host", "content-length", "connection", "accept-encoding")


@pytest.fixture(scope="module")
def server(qwen_vocab_checkpoint):
    # one request at a time: the fixtures of a client share their long prefix (system prompt, tools),
    # which the prefix cache then reads instead of prefilling it again
    server, service = start(qwen_vocab_checkpoint, MODEL, max_running=1, api_key=KEY)
    with server:
        yield server
    service.engine.close()


def replay(server, fixture: dict) -> httpx.Response:
    """The captured request sent again, with this server's key; a sampled one (Claude Code's request
    without a stream: temperature 1) with max_tokens 1, every field still sent: on a CPU each
    sampled denoising step sorts the 248K-token vocabulary (about 1 s a step here), and the random
    model's sampled answer is not cut short by its length penalty as its greedy one is."""
    body = fixture["body"]
    if body.get("temperature", 0) > 0:
        body = {**body, "max_tokens": 1}
    headers = {name: value.replace(API_KEY, KEY) for name, value in fixture["headers"].items()
               if name not in TRANSPORT}
    query = "?" + fixture["query"] if fixture["query"] else ""
    return httpx.request(fixture["method"], server.url + fixture["path"] + query, headers=headers,
                         content=json.dumps(body).encode(), timeout=300)


def test_every_client_and_endpoint_has_its_fixtures():
    clients = {(load(path)["client"].split("/")[0].split()[0], load(path)["path"]) for path in REQUESTS}
    assert clients == {("codex-cli", "/v1/responses"), ("claude-cli", "/v1/messages")}


@pytest.mark.parametrize("path", REQUESTS, ids=lambda path: path.stem)
def test_a_captured_request_is_answered(server, path):
    fixture = load(path)
    response = replay(server, fixture)
    assert response.status_code == 200, response.text
    if not fixture["body"].get("stream"):
        anthropic.types.Message.model_validate(response.json())  # Claude Code's request without a stream
        return
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert all(name == data["type"] for name, data in events), [name for name, _ in events]
    if fixture["path"] == "/v1/responses":
        check_responses_stream([data for _, data in events])
    else:
        check_messages_stream([data for _, data in events if data["type"] != "ping"])


def check_responses_stream(events: list[dict]) -> None:
    """Numbered from 0; created, in_progress, then each output item from `added` to `done` (its
    events naming it, its deltas adding up to its `.done` text), and last the whole response, whose
    output is the items done."""
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    kinds = [event["type"] for event in events]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete") and kinds.count(kinds[-1]) == 1
    item, done, pieces = None, [], []
    for event in events[2:-1]:
        kind = event["type"]
        assert event["output_index"] == len(done), kind
        if kind == "response.output_item.added":
            assert item is None, kind
            item, pieces = event["item"], []
        elif kind == "response.output_item.done":
            assert item is not None and event["item"]["id"] == item["id"]
            done.append(event["item"])
            item = None
        else:
            assert item is not None and event["item_id"] == item["id"], kind
            if kind.endswith(".delta"):
                pieces.append(event["delta"])
            elif kind.endswith("text.done") or kind.endswith("arguments.done"):
                assert "".join(pieces) == event.get("text", event.get("arguments")), kind
    assert item is None and done and done == events[-1]["response"]["output"]
    openai.types.responses.Response.model_validate(events[-1]["response"])


def check_messages_stream(events: list[dict]) -> None:
    """message_start, then the blocks in order (each start, deltas and stop naming its index), then
    message_delta and message_stop."""
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for event in events:
        adapter.validate_python(event)
    kinds = [event["type"] for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks, open_index = 0, None
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == blocks
            open_index, blocks = event["index"], blocks + 1
        else:
            assert event["index"] == open_index, event
            open_index = None if event["type"] == "content_block_stop" else open_index
    assert open_index is None and blocks >= 1 and events[-2]["usage"]["output_tokens"] >= 1


# ---------------------------------------------------------------------- the docs' tables
def documented() -> dict[str, set[str]]:
    """Per endpoint, the names (backquoted, `*` a wildcard) in the first column of the tables under
    the Agents section's heading that names it."""
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text.split("\n## Agents\n", 1)[1].split("\n## ", 1)[0]
    names: dict[str, set[str]] = {}
    for part in section.split("\n### ")[1:]:
        heading, _, body = part.partition("\n")
        endpoint = re.search(r"`(/v1/\w+)`", heading)
        if endpoint is None:
            continue
        rows = [row.split(" | ")[0] for row in body.splitlines() if row.startswith("| ")]
        found = {name for row in rows for name in re.findall(r"`([^`]+)`", row)}
        names.setdefault(endpoint.group(1), set()).update(found)
    return names


def test_every_field_header_and_query_parameter_the_clients_send_is_in_the_docs_table():
    tables = documented()
    assert set(tables) == set(ENDPOINTS) and all(len(names) > 20 for names in tables.values()), tables
    missing = set()
    for path in REQUESTS:
        fixture = load(path)
        listed = tables[fixture["path"]]
        query = [pair.split("=")[0] for pair in fixture["query"].split("&") if pair]
        for kind, names in (("field", fixture["body"]), ("header", fixture["headers"]), ("query", query)):
            missing |= {(fixture["path"], kind, name) for name in names
                        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in listed)}
    assert not missing, f"add them to docs/serving.md, Agents: {sorted(missing)}"
