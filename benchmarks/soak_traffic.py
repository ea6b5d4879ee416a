"""The soak's traffic (`benchmarks/soak.py`): a fixed random mix of requests, and the clients that send it.

Single requests: chat and completions; the three decoding modes; greedy and sampled; streamed and
whole; block sizes 16 and 32 (diffusion and self-speculative); a share cancelled mid-stream (the
client closes the stream after its first chunk); a share invalid (one bad field: a 4xx); prompts of
1 to 24 digits, so that prompt lengths and the mix of work in a pass keep changing.

Conversations: an agent's multi-turn chat that resends its whole growing transcript each turn (its
earlier messages and the server's replies), so that every turn after the first starts from a prefix
the engine's prefix cache holds — unless the cache evicted it meanwhile. One client sends a
conversation's turns in order; each turn counts as one request.
"""

from __future__ import annotations

import random
import threading

CONVERSATION_SHARE = 0.3       # of the requests, the turns of conversations
TURNS = (2, 5)                 # turns per conversation, at least and at most


def _digits(chooser: random.Random) -> str:
    return " ".join(str(chooser.randrange(10)) for _ in range(chooser.randint(1, 24)))


def _single(chooser: random.Random) -> dict:
    mode = chooser.choice(["diffusion", "diffusion", "autoregressive", "self_speculative"])
    body = {"model": "tiny-clover", "max_tokens": chooser.choice([8, 16, 32, 48]), "mode": mode,
            "block_size": chooser.choice([16, 16, 32])}
    if mode == "autoregressive":
        del body["block_size"]
    if mode != "self_speculative" and chooser.random() < 0.3:
        body.update(temperature=0.8, seed=chooser.randrange(2**31))
    chat = chooser.random() < 0.7
    if chat:
        body["messages"] = [{"role": "user", "content": "sort " + _digits(chooser)}]
    else:
        body["prompt"] = "sort " + _digits(chooser)
    stream = chooser.random() < 0.5
    body["stream"] = stream
    cancel = stream and chooser.random() < 0.2
    invalid = chooser.random() < 0.1
    if invalid:
        body[chooser.choice(["temperature", "top_p", "max_tokens", "mode"])] = chooser.choice([-1, "many", 1e9])
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
            "cancel": cancel and not invalid, "invalid": invalid, "turns": None}


def _conversation(chooser: random.Random, turns: int) -> dict:
    """A conversation of `turns` user messages; every turn decodes in one mode, whole (not streamed)."""
    mode = chooser.choice(["diffusion", "autoregressive", "self_speculative"])
    body = {"model": "tiny-clover", "max_tokens": chooser.choice([16, 32]), "mode": mode, "stream": False}
    return {"path": "/v1/chat/completions", "body": body, "cancel": False, "invalid": False,
            "turns": ["sort " + _digits(chooser) for _ in range(turns)]}


def request_mix(count: int, seed: int) -> list[dict]:
    """Items making `count` requests (a conversation of k turns makes k), the same for a seed:
    {"path", "body", "cancel", "invalid", "turns" (None, or a conversation's user messages)}."""
    chooser = random.Random(seed)
    items, made = [], 0
    while made < count:
        if chooser.random() < CONVERSATION_SHARE and count - made >= TURNS[0]:
            item = _conversation(chooser, min(chooser.randint(*TURNS), count - made))
        else:
            item = _single(chooser)
        items.append(item)
        made += len(item["turns"] or [None])
    return items


def request_count(items: list[dict]) -> int:
    return sum(len(item["turns"] or [None]) for item in items)


def kind_of(item: dict) -> str:
    return "cancelled" if item["cancel"] else "invalid" if item["invalid"] else "turn" if item["turns"] else "served"


def _send(http, url: str, item: dict) -> list:
    """The statuses of an item's requests (a conversation's: one per turn, in order)."""
    body = item["body"]
    if item["turns"] is None:
        if body["stream"]:
            with http.stream("POST", url + item["path"], json=body) as response:
                for _ in response.iter_lines():
                    if item["cancel"]:
                        break  # leave mid-stream: the server cancels the request
                return [response.status_code]
        return [http.post(url + item["path"], json=body).status_code]
    messages, statuses = [], []
    for turn in item["turns"]:
        messages.append({"role": "user", "content": turn})
        response = http.post(url + item["path"], json={**body, "messages": messages})
        statuses.append(response.status_code)
        reply = response.json()["choices"][0]["message"].get("content") if response.status_code == 200 else None
        messages.append({"role": "assistant", "content": reply or "no answer"})
    return statuses


def run_phase(url: str, items: list[dict], concurrency: int) -> dict:
    """Send `items` from `concurrency` clients, each taking the next item when its last one ends;
    returns {"KIND STATUS": requests} (a transport failure's status names its exception)."""
    import httpx

    outcomes: dict = {}
    lock = threading.Lock()
    pending = iter(items)

    def client():
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    item = next(pending, None)
                if item is None:
                    return
                try:
                    statuses = _send(http, url, item)
                except Exception as error:  # a transport failure is an outcome too
                    statuses = [f"transport: {type(error).__name__}"]
                with lock:
                    for status in statuses:
                        key = (kind_of(item), status)
                        outcomes[key] = outcomes.get(key, 0) + 1

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {f"{kind} {status}": count for (kind, status), count in sorted(outcomes.items(), key=str)}
