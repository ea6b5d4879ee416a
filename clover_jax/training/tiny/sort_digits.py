"""The synthetic task the bundled tiny Clover learns: sorting a list of digits.

    user:      sort 3 1 4 1 5
    assistant: <think>\\n5 digits\\n</think>\\n\\n1 1 3 4 5<|im_end|>

The thinking segment states how many digits there are (so the end of the answer is known
before the digits are), the answer is the digits in ascending order. Answers are checked
exactly. Held-out problems come from their own seed and are excluded from training, so the
evaluation never sees a training prompt.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from clover_jax.training.tiny.chat_format import render_chat
from clover_jax.training.tiny.vocabulary import IM_END, THINK_END

Problem = tuple[int, ...]  # the digits, in the order given


class Example(NamedTuple):
    """One tokenized conversation: the prompt (ends with the generation prompt) and the response
    (ends with <|im_end|>)."""

    prompt: list[int]
    response: list[int]


@dataclasses.dataclass(frozen=True)
class SortDigits:
    min_digits: int = 4
    max_digits: int = 8
    held_out_seed: int = 20_251_202

    # ------------------------------------------------------------------ problems
    def sample(self, rng: np.random.Generator) -> Problem:
        length = int(rng.integers(self.min_digits, self.max_digits + 1))
        return tuple(int(d) for d in rng.integers(0, 10, length))

    def held_out(self, count: int = 200) -> list[Problem]:
        """`count` distinct problems that training never uses (the same list every time)."""
        rng = np.random.default_rng(self.held_out_seed)
        problems: dict[Problem, None] = {}
        while len(problems) < count:
            problems.setdefault(self.sample(rng))
        return list(problems)

    def training_sampler(self, seed: int, excluded_count: int = 1000) -> "TrainingSampler":
        """Problems drawn from `seed`, never one of the first `excluded_count` held-out problems."""
        return TrainingSampler(self, seed, frozenset(self.held_out(excluded_count)))

    # ------------------------------------------------------------------ text
    def user_message(self, problem: Problem) -> str:
        return "sort " + " ".join(map(str, problem))

    def reasoning(self, problem: Problem) -> str:
        return f"{len(problem)} digits"

    def answer(self, problem: Problem) -> str:
        return " ".join(map(str, sorted(problem)))

    def messages(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": self.user_message(problem)}]

    def prompt_text(self, problem: Problem, thinking: bool = True) -> str:
        return render_chat(self.messages(problem), add_generation_prompt=True, enable_thinking=thinking)

    def response_text(self, problem: Problem, thinking: bool = True) -> str:
        """What the assistant writes after the generation prompt, through <|im_end|>."""
        reply = {"role": "assistant", "content": self.answer(problem),
                 "reasoning_content": self.reasoning(problem) if thinking else ""}
        conversation = render_chat(self.messages(problem) + [reply])
        prompt = self.prompt_text(problem, thinking)
        if not conversation.startswith(prompt):
            raise AssertionError(f"the chat template's conversation does not extend its prompt: {conversation!r}")
        return conversation[len(prompt):conversation.rindex(IM_END) + len(IM_END)]

    def encode(self, tokenizer, problem: Problem, thinking: bool = True) -> Example:
        prompt = tokenizer.encode(self.prompt_text(problem, thinking), add_special_tokens=False).ids
        response = tokenizer.encode(self.response_text(problem, thinking), add_special_tokens=False).ids
        return Example(prompt, response)

    def max_lengths(self, tokenizer) -> tuple[int, int]:
        """Longest prompt and response in tokens (the longest problem, thinking on)."""
        longest = (9,) * self.max_digits
        example = self.encode(tokenizer, longest)
        return len(example.prompt), len(example.response)

    # ------------------------------------------------------------------ scoring
    @staticmethod
    def final_answer(response_text: str) -> str:
        """The text after the thinking segment, without the end-of-turn token."""
        text = response_text.split(THINK_END)[-1]
        return text.split(IM_END)[0].strip()

    def is_correct(self, problem: Problem, response_text: str) -> bool:
        return self.final_answer(response_text) == self.answer(problem) and response_text.endswith(IM_END)


@dataclasses.dataclass
class TrainingSampler:
    task: SortDigits
    seed: int
    excluded: frozenset

    def problems(self, step: int, count: int) -> list[Problem]:
        """The `count` training problems of step `step` (a function of seed and step, so a resumed
        run sees the same data)."""
        rng = np.random.default_rng([self.seed, step])
        drawn: list[Problem] = []
        while len(drawn) < count:
            problem = self.task.sample(rng)
            if problem not in self.excluded:
                drawn.append(problem)
        return drawn
