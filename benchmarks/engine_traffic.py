"""The serving benchmarks' traffic: the requests they send and the clients that send them
(`serving.py`, `serving_burst.py`, `serving_http.py`, `chunked_prefill.py`)."""

from __future__ import annotations

import threading
import time

import numpy as np

from clover_jax import bundled_model_path

BUNDLED_DIR = str(bundled_model_path())


class Tickets:
    """The indices 0..count-1 handed out once each, in order, to the clients' threads."""

    def __init__(self, count: int):
        self.count, self._next, self._lock = count, 0, threading.Lock()

    def take(self) -> int | None:
        """The next index, or None when all are taken."""
        with self._lock:
            if self._next >= self.count:
                return None
            self._next += 1
            return self._next - 1


def closed_loop(engine, requests, concurrency: int) -> dict:
    """Run `requests` through the engine with `concurrency` clients; per request its tokens and
    times (submitted, first tokens, finished)."""
    from decoding.engine import EngineEvent

    count = len(requests)
    tokens = [[] for _ in range(count)]
    times = np.zeros((count, 3))
    nfe = [0] * count
    state, tickets = {"done": 0}, Tickets(count)
    lock, finished = threading.Lock(), threading.Event()

    def submit_next():
        index = tickets.take()
        if index is None:
            return
        times[index, 0] = time.perf_counter()
        engine.submit(requests[index], lambda event, i=index: listen(i, event))

    def listen(index: int, event: EngineEvent):
        if event.tokens and not tokens[index]:
            times[index, 1] = time.perf_counter()
        tokens[index].extend(event.tokens)
        if event.finish is not None:
            times[index, 2] = time.perf_counter()
            if not times[index, 1]:  # no tokens before the last event: the first came with it
                times[index, 1] = times[index, 2]
            nfe[index] = event.stats.nfe
            with lock:
                state["done"] += 1
                if state["done"] == count:
                    finished.set()
            submit_next()

    started = time.perf_counter()
    for _ in range(min(concurrency, count)):
        submit_next()
    finished.wait()
    wall = time.perf_counter() - started
    return {"wall": wall, "tokens": tokens, "times": times, "nfe": nfe}


def bundled_requests(count: int, max_new_tokens: int):
    from clover_jax.text.tokenizer import Tokenizer
    from clover_jax.training.tiny.sort_digits import SortDigits
    from decoding.engine import EngineRequest

    tokenizer, task = Tokenizer.from_pretrained(BUNDLED_DIR), SortDigits()
    return [EngineRequest(tokenizer.apply_chat_template([{"role": "user", "content": task.user_message(p)}],
                                                        add_generation_prompt=True, return_dict=False),
                          overrides={"max_new_tokens": max_new_tokens})
            for p in task.held_out(count)]


def random_requests(count: int, vocab: int, prompt: int, max_new_tokens: int):
    from decoding.engine import EngineRequest

    rng = np.random.default_rng(0)
    return [EngineRequest(rng.integers(2, vocab - 1, int(rng.integers(prompt // 2, prompt + 1))).tolist(),
                          overrides={"max_new_tokens": max_new_tokens}) for _ in range(count)]
