"""Causal passes in chunks: a long prompt is appended to the state `chunk_size` tokens at a time.

The result equals one unchunked pass (tested); memory holds one chunk's activations, and with
`online_attention` never a [tokens, tokens] score matrix. Full chunks run under one `lax.scan`
(one compiled chunk), then one call takes the remainder.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clover_jax.model import CloverTransformer, Params
from clover_jax.state import ModelState

DEFAULT_CHUNK = 2048


def causal_pass(module: CloverTransformer, params: Params, input_ids: jax.Array, state: ModelState,
                chunk_size: int = DEFAULT_CHUNK, logits: str = "none") -> tuple[jax.Array | None, ModelState]:
    """Append `input_ids` (int [batch, tokens]) to `state` in chunks.

    logits: "all" (float32 [batch, tokens, vocab]), "last" ([batch, 1, vocab]) or "none".
    """
    batch, num_tokens = input_ids.shape
    apply = lambda ids, state, logits_from: module.apply({"params": params}, ids, state, ids.shape[1], logits_from)
    first_logit = {"all": lambda n: 0, "last": lambda n: n - 1, "none": lambda n: n}[logits]
    num_full, remainder = divmod(num_tokens, chunk_size)
    pieces = []
    if num_full:
        chunks = jnp.swapaxes(input_ids[:, :num_full * chunk_size].reshape(batch, num_full, chunk_size), 0, 1)

        def step(state, chunk_ids):
            out = apply(chunk_ids, state, first_logit(chunk_size))
            return out.state, out.logits

        state, chunk_logits = jax.lax.scan(step, state, chunks)  # [chunks, batch, rows, vocab]
        pieces.append(jnp.swapaxes(chunk_logits, 0, 1).reshape(batch, -1, chunk_logits.shape[-1]))
    if remainder:
        out = apply(input_ids[:, num_full * chunk_size:], state, first_logit(remainder))
        state = out.state
        pieces.append(out.logits)
    if logits == "none":
        return None, state
    if logits == "last":
        return pieces[-1][:, -1:], state
    return jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0], state
