"""Faults injected into a running server of the bundled model: a mode's decision that raises fails
that mode's requests with an OpenAI error body, while the requests of the other mode, sent at the
same time and decoded in the same passes, are answered as they are without the fault; afterwards
the server serves every mode."""

from __future__ import annotations

import asyncio
import json

import httpx

from decoding.engine import decisions

SORTS = ["sort 3 1 4 1 5", "sort 9 2 7 4", "sort 8 1 6 0 2 2", "sort 5 5 1", "sort 7 3 9 1 0 4 2", "sort 6 2 8 4"]


def _body(content: str, mode: str) -> dict:
    return {"model": "tiny-clover", "max_tokens": 24, "mode": mode, "messages": [{"role": "user", "content": content}]}


def _send_together(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async def together():
        async with httpx.AsyncClient(timeout=600) as http:
            return await asyncio.gather(*(http.post(url + "/v1/chat/completions", json=body) for body in bodies))
    return asyncio.run(together())


def test_a_failing_decision_fails_its_modes_requests_and_the_other_mode_serves_on(bundled_server, monkeypatch):
    server, service = bundled_server
    bodies = [_body(content, mode) for content in SORTS for mode in ("diffusion", "autoregressive")]
    healthy = _send_together(server.url, bodies)
    assert all(response.status_code == 200 for response in healthy), [r.text for r in healthy]

    def broken(*args, **kwargs):
        raise RuntimeError("injected decision failure")

    monkeypatch.setattr(decisions, "decide_autoregressive", broken)
    faulty = _send_together(server.url, bodies)
    for body, response, before in zip(bodies, faulty, healthy, strict=True):
        if body["mode"] == "autoregressive":
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert "injected decision failure" in error["message"] and error["code"] == "engine_error", error
        else:  # diffusion decodes on, and gives what it gave without the fault
            assert response.status_code == 200, response.text
            assert response.json()["choices"] == before.json()["choices"]
    monkeypatch.undo()
    again = _send_together(server.url, bodies)
    assert [r.json()["choices"] for r in again] == [r.json()["choices"] for r in healthy]
    assert httpx.get(server.url + "/health").json()["running"] == 0


def test_a_body_that_stops_arriving_gets_408_and_connections_are_bounded(bundled_server):
    """A client that sends headers and half its body, then nothing: 408 with an OpenAI error body
    after the body timeout, not a connection held forever. Beyond the connection bound, uvicorn
    answers 503 at once; the connections within it are served."""
    import socket
    import time

    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import ServerThread

    _, service = bundled_server
    # uvicorn counts the arriving connection too: a bound of 3 serves 2 at once and refuses the third
    with ServerThread(create_app(service, body_timeout=1.0), max_connections=3) as server:
        half = b'{"model": "tiny-clover", "messages": ['
        stalled = []
        for _ in range(2):
            connection = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 200\r\n\r\n" + half)
            stalled.append(connection)
        started = time.monotonic()
        time.sleep(0.2)
        # both slots of the bound are held by the stalled bodies: a third request is turned away
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503
        for connection in stalled:
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                piece = connection.recv(65536)
                if not piece:
                    break
                reply += piece
            connection.close()
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), reply
            error = json.loads(body)["error"]
            assert error["code"] == "request_timeout" and "not complete within 1 s" in error["message"], error
        assert time.monotonic() - started < 20
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # the bound is free again
