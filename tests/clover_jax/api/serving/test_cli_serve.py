"""`clover-jax serve` as a user starts it: a subprocess on 127.0.0.1 with an API key, answering the
`openai` client (request ids echoed and logged with --log-requests), then stopped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_clover_jax_serve_answers_the_openai_client():
    port, key = free_port(), "local-key"
    command = [sys.executable, "-m", "clover_jax.api.cli", "serve", "--port", str(port), "--api-key", key,
               "--max-running", "2", "--no-warmup", "--log-requests"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, health = time.monotonic() + 120, None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {key}"})
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert health is not None and health.json()["model"] == "tiny-clover", process.stderr.read() if \
            process.poll() is not None else "no answer"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 401
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="tiny-clover", max_tokens=32, messages=[{"role": "user", "content": "sort 3 1 4 1 5"}],
            extra_headers={"X-Request-Id": "cli-trace-1"})
        assert reply.headers["x-request-id"] == "cli-trace-1"
        assert reply.parse().choices[0].message.content == "1 1 3 4 5"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    stderr = process.stderr.read()
    assert "serving 'tiny-clover' at http://127.0.0.1" in stderr
    # --log-requests: one line per request, with its status and id
    assert "POST /v1/chat/completions 200" in stderr and "id=cli-trace-1" in stderr, stderr
