"""The next-token objective on Clover's causal pass: what `generate(mode="autoregressive")` decodes with.

One `CloverTransformer` call runs each clean conversation (prompt + response, left-padded;
`start` marks the padding, so RoPE positions count from the first real token) causally from
an empty state, as autoregressive generation's prefill does, with plain top-k routing (no
coreset: that is for block rows). Row p's logits predict the token at p + 1; the loss is the
mean cross-entropy over the response tokens of the batch (the prompt is the user's digits,
which nothing can predict):

    loss = Σ_{b, p+1 a response row} −log p(x_{b,p+1} | x_{b,≤p}) / (number of response tokens)

The Clover block-mode parameters take no part in a causal pass, so this loss alone gives them
no gradient; the block-diffusion loss does (`clover_jax.training.objective.joint_loss`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.state import empty_state
from clover_jax.nn.model import CloverTransformer, Params, TransformerPasses


def differentiable(module: CloverTransformer) -> CloverTransformer:
    """`module` with its routed experts in the form reverse-mode differentiation goes through:
    "dense" (every expert on every token). Decoding's expert loop has data-dependent trip counts,
    which `jax.grad` cannot differentiate; both forms compute the same function."""
    return module.clone(kernels=dataclasses.replace(module.kernels, expert_strategy="dense"))


class NextTokenParts(NamedTuple):
    """Diagnostics: the per-token cross-entropy (the loss itself) and greedy accuracy on response tokens."""

    cross_entropy: jax.Array
    accuracy: jax.Array


def causal_logits(module: CloverTransformer, params: Params, sequence_ids: jax.Array,
                  sequence_start: jax.Array) -> jax.Array:
    """float32 [b, S, V]: every row's causal logits. sequence_ids: int [b, S], left-padded; sequence_start: int [b]."""
    batch, width = sequence_ids.shape
    state = empty_state(module.config, batch, width, module.dtype, sequence_start)
    return TransformerPasses(differentiable(module)).causal(params, sequence_ids, state).logits


def next_token_cross_entropy(logits: jax.Array, sequence_ids: jax.Array,
                             is_response: jax.Array) -> NextTokenParts:
    """logits: float [b, S, V]; sequence_ids: int [b, S]; is_response: bool [b, S] -> float32 diagnostics.

    Targets are the response tokens; each is predicted by the row before it.
    """
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = sequence_ids[:, 1:]
    token_loss = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [b, S-1]
    weight = is_response[:, 1:].astype(jnp.float32)
    count = jnp.maximum(jnp.sum(weight), 1.0)
    correct = (jnp.argmax(logits[:, :-1], axis=-1) == targets).astype(jnp.float32)
    return NextTokenParts(jnp.sum(token_loss * weight) / count, jnp.sum(correct * weight) / count)


def next_token_loss(params: Params, module: CloverTransformer, sequence_ids: jax.Array, sequence_start: jax.Array,
                    is_response: jax.Array) -> NextTokenParts:
    """The next-token cross-entropy of a batch's clean sequences (see the module docstring)."""
    logits = causal_logits(module, params, jnp.asarray(sequence_ids), jnp.asarray(sequence_start))
    return next_token_cross_entropy(logits, jnp.asarray(sequence_ids), jnp.asarray(is_response))
