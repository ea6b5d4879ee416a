"""`clover_jax.text.tokenizer` and its chat-template sandbox (`clover_jax.text.chat_templates`)
against transformers: chat templates render to the same text and ids, and every name the two share
returns what transformers returns. Hostile tokenizer configs and chat templates are one-line errors.

The helpers at the top write a tokenizer (byte-level BPE built with `tokenizers`, Qwen's special
tokens, a Qwen3-style chat template with `enable_thinking`) and a tiny random Clover checkpoint
that uses it; tests/clover_jax/api/test_cli.py and tests/test_notebooks.py import them.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from clover_jax.core.config import ConfigError
from clover_jax.text import chat_templates, tokenizer as tokenizer_module
from clover_jax.text.tokenizer import ChatTemplateError, Tokenizer, TokenizerConfigError, TokenizerError

# Qwen3's template, trimmed of tool calls, with the Qwen3.5/3.6 generation prompt: thinking on
# opens "<think>\n", thinking off gives an empty think block.
QWEN_STYLE_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(searching=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if ns.searching and message.role == 'user' %}
        {%- set ns.searching = false %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role != 'system' %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501 (Qwen3's template, line for line)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = [
    "Diffusion language models denoise a block of masked tokens in parallel.",
    "The quick brown fox jumps over the lazy dog. What is diffusion? It is a process.",
    "Block diffusion decodes 32 tokens at a time, filling the confident positions first.",
    "user assistant system think answer question: 1 + 2 = 3, 2 * 3 = 6.",
]


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE with Qwen's special tokens and non-special <think>, </think>."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 20, trainer)
    backend.add_tokens(["<think>", "</think>"])
    return backend


def write_tokenizer(directory, template: str | None = QWEN_STYLE_TEMPLATE, vocab_size: int = 320, **config) -> int:
    """tokenizer.json + tokenizer_config.json; returns the tokenizer's vocabulary size."""
    backend = build_tokenizer(vocab_size)
    os.makedirs(directory, exist_ok=True)
    backend.save(os.path.join(directory, "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                        "pad_token": "<|endoftext|>", "model_max_length": 4096, **config}
    if template is not None:
        tokenizer_config["chat_template"] = template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
        json.dump(tokenizer_config, handle)
    return backend.get_vocab_size()


def write_chat_checkpoint(directory, max_position_embeddings: int = 512, seed: int = 0) -> str:
    """A tiny random Clover (docs/design.md §2 layout) with the tokenizer above, a chat template and a
    generation_config.json; the LM head is scaled so that some positions are confident."""
    from safetensors.numpy import load_file, save_file

    from tests.checkpoints import QWEN36_LIKE, add_clover_tensors, write_hf_checkpoint

    directory = str(directory)
    backbone = os.path.join(directory, "backbone")
    vocab = build_tokenizer().get_vocab_size()
    ids = {token: build_tokenizer().token_to_id(token) for token in SPECIAL_TOKENS + ["<think>", "</think>"]}
    fields = dict(QWEN36_LIKE, vocab_size=vocab, eos_token_id=ids["<|im_end|>"],
                  max_position_embeddings=max_position_embeddings)
    write_hf_checkpoint(backbone, fields, seed=seed)
    target = os.path.join(directory, "clover")
    add_clover_tensors(backbone, target, mask_token_id=ids["<|mask|>"], seed=seed)
    weights = os.path.join(target, "model.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 4.0
    save_file(tensors, weights)
    write_tokenizer(target)
    generation = {"block_size": 8, "threshold": 0.9, "max_new_tokens": 16,
                  "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "mask_token_id": ids["<|mask|>"]}
    with open(os.path.join(target, "generation_config.json"), "w") as handle:
        json.dump(generation, handle)
    return target


# ---------------------------------------------------------------------- tests
CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is diffusion?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2 * 3 = ?"}],
    "multi_turn": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n3"},
        {"role": "user", "content": "And 2 * 3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "multiply"},
        {"role": "user", "content": "The quick brown fox?", "name": None},
    ],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    write_tokenizer(directory, bos_token="<|endoftext|>")
    return directory


@pytest.fixture(scope="module")
def pair(tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    return Tokenizer.from_pretrained(tokenizer_dir), PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_text_and_ids_equal_transformers(pair, name, thinking, generation_prompt):
    ours, theirs = pair
    messages = CONVERSATIONS[name]
    options = dict(add_generation_prompt=generation_prompt, enable_thinking=thinking)
    text = ours.apply_chat_template(messages, tokenize=False, **options)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **options)
    encoding = ours.apply_chat_template(messages, **options)  # tokenize=True, return_dict=True by default
    assert dict(encoding) == dict(theirs.apply_chat_template(messages, **options))
    ids = ours.apply_chat_template(messages, return_dict=False, **options)
    assert ids == theirs.apply_chat_template(messages, return_dict=False, **options) == encoding.input_ids
    assert ours.decode(ids) == text


def test_thinking_switch_changes_only_the_generation_prompt(pair):
    ours, _ = pair
    on = ours.apply_chat_template(CONVERSATIONS["single"], tokenize=False, add_generation_prompt=True,
                                  enable_thinking=True)
    off = ours.apply_chat_template(CONVERSATIONS["single"], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = ours.apply_chat_template(CONVERSATIONS["single"], add_generation_prompt=True, return_dict=False)
    assert ids[-2:] == [ours.token_to_id("<think>"), ours.encode("\n")[0]]


def test_special_token_variables_extra_kwargs_and_raise_exception_match_transformers(pair):
    ours, theirs = pair
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}|{{ m.content | tojson }}]{% endfor %}"
                "{{ greeting }}{{ eos_token }}{% if strict %}{{ raise_exception('strict mode: no ' + 'tools') }}"
                "{% endif %}")
    messages = [{"role": "user", "content": "<a & b>"}]
    kwargs = dict(chat_template=template, tokenize=False, greeting="hi", strict=False)
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == theirs.apply_chat_template(messages, **kwargs)
    assert text == '<|endoftext|>[user|"<a & b>"]hi<|im_end|>'
    with pytest.raises(ChatTemplateError, match="strict mode: no tools"):
        ours.apply_chat_template(messages, **{**kwargs, "strict": True})
    with pytest.raises(Exception, match="strict mode: no tools"):
        theirs.apply_chat_template(messages, **{**kwargs, "strict": True})


def test_encode_decode_and_special_ids_match_transformers(pair):
    ours, theirs = pair
    text = "<|im_start|>user\nThe quick brown fox<|im_end|>\n<think>ok</think> ünïcode"
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=True)
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in ours.decode(ids, skip_special_tokens=True)
    assert "<think>" in ours.decode(ids, skip_special_tokens=True)  # added but not special, as in Qwen
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id, ours.mask_token_id, ours.unk_token_id) == \
        (theirs.eos_token_id, theirs.pad_token_id, theirs.bos_token_id, theirs.mask_token_id, theirs.unk_token_id)
    assert (ours.vocab_size, len(ours)) == (theirs.vocab_size, len(theirs)) and ours.vocab_size < len(ours)


