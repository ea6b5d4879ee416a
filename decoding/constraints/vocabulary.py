"""A checkpoint's tokenizer as llguidance reads it (`LLTokenizer`), built once per tokenizer.

llguidance reads a `tokenizer.json` itself when its decoder is one it knows (byte-level BPE, as
Qwen's). The bundled tiny models' tokenizers join their tokens with a `Fuse` decoder, which
llguidance 1.9 refuses ("can't determine decoder type"); their tokens are plain text (no byte
mapping, no normaliser), so each token's bytes are its vocabulary string's UTF-8, and they are
handed over as a `TokenizerWrapper` with the tokenizer's own encoder. A tokenizer that is neither
is refused with the reason.
"""

from __future__ import annotations

import functools
import json
import os

from clover_jax.core.errors import UNSUPPORTED, FieldError

# decoders whose output is the tokens' vocabulary strings joined as they are
_PLAIN_DECODERS = (None, "Fuse")


def llguidance_tokenizer(tokenizer_path: str | os.PathLike, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """The `llguidance.LLTokenizer` of the tokenizer.json at `tokenizer_path`, over the model's
    `vocab_size` ids (rows past the tokenizer's are never allowed), ending with any of `eos_token_ids`."""
    path = os.fspath(tokenizer_path)
    return _cached(path, os.stat(path).st_mtime_ns, int(vocab_size), tuple(int(e) for e in eos_token_ids))


@functools.lru_cache(maxsize=8)
def _cached(path: str, mtime: int, vocab_size: int, eos_token_ids: tuple[int, ...]):
    import llguidance

    with open(path, encoding="utf-8") as file:
        text = file.read()
    eos = list(eos_token_ids)
    try:
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
    except (ValueError, RuntimeError) as error:  # a decoder llguidance does not know
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_PlainTokens(text, path, error)),
                                      n_vocab=vocab_size, eos_token=eos)


class _PlainTokens:
    """What `llguidance.TokenizerWrapper` reads of a tokenizer whose tokens are plain text."""

    def __init__(self, text: str, path: str, refusal: Exception):
        from tokenizers import Tokenizer

        spec = json.loads(text)
        decoder = (spec.get("decoder") or {}).get("type")
        model = spec.get("model") or {}
        if decoder not in _PLAIN_DECODERS or spec.get("normalizer") or not isinstance(model.get("vocab"), dict):
            raise FieldError("constraint", f"{path}: llguidance cannot read this tokenizer ({refusal}), and its "
                                           f"tokens are not plain text (decoder {decoder!r}, normalizer "
                                           f"{(spec.get('normalizer') or {}).get('type')!r})", code=UNSUPPORTED)
        strings = {index: token for token, index in model["vocab"].items()}
        added = spec.get("added_tokens") or []
        strings.update({token["id"]: token["content"] for token in added})
        self.tokens = [strings.get(index, "").encode("utf-8") for index in range(max(strings) + 1)]
        self.special_token_ids = [token["id"] for token in added if token.get("special")]
        self.eos_token_id = self.special_token_ids[0] if self.special_token_ids else 0
        self.bos_token_id = None
        self._backend = Tokenizer.from_str(text)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._backend.encode(text, add_special_tokens=False).ids
