"""Codex CLI and Claude Code, the versions `make test` installs (Makefile: AGENT_CLIS), each driving a
server of this process for a turn; and what they send, recorded.

    recorder = Recorder(create_app(service, api_key=KEY))   # the app, every exchange kept
    with ServerThread(recorder) as server:
        done = run_codex(server.url, KEY, "Say hi", tmp_path)
        done = run_claude(server.url, KEY, "Say hi", tmp_path)

Each CLI runs offline (the server on 127.0.0.1 is the only address it reaches; any other goes to a
proxy where nothing listens), in a temporary home and with a clean environment, so that nothing of
the user's configuration, keys or proxies reaches it.

`python -m tests.clover_jax.api.serving.agent_clis` captures agent_requests/ again (after a new pin in
the Makefile): each client's requests as they arrived, with the key, the temporary paths and the
machine's user hash replaced by placeholders.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[4]
BIN = ROOT / ".venv" / "agent-clis" / "node_modules" / ".bin"
FIXTURES = Path(__file__).resolve().parent / "agent_requests"
MODEL = "qwen-vocab"  # the served name: Codex sends its configured model, which the server checks
API_KEY, HOME = "<API_KEY>", "/home/user"  # the placeholders of the fixtures
CAPTURE_KEY = "capture-key"
SAME_AS, SHARED_BYTES = "$same_as", 4096  # a fixture's body field that repeats the first one's: {"$same_as": FILE}
MAX_OUTPUT_TOKENS = 64  # Claude Code's max_tokens (the test model ends its answers after a few tokens)


def cli(name: str) -> str:
    """The installed CLI `name` (codex, claude); a test fails, not skips, without it."""
    path = BIN / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: `make test` installs the pinned Codex CLI and Claude Code there first "
                    "(the Makefile's AGENT_CLIS step, `make agent-clis`: npm install --prefix .venv/agent-clis)")
    return str(path)


def version(name: str) -> str:
    """The CLI's version, as `--version` prints it."""
    return subprocess.run([cli(name), "--version"], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


# ---------------------------------------------------------------------- the recorder
@dataclasses.dataclass
class Exchange:
    """One HTTP exchange: the request as the client sent it, and what the server answered."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any                  # the JSON body (None: none)
    forced: dict | None = None  # what the recorder changed in it before the app read it
    status: int | None = None
    response: bytes = b""

    def events(self) -> list[tuple[str | None, dict]]:
        return sse_events(self.response.decode("utf-8"))

    def mentions(self, text: str) -> bool:
        return text in json.dumps(self.body, ensure_ascii=False)


def sse_events(text: str) -> list[tuple[str | None, dict]]:
    """Server-sent events as (event name, data) pairs."""
    events = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            events.append((lines.get("event"), json.loads(lines["data"])))
    return events


class Recorder:
    """An ASGI app around another that keeps every HTTP exchange. rewrite(exchange): a body for the
    app to read instead of the client's, or None (the capture forces a tool call, so as to record
    the turn that answers it)."""

    def __init__(self, app, rewrite: Callable[[Exchange], dict | None] | None = None):
        self.app, self.rewrite = app, rewrite
        self.exchanges: list[Exchange] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        exchange = Exchange(scope["method"], scope["path"], scope["query_string"].decode(), headers,
                            json.loads(body) if body else None)
        self.exchanges.append(exchange)
        changed = self.rewrite(exchange) if self.rewrite and exchange.body else None
        if changed is not None:
            exchange.forced = {key: value for key, value in changed.items() if exchange.body.get(key) != value}
            body = json.dumps(changed).encode()
        sent = False

        async def replayed():
            nonlocal sent
            if sent:
                return await receive()  # the client's disconnect, which cancels its request
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def recorded(message):
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                exchange.response += message.get("body", b"")
            await send(message)

        await self.app(scope, replayed, recorded)


class ForceOnce:
    """A rewrite that adds `fields` to the first request whose body mentions `marker`."""

    def __init__(self, marker: str, fields: dict):
        self.marker, self.fields, self.done = marker, fields, False

    def __call__(self, exchange: Exchange) -> dict | None:
        if self.done or not exchange.mentions(self.marker):
            return None
        self.done = True
        return {**exchange.body, **self.fields}


# ---------------------------------------------------------------------- the CLIs
# every other address through a proxy where nothing listens (the discard port): what a CLI would
# fetch from the network fails at once, on a machine with a network too
NOWHERE = "http://127.0.0.1:9"


def _environment(home: Path, **more: str) -> dict[str, str]:
    """A clean environment: the PATH (node), a temporary home, and no way out but to the server."""
    proxies = {name: NOWHERE for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                          "all_proxy")}
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", **proxies,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **more}


def codex_config(url: str) -> str:
    """Codex's config.toml for a Clover server at `url` (docs/serving.md, Agents)."""
    return f"""\
model = "{MODEL}"
model_provider = "clover"
model_context_window = 131072
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.clover]
name = "Clover"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "CLOVER_API_KEY"
request_max_retries = 0
stream_max_retries = 0
"""


