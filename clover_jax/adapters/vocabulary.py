"""A converted base's grown vocabulary: when the mask token a conversion adds lies past the
embedding, the embedding (and an untied LM head) grow, new rows at the mean of the old ones. A
conversion run grows its base this way, and loading an adapter trained over one grows the base again."""

from __future__ import annotations

import jax.numpy as jnp

from clover_jax.core.config import CloverConfig


def grow_vocabulary(params: dict, config: CloverConfig, rows: int) -> dict:
    """`params` with the embedding (and an untied LM head) grown to `rows` rows, new rows at the
    mean of the old ones."""
    def grown(table):
        mean = jnp.mean(table, axis=0, keepdims=True)
        return jnp.concatenate([table, jnp.repeat(mean, rows - table.shape[0], axis=0)], axis=0)

    params = dict(params)
    params["embed_tokens"] = {**params["embed_tokens"], "embedding": grown(params["embed_tokens"]["embedding"])}
    if not config.tie_word_embeddings:
        params["lm_head"] = grown(params["lm_head"])
    return params
