"""Constrained decoding (docs/structured_outputs.md): the grammar engine against the bundled
tokenizer, the diffusion commit rule against a fresh matcher, and `generate` in every mode against
Python's `re` (an independent reference for what the regular expressions accept)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from clover_jax.core.errors import FieldError
from clover_jax.training.tiny.recipe import BUNDLED_DIR
from decoding import GenerationConfig
from decoding.constraints import Constraint, compile_constraint
from decoding.constraints.commit_rule import BlockGrammar, Proposal

TOKENIZER = os.path.join(BUNDLED_DIR, "tokenizer.json")
MASK, IM_END, ENDOFTEXT = 5, 2, 0
EOS = (IM_END, ENDOFTEXT)
with open(TOKENIZER, encoding="utf-8") as _file:
    _SPEC = json.load(_file)
TEXT = {index: token for token, index in _SPEC["model"]["vocab"].items()}
VOCAB = len(TEXT)
ID = {text: index for index, text in TEXT.items()}


def matcher(constraint: Constraint, thinking: bool = False):
    return compile_constraint(constraint, tokenizer_path=TOKENIZER, vocab_size=VOCAB, eos_token_ids=EOS,
                              think_end_token_id=ID["</think>"], thinking=thinking)


def text_of(tokens) -> str:
    return "".join(TEXT[int(t)] for t in tokens)


# ---------------------------------------------------------------------- the constraint and its matcher
def test_constraints_are_checked_and_named():
    assert Constraint.of({"regex": "[0-9]+"}) == Constraint("regex", "[0-9]+")
    assert Constraint.of({"json_schema": {"type": "object", "a": 1}}).source == '{"type": "object", "a": 1}'
    assert Constraint.of({"json_object": True}).kind == "json_object"
    for bad, message in (({"regex": "a", "lark": "b"}, "exactly one"), ({"grammar": "x"}, "exactly one"),
                         ("[0-9]", "a Constraint or a dict"), ({"regex": ""}, "empty"),
                         ({"json_schema": "{"}, "not JSON"), ({"json_object": 1}, "takes True")):
        with pytest.raises(FieldError, match=message) as caught:
            Constraint.of(bad)
        assert caught.value.field == "constraint"
    assert GenerationConfig(constraint={"regex": "a"}).constraint == Constraint("regex", "a")
    with pytest.raises(FieldError, match="constraint_gap_rule"):
        GenerationConfig(constraint_gap_rule="left")


@pytest.mark.parametrize("constraint, message", [
    (Constraint("regex", "(ab", "response_format"), "cannot be compiled"),
    (Constraint("lark", "start: missing_rule", "response_format"), "cannot be compiled"),
])
def test_a_grammar_the_engine_refuses_names_its_field(constraint, message):
    with pytest.raises(FieldError, match=message) as caught:
        matcher(constraint)
    assert caught.value.field == "response_format"


def test_the_allowed_tokens_are_the_prefixes_of_the_language():
    # a finite language, so that the prefixes can be listed: every token whose text extends the
    # consumed text to a prefix of some word is allowed, and an end-of-sequence id exactly at a word
    words = ["ab d", "a cd", "abd"]
    grammar = matcher(Constraint.regex("|".join(re.escape(w) for w in words)))
    prefixes = {w[:k] for w in words for k in range(len(w) + 1)}
    consumed = ""
    for step in range(4):
        allowed = grammar.allowed()
        expected = {t for t, text in TEXT.items() if t not in EOS and text and consumed + text in prefixes
                    and t not in (3, 4)}  # <think>, </think>: tokens of text too (none are prefixes here)
        assert set(np.flatnonzero(allowed)) - set(EOS) == expected, (step, consumed)
        assert all(allowed[e] == (consumed in words) for e in EOS)
        if consumed in words:
            break
        token = min(expected)
        grammar.consume([token])
        consumed += TEXT[token]
    assert consumed in words and grammar.accepting


def test_accepts_counts_without_consuming_and_tokens_after_the_end_are_free():
    grammar = matcher(Constraint.regex("[0-9]( [0-9])*"))
    digits = [ID["1"], ID[" 2"], ID[" 3"]]
    assert grammar.accepts(digits + [ID["a"]]) == 3 and grammar.consumed == 0
    assert grammar.accepts(digits + [IM_END, ID["a"], ID["b"]]) == 6  # the answer ended at IM_END
    grammar.consume(digits)
    assert grammar.accepting and not grammar.ended and grammar.allowed()[IM_END]
    grammar.rollback(2)
    assert grammar.consumed == 1 and not grammar.allowed()[ID["a"]]


def test_thinking_is_free_until_the_think_end_token():
    grammar = matcher(Constraint.regex("[0-9]+"), thinking=True)
    thought = [ID["a"], ID[" "], ID["<"], ID["/"], ID["b"]]  # "</" as text does not close thinking
    assert grammar.accepts(thought + [ID["</think>"], ID["1"], IM_END]) == 8
    assert grammar.accepts(thought + [ID["1"]]) == 6 and grammar.accepts([ID["</think>"], ID["a"]]) == 1


# ---------------------------------------------------------------------- the diffusion commit rule
ALPHABET = [ID[c] for c in "abcd"] + [ID[" "], ID["0"], IM_END]
RULE_REGEX = "(ab|cd)+( (ab|cd)+)*"


def _valid_with_witness(grammar: BlockGrammar, block, after, lo: int, hi: int) -> bool:
    """A fresh matcher takes the span's decided tokens, the gaps between them filled by the witness."""
    decided = np.flatnonzero(after[lo:hi])
    if not decided.size:
        return True
    end = lo + int(decided[-1]) + 1
    tokens = [int(block[p]) if after[p] else int(grammar.witness[p]) for p in range(lo, end)]
    assert all(t >= 0 for t in tokens), "a gap without a witness token"
    fresh = matcher(Constraint.regex(RULE_REGEX))
    return fresh.accepts(tokens) == len(tokens)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), gap_rule=st.sampled_from(["witness", "frontier"]), size=st.integers(4, 10),
       lo=st.integers(0, 2), short=st.integers(0, 3))
