"""Cross-entropy from hidden states, a chunk of rows at a time.

Clover's vocabulary is 248,320 wide: float32 logits of 4,096 rows of two or three streams would
take 8–12 GB. The loss never holds them: rows go through the LM head in chunks inside a
`lax.scan`, each chunk's logits reduced at once to the target's log-probability and the argmax,
and the chunk is rematerialised in the backward pass (`jax.checkpoint`), so at most one chunk's
`[rows, vocab]` logits exist at a time, forward or backward. The backward pass holds a few arrays
of that shape (the logits, their softmax and cotangent, a compute-dtype copy for the matmul), so
the chunk's rows follow the vocabulary: float32 logits of at most `CHUNK_LOGIT_BYTES`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_ROWS = 1024  # the most rows per chunk
CHUNK_LOGIT_BYTES = 256 * 2**20  # one chunk's float32 logits: 256 rows at Clover's 248,320 tokens


def chunk_rows_for(vocab: int) -> int:
    """Rows per chunk for a `vocab`-wide head: the largest power of two (8 to `DEFAULT_CHUNK_ROWS`)
    whose float32 logits fit `CHUNK_LOGIT_BYTES`."""
    rows = max(CHUNK_LOGIT_BYTES // (4 * vocab), 8)
    return min(1 << (rows.bit_length() - 1), DEFAULT_CHUNK_ROWS)


class TokenLosses(NamedTuple):
    """nll: float32 [rows], −log p(target) under the softmax without the excluded token;
    correct: bool [rows], whether the argmax is the target."""

    nll: jax.Array
    correct: jax.Array


def chunked_cross_entropy(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, excluded_token: int | None,
                          chunk_rows: int | None = None) -> TokenLosses:
    """hidden: [rows, hidden_size]; head: [vocab, hidden_size]; targets: int [rows] -> `TokenLosses`.

    The logits are `hidden @ headᵀ` in float32; `excluded_token` (the mask token: decoding never
    chooses it, docs/design.md §4) gets logit −∞. chunk_rows: rows per chunk (None:
    `chunk_rows_for` the vocabulary)."""
    rows = hidden.shape[0]
    if rows == 0:
        return TokenLosses(jnp.zeros((0,), jnp.float32), jnp.zeros((0,), bool))
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(head.shape[0])
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    chunk_rows = min(chunk_rows, rows)
    pad = (-rows) % chunk_rows
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk_rows, hidden.shape[-1])
    targets = jnp.pad(targets, (0, pad)).reshape(-1, chunk_rows)

    @jax.checkpoint
    def chunk(args):
        rows_hidden, rows_targets = args
        logits = jnp.einsum("th,vh->tv", rows_hidden, head, preferred_element_type=jnp.float32)
        if excluded_token is not None:
            logits = logits.at[:, excluded_token].set(-jnp.inf)
        target_logit = jnp.take_along_axis(logits, rows_targets[:, None], axis=-1)[:, 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
        return nll, jnp.argmax(logits, axis=-1) == rows_targets

    nll, correct = jax.lax.map(chunk, (hidden, targets))
    return TokenLosses(nll.reshape(-1)[:rows], correct.reshape(-1)[:rows])