def test_batched_conversations_render_each(pair):
    ours, theirs = pair
    batch = [CONVERSATIONS["single"], CONVERSATIONS["system"]]
    assert ours.apply_chat_template(batch, return_dict=False) == \
        [ours.apply_chat_template(c, return_dict=False) for c in batch]
    for options in ({}, {"return_dict": False}, {"tokenize": False}, {"padding": True, "return_tensors": "np"}):
        expected = theirs.apply_chat_template(batch, **options)
        got = ours.apply_chat_template(batch, **options)
        if "return_tensors" in options:
            assert all(np.array_equal(got[key], expected[key]) for key in ("input_ids", "attention_mask"))
        else:
            assert (dict(got) if isinstance(got, dict) else got) == (dict(expected) if options == {} else expected)


def test_chat_template_file_wins_over_tokenizer_config(tokenizer_dir, tmp_path):
    import shutil

    directory = tmp_path / "with_file"
    shutil.copytree(tokenizer_dir, directory)
    (directory / "chat_template.jinja").write_text("FILE{{ messages[0].content }}")
    tokenizer = Tokenizer.from_pretrained(directory)
    assert tokenizer.apply_chat_template(CONVERSATIONS["single"], tokenize=False) == "FILEWhat is diffusion?"


def test_has_chat_template_sees_the_template_wherever_the_tokenizer_reads_it(tokenizer_dir, tmp_path):
    assert tokenizer_module.has_chat_template(tokenizer_dir)
    bare = tmp_path / "bare"
    write_tokenizer(bare, template=None)
    assert not tokenizer_module.has_chat_template(bare)
    (bare / "additional_chat_templates").mkdir()
    (bare / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0].content }}")
    assert tokenizer_module.has_chat_template(bare)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("[1, 2]")  # unreadable: counted as no template, no error
    assert not tokenizer_module.has_chat_template(broken)


