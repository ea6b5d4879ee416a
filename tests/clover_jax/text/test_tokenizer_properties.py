"""Generated text through `clover_jax.Tokenizer`: decode(encode(text)) == text.

- A byte-level BPE built as Qwen3.5/3.6's tokenizer.json is (NFC normaliser, Qwen's split
  pattern, byte-level bytes, byte-level decoder, special tokens that are never normalised; its
  merges trained here on a small corpus): any NFC-normalised text that holds no special-token
  string comes back unchanged, whatever its script, emoji, control characters or whitespace.
- The bundled tokenizer: any text over its alphabet (letters, digits, space, newline and its
  punctuation) comes back unchanged.
"""

from __future__ import annotations

import json
import os
import unicodedata

import pytest
from hypothesis import given, settings, strategies as st

import clover_jax
from clover_jax import Tokenizer

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# Qwen2/3/3.5's pre-tokenizer pattern, as its tokenizer.json writes it.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")
CORPUS = ["Diffusion language models denoise a block of masked tokens in parallel.",
          "Größe, naïve café — 日本語のテキスト, 中文文本, ελληνικά, русский текст, عربى 🙂👍🏽\t\r\n",
          "def f(x):\n    return x ** 2  # 1 + 2 = 3\n\n\n"] * 10


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory) -> Tokenizer:
    from tokenizers import Regex, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)])
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    directory = tmp_path_factory.mktemp("qwen_style")
    backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
        json.dump({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "clean_up_tokenization_spaces": False, "model_max_length": 262144}, handle)
    return Tokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def bundled() -> Tokenizer:
    return Tokenizer.from_pretrained(clover_jax.bundled_model_path())


NFC_TEXT = st.text(max_size=40).map(lambda text: unicodedata.normalize("NFC", text)).filter(
    lambda text: not any(token in text for token in SPECIAL))


@SETTINGS
@given(text=NFC_TEXT)
def test_qwen_style_byte_level_round_trip(qwen_style, text):
    ids = qwen_style.encode(text, add_special_tokens=False)
    assert qwen_style.decode(ids, skip_special_tokens=False) == text


BUNDLED_ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.,:;?!+-=*/()'\"_<>|#%&")


@SETTINGS
@given(text=st.lists(st.sampled_from(BUNDLED_ALPHABET + ["sort", "digits", "assistant", " 7", "\n\n"]),
                     max_size=40).map("".join))
def test_bundled_tokenizer_round_trip_on_its_alphabet(bundled, text):
    tokenizer = bundled
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert 6 not in ids  # <|unk|>: every character of the alphabet is in the vocabulary
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
