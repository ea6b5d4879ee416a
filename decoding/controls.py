"""`process(ℓ, t)` of docs/design.md §4 — repetition, presence/frequency, length and thinking controls,
the mask ban — and the choice of a token with its confidence (greedy or sampled).

Everything is a pure function of arrays, used per sequence inside the jitted decoding loop.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Controls(NamedTuple):
    """The numeric controls `process` and `choose` read, traced (changing them does not recompile),
    each named as its `GenerationConfig` field. The threshold τ is not one of them: it is the
    schedule's (its parameters, and `StepView.threshold`)."""

    repetition_penalty: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    dllm_length_penalty: jax.Array
    dllm_length_penalty_start: jax.Array
    dllm_length_penalty_window: jax.Array
    dllm_think_end_bias: jax.Array
    dllm_think_end_start: jax.Array
    dllm_think_end_window: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


class TokenIds(NamedTuple):
    """Special tokens; -1 where a checkpoint has none. eos: int32 [num_eos]."""

    eos: jax.Array
    mask: jax.Array
    think_start: jax.Array
    think_end: jax.Array


def per_sequence_axes(tree):
    """vmap axes of a pytree whose leaves are one value for the batch (None) or one per sequence (0),
    such as `Controls` given once for a `generate` call or per request in the serving engine."""
    return jax.tree_util.tree_map(lambda leaf: 0 if jnp.ndim(leaf) else None, tree)


def thinking_open(counts: jax.Array, prompt_thinking: jax.Array, ids: TokenIds) -> jax.Array:
    """bool [b]: the prompt or the response opened <think> and the response has not closed it.
    counts: int32 [b, vocab], the response so far; prompt_thinking: bool [b]."""
    count = lambda token: jnp.where(token >= 0, counts[:, jnp.maximum(token, 0)], 0)
    return (prompt_thinking | (count(ids.think_start) > 0)) & (count(ids.think_end) == 0)


def process_batch(logits: jax.Array, counts: jax.Array, response_index: jax.Array, prompt_thinking: jax.Array,
                  controls: Controls, ids: TokenIds) -> jax.Array:
    """`process` for every sequence of a batch, with each one's thinking state from its counts: the
    one per-step controls helper of the block-diffusion, autoregressive and self-speculative loops.

    logits: float32 [b, rows, vocab]; counts: int32 [b, vocab], the response so far; response_index:
    int32 [b, rows]; prompt_thinking: bool [b]; controls: one for the batch (scalars) or one per
    sequence ([b] arrays). returns float32 [b, rows, vocab]."""
    thinking = thinking_open(counts, prompt_thinking, ids)
    return jax.vmap(process, in_axes=(0, 0, 0, 0, per_sequence_axes(controls), None))(
        logits, counts, response_index, thinking, controls, ids)


def ramp(t: jax.Array, start: jax.Array, window: jax.Array) -> jax.Array:
    """clip((t − start) / window, 0, 1); a window of 0 is a step at `start`."""
    t = t.astype(jnp.float32)
    smooth = jnp.clip((t - start) / jnp.maximum(window, 1), 0.0, 1.0)
    return jnp.where(window == 0, (t >= start).astype(jnp.float32), smooth)


def process(logits: jax.Array, counts: jax.Array, response_index: jax.Array, thinking_open: jax.Array,
            controls: Controls, ids: TokenIds) -> jax.Array:
    """docs/design.md §4 steps 1–5 for the rows of one sequence's block.

    logits: float32 [rows, vocab]; counts: int32 [vocab], response token counts so far;
    response_index: int32 [rows], t of each row; thinking_open: bool []
    """
    seen = (counts > 0)[None, :]
    penalised = jnp.where(logits > 0, logits / controls.repetition_penalty, logits * controls.repetition_penalty)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - controls.frequency_penalty * counts[None, :] - controls.presence_penalty * seen
    vocab = jnp.arange(logits.shape[-1])
    length_bias = controls.dllm_length_penalty * ramp(response_index, controls.dllm_length_penalty_start,
                                                      controls.dllm_length_penalty_window)
    is_eos = jnp.any(vocab[:, None] == ids.eos[None, :], axis=-1)  # -1 entries never match
    logits = logits + jnp.where(is_eos[None, :], length_bias[:, None], 0.0)
    think_bias = controls.dllm_think_end_bias * ramp(response_index, controls.dllm_think_end_start,
                                                     controls.dllm_think_end_window)
    think_bias = jnp.where(thinking_open, think_bias, 0.0)
    logits = logits + jnp.where((vocab == ids.think_end)[None, :], think_bias[:, None], 0.0)
    return jnp.where((vocab == ids.mask)[None, :], -jnp.inf, logits)


