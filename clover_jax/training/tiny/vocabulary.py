"""The tiny model's tokenizer: characters, a few whole words, and Qwen3's special tokens.

Built with the `tokenizers` library as a BPE whose merges only spell out a handful of words
(`user`, `assistant`, `sort`, ...), so any text over the character set tokenizes, known words
become one token, and digits come with their leading space (`" 7"`), as word-piece tokenizers
split numbers. The pre-tokenizer cuts text into letter runs, an optional space plus one digit,
newline runs (`"\\n\\n"` is one token, as in Qwen3) and single other characters.

Ids 0-6 are the special tokens, at fixed ids:

    0 <|endoftext|>  pad, and what follows the end of a response inside its last block
    1 <|im_start|>   2 <|im_end|>  (the end of an assistant turn: EOS)
    3 <think>        4 </think>    (not "special": they stay in decoded text, as in Qwen3)
    5 <|mask|>       the diffusion mask token (never produced)
    6 <|unk|>        a character outside the vocabulary
"""

from __future__ import annotations

import json
import os
import string

from clover_jax.training.tiny.chat_format import CHAT_TEMPLATE

ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END, MASK, UNK = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>", "<|unk|>")
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END, MASK, UNK)
NOT_SPECIAL = (THINK_START, THINK_END)  # kept by decode(skip_special_tokens=True), as in Qwen3

CHARACTERS = string.ascii_lowercase + string.ascii_uppercase + string.digits + " \n" + ".,:;?!+-=*/()'\"_<>|#%&"
WORDS = ("user", "assistant", "system", "sort", "digits", "digit")
PRE_TOKENIZER_PATTERN = r"[A-Za-z]+| ?[0-9]|\n+|[^A-Za-z0-9\n]"


def special_tokens(with_mask: bool = True) -> tuple[str, ...]:
    """The special tokens at the first ids: without the mask token for an autoregressive base model
    (then <|unk|> is id 5 and every later id one lower)."""
    return SPECIAL_TOKENS if with_mask else tuple(token for token in SPECIAL_TOKENS if token != MASK)


def vocabulary_and_merges(with_mask: bool = True) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Token -> id (specials first) and the BPE merges that build the spaced digits, "\\n\\n" and WORDS."""
    vocabulary: dict[str, int] = {}

    def add(token: str) -> None:
        vocabulary.setdefault(token, len(vocabulary))

    for token in special_tokens(with_mask) + tuple(CHARACTERS):
        add(token)
    merges: list[tuple[str, str]] = [(" ", digit) for digit in string.digits] + [("\n", "\n")]
    for word in WORDS:
        built = word[0]
        for character in word[1:]:
            if (built, character) not in merges:
                merges.append((built, character))
            built += character
    for left, right in merges:
        add(left + right)
    return vocabulary, merges


def build_tokenizer(with_mask: bool = True):
    """A `tokenizers.Tokenizer` for the task vocabulary (`with_mask`: holding the mask token)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = special_tokens(with_mask)
    vocabulary, merges = vocabulary_and_merges(with_mask)
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=merges, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    # `add_special_tokens` marks every token special; the think tags go through `add_tokens` so that
    # decode(skip_special_tokens=True) keeps them, as Qwen3's tokenizer does. Ids come from the vocabulary.
    added = lambda token: AddedToken(token, special=token not in NOT_SPECIAL, normalized=False)
    tokenizer.add_special_tokens([added(token) for token in specials if token not in NOT_SPECIAL])
    tokenizer.add_tokens([added(token) for token in specials if token in NOT_SPECIAL])
    return tokenizer


def write_tokenizer_files(directory: str | os.PathLike, model_max_length: int,
                          with_mask: bool = True) -> dict[str, int]:
    """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template); returns the
    special token ids by name."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tokenizer = build_tokenizer(with_mask)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    added = {}
    for token in special_tokens(with_mask):
        added[str(tokenizer.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": token not in NOT_SPECIAL}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": UNK,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    if with_mask:
        config["mask_token"] = MASK
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
        json.dump(config, handle, indent=2, ensure_ascii=False)
        handle.write("\n")
    return special_token_ids(tokenizer)


def special_token_ids(tokenizer) -> dict[str, int]:
    """Special token -> id (None for one the tokenizer lacks: the mask token of a base model)."""
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