def test_the_training_chat_format_renders_in_the_one_bounded_sandbox(monkeypatch):
    from clover_jax.training.tiny.chat_format import render_chat

    monkeypatch.setattr(chat_templates, "MAX_TEMPLATE_STEPS", 50)
    with pytest.raises(ChatTemplateError, match="more than 50 loop iterations"):
        render_chat([{"role": "user", "content": "sort 1 2"}], template="{% for i in range(100) %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="A system message must come first"):
        render_chat([{"role": "user", "content": "sort 1 2"}, {"role": "system", "content": "late"}])


def test_legacy_special_tokens_map_and_model_specific_tokens_as_in_transformers(tokenizer_dir, tmp_path):
    import shutil

    from transformers import PreTrainedTokenizerFast

    directory = tmp_path / "legacy"
    shutil.copytree(tokenizer_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(image_token="<|im_start|>", additional_special_tokens=["<|mask|>"])
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    # read because tokenizer_config.json has no added_tokens_decoder; its tokens override the config's
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>", "lstrip": False}, "mask_token": "<|mask|>"}))
    ours, theirs = Tokenizer.from_pretrained(directory), PreTrainedTokenizerFast.from_pretrained(directory)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.eos_token, ours.eos_token_id, ours.mask_token_id) == \
        (theirs.eos_token, theirs.eos_token_id, theirs.mask_token_id) == ("<|endoftext|>", 0, 3)
    assert (ours.all_special_tokens, ours.all_special_ids) == (theirs.all_special_tokens, theirs.all_special_ids)
    template = "{{ image_token }}{{ mask_token }}{{ eos_token }}"  # named tokens are template variables
    assert ours.apply_chat_template(CONVERSATIONS["single"], chat_template=template, tokenize=False) == \
        theirs.apply_chat_template(CONVERSATIONS["single"], chat_template=template, tokenize=False)


def test_missing_tokenizer_file_and_missing_template_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="checkpoint directory '.*nowhere' does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match="no tokenizer.json in"):
        Tokenizer.from_pretrained(tmp_path)
    write_tokenizer(tmp_path, template=None)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS["single"])
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([], chat_template="x")


def test_bundled_tokenizer_renders_and_encodes_as_transformers():
    from transformers import PreTrainedTokenizerFast

    from clover_jax.api.cli import BUNDLED_MODEL

    if not (BUNDLED_MODEL / "tokenizer.json").is_file():
        pytest.skip(f"the bundled model is not in this checkout yet ({BUNDLED_MODEL})")
    ours, theirs = Tokenizer.from_pretrained(BUNDLED_MODEL), PreTrainedTokenizerFast.from_pretrained(BUNDLED_MODEL)
    for messages in list(CONVERSATIONS.values()) + [[{"role": "user", "content": "sort 3 1 4 1 5"}]]:
        for thinking in (True, False):
            options = dict(add_generation_prompt=True, enable_thinking=thinking)
            assert ours.apply_chat_template(messages, tokenize=False, **options) == \
                theirs.apply_chat_template(messages, tokenize=False, **options)
            assert dict(ours.apply_chat_template(messages, **options)) == \
                dict(theirs.apply_chat_template(messages, **options))
    assert (ours.eos_token_id, ours.pad_token_id, ours.mask_token_id) == \
        (theirs.eos_token_id, theirs.pad_token_id, theirs.mask_token_id)
    assert (ours.all_special_ids, ours.special_tokens_map) == (theirs.all_special_ids, theirs.special_tokens_map)


