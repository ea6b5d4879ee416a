"""Log-probabilities of given tokens from one causal pass: prompt scoring, log-likelihoods, and
the response log-probabilities of autoregressive and self-speculative decoding.

Every figure is a log-probability of the *processed* distribution, the one decoding chooses from
(`decoding.controls.process`: the decoding controls, then the mask-token rule), in float32:

* a prompt token (`prompt_logprobs`): the causal distribution after the tokens before it, with the
  mask token excluded (the controls read the response only, so at a prompt position the mask rule is
  all that applies);
* a response token of autoregressive or self-speculative decoding (`response_logprobs`): the causal
  distribution after the prompt and the response before it, processed with the request's controls
  at that response index (its counts, the length and thinking ramps), as the decoder processed it
  when it chose the token. Both modes choose every token from exactly that distribution, so the
  figure is exact (to the float rounding between one pass over the whole sequence and the decoder's
  token-by-token passes).

One pass over the whole sequence, padded to a power of two (causal: the padding after a position
does not change it), so a few lengths compile.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from decoding.controls import Controls, TokenIds, process, thinking_open
from decoding.generation_config import GenerationConfig
from decoding.layouts import controls_of, token_ids_of

MIN_BUCKET = 16


@dataclasses.dataclass
class TokenScores:
    """Per scored token: its log-probability, and the `top` most likely tokens with theirs
    (descending). logprobs: float32 [n]; top_ids: int32 [n, top]; top_logprobs: float32 [n, top]."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def _bucket(length: int, limit: int) -> int:
    return min(max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length()), limit)


def causal_logits(model, ids: Sequence[int]) -> jax.Array:
    """float32 [bucket, V]: the causal logits of `ids` right-padded to a power of two (rows past
    len(ids) are padding). model: a `CloverModel` (its `forward`)."""
    limit = model.config.max_position_embeddings
    if not 1 <= len(ids) <= limit:
        raise ValueError(f"a scored sequence holds 1 to {limit} tokens (max_position_embeddings), got {len(ids)}")
    padded = np.zeros((1, _bucket(len(ids), limit)), np.int32)
    padded[0, :len(ids)] = ids
    return model.forward(padded)[0]


@functools.partial(jax.jit, static_argnames=("top",))
def _prompt_scores(logits: jax.Array, targets: jax.Array, mask: jax.Array, top: int):
    logits = jnp.where(jnp.arange(logits.shape[-1]) == mask, -jnp.inf, logits.astype(jnp.float32))
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    values, indices = jax.lax.top_k(logp, max(top, 1))
    return chosen, indices[:, :top], values[:, :top]


def prompt_logprobs(model, ids: Sequence[int], mask_token_id: int | None, top: int = 0) -> TokenScores:
    """Scores of ids[1:] (n = len(ids) - 1), each after the tokens before it, from one causal pass."""
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        return TokenScores(np.zeros(0, np.float32), np.zeros((0, top), np.int32), np.zeros((0, top), np.float32))
    logits = causal_logits(model, ids)
    targets = np.zeros(logits.shape[0], np.int32)
    targets[:len(ids) - 1] = ids[1:]
    mask = np.int32(-1 if mask_token_id is None else mask_token_id)
    chosen, top_ids, top_values = jax.device_get(_prompt_scores(logits, targets, mask, top))
    n = len(ids) - 1
    return TokenScores(chosen[:n], top_ids[:n], top_values[:n])


@functools.partial(jax.jit, static_argnames=("top",))
def _response_scores(logits: jax.Array, targets: jax.Array, prompt_thinking: jax.Array, controls: Controls,
                     ids: TokenIds, top: int):
    """logits: float32 [R, V], row t the causal logits before response token t; targets: int32 [R]."""

    def row(counts, inputs):
        index, logits_t, target = inputs
        open_ = thinking_open(counts[None], prompt_thinking[None], ids)[0]
        processed = process(logits_t[None].astype(jnp.float32), counts, index[None], open_, controls, ids)[0]
        logp = jax.nn.log_softmax(processed)
        values, indices = jax.lax.top_k(logp, max(top, 1))
        return counts.at[target].add(1), (logp[target], indices[:top], values[:top])

    counts = jnp.zeros(logits.shape[-1], jnp.int32)
    _, out = jax.lax.scan(row, counts, (jnp.arange(logits.shape[0], dtype=jnp.int32), logits, targets))
    return out


def response_logprobs(model, prompt: Sequence[int], response: Sequence[int], config: GenerationConfig,
                      thinking: bool, top: int = 0) -> TokenScores:
    """Scores of the response tokens as autoregressive (or self-speculative) decoding processed
    them; config: the request's resolved generation config (its controls and special tokens);
    thinking: the prompt ends inside an unclosed <think>."""
    prompt, response = [int(i) for i in prompt], [int(i) for i in response]
    if not response:
        return TokenScores(np.zeros(0, np.float32), np.zeros((0, top), np.int32), np.zeros((0, top), np.float32))
    logits = causal_logits(model, prompt + response)
    rows = _bucket(len(response), logits.shape[0])
    start = len(prompt) - 1
    window = jax.lax.dynamic_slice_in_dim(jnp.pad(logits, ((0, rows), (0, 0))), start, rows)
    targets = np.zeros(rows, np.int32)
    targets[:len(response)] = response
    chosen, top_ids, top_values = jax.device_get(_response_scores(
        window, targets, np.bool_(thinking), controls_of(config), token_ids_of(config), top))
    n = len(response)
    return TokenScores(chosen[:n], top_ids[:n], top_values[:n])
