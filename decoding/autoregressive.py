"""Autoregressive decoding through the causal backbone (docs/design.md §4, `mode="autoregressive"`).

Token by token with the K/V and GDN state, greedy or sampled, with the same `process`
controls as the block decoder (neutral for base Qwen checkpoints). One jitted while_loop; the
forward after a sequence's last token is skipped, so NFE = prefill + one call per further token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.executable_cache import persistent_jit
from clover_jax.core.passes import ModelPasses
from decoding.controls import Controls, TokenIds, choose, process_batch


class AutoregressiveSpec(NamedTuple):
    prompt_length: int   # left-padded prompt length
    max_new_tokens: int  # buffer length (bucketed)
    do_sample: bool
    chunk_size: int      # tokens per causal pass of the prefill


class LeftPadded(NamedTuple):
    """The per-sequence inputs of the loops over left-padded prompts (autoregressive,
    self-speculative), traced. b = batch."""

    prompt_ids: jax.Array        # int32 [b, prompt_length], left padded
    start: jax.Array             # int32 [b]: first real row
    max_new_tokens: jax.Array    # int32 [b]
    prompt_thinking: jax.Array   # bool [b]: the prompt ends inside an unclosed <think>


class AutoregressiveState(NamedTuple):
    model: Any
    logits: jax.Array     # float32 [b, vocab], for the next token
    token: jax.Array      # int32 [b], the latest token chosen (the next forward's input)
    tokens: jax.Array     # int32 [b, max_new_tokens]
    counts: jax.Array     # int32 [b, vocab]
    finished: jax.Array   # bool [b]
    lengths: jax.Array    # int32 [b], tokens generated
    nfe: jax.Array        # int32 [b]
    index: jax.Array      # int32 []


def next_tokens(logits: jax.Array, counts: jax.Array, index: jax.Array, prompt_thinking: jax.Array,
                sequence_keys: jax.Array, controls: Controls, ids: TokenIds, choose_rows) -> jax.Array:
    """The next token of every sequence (int32 [b]): `process` (response index `index` [b], counts
    [b, vocab] of the response so far), then `choose_rows(processed [b, 1, vocab], keys [b])`,
    sequence i drawing from fold_in(sequence_keys[i], index[i]). controls: one for the batch
    (scalars) or one per sequence ([b] arrays). Shared by `run_autoregressive` and the serving engine."""
    processed = process_batch(logits[:, None], counts, index[:, None], prompt_thinking, controls, ids)
    keys = jax.vmap(jax.random.fold_in)(sequence_keys, index)
    return choose_rows(processed, keys).token[:, 0]


def _initial(passes: ModelPasses, params: Any, spec: AutoregressiveSpec, prompts: LeftPadded) -> AutoregressiveState:
    """The prefill: the state whose logits give the first response token."""
    prompt_ids, start = prompts.prompt_ids, prompts.start
    batch = prompt_ids.shape[0]
    vocab = passes.config.vocab_size
    model_state = passes.new_state(batch, spec.prompt_length + spec.max_new_tokens, start)
    last_logits, model_state = passes.prefill(params, prompt_ids, model_state, chunk_size=spec.chunk_size,
                                              logits="last")
    return AutoregressiveState(model=model_state, logits=last_logits[:, 0], token=jnp.zeros(batch, jnp.int32),
                               tokens=jnp.zeros((batch, spec.max_new_tokens), jnp.int32),
                               counts=jnp.zeros((batch, vocab), jnp.int32), finished=jnp.zeros(batch, bool),
                               lengths=jnp.zeros(batch, jnp.int32), nfe=jnp.ones(batch, jnp.int32),
                               index=jnp.int32(0))


def _choose_next(state: AutoregressiveState, spec: AutoregressiveSpec, prompts: LeftPadded, key: jax.Array,
                 controls: Controls, ids: TokenIds) -> AutoregressiveState:
    """Choose every live sequence's next token from the state's logits and record it."""
    batch = state.token.shape[0]
    index = state.index
    sequence_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))  # sequence i: fold_in(key, i)
    token = next_tokens(logits=state.logits, counts=state.counts, index=jnp.broadcast_to(index, (batch,)),
                        prompt_thinking=prompts.prompt_thinking, sequence_keys=sequence_keys, controls=controls,
                        ids=ids, choose_rows=lambda rows, keys: jax.vmap(
                            lambda logits, k: choose(logits, controls, spec.do_sample, k))(rows, keys))
    live = ~state.finished
    lengths = state.lengths + live
    finished = state.finished | (live & (jnp.any(token[:, None] == ids.eos[None, :], axis=-1)
                                         | (lengths >= prompts.max_new_tokens)))
    return state._replace(token=token, tokens=state.tokens.at[:, index].set(jnp.where(live, token, 0)),
                          counts=state.counts.at[jnp.arange(batch), token].add(live.astype(jnp.int32)),
                          finished=finished, lengths=lengths, index=index + 1)


def _forward(passes: ModelPasses, params: Any, state: AutoregressiveState) -> AutoregressiveState:
    """The forward of the latest token: the logits of the next."""
    out = passes.causal(params, state.token[:, None], state.model)
    return state._replace(model=out.state, logits=out.logits[:, 0], nfe=state.nfe + ~state.finished)


@persistent_jit(static_argnames=("passes", "spec"))
def run_autoregressive(passes: ModelPasses, params: Any, spec: AutoregressiveSpec, prompts: LeftPadded,
                       key: jax.Array, controls: Controls, ids: TokenIds) -> tuple[jax.Array, jax.Array, jax.Array]:
    """returns (tokens int32 [b, max_new_tokens], generated lengths [b], NFE [b]); not the caches.

    passes: the model's pass interface (`CloverModel.passes`); params: in the layout it runs with;
    key: the call's PRNG key.

    Each iteration runs the forward of the latest token, then chooses the next one; the loop
    stops once every sequence is finished, so the forward after a sequence's last token never
    runs and the state is never an output of a `lax.cond` (which would copy the caches).
    """
    choose_next = lambda state: _choose_next(state, spec, prompts, key, controls, ids)
    final = jax.lax.while_loop(lambda s: ~jnp.all(s.finished) & (s.index < spec.max_new_tokens),
                               lambda s: choose_next(_forward(passes, params, s)),
                               choose_next(_initial(passes, params, spec, prompts)))
    return final.tokens, final.lengths, final.nfe


# ---------------------------------------------------------------------- token by token (under a grammar)
@persistent_jit(static_argnames=("passes", "spec"))
def start_autoregressive(passes: ModelPasses, params: Any, spec: AutoregressiveSpec,
                         prompts: LeftPadded) -> AutoregressiveState:
    """The prefill (host-driven decoding: the host masks each next token's logits)."""
    return _initial(passes, params, spec, prompts)


@persistent_jit(static_argnames=("passes", "spec", "forward"), donate_argnames=("state",))
def autoregressive_step(passes: ModelPasses, params: Any, spec: AutoregressiveSpec, prompts: LeftPadded,
                        key: jax.Array, controls: Controls, ids: TokenIds, state: AutoregressiveState, *,
                        allowed: jax.Array, forward: bool) -> AutoregressiveState:
    """`forward` (every step but the first: the forward of the latest token), then the next token
    chosen with the logits outside `allowed` (bool [b, V]) at -inf before the controls (greedy:
    `run_autoregressive`'s choice wherever `allowed` holds it; sampled: a draw from the masked
    distribution)."""
    if forward:
        state = _forward(passes, params, state)
    state = state._replace(logits=jnp.where(allowed, state.logits, -jnp.inf))
    return _choose_next(state, spec, prompts, key, controls, ids)
