"""The model's reasoning, as the Qwen3.5/3.6 family writes it: `<think>…</think>` before the answer.

    <think>\\nI should sort them.\\n</think>\\n\\n1 2 3        ->  reasoning "I should sort them.", content "1 2 3"

A response opens its reasoning with `<think>` at its very start, or the prompt already opened it
(a chat template that ends the generation prompt with `<think>\\n`): `opened` says which. Newlines
around the reasoning and before the answer are dropped, as the chat templates drop them when
they render an assistant turn again. Text arrives in pieces cut anywhere; whatever a later piece
could still change (a partial tag, newlines that may turn out to be trailing) is held back.
"""

from __future__ import annotations

from clover_jax.api.serving.text import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    """push(text) -> [("reasoning" | "content", text), ...]; finish() -> the held rest."""

    def __init__(self, opened: bool):
        self.state = "reasoning_start" if opened else "start"
        self.held = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        return self._run(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            before = (self.state, self.held)
            self._advance(out, final)
            if (self.state, self.held) == before:
                return [(kind, piece) for kind, piece in out if piece]

    def _advance(self, out: list, final: bool) -> None:
        held = self.held
        if self.state == "start":
            if held.startswith(OPEN):
                self.state, self.held = "reasoning_start", held[len(OPEN):]
            elif OPEN.startswith(held) and not final:
                return  # maybe the start of <think>
            else:
                self.state = "content"
        elif self.state == "reasoning_start":  # newlines right after <think> are dropped
            stripped = held.lstrip("\n")
            if stripped or final:
                self.state, self.held = "reasoning", stripped
            else:
                self.held = ""
        elif self.state == "reasoning":
            end = held.find(CLOSE)
            if end >= 0:
                out.append(("reasoning", held[:end].rstrip("\n")))
                self.state, self.held = "content_start", held[end + len(CLOSE):]
                return
            if final:
                out.append(("reasoning", held.rstrip("\n") if held.strip("\n") else ""))
                self.held = ""
                return
            # hold a partial </think> and the newlines before it (trailing newlines are dropped)
            keep = partial_suffix(held, CLOSE)
            body = held[:len(held) - keep]
            sent = body.rstrip("\n")
            out.append(("reasoning", sent))
            self.held = held[len(sent):]
        elif self.state == "content_start":  # newlines between </think> and the answer are dropped
            stripped = held.lstrip("\n")
            if stripped:
                self.state, self.held = "content", stripped
            else:
                self.held = ""
        else:  # content
            out.append(("content", held))
            self.held = ""
