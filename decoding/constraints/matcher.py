"""One sequence's grammar on the host: `GrammarMatcher`, compiled by `compile_constraint`.

The matcher holds the tokens committed so far (the answer's, from `</think>` on when the response
starts inside thinking) and answers what the decoding loops ask: the tokens allowed next (a bool
mask over the vocabulary), how many of a run of tokens it would accept, and whether the text so
far is a complete answer. Everything is llguidance's (`LLMatcher`); nothing here parses.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from clover_jax.core.errors import UNSUPPORTED, FieldError
from decoding.constraints.spec import Constraint
from decoding.constraints.vocabulary import llguidance_tokenizer

# llguidance's `compute_logit_bias` marks an allowed token with this byte (and a refused one with 0)
_ALLOWED_BYTE = 200


class GrammarMatcher:
    """A compiled constraint following one sequence. vocab_size: V, the model's logit rows;
    eos_token_ids: the ids that end the answer (allowed only where the grammar accepts)."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos = frozenset(int(e) for e in eos_token_ids)
        self._held: list[int] = []  # the tokens consumed, the answer's end-of-sequence id last if it ended

    @property
    def consumed(self) -> int:
        """Tokens consumed (what `rollback` can undo)."""
        return len(self._held)

    @property
    def ended(self) -> bool:
        """The answer's end-of-sequence token has been consumed: what follows is not the answer's."""
        return bool(self._held) and self._held[-1] in self.eos

    @property
    def accepting(self) -> bool:
        """The text consumed is a complete answer."""
        return self.ended or self._matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar takes next (an end-of-sequence id only where the answer
        is complete); every token once the answer has ended."""
        if self.ended:
            return np.ones(self.vocab_size, bool)
        bias = np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8)
        allowed = np.zeros(self.vocab_size, bool)
        allowed[:bias.shape[0]] = bias[:self.vocab_size] == _ALLOWED_BYTE
        return allowed

    def accepts(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar would take from here (nothing is consumed);
        all of them once the answer ends among them (an end-of-sequence id where it is complete)."""
        tokens = [int(t) for t in tokens]
        if self.ended:
            return len(tokens)
        end = next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        taken = self._matcher.validate_tokens(tokens[:end]) if end else 0
        if taken == end < len(tokens) and self._accepting_after(tokens[:end]):
            return len(tokens)
        return taken

    def _accepting_after(self, tokens: list[int]) -> bool:
        """The answer would be complete after `tokens` (consumed, then rolled back)."""
        if not tokens:
            return self._matcher.is_accepting()
        if not self._matcher.consume_tokens(tokens):
            raise RuntimeError(f"llguidance refused tokens it validated: {self._matcher.get_error()}")
        accepting = self._matcher.is_accepting()
        self._matcher.rollback(len(tokens))
        return accepting

    # The end-of-sequence id is never handed to llguidance: once its grammar has stopped (nothing
    # but the end could follow), llguidance 1.9 takes the id without counting it, and a later
    # rollback of one token then removes the token before it.
    def consume(self, tokens: Sequence[int]) -> None:
        """Commit `tokens` (which `accepts` has taken); those after the answer's end are not the answer's."""
        for token in tokens:
            token = int(token)
            if self.ended:
                return
            if token in self.eos:
                if not self._matcher.is_accepting():
                    raise RuntimeError(f"the answer is not complete: end-of-sequence id {token} refused")
            elif not self._matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused committed token {token}: {self._matcher.get_error()}")
            self._held.append(token)

    def rollback(self, count: int) -> None:
        if not count:
            return
        if count > len(self._held):
            raise RuntimeError(f"cannot roll the grammar back {count} tokens ({len(self._held)} consumed)")
        engine = count - int(self.ended)  # the end-of-sequence id is ours alone
        if engine and not self._matcher.rollback(engine):
            raise RuntimeError(f"llguidance could not roll back {engine} tokens")
        del self._held[-count:]


# JSON is written as `json.dumps` writes it: ", " between items, ": " after keys, no other whitespace
# (llguidance's flexible whitespace lets a weak model pad forever); a schema's "x-guidance" field overrides it
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar JSON."""
    import llguidance

    if constraint.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.source, defaults=JSON_LAYOUT)
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.source)
    return llguidance.LLMatcher.grammar_from_lark(constraint.source)


def _after_thinking(grammar: str, think_end_token_id: int) -> str:
    """`grammar` preceded by free text up to the `</think>` token: the answer of a response that
    starts inside thinking."""
    # llguidance gives a Lark grammar back as its text, the other kinds as its grammar JSON
    answer = json.loads(grammar)["grammars"][0] if grammar.lstrip().startswith("{") else {"lark_grammar": grammar}
    top = {"lark_grammar": f"start: /(?s:.*)/ <[{int(think_end_token_id)}]> @answer"}
    return json.dumps({"grammars": [top, dict(answer, name="answer")]})


def compile_constraint(constraint: Constraint, *, tokenizer_path: str | os.PathLike, vocab_size: int,
                       eos_token_ids: Sequence[int], think_end_token_id: int | None = None,
                       thinking: bool = False) -> GrammarMatcher:
    """A fresh matcher for one sequence. thinking: the response starts inside `<think>` (the
    constraint applies from `think_end_token_id` on). A grammar llguidance refuses is a FieldError
    naming `constraint.field`."""
    import llguidance

    if not eos_token_ids:
        raise FieldError(constraint.field, "a constraint needs the model's end-of-sequence ids (eos_token_id)",
                         code=UNSUPPORTED)
    tokenizer = llguidance_tokenizer(tokenizer_path, vocab_size, tuple(eos_token_ids))
    try:
        grammar = grammar_text(constraint)
    except ValueError as error:
        raise FieldError(constraint.field, f"the {constraint.kind} cannot be compiled: {error}") from None
    if thinking:
        if think_end_token_id is None:
            raise FieldError(constraint.field, "the response starts inside <think> but the model has no "
                                               "think_end_token_id", code=UNSUPPORTED)
        grammar = _after_thinking(grammar, think_end_token_id)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise FieldError(constraint.field, f"the {constraint.kind} cannot be compiled: {matcher.get_error()}")
    return GrammarMatcher(matcher, vocab_size, eos_token_ids)


def matcher_for(model, config, thinking: bool) -> GrammarMatcher:
    """A fresh matcher for one sequence of `model` (anything with `config.vocab_size` and the
    checkpoint directory as `path`) under `config.constraint`, from the checkpoint's tokenizer.json."""
    constraint = config.constraint
    directory = getattr(model, "path", None)
    tokenizer_path = os.path.join(directory, "tokenizer.json") if directory else None
    if tokenizer_path is None or not os.path.isfile(tokenizer_path):
        raise FieldError(constraint.field, "a constraint is compiled against the model's tokenizer: the model "
                                           f"needs a checkpoint directory with tokenizer.json (path: {directory!r})",
                         code=UNSUPPORTED)
    return compile_constraint(constraint, tokenizer_path=tokenizer_path, vocab_size=model.config.vocab_size,
                              eos_token_ids=config.eos_token_id, think_end_token_id=config.think_end_token_id,
                              thinking=bool(thinking))
