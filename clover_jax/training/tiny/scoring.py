"""Score a Clover checkpoint on held-out task prompts with `decoding.generate`.

Exact match means the response decodes to the reference thinking segment and answer, ending
with <|im_end|> (`full_match`); `answer_match` only asks for the answer after `</think>`.
Tokens per forward follow docs/design.md §4 (response tokens through the first EOS over the forward
passes of that prompt); reported as the mean over prompts and pooled (all tokens over all
forward passes).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from clover_jax.training.tiny.sort_digits import Problem, SortDigits


def score_exact_match(model, tokenizer, task: SortDigits, problems: Sequence[Problem], thinking: bool = True,
             batch_size: int = 200, **overrides: Any) -> dict[str, Any]:
    """Generate a response to every problem (greedy, the checkpoint's generation config plus
    `overrides`) and score it."""
    from decoding import generate

    prompts = [task.encode(tokenizer, problem, thinking).prompt for problem in problems]
    references = [task.response_text(problem, thinking) for problem in problems]
    full, answer, per_prompt, tokens, nfe, failures = [], [], [], [], [], []
    started = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        out = generate(model, prompts[first:first + batch_size], **overrides)
        for offset, sequence in enumerate(out.sequences):
            index = first + offset
            text = tokenizer.decode(sequence, skip_special_tokens=False)
            full.append(text == references[index])
            answer.append(task.is_correct(problems[index], text))
            per_prompt.append(out.tokens_per_forward[offset])
            tokens.append(len(sequence))
            nfe.append(out.nfe[offset])
            if not answer[-1] and len(failures) < 5:
                failures.append({"prompt": task.user_message(problems[index]), "response": text})
    return {
        "prompts": len(problems),
        "answer_match": float(np.mean(answer)),
        "full_match": float(np.mean(full)),
        "tokens_per_forward": float(np.mean(per_prompt)),
        "tokens_per_forward_pooled": float(np.sum(tokens) / max(np.sum(nfe), 1)),
        "mean_nfe": float(np.mean(nfe)),
        "mean_response_tokens": float(np.mean(tokens)),
        "seconds": round(time.perf_counter() - started, 2),
        "failures": failures,
    }