class Choice(NamedTuple):
    """token: int32 [rows]; confidence: its probability; margin: top-1 minus top-2 probability;
    entropy: of the distribution the token was chosen from (nats)."""

    token: jax.Array
    confidence: jax.Array
    margin: jax.Array
    entropy: jax.Array


def truncates(controls: Controls, vocab: int) -> jax.Array:
    """bool, the controls' shape: the sequence's top-k or top-p cuts its distribution (else sampling
    reads every token and needs no sort of the vocabulary)."""
    top_k = jnp.asarray(controls.top_k)
    return ((top_k > 0) & (top_k < vocab)) | (jnp.asarray(controls.top_p) < 1.0)


def sampling_logits(logits: jax.Array, controls: Controls, *, truncate: bool = True) -> jax.Array:
    """Temperature, then top-k, then top-p (nucleus), as transformers' logits warpers apply them.
    truncate: False when no sequence's top-k or top-p cuts (`truncates`): temperature alone, no sort."""
    logits = logits / controls.temperature
    if not truncate:
        return logits
    # the sort of a 248,320-id vocabulary is most of a sampled step's time on CPU: skipped at run time
    # when nothing cuts (inside a vmap over per-sequence controls this becomes a select of both)
    return jax.lax.cond(jnp.any(truncates(controls, logits.shape[-1])), _truncated, lambda values, _: values,
                        logits, controls)


def _truncated(logits: jax.Array, controls: Controls) -> jax.Array:
    descending = jnp.sort(logits, axis=-1)[..., ::-1]
    k = jnp.where(controls.top_k > 0, jnp.minimum(controls.top_k, logits.shape[-1]), logits.shape[-1])
    kth = jnp.take_along_axis(descending, jnp.broadcast_to(k - 1, logits.shape[:-1])[..., None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    # the sorted top-k logits: the same values sorted again, but the cut keeps the order (one sort, not two;
    # the sort of a 248,320-id vocabulary is most of a sampled step's time on CPU)
    descending = jnp.where(descending < kth, -jnp.inf, descending)
    probabilities = jax.nn.softmax(descending, axis=-1)
    mass_before = jnp.cumsum(probabilities, axis=-1) - probabilities
    # keep the smallest prefix of the sorted tokens whose mass reaches top_p (always the first); top_p 1
    # keeps every token, as transformers (which then adds no top-p warper): float32 sums of the sorted
    # probabilities can reach 1 before the last tokens
    kept = (mass_before < controls.top_p) | (jnp.arange(logits.shape[-1]) == 0) | (controls.top_p >= 1.0)
    cutoff = jnp.min(jnp.where(kept, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def choose(logits: jax.Array, controls: Controls, do_sample: bool, key: jax.Array | None, *,
           truncate: bool = True) -> Choice:
    """Greedy argmax (ties: lowest id) or a sample; confidence is the chosen token's probability
    under the distribution it was chosen from. logits: float32 [rows, vocab]. truncate: as
    `sampling_logits`'s."""
    if do_sample:
        logits = sampling_logits(logits, controls, truncate=truncate)
        token = jax.random.categorical(key, logits, axis=-1)
    else:
        token = jnp.argmax(logits, axis=-1)
    probabilities = jax.nn.softmax(logits, axis=-1)
    confidence = jnp.take_along_axis(probabilities, token[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.where(probabilities > 0, probabilities * jnp.log(probabilities), 0.0), axis=-1)
    return Choice(token.astype(jnp.int32), confidence, top_two_gap(probabilities), entropy)


def top_two_gap(probabilities: jax.Array) -> jax.Array:
    """The largest value minus the second largest (0 when the largest occurs twice) over the last
    axis: `lax.top_k(p, 2)`'s two values subtracted, in reductions. Why not top_k: XLA:CPU turned
    `top_k(p, 2)` followed by a slice into a sort of the whole vocabulary for every row (measured:
    270 ms for 32 rows of 32,768 against 1.7 ms for top_k alone, and as much inside `choose`)."""
    first = jnp.max(probabilities, axis=-1, keepdims=True)
    at_first = probabilities == first
    rest = jnp.max(jnp.where(at_first, -jnp.inf, probabilities), axis=-1)
    second = jnp.where(jnp.sum(at_first, axis=-1) > 1, first[..., 0], rest)
    return first[..., 0] - second
