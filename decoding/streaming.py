"""Streaming: what `generate` hands to the host while it decodes, and a text streamer.

When a caller asks for streaming (`on_block`, `streamer`, `progress`), `generate` drives the
decode from the host one block per compiled call (`decoding.block_loop.next_block`) and reports
each decided block between calls; there is no host callback inside a compiled program. Each
report is cut at the sequence's first EOS (kept) and at `max_new_tokens`, so nothing past the
end of a response is ever passed on.

Listeners:
* `on_block(prompt_index, tokens, block_number)`: the response tokens of each decided block;
* `streamer`: any object with `put(ids)` and `end()`, as `transformers` streamers have
  (`put` first receives the prompt, then the new tokens; batch size 1); `TextStreamer` below
  prints text over this project's `Tokenizer` (or any object with `decode`);
* a progress bar of response tokens decided.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np

BlockListener = Callable[[int, list, int], None]  # (prompt index, response tokens of the block, block number)


class TextStreamer:
    """Print decoded text as blocks are decided (the `put`/`end` protocol of transformers' streamers).

    tokenizer: anything with `decode(ids, **decode_kwargs)`; skip_prompt: do not print the prompt
    (`put` receives it first); decode_kwargs: e.g. `skip_special_tokens=True`. Text is printed
    once it is stable (a partial UTF-8 character or word is held back until the next block).
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, file=None, **decode_kwargs: Any):
        self.tokenizer, self.skip_prompt, self.decode_kwargs = tokenizer, skip_prompt, decode_kwargs
        self.file = file
        self.tokens: list[int] = []
        self.printed = 0
        self.prompt_seen = False

    def put(self, ids: Any) -> None:
        ids = np.asarray(ids)
        if ids.ndim > 1:
            if ids.shape[0] > 1:
                raise ValueError("TextStreamer only supports batch size 1")
            ids = ids[0]
        if self.skip_prompt and not self.prompt_seen:
            self.prompt_seen = True
            return
        self.prompt_seen = True
        self.tokens.extend(int(token) for token in ids)
        text = self.tokenizer.decode(self.tokens, **self.decode_kwargs)
        # Hold back a trailing replacement character (an incomplete UTF-8 sequence) until more tokens come.
        stable = len(text) - 1 if text.endswith("\ufffd") else len(text)
        self.on_text(text[self.printed:stable])
        self.printed = max(self.printed, stable)

    def end(self) -> None:
        if self.tokens:
            text = self.tokenizer.decode(self.tokens, **self.decode_kwargs)
            self.on_text(text[self.printed:], stream_end=True)
        self.tokens, self.printed, self.prompt_seen = [], 0, False

    def on_text(self, text: str, stream_end: bool = False) -> None:
        print(text, end="\n" if stream_end else "", flush=True, file=self.file or sys.stdout)


def response_slice(block: np.ndarray, first_row: int, remaining: int, eos: set[int]) -> tuple[list[int], bool]:
    """The response tokens of one decided block: from `first_row` (a prompt tail sits before it in
    the first block), at most `remaining` of them, cut after the first EOS (kept).
    returns (tokens, whether the response ended here)."""
    tokens = [int(token) for token in block[first_row:first_row + max(remaining, 0)]]
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[:index + 1], True
    return tokens, len(tokens) >= remaining


class BlockReporter:
    """Turns the decided blocks the host reads between compiled calls into listener calls.

    prompts: the prompts (a streamer first receives its prompt); tails: prompt tokens at the
    start of each sequence's first block; max_new_tokens: N; eos: the EOS ids.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], tails: np.ndarray, max_new_tokens: int, eos: Sequence[int],
                 on_block: BlockListener | None = None, streamer: Any = None, bar: Any = None):
        self.tails, self.limit, self.eos = tails, max_new_tokens, set(eos)
        self.on_block, self.streamer, self.bar = on_block, streamer, bar
        self.emitted = np.zeros(len(prompts), int)
        self.ended = np.zeros(len(prompts), bool)
        if streamer is not None:
            if len(prompts) != 1:
                raise ValueError(f"a streamer takes one prompt at a time (transformers' rule), got {len(prompts)}")
            streamer.put(np.asarray([prompts[0]]))

    def report(self, block_number: int, blocks: np.ndarray, closed: np.ndarray) -> None:
        """blocks: int [b, B], the block `block_number` of every sequence; closed: bool [b], decided in this call."""
        for index in np.flatnonzero(closed & ~self.ended):
            first_row = int(self.tails[index]) if block_number == 0 else 0
            tokens, ended = response_slice(blocks[index], first_row, self.limit - int(self.emitted[index]), self.eos)
            self.emitted[index] += len(tokens)
            self.ended[index] = ended
            if self.bar is not None:
                self.bar.update(len(tokens))
            if tokens and self.streamer is not None:
                self.streamer.put(np.asarray(tokens))
            if tokens and self.on_block is not None:
                self.on_block(int(index), tokens, block_number)

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
