"""The tasks a schedule sweep runs that need the application: the bundled model's digit sorting
(`clover_jax.training.tiny.sort_digits.SortDigits`) and tasks named by a string, whose tokenizer is loaded
from the model's checkpoint. `sweep` is `decoding.research.sweep` with `task="sort"` or a
`.jsonl` path accepted.

    from clover_jax.api import research_tasks
    records = research_tasks.sweep(model, {"low_confidence": {"threshold": [0.9, 0.7, 0.5]}},
                                   block_sizes=[8, 16], task="sort", output="sweep.jsonl")
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from decoding import research
from decoding.research import SweepRecord, Task, jsonl_task


def sort_task(tokenizer, count: int = 64, min_digits: int = 4, max_digits: int = 8,
              seed: int | None = None) -> Task:
    """The bundled model's task (`clover_jax.training.tiny.sort_digits.SortDigits`): `count` held-out lists of
    `min_digits`..`max_digits` digits, chat-formatted with thinking on; right when the answer after
    `</think>` is the sorted digits and the response ends with <|im_end|>. Lists longer than the
    training range (8) make the task harder."""
    from clover_jax.training.tiny.sort_digits import SortDigits

    task = SortDigits(min_digits, max_digits) if seed is None else SortDigits(min_digits, max_digits, seed)
    problems = task.held_out(count)
    backend = tokenizer.backend
    prompts = [task.encode(backend, problem).prompt for problem in problems]

    def score(index: int, response: Sequence[int]) -> float:
        return float(task.is_correct(problems[index], tokenizer.decode(response)))

    return Task(f"sort{min_digits}-{max_digits}", prompts, score, task.max_lengths(backend)[1])


def load_task(model, task: "Task | str | os.PathLike", tokenizer=None) -> Task:
    """`task` as a `Task`: "sort" (the bundled model's task), a path to a JSONL of {"prompt",
    "answer"} lines, or a `Task` as it is; the tokenizer defaults to the one at the model's path."""
    if isinstance(task, Task):
        return task
    if tokenizer is None:
        from clover_jax.text.tokenizer import Tokenizer

        path = getattr(model, "path", None)
        if path is None:
            raise ValueError("the task needs a tokenizer: pass tokenizer=... (the model has no checkpoint path)")
        tokenizer = Tokenizer.from_pretrained(path)
    if task == "sort":
        return sort_task(tokenizer)
    if isinstance(task, (str, os.PathLike)) and str(task).endswith(".jsonl"):
        return jsonl_task(task, tokenizer)
    raise ValueError(f"task must be 'sort', a .jsonl path or a decoding.research.Task, got {task!r}")


def sweep(model, schedules: Any = ("low_confidence",), block_sizes: Sequence[int] | None = None,
          task: "Task | str | os.PathLike" = "sort", *, tokenizer=None, **options: Any) -> list[SweepRecord]:
    """`decoding.research.sweep` over `load_task(model, task, tokenizer)`; `options` are its keywords."""
    return research.sweep(model, schedules, block_sizes, load_task(model, task, tokenizer), **options)
