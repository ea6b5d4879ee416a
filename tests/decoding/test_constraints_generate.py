"""`generate` under a constraint on the bundled tiny Clover, in every mode: outputs keep to the
grammar (checked with Python's `re`, independently of the grammar engine), a constraint the
model's own answers satisfy changes nothing, and the answer of a response that starts inside
`<think>` is constrained from `</think>` on."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest

from clover_jax.core.errors import FieldError
from clover_jax.training.tiny.recipe import BUNDLED_DIR
from clover_jax.training.tiny.sort_digits import SortDigits
from decoding import generate
from decoding.constraints import Constraint, compile_constraint

EOS = (2, 0)
THINKING_DIGITS = r"<think>\n[0-9]+ digits\n</think>\n\n[0-9]( [0-9])*"
# answers the model was never trained to write: letters, and two-letter words
LETTERS = r"<think>\n[0-9]+ digits\n</think>\n\n(a|bb|0)( (a|bb|0))*"
LETTERS_LARK = ('start: "<think>\\n" DIGITS " digits\\n</think>\\n\\n" ITEM (" " ITEM)*\n'
                'DIGITS: /[0-9]+/\nITEM: "a" | "bb" | "0"\n')
MODES = ("diffusion", "autoregressive", "self_speculative")


@pytest.fixture(scope="module")
def bundled():
    from clover_jax import CloverModel

    return CloverModel.from_pretrained(BUNDLED_DIR, strict=True, progress=False, chunk_size=64)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(BUNDLED_DIR, "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    task = SortDigits()
    return [task.encode(tokenizer, problem).prompt for problem in task.held_out(6)]


def keeps_to(tokens: list[int], regex: str, tokenizer, constraint: Constraint, thinking: bool = False) -> bool:
    """An output that ends with an end-of-sequence id is a whole match of `regex` (Python's `re`);
    one cut by max_new_tokens is a prefix the grammar engine takes."""
    if tokens and tokens[-1] in EOS:
        text = tokenizer.decode(tokens[:-1], skip_special_tokens=False)
        if thinking:
            text = text.split("</think>", 1)[1]
        return re.fullmatch(regex, text) is not None
    matcher = compile_constraint(constraint, tokenizer_path=os.path.join(BUNDLED_DIR, "tokenizer.json"),
                                 vocab_size=128, eos_token_ids=EOS, think_end_token_id=4, thinking=thinking)
    return matcher.accepts(tokens) == len(tokens)


@pytest.mark.parametrize("mode", MODES)
def test_a_constraint_the_answers_satisfy_changes_nothing(bundled, prompts, mode):
    free = generate(bundled, prompts, mode=mode)
    constrained = generate(bundled, prompts, mode=mode, constraint={"regex": THINKING_DIGITS})
    assert constrained.sequences == free.sequences and constrained.nfe == free.nfe
    assert constrained.steps_per_block == free.steps_per_block
    assert all(constrained.constraint["complete"])
    if mode == "diffusion":  # every proposal stood as it was
        assert set(constrained.constraint["options"]) == {"a"}


@pytest.mark.parametrize("mode, sample, gap_rule", [
    ("diffusion", False, "witness"), ("diffusion", True, "witness"), ("diffusion", False, "frontier"),
    ("autoregressive", False, "witness"), ("autoregressive", True, "witness"), ("self_speculative", False, "witness"),
])
@pytest.mark.parametrize("kind", ["regex", "lark"])
def test_every_output_keeps_to_a_grammar_the_model_does_not_follow(bundled, prompts, tokenizer, mode, sample,
                                                                    gap_rule, kind):
    constraint = Constraint.regex(LETTERS) if kind == "regex" else Constraint.lark(LETTERS_LARK)
    out = generate(bundled, prompts, mode=mode, constraint=constraint, constraint_gap_rule=gap_rule,
                   do_sample=sample, key=jax.random.key(3) if sample else None)
    for tokens in out.sequences:
        assert keeps_to(tokens, LETTERS, tokenizer, constraint), tokenizer.decode(tokens, skip_special_tokens=False)
    ended = np.mean([bool(tokens) and tokens[-1] in EOS for tokens in out.sequences])
    assert ended >= 0.5, out.sequences  # the grammar lets the answer end; most do within 32 tokens


def test_the_answer_after_thinking_is_constrained(bundled, prompts, tokenizer):
    thinking = [prompt + tokenizer.encode("<think>\n", add_special_tokens=False).ids for prompt in prompts]
    answer = r"\n\n(a|bb)( (a|bb))*"
    lark = 'start: "\\n\\n" ITEM (" " ITEM)*\nITEM: "a" | "bb"\n'
    for mode, constraint in (("diffusion", Constraint.regex(answer)), ("autoregressive", Constraint.regex(answer)),
                             ("autoregressive", Constraint.lark(lark))):
        out = generate(bundled, thinking, mode=mode, constraint=constraint)
        for tokens in out.sequences:
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            assert re.match(r"[0-9]+ digits\n</think>", text), text  # the thinking is the model's own
            assert keeps_to(tokens, answer, tokenizer, Constraint.regex(answer), thinking=True), text


def test_a_constraint_needs_the_checkpoint_tokenizer(bundled, prompts):
    from clover_jax import CloverModel
    from decoding import GenerationConfig

    pathless = CloverModel(bundled.config, bundled.params, bundled.dtype, None, bundled.chunk_size)
    with pytest.raises(FieldError, match="tokenizer.json") as caught:
        generate(pathless, prompts[:1], GenerationConfig.from_pretrained(BUNDLED_DIR), constraint={"regex": "a"})
    assert caught.value.field == "constraint"
