"""Log-probabilities in OpenAI's two response shapes, from `decoding.scoring.TokenScores`.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}` over the
response tokens. Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` over the
echoed prompt (its first token has no figure: null) and the response tokens. A token's text is its
own decoding (special tokens included), so a character split across tokens shows as U+FFFD pieces
whose `bytes` are still the token's text's.

A stream gives the same figures piece by piece (`StreamedLogprobs`): the pieces of a choice's
chunks put together are its whole response's `logprobs`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from decoding.scoring import TokenScores


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([int(token)], skip_special_tokens=False)


def chat_logprobs(tokenizer, tokens: Sequence[int], scores: TokenScores) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for position, token in enumerate(tokens[:len(scores.logprobs)]):
        alternatives = [entry(t, v) for t, v in zip(scores.top_ids[position], scores.top_logprobs[position],
                                                      strict=True)]
        content.append({**entry(token, scores.logprobs[position]), "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, prompt: Sequence[int], prompt_scores: TokenScores | None, tokens: Sequence[int],
                        scores: TokenScores, offset: int = 0) -> dict[str, Any]:
    """prompt: the echoed prompt's tokens ([] without echo); prompt_scores: its tokens' scores after
    the first (`decoding.scoring.prompt_logprobs`); offset: the first token's `text_offset` (a
    stream's later pieces continue the offsets of the earlier ones)."""
    texts, values, tops = [], [], []

    def add(token: int, value: float | None, ids=(), logprobs=()) -> None:
        texts.append(_token_text(tokenizer, token))
        values.append(None if value is None else float(value))
        tops.append(None if value is None else {_token_text(tokenizer, t): float(v)
                                                 for t, v in zip(ids, logprobs, strict=True)})

    for position, token in enumerate(prompt):
        if position == 0:
            add(token, None)
        else:
            add(token, prompt_scores.logprobs[position - 1], prompt_scores.top_ids[position - 1],
                prompt_scores.top_logprobs[position - 1])
    for position, token in enumerate(tokens[:len(scores.logprobs)]):
        add(token, scores.logprobs[position], scores.top_ids[position], scores.top_logprobs[position])
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def no_scores(top: int) -> TokenScores:
    return TokenScores(np.zeros(0, np.float32), np.zeros((0, top), np.int32), np.zeros((0, top), np.float32))


class StreamedLogprobs:
    """One streamed choice's log-probabilities, given out piece by piece so that the pieces put
    together are its whole response's: the response tokens read as a whole response reads them (every
    event's until a stop string is found), and how many of them were given out.

    score(tokens, engine_rows) -> TokenScores of every token read (engine_rows: the engine's
    (logprob, top ids, top logprobs) per token, diffusion); causal: score is a causal scoring pass
    (autoregressive, self-speculative), to run off the event loop; offset: completions, the
    `text_offset` the response's first token has (the echoed prompt's tokens' texts before it)."""

    def __init__(self, tokenizer, chat: bool, score: Callable[[list[int], list], TokenScores], causal: bool,
                 offset: int = 0):
        self.tokenizer, self.chat, self.score, self.causal = tokenizer, chat, score, causal
        self.tokens: list[int] = []
        self.rows: list = []
        self.given = 0
        self.offset = offset

    def read(self, tokens: Sequence[int], rows: list | None) -> None:
        self.tokens.extend(int(t) for t in tokens)
        self.rows.extend(rows or ())

    @property
    def due(self) -> bool:
        """Tokens were read whose figures are not given yet."""
        return self.given < len(self.tokens)

    def take(self) -> dict[str, Any] | None:
        """The figures of the tokens read since the last take, in the choice's shape; None: none.
        A causal scoring pass scores every token read (the same pass a whole response makes, over
        a shorter response: a token's figure depends on the tokens before it); the engine's rows
        stand alone, so only the new ones are read."""
        if not self.due:
            return None
        start, self.given = self.given, len(self.tokens)
        tokens = self.tokens[start:]
        if self.causal:
            scores = self.score(self.tokens, self.rows)
            part = TokenScores(scores.logprobs[start:], scores.top_ids[start:], scores.top_logprobs[start:])
        else:
            part = self.score(tokens, self.rows[start:])
        if self.chat:
            return chat_logprobs(self.tokenizer, tokens, part)
        out = completion_logprobs(self.tokenizer, [], None, tokens, part, offset=self.offset)
        if out["tokens"]:
            self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out
