"""Servers for the serving tests: one per model, in this process on 127.0.0.1, shared by a module."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import clover_jax

HERE = os.path.dirname(os.path.abspath(__file__))


def start(path: str, name: str, **options):
    """A `ServerThread` over a freshly built service (and the service)."""
    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import ServerThread, build_service

    app_options = {key: options.pop(key) for key in ("api_key", "max_body_bytes") if key in options}
    service = build_service(path, name=name, **options)
    return ServerThread(create_app(service, **app_options)), service


@pytest.fixture(scope="module")
def bundled_server():
    """The bundled tiny Clover (it sorts digits), up to 8 requests decoding at once."""
    server, service = start(clover_jax.bundled_model_path(), "tiny-clover", max_running=8)
    with server:
        yield server, service
    service.engine.close()


@pytest.fixture(scope="module")
def tools_checkpoint(small_clover_checkpoint, tmp_path_factory) -> str:
    """The two-layer random Clover with the bundled tokenizer (the same vocabulary size) and a chat
    template that renders tools, tool calls and tool results."""
    directory = tmp_path_factory.mktemp("tools_clover")
    for name in os.listdir(small_clover_checkpoint):
        shutil.copy(os.path.join(small_clover_checkpoint, name), directory / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(clover_jax.bundled_model_path(), name), directory / name)
    shutil.copy(os.path.join(HERE, "tool_chat_template.jinja"), directory / "chat_template.jinja")
    return str(directory)


@pytest.fixture(scope="module")
def endless_server(tools_checkpoint, tmp_path_factory):
    """The tools checkpoint whose only end-of-response id is the mask token, which no step writes:
    its requests run to `max_tokens` unless cancelled, so a test that cancels one mid-flight never
    races the request's own end (a greedy answer of the random model may end after any number of
    tokens)."""
    from tests.conftest import MASK_ID

    directory = tmp_path_factory.mktemp("endless_clover")
    for name in os.listdir(tools_checkpoint):
        shutil.copy(os.path.join(tools_checkpoint, name), directory / name)
    with open(directory / "generation_config.json", "w") as handle:
        json.dump({"eos_token_id": [MASK_ID]}, handle)
    server, service = start(str(directory), "tools-clover", max_running=2)
    with server:
        yield server, service
    service.engine.close()


@pytest.fixture(scope="module")
def tools_server(tools_checkpoint):
    server, service = start(tools_checkpoint, "tools-clover", max_running=2)
    with server:
        yield server, service
    service.engine.close()
