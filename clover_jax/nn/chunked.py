"""Causal passes in chunks, on a module: `ModelPasses.prefill` (`clover_jax.core.passes`) for
callers that hold a `CloverTransformer` rather than its passes.

The result equals one unchunked pass (tested); memory holds one chunk's activations, and with
`online_attention` never a [tokens, tokens] score matrix.
"""

from __future__ import annotations

import jax

from clover_jax.core.passes import DEFAULT_CHUNK
from clover_jax.nn.model import CloverTransformer, Params, TransformerPasses
from clover_jax.core.state import ModelState

__all__ = ["DEFAULT_CHUNK", "causal_pass"]


def causal_pass(module: CloverTransformer, params: Params, input_ids: jax.Array, state: ModelState,
                chunk_size: int = DEFAULT_CHUNK, logits: str = "none") -> tuple[jax.Array | None, ModelState]:
    """Append `input_ids` (int [batch, tokens]) to `state` in chunks of `chunk_size` tokens.

    logits: "all" (float32 [batch, tokens, vocab]), "last" ([batch, 1, vocab]) or "none".
    """
    return TransformerPasses(module).prefill(params, input_ids, state, chunk_size=chunk_size, logits=logits)
