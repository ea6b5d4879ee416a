"""The sorting task, its tokenizer and chat template: rendered as transformers renders them."""

from __future__ import annotations

import pytest

from clover_jax.training.tiny.chat_format import CHAT_TEMPLATE, render_chat
from clover_jax.training.tiny.sort_digits import SortDigits
from clover_jax.training.tiny.vocabulary import (
    ENDOFTEXT,
    IM_END,
    MASK,
    SPECIAL_TOKENS,
    build_tokenizer,
    special_token_ids,
    write_tokenizer_files,
)

TASK = SortDigits()
CONVERSATIONS = [
    [{"role": "user", "content": "sort 3 1 4 1 5"}],
    [{"role": "system", "content": "you sort digits"}, {"role": "user", "content": "sort 9 0"}],
    [{"role": "user", "content": "sort 2 1"}, {"role": "assistant", "content": "<think>\n2 digits\n</think>\n\n1 2"},
     {"role": "user", "content": "sort 7 7 3"}],
    [{"role": "user", "content": "sort 2 1"}, {"role": "assistant", "reasoning_content": "2 digits", "content": "1 2"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(directory, model_max_length=1024)
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("thinking", [True, False, None])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_apply_chat_template(hf_tokenizer, conversation, thinking,
                                                                   generation_prompt):
    messages = CONVERSATIONS[conversation]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    ours = render_chat(messages, add_generation_prompt=generation_prompt, **kwargs)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                              **kwargs)
    assert ours == theirs


def test_generation_prompt_follows_qwen3_thinking_switch():
    messages = CONVERSATIONS[0]
    assert render_chat(messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert render_chat(messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # earlier assistant turns lose their reasoning; the last one keeps it
    assert "2 digits" not in render_chat(CONVERSATIONS[2])
    assert "<think>\n2 digits\n</think>\n\n1 2<|im_end|>" in render_chat(CONVERSATIONS[3])


@pytest.mark.parametrize("thinking", [True, False])
def test_training_examples_equal_the_transformers_tokenization(hf_tokenizer, thinking):
    tokenizer = build_tokenizer()
    for problem in TASK.held_out(20):
        example = TASK.encode(tokenizer, problem, thinking)
        prompt = hf_tokenizer.apply_chat_template(TASK.messages(problem), tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=thinking)
        reply = {"role": "assistant", "content": TASK.answer(problem),
                 "reasoning_content": TASK.reasoning(problem) if thinking else ""}
        conversation = hf_tokenizer.apply_chat_template(TASK.messages(problem) + [reply], tokenize=False)
        assert conversation == prompt + TASK.response_text(problem, thinking) + "\n"
        ids = hf_tokenizer(conversation, add_special_tokens=False)["input_ids"]
        assert ids[:-1] == example.prompt + example.response  # the trailing "\n" is not trained on
        assert example.response[-1] == hf_tokenizer.convert_tokens_to_ids(IM_END)
        assert hf_tokenizer.decode(example.response) == TASK.response_text(problem, thinking)


def test_response_format_and_exact_scoring():
    problem = (3, 1, 4, 1, 5)
    assert TASK.response_text(problem) == "<think>\n5 digits\n</think>\n\n1 1 3 4 5<|im_end|>"
    assert TASK.response_text(problem, thinking=False) == "1 1 3 4 5<|im_end|>"
    assert TASK.is_correct(problem, "<think>\n5 digits\n</think>\n\n1 1 3 4 5<|im_end|>")
    assert TASK.is_correct(problem, "1 1 3 4 5<|im_end|>")
    assert not TASK.is_correct(problem, "<think>\n5 digits\n</think>\n\n1 1 3 4<|im_end|>")
    assert not TASK.is_correct(problem, "<think>\n5 digits\n</think>\n\n1 1 3 4 5")  # never ended
    tokens = build_tokenizer().encode(TASK.response_text(problem)).tokens
    assert tokens == ["<think>", "\n", "5", " ", "digits", "\n", "</think>", "\n\n", "1", " 1", " 3", " 4", " 5",
                      IM_END]


def test_held_out_prompts_never_appear_in_training():
    held_out = TASK.held_out(200)
    assert len(set(held_out)) == 200 and held_out == TASK.held_out(200)
    sampler = TASK.training_sampler(seed=0)
    drawn = {problem for step in range(300) for problem in sampler.problems(step, 32)}
    assert not drawn & set(held_out)
    assert sampler.problems(7, 32) == TASK.training_sampler(seed=0).problems(7, 32)  # a function of the step


def test_special_tokens_have_fixed_ids_and_the_vocabulary_fits_the_model():
    tokenizer = build_tokenizer()
    assert list(special_token_ids(tokenizer).values()) == list(range(len(SPECIAL_TOKENS)))
    assert special_token_ids(tokenizer)[ENDOFTEXT] == 0 and special_token_ids(tokenizer)[MASK] == 5
    assert tokenizer.get_vocab_size() == 128
    for word in ("user", "assistant", "system", "sort", "digits"):
        assert tokenizer.encode(word).tokens == [word]
    assert "enable_thinking" in CHAT_TEMPLATE
