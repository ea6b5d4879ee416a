"""`clover_jax.tokenization` against transformers: chat templates render to the same text and ids.

The helpers at the top write a tokenizer (byte-level BPE built with `tokenizers`, Qwen's special
tokens, a Qwen3-style chat template with `enable_thinking`) and a tiny random Clover checkpoint
that uses it; tests/test_cli.py and tests/test_notebooks.py import them.
"""

from __future__ import annotations

import json
import os

import pytest

from clover_jax.tokenization import ChatTemplateError, Tokenizer, TokenizerError

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
"""

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
    """A tiny random Clover (spec §2 layout) with the tokenizer above, a chat template and a
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
    ids = ours.apply_chat_template(messages, tokenize=True, **options)
    assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    assert ours.decode(ids) == text


def test_thinking_switch_changes_only_the_generation_prompt(pair):
    ours, _ = pair
    on = ours.apply_chat_template(CONVERSATIONS["single"], tokenize=False, enable_thinking=True)
    off = ours.apply_chat_template(CONVERSATIONS["single"], tokenize=False, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours.apply_chat_template(CONVERSATIONS["single"])[-2:] == [ours.token_to_id("<think>"),
                                                                     ours.encode("\n")[0]]


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
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == \
        (theirs.eos_token_id, theirs.pad_token_id, theirs.bos_token_id)
    assert ours.vocab_size == len(theirs)


def test_batched_conversations_render_each(pair):
    ours, _ = pair
    batch = [CONVERSATIONS["single"], CONVERSATIONS["system"]]
    assert ours.apply_chat_template(batch) == [ours.apply_chat_template(c) for c in batch]


def test_chat_template_file_wins_over_tokenizer_config(tokenizer_dir, tmp_path):
    import shutil

    directory = tmp_path / "with_file"
    shutil.copytree(tokenizer_dir, directory)
    (directory / "chat_template.jinja").write_text("FILE{{ messages[0].content }}")
    tokenizer = Tokenizer.from_pretrained(directory)
    assert tokenizer.apply_chat_template(CONVERSATIONS["single"], tokenize=False) == "FILEWhat is diffusion?"


def test_mask_token_id_falls_back_to_the_checkpoint_config(tokenizer_dir, tmp_path):
    import shutil

    directory = tmp_path / "with_config"
    shutil.copytree(tokenizer_dir, directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "clover_moe", "mask_token_id": 3}))
    assert Tokenizer.from_pretrained(directory).mask_token_id == 3
    assert Tokenizer.from_pretrained(tokenizer_dir).mask_token_id is None


def test_missing_tokenizer_file_and_missing_template_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
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

    from clover_jax.cli import BUNDLED_MODEL

    if not (BUNDLED_MODEL / "tokenizer.json").is_file():
        pytest.skip(f"the bundled model is not in this checkout yet ({BUNDLED_MODEL})")
    ours, theirs = Tokenizer.from_pretrained(BUNDLED_MODEL), PreTrainedTokenizerFast.from_pretrained(BUNDLED_MODEL)
    for messages in list(CONVERSATIONS.values()) + [[{"role": "user", "content": "sort 3 1 4 1 5"}]]:
        for thinking in (True, False):
            options = dict(add_generation_prompt=True, enable_thinking=thinking)
            assert ours.apply_chat_template(messages, tokenize=False, **options) == \
                theirs.apply_chat_template(messages, tokenize=False, **options)
            assert ours.apply_chat_template(messages, **options) == \
                theirs.apply_chat_template(messages, return_dict=False, **options)
    assert (ours.eos_token_id, ours.pad_token_id, ours.mask_token_id) == \
        (theirs.eos_token_id, theirs.pad_token_id, theirs.mask_token_id)