def test_the_commit_rule_keeps_a_witness_and_commits_every_step(data, gap_rule, size, lo, short):
    hi = size - short
    grammar = BlockGrammar(matcher(Constraint.regex(RULE_REGEX)), gap_rule)
    grammar.open_block(size, lo, hi)
    block = np.full(size, MASK, np.int64)
    block[:lo] = ID["x"]  # the prompt's tail: never the answer's
    decided = np.arange(size) < lo
    for _ in range(4 * size):
        front = grammar.frontier(decided)
        if decided.all():
            break
        allowed = np.flatnonzero(grammar.allowed()) if front >= 0 else np.arange(VOCAB)
        candidates = np.array(data.draw(st.lists(st.sampled_from(ALPHABET), min_size=size, max_size=size)))
        frontier_token = int(data.draw(st.sampled_from(sorted(allowed))))
        fills = np.array(data.draw(st.lists(st.booleans(), min_size=size, max_size=size))) & ~decided
        if not fills.any():
            fills[np.flatnonzero(~decided)[0]] = True
        edits = np.array(data.draw(st.lists(st.booleans(), min_size=size, max_size=size))) & decided
        edits[:lo] = False
        after = decided | fills
        proposal = Proposal(block=block.copy(), decided=decided.copy(), candidates=candidates,
                            frontier_token=frontier_token, after=after, edit=edits & (candidates != block))
        # the whole proposal, checked independently: valid -> it stands as it is ("a")
        whole = np.where(proposal.edit, candidates, np.where(decided, block, candidates))
        if front >= 0:
            whole[front] = frontier_token
        grammar_before = grammar.matcher.consumed
        verdict = grammar.vet(proposal)
        assert grammar.matcher.consumed >= 0 and grammar_before >= 0
        span_after = np.flatnonzero(after[lo:hi])
        proposal_valid = (not span_after.size or matcher(Constraint.regex(RULE_REGEX)).accepts(
            whole[lo:lo + span_after[-1] + 1]) == span_after[-1] + 1)
        if proposal_valid:
            assert verdict.option == "a" or gap_rule == "frontier"
        changed = verdict.after & (~decided | verdict.edit)
        block = np.where(changed, verdict.tokens, np.where(verdict.after, block, MASK))
        newly = verdict.after & ~decided
        if (fills[lo:hi]).any():
            assert newly[lo:hi].any(), "a step the schedule filled committed nothing of the answer"
        if gap_rule == "frontier":  # up to the answer's end: what follows it is free
            ends = np.flatnonzero(verdict.after[lo:hi] & np.isin(block[lo:hi], EOS))
            span = verdict.after[lo:lo + int(ends[0]) if ends.size else hi]
            assert not (np.diff(span.astype(int)) > 0).any(), "a commit past an undecided position"
        decided = verdict.after
        assert _valid_with_witness(grammar, block, decided, lo, hi)
        # the matcher holds exactly the decided run from lo
        run = lo
        while run < hi and decided[run]:
            run += 1
        fresh = matcher(Constraint.regex(RULE_REGEX))
        held = [int(t) for t in block[lo:run]]
        fresh.consume(held[:fresh.accepts(held)])
        if not grammar.matcher.ended:
            assert (fresh.allowed() == grammar.allowed()).all()
    assert decided.all()


def test_the_end_of_sequence_id_counts_where_the_grammar_has_stopped():
    # llguidance's validate_tokens counts no end-of-sequence id once nothing else could follow
    # ("abd" is the whole language); it is allowed there, and the answer ends with it
    grammar = matcher(Constraint.regex("abd"))
    run = [ID["a"], ID["b"], ID["d"]]
    assert grammar.accepts(run + [IM_END, ID["x"]]) == 5
    grammar.consume(run)
    assert grammar.allowed()[IM_END] and grammar.accepts([IM_END]) == 1 and grammar.accepts([ID["a"]]) == 0
    grammar.consume([IM_END])
    assert grammar.ended and grammar.accepts([ID["a"]]) == 1
    grammar.rollback(1)
    assert not grammar.ended and grammar.accepts([ENDOFTEXT]) == 1
