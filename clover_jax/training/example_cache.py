"""Tokenised training data kept on disk, keyed by what it was made from.

Reading a large JSONL file renders every chat with the template and tokenises it; a second run on
the same data — a resumed run, a new learning rate — loads the result instead. The key hashes the
data files' bytes, the tokenizer's files (`tokenizer.json`, `tokenizer_config.json`, a stored chat
template) and the reading options, so any change to them reads the data again. Shards live in the
run's `checkpoint_dir` (`data/`) when it has one, else in the cache directory
(`clover_jax.core.compilation_cache.data_directory`; `CLOVER_JAX_CACHE_DIR=""` turns it off).
Each is written to a temporary name and renamed, so a killed run never leaves half a shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Sequence

import numpy as np

from clover_jax.training.examples import Example, read_examples

logger = logging.getLogger(__name__)

VERSION = 1  # bump when the reader's output changes for the same input
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def data_key(paths: Sequence[str], tokenizer_dir: str, *, end_of_turn: Sequence[int], split_turns: bool) -> str:
    digest = hashlib.sha256(json.dumps([VERSION, list(end_of_turn), split_turns]).encode())
    for path in paths:
        _update(digest, path)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            digest.update(name.encode())
            _update(digest, os.path.join(tokenizer_dir, name))
    return digest.hexdigest()[:32]


def _update(digest, path: str) -> None:
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)


def cached_examples(paths, tokenizer, *, end_of_turn: Sequence[int], split_turns: bool,
                    directory: str | None) -> list[Example]:
    """`read_examples`, from the shard of the same key in `directory` when there is one (and into
    it otherwise); `directory` None reads without keeping anything."""
    paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if directory is None or tokenizer.path is None or not all(os.path.isfile(path) for path in paths):
        return read_examples(paths, tokenizer, end_of_turn=end_of_turn, split_turns=split_turns)
    shard = os.path.join(directory, data_key(paths, os.fspath(tokenizer.path), end_of_turn=end_of_turn,
                                             split_turns=split_turns) + ".npz")
    if os.path.isfile(shard):
        logger.info("tokenised data from %s", shard)
        return _load(shard)
    examples = read_examples(paths, tokenizer, end_of_turn=end_of_turn, split_turns=split_turns)
    os.makedirs(directory, exist_ok=True)
    temporary = f"{shard}.{os.getpid()}.tmp.npz"
    lengths = np.asarray([len(example.ids) for example in examples], np.int64)
    np.savez(temporary, ids=np.concatenate([example.ids for example in examples]) if examples else np.zeros(0),
             loss=np.concatenate([example.loss for example in examples]) if examples else np.zeros(0, bool),
             lengths=lengths, turn_ends=json.dumps([list(example.turn_ends) for example in examples]),
             sources=json.dumps([example.source for example in examples]))
    os.replace(temporary, shard)
    logger.info("tokenised %d examples into %s", len(examples), shard)
    return examples


def _load(shard: str) -> list[Example]:
    with np.load(shard) as stored:
        bounds = np.concatenate([[0], np.cumsum(stored["lengths"])])
        turn_ends, sources = json.loads(str(stored["turn_ends"])), json.loads(str(stored["sources"]))
        ids, loss = stored["ids"].astype(np.int32), stored["loss"].astype(bool)
    return [Example(ids[start:end], loss[start:end], tuple(ends), source)
            for start, end, ends, source in zip(bounds[:-1], bounds[1:], turn_ends, sources, strict=True)]