def homes(root: Path) -> tuple[Path, Path]:
    """(the CLIs' home, the project directory they work in), made under `root`."""
    home, project = root / "home", root / "home" / "project"
    project.mkdir(parents=True, exist_ok=True)
    return home, project


def run_codex(url: str, key: str, prompt: str, root: Path, *args: str,
              timeout: float = 180) -> subprocess.CompletedProcess:
    """`codex exec [ARGS] PROMPT` against the server; its last message is written to
    root/codex-last-message.txt. args: e.g. ("resume", "--last")."""
    home, project = homes(root)
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(url))
    command = [cli("codex"), "exec", "--strict-config", "--skip-git-repo-check", "--color", "never", "--cd",
               str(project), "--output-last-message", str(root / "codex-last-message.txt"), *args, prompt]
    environment = _environment(home, CODEX_HOME=str(codex_home), CLOVER_API_KEY=key)
    return subprocess.run(command, cwd=project, env=environment, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def claude_environment(url: str, key: str, home: Path) -> dict[str, str]:
    """Claude Code's environment for a Clover server at `url` (docs/serving.md, Agents)."""
    return _environment(home, CLAUDE_CONFIG_DIR=str(home / ".claude"), ANTHROPIC_BASE_URL=url,
                        ANTHROPIC_API_KEY=key, ANTHROPIC_MODEL=MODEL, ANTHROPIC_SMALL_FAST_MODEL=MODEL,
                        ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(MAX_OUTPUT_TOKENS),
                        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")


def run_claude(url: str, key: str, prompt: str, root: Path, *args: str, timeout: float = 180,
               **more_environment: str) -> subprocess.CompletedProcess:
    """`claude -p PROMPT --output-format json [ARGS]` against the server (its result on stdout)."""
    home, project = homes(root)
    environment = {**claude_environment(url, key, home), **more_environment}
    command = [cli("claude"), "-p", prompt, "--output-format", "json", *args]
    return subprocess.run(command, cwd=project, env=environment, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def finished(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`done`, or an AssertionError that shows what the CLI said."""
    assert done.returncode == 0, f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    return done


# ---------------------------------------------------------------------- the fixtures
def sanitized(exchange: Exchange, root: Path, client: str, what: str) -> dict:
    """A fixture of `exchange`: the key, the temporary home (root/home) and the user hash of Claude
    Code's metadata replaced by placeholders, the transport's own headers by theirs."""
    headers = dict(exchange.headers)
    for name, value in (("authorization", f"Bearer {API_KEY}"), ("x-api-key", API_KEY),
                        ("host", "127.0.0.1:<PORT>"), ("content-length", "<LENGTH>")):
        if name in headers:
            headers[name] = value
    fixture = {"client": client, "captured": datetime.date.today().isoformat(), "what": what,
               "method": exchange.method, "path": exchange.path, "query": exchange.query, "headers": headers,
               "body": exchange.body}
    text = json.dumps(fixture, ensure_ascii=False).replace(str(root / "home"), HOME)
    text = re.sub(r"user_[0-9a-f]{64}_account", "user_" + "0" * 64 + "_account", text)
    text = text.replace(f"Linux {platform.release()}", "Linux <KERNEL>")
    for left in (str(root), str(ROOT), CAPTURE_KEY):
        assert left not in text, f"{left!r} is left in the fixture"
    return json.loads(text)


def deduplicated(fixtures: dict[str, dict]) -> dict[str, dict]:
    """The fixtures of one client, each large body field that equals the first fixture's (Claude
    Code's tools and system prompt, Codex's tools) written as a reference to it, which `load` follows."""
    first, *rest = fixtures
    for name in rest:
        body = fixtures[name]["body"]
        for key, value in body.items():
            if len(json.dumps(value)) > SHARED_BYTES and value == fixtures[first]["body"].get(key):
                body[key] = {SAME_AS: f"{first}.json"}
    return fixtures


def load(path: Path) -> dict:
    """A fixture, its references to another fixture's fields followed."""
    fixture = json.loads(path.read_text())
    for key, value in fixture["body"].items():
        if isinstance(value, dict) and set(value) == {SAME_AS}:
            fixture["body"][key] = load(path.parent / value[SAME_AS])["body"][key]
    return fixture


def _one(exchanges: list[Exchange], test: Callable[[Exchange], bool], what: str) -> Exchange:
    found = [exchange for exchange in exchanges if test(exchange)]
    assert found, f"no request was {what}; the server saw: " + "; ".join(
        f"{e.method} {e.path} {e.status} forced={e.forced} {json.dumps(e.body)[-300:]}" for e in exchanges)
    return found[-1]


def _user_texts(exchange: Exchange) -> list[str]:
    """The texts of a Messages request's user turns ([] for other requests)."""
    if exchange.path != "/v1/messages":
        return []
    return [block.get("text", "") for message in exchange.body.get("messages", []) if message["role"] == "user"
            for block in (message["content"] if isinstance(message["content"], list) else
                          [{"text": message["content"]}])]


Captured = tuple[dict[str, tuple[Exchange, str]], str]  # (fixture name -> (exchange, what it is)), the client


def capture_codex(url: str, recorder: Recorder, root: Path) -> Captured:
    client = "codex-cli " + version("codex").split()[-1]
    finished(run_codex(url, CAPTURE_KEY, "Say hi", root))
    first = _one(recorder.exchanges, lambda e: e.mentions('"Say hi"'), "Codex's first turn")
    finished(run_codex(url, CAPTURE_KEY, "And again", root, "resume", "--last"))
    again = _one(recorder.exchanges, lambda e: e.mentions('"And again"'), "Codex's resumed turn")
    recorder.rewrite = ForceOnce('"List files"', {"tool_choice": {"type": "function", "name": "get_goal"}})
    finished(run_codex(url, CAPTURE_KEY, "List files", root))
    output = _one(recorder.exchanges, lambda e: e.mentions("function_call_output"), "Codex's turn after a call")
    recorder.rewrite = None
    return {"codex_exec": (first, "codex exec \"Say hi\": the first turn (stream, store false, the tools)"),
            "codex_resume": (again, "codex exec resume --last \"And again\": the history with the server's own "
                                    "reasoning and message items"),
            "codex_function_call_output": (output, "codex exec \"List files\": the turn after a get_goal call "
                                                   "(forced by the capture's tool_choice) with its output")}, client


def capture_claude(url: str, recorder: Recorder, root: Path) -> Captured:
    client = "claude-cli/" + version("claude").split()[0]
    # in a git repository, Claude Code also asks its small model (without tools) which files matter
    subprocess.run(["git", "init", "-q", str(homes(root)[1])], check=True, env=_environment(homes(root)[0]))
    start = len(recorder.exchanges)
    finished(run_claude(url, CAPTURE_KEY, "Say hi", root))
    made = recorder.exchanges[start:]
    main = _one(made, lambda e: "Say hi" in _user_texts(e), "Claude Code's main request")
    warmup = min((e for e in made if _user_texts(e) == ["Warmup"]), key=lambda e: len(json.dumps(e.body)))
    # a tool without parameters: a forced call of the random model is then whole (a string parameter's
    # value runs to max_tokens), and Claude Code runs it
    recorder.rewrite = ForceOnce('"List files"', {"tool_choice": {"type": "tool", "name": "EnterPlanMode"}})
    finished(run_claude(url, CAPTURE_KEY, "List files", root, "--max-turns", "3"))
    result = _one(recorder.exchanges, lambda e: e.mentions('"tool_result"'), "Claude Code's turn after a call")
    thinking = {"MAX_THINKING_TOKENS": "1024"}
    finished(run_claude(url, CAPTURE_KEY, "Think", root, **thinking))
    finished(run_claude(url, CAPTURE_KEY, "And again", root, "--continue", **thinking))
    again = _one(recorder.exchanges, lambda e: "And again" in _user_texts(e), "Claude Code's continued turn")
    # a refused stream (a field the server refuses, added by the capture) makes Claude Code ask again
    # without streaming
    recorder.rewrite = ForceOnce('"Once more"', {"container": "refused"})
    finished(run_claude(url, CAPTURE_KEY, "Once more", root))
    fallback = _one(recorder.exchanges, lambda e: "Once more" in _user_texts(e) and not e.body.get("stream"),
                    "Claude Code's request without streaming")
    recorder.rewrite = None
    captured = {
        "claude_print": (main, 'claude -p "Say hi": the main request (stream, the system prompt, the tools)'),
        "claude_warmup": (warmup, 'claude -p: a subagent\'s "Warmup" request, sent at start-up beside the main one '
                                  "(to warm a prompt cache) and dropped when the main one ends"),
        "claude_tool_result": (result, 'claude -p "List files": the turn after an EnterPlanMode call (forced '
                                       "by the capture's tool_choice) with its tool_result"),
        "claude_thinking": (again, 'MAX_THINKING_TOKENS=1024 claude -p --continue "And again": thinking on, the '
                                   "earlier thinking block sent back"),
        "claude_non_streaming": (fallback, 'claude -p "Once more": the request Claude Code makes without streaming '
                                           "once its stream was refused")}
    background = _one(recorder.exchanges[start:], lambda e: e.path == "/v1/messages" and e.body.get("tools") == [],
                      "Claude Code's background request")
    captured["claude_background"] = (background, "claude -p in a git repository: the request of its small model "
                                                 "(no tools) about the files that matter, made beside the main one")
    return captured, client


def main(argv=None) -> None:
    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import ServerThread, build_service
    from scripts.make_qwen_vocab_model import write

    parser = argparse.ArgumentParser(description="Capture what Codex CLI and Claude Code send (agent_requests/).")
    parser.add_argument("--out", default=str(FIXTURES))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with tempfile.TemporaryDirectory(prefix="agent-capture-") as tmp:
        root = Path(tmp)
        service = build_service(write(str(root / "model")), name=MODEL, max_running=8)
        recorder = Recorder(create_app(service, api_key=CAPTURE_KEY))
        try:
            with ServerThread(recorder) as server:
                captured = [capture_codex(server.url, recorder, root), capture_claude(server.url, recorder, root)]
        finally:
            service.engine.close()
        for fixtures, client in captured:
            made = {name: sanitized(exchange, root, client, what) for name, (exchange, what) in fixtures.items()}
            for name, fixture in deduplicated(made).items():
                path = Path(args.out) / f"{name}.json"
                path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
                logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