# ---------------------------------------------------------------------- the names shared with transformers
def test_defaults_and_return_types_of_shared_names_match_transformers(pair):
    import jax.numpy as jnp

    ours, theirs = pair
    messages = CONVERSATIONS["single"]
    assert "add_generation_prompt" not in ours.apply_chat_template(messages, tokenize=False)[-30:] and \
        ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    encoding = ours.apply_chat_template(messages, add_generation_prompt=True, return_tensors="np")
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, return_tensors="np")
    assert encoding["input_ids"].shape == expected["input_ids"].shape == (1, len(expected["attention_mask"][0]))
    assert np.array_equal(encoding.input_ids, expected["input_ids"])
    as_jax = ours.apply_chat_template(messages, add_generation_prompt=True, return_tensors="jax")
    assert isinstance(as_jax["input_ids"], jnp.ndarray) and np.array_equal(as_jax["input_ids"], expected["input_ids"])
    texts = ["What is diffusion?", "The quick brown fox jumps"]
    assert dict(ours(texts[0])) == dict(theirs(texts[0]))
    assert dict(ours(texts)) == dict(theirs(texts))
    for side in ("left", "right"):
        got, want = ours(texts, padding=True, padding_side=side), theirs(texts, padding=True, padding_side=side)
        assert dict(got) == dict(want)
    ids = ours.encode(texts[1])
    assert isinstance(ids, list) and ids == theirs.encode(texts[1])
    for form in (ids, np.array(ids), jnp.array(ids), ids[0]):
        assert ours.decode(form) == theirs.decode(form if not isinstance(form, jnp.ndarray) else np.array(form))
    assert ours.batch_decode([ids, ids[:2]]) == theirs.batch_decode([ids, ids[:2]])
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids[0]) == theirs.convert_ids_to_tokens(ids[0])
    tokens = ["<think>", "<|im_end|>", "no-such-token"]
    assert ours.convert_tokens_to_ids(tokens[:2]) == theirs.convert_tokens_to_ids(tokens[:2])
    assert ours.convert_tokens_to_ids("<think>") == theirs.convert_tokens_to_ids("<think>")
    assert ours.get_vocab() == theirs.get_vocab()
    assert (ours.all_special_tokens, ours.all_special_ids) == (theirs.all_special_tokens, theirs.all_special_ids)
    assert ours.special_tokens_map == theirs.special_tokens_map


def test_continue_final_message_matches_transformers(pair):
    ours, theirs = pair
    messages = [{"role": "user", "content": "What is 1 + 2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is "}]
    text = ours.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text == theirs.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text.endswith("</think>\n\nIt is ")
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        ours.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=True)


@pytest.mark.parametrize("option", [dict(truncation=True), dict(return_assistant_tokens_mask=True),
                                    dict(return_tensors="pt"), dict(padding="max_length")])
def test_transformers_options_not_implemented_here_are_refused_not_ignored(pair, option):
    ours, _ = pair
    with pytest.raises(TokenizerError, match=f"{next(iter(option))}"):
        ours.apply_chat_template([CONVERSATIONS["single"], CONVERSATIONS["system"]], **option)


