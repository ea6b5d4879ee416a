"""Log-probabilities in OpenAI's two response shapes, from `decoding.scoring.TokenScores`.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}` over the
response tokens. Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` over the
echoed prompt (its first token has no figure: null) and the response tokens. A token's text is its
own decoding (special tokens included), so a character split across tokens shows as U+FFFD pieces
whose `bytes` are still the token's text's.
"""

from __future__ import annotations

from typing import Any, Sequence

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
                        scores: TokenScores) -> dict[str, Any]:
    """prompt: the echoed prompt's tokens ([] without echo); prompt_scores: its tokens' scores after
    the first (`decoding.scoring.prompt_logprobs`)."""
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
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