# ---------------------------------------------------------------------- hostile tokenizer_config.json
@pytest.mark.parametrize("config, field", [
    ([1, 2], "must hold a JSON object"),
    ({"eos_token": 7}, "eos_token must be a string or an object"),
    ({"pad_token": {"text": "<|endoftext|>"}}, "pad_token must be"),
    ({"chat_template": 3}, "chat_template must be a string or a list"),
    ({"chat_template": [{"name": "default", "template": None}]}, "chat_template[0] must be"),
    ({"additional_special_tokens": "<|im_start|>"}, "additional_special_tokens must be a list"),
    ({"additional_special_tokens": ["<|im_start|>", None]}, "additional_special_tokens[1] must be"),
    ({"extra_special_tokens": {"image_token": 5}}, "extra_special_tokens.image_token must be"),
    ({"clean_up_tokenization_spaces": "false"}, 'clean_up_tokenization_spaces must be true or false, got "false"'),
    ({"padding_side": "middle"}, "padding_side must be"),
])
def test_a_tokenizer_config_field_of_the_wrong_type_is_a_config_error_naming_it(tmp_path, config, field):
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    # a tokenizer.json that `tokenizers` cannot parse: the config is refused before it is read
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerConfigError) as caught:
        Tokenizer.from_pretrained(tmp_path)
    assert isinstance(caught.value, ConfigError) and field in str(caught.value)
    assert "\n" not in str(caught.value) and "tokenizer_config.json" in str(caught.value)


# ---------------------------------------------------------------------- hostile chat templates
FEW_STEPS = 20_000  # the step budget in these tests (the default is MAX_TEMPLATE_STEPS)


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     f"more than {FEW_STEPS} loop iterations and calls"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses too deeply"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     f"more than {FEW_STEPS} loop iterations and calls"),
    ("{{ 'x' * 10**12 }}", "repeating a str of 1 items 1000000000000 times"),
    ("{% for i in range(100) %}{{ 'y' * 10**6 }}{% endfor %}", "its output exceeds"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "it built a str of 67108864 items"),
    ("{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "it built a list of 67108864 items"),
    ("{{ 'x' | center(10**12) }}", "a filter argument 1000000000000 exceeds"),
    ("{{ 'x'.ljust(10**12) }}", "an argument 1000000000000 exceeds"),
    ("{{ (['x' * 10**7] * 100) | join }}", "joining 1000000000 characters"),
    ("{{ '%0999999999d' % 1 }}", "a format width 999999999 exceeds"),
    ("{{ 2 ** (10**9) }}", "too large a number"),
    ("{{ messages[0].content.__class__ }}", "chat template error"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_a_pathological_chat_template_is_a_one_line_error(pair, monkeypatch, template, message):
    import time

    ours, _ = pair
    monkeypatch.setattr(chat_templates, "MAX_TEMPLATE_STEPS", FEW_STEPS)
    started = time.perf_counter()
    try:
        ours.apply_chat_template(CONVERSATIONS["single"], chat_template=template, tokenize=False)
        error = None
    except ChatTemplateError as caught:
        error = str(caught)
    if template.endswith("__class__ }}"):  # the sandbox renders an unsafe attribute as undefined (empty)
        assert error is None
        return
    assert error is not None and message in error and "\n" not in error, error
    assert time.perf_counter() - started < 30


def test_templates_within_the_bounds_render_as_in_transformers(pair, monkeypatch):
    ours, theirs = pair
    monkeypatch.setattr(chat_templates, "MAX_TEMPLATE_STEPS", FEW_STEPS)
    template = ("{% for m in messages %}{% for i in range(3) %}{{ m.role ~ i }}{% endfor %}{{ m.content|center(30) }}"
                "{{ ('-' * 5) + '%3d' % 7 }}{{ ([m.role] * 2) | join(',') }}{% endfor %}{{ 2 ** 10 }}")
    messages = CONVERSATIONS["multi_turn"]
    assert ours.apply_chat_template(messages, chat_template=template, tokenize=False) == \
        theirs.apply_chat_template(messages, chat_template=template, tokenize=False)
