"""Self-speculative decoding (docs/design.md §8, `mode="self_speculative"`): the block-mode pass drafts a
block, the causal pass verifies it, and the causal state is rolled back to what was accepted.

Every sequence holds a *pending* token: the latest token emitted (in the first round, the
prompt's last token), not yet in the state. One round, in lockstep over the batch:

1. **Draft** — one forward: the pending token as a causal row (it is appended to the state; a
   commit fused with a denoising step, as the block decoder fuses them) and B masks as block
   rows right after it. The causal row's logits are the autoregressive logits of the next
   position; the masked rows' greedy candidates after `process` (docs/design.md §4, counts = the response
   so far) are the drafts d_0 … d_{B-1}.
2. **Verify** — one recording causal pass over the drafts (`clover_jax.nn.rollback`).
3. **Accept** — c_j, the token autoregressive decoding would emit at draft position j if
   d_0 … d_{j-1} were accepted: the greedy choice of `process`(causal logits of the row before
   position j, counts + d_0 … d_{j-1}, response index of j). With a = the number of leading j
   where d_j = c_j, the round emits c_0 … c_a: the a accepted drafts (equal to their c) and the
   causal pass's own token where they first differ (or after the whole block). It stops at the
   first EOS and at max_new_tokens.
4. **Roll back** — the state keeps the pending row and the a accepted drafts' rows; c_a becomes
   the pending token, so the next draft starts right after the accepted tokens.

Every emitted token is thus the greedy choice from processed causal logits over exactly the
tokens before it: what `mode="autoregressive"` emits (the two compute those logits in passes of
different shapes, so they agree to float rounding; greedy decisions far from ties agree exactly).
NFE counts every pass: the prefill (all prompt tokens but the last, when there are any) plus two
per round. Each sequence's accepted length is its own: after a rollback the state's fill is per
sequence, and a finished sequence's fill stays where it was.

Why the verify pass is not fused with the next round's draft: the next draft reads the state
after the accepted tokens and sits right after them, and which tokens are accepted is known only
from the verify pass's logits; a fused call would have to draft after the whole block, which is
of use only when all of it is accepted. The pending token's commit is what fuses (step 1).

Greedy only: sampling would need the speculative accept/resample rule over the draft and causal
distributions; `generate` refuses `do_sample=True` in this mode.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.executable_cache import persistent_jit
from clover_jax.core.passes import ModelPasses
from clover_jax.core.state import ModelState
from decoding.autoregressive import LeftPadded
from decoding.controls import Controls, TokenIds, choose, process_batch


class SpeculativeSpec(NamedTuple):
    """Static layout of one compiled decoder (changing any field recompiles)."""

    prompt_length: int   # left-padded prompt length
    max_new_tokens: int  # buffer length (bucketed); also the most rounds a decode can take
    block_size: int      # drafted positions per round
    coreset: bool        # block expert selection in the draft pass
    trajectory: bool     # record every round's drafts and accepted run
    chunk_size: int      # tokens per causal pass of the prefill


class Rounds(NamedTuple):
    """Every round of every sequence, filled inside the loop when requested; R = max_new_tokens
    (a round emits at least one token), rows past a sequence's `num_rounds` are padding."""

    drafts: jax.Array     # int32 [b, R, B]: the draft of each round
    accepted: jax.Array   # int32 [b, R]: drafts accepted (the leading run equal to the causal choices)
    emitted: jax.Array    # int32 [b, R]: tokens the round emitted (accepted + 1, cut at EOS / max_new_tokens)
    num_rounds: jax.Array  # int32 [b]


class SpeculativeResults(NamedTuple):
    """What leaves the device: the per-sequence outputs, not the caches."""

    tokens: jax.Array            # int32 [b, max_new_tokens]
    lengths: jax.Array           # int32 [b]: tokens emitted
    nfe: jax.Array               # int32 [b]
    distinct_experts: jax.Array  # float32 [b, R]: of each round's draft pass, mean over layers
    rounds: Rounds | None


class SpeculativeState(NamedTuple):
    model: ModelState            # everything before each sequence's pending token; length int32 [b]
    pending: jax.Array           # int32 [b]
    tokens: jax.Array            # int32 [b, max_new_tokens]
    counts: jax.Array            # int32 [b, vocab]: response tokens emitted
    finished: jax.Array          # bool [b]
    lengths: jax.Array           # int32 [b]: tokens emitted
    nfe: jax.Array               # int32 [b]
    distinct_experts: jax.Array  # float32 [b, R]
    rounds: Rounds | None
    round: jax.Array             # int32 []


def greedy_processed(logits: jax.Array, counts: jax.Array, response_index: jax.Array, prompt_thinking: jax.Array,
                     controls: Controls, ids: TokenIds) -> jax.Array:
    """int32 [b, rows]: `process` then greedy, per sequence. logits: [b, rows, vocab]; response_index: [b, rows];
    controls: one for the batch (scalars) or one per sequence ([b] arrays)."""
    processed = process_batch(logits, counts, response_index, prompt_thinking, controls, ids)
    return jax.vmap(lambda rows: choose(rows, controls, False, None).token)(processed)  # greedy: no control read


def causal_choices(logits: jax.Array, drafts: jax.Array, counts: jax.Array, lengths: jax.Array,
                   prompt_thinking: jax.Array, controls: Controls, ids: TokenIds) -> jax.Array:
    """c_0 … c_B (int32 [b, B+1]): row j's token as autoregressive decoding would choose it after
    the drafts before j. logits: float32 [b, B+1, vocab], row j the causal logits before position j;
    drafts: int32 [b, B]; counts: [b, vocab], the response so far; lengths: [b], its length."""
    batch = drafts.shape[0]
    after = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)  # the last row adds nothing used

    def row(counts, inputs):
        logits_j, draft_j, j = inputs
        token = greedy_processed(logits_j[:, None], counts, (lengths + j)[:, None], prompt_thinking, controls,
                                 ids)[:, 0]
        return counts.at[jnp.arange(batch), draft_j].add(1), token

    _, tokens = jax.lax.scan(row, counts, (jnp.moveaxis(logits, 1, 0), after.T, jnp.arange(after.shape[1])))
    return tokens.T


class RoundOutcome(NamedTuple):
    """One round of every sequence ([b] unless noted); sequences not active emit nothing and keep their fill."""

    model: ModelState            # rolled back to the accepted drafts; length int32 [b]
    pending: jax.Array           # int32: the next round's pending token
    choices: jax.Array           # int32 [b, B+1]: c_0 … c_B; the first `emitted` are this round's tokens
    emitted: jax.Array           # int32: tokens emitted (accepted + 1, cut at EOS / max_new_tokens)
    counts: jax.Array            # int32 [b, vocab]: response tokens emitted, this round's included
    lengths: jax.Array           # int32: response length after the round
    finished: jax.Array          # bool: the round emitted an EOS or reached max_new_tokens
    drafts: jax.Array            # int32 [b, B]
    accepted: jax.Array          # int32: leading drafts equal to the causal choices
    distinct_experts: jax.Array  # float32: of the draft pass, mean over layers


class Acceptance(NamedTuple):
    """Step 3 of a round for every sequence ([b] unless noted); sequences not active emit nothing."""

    choices: jax.Array           # int32 [b, B+1]: c_0 … c_B; the first `emitted` are this round's tokens
    accepted: jax.Array          # int32: leading drafts equal to the causal choices
    emitted: jax.Array           # int32: tokens emitted (accepted + 1, cut at EOS / max_new_tokens)
    counts: jax.Array            # int32 [b, vocab]: response tokens emitted, this round's included
    lengths: jax.Array           # int32: response length after the round
    finished: jax.Array          # bool: the round emitted an EOS or reached max_new_tokens


def draft_tokens(block_logits: jax.Array, counts: jax.Array, lengths: jax.Array, prompt_thinking: jax.Array,
                 controls: Controls, ids: TokenIds) -> jax.Array:
    """Step 1's drafts d_0 … d_{B-1} (int32 [b, B]): the greedy choice of `process` at each masked
    row of the draft pass (block_logits: float32 [b, B, vocab]) with the response so far's counts."""
    size = block_logits.shape[1]
    return greedy_processed(block_logits, counts, lengths[:, None] + jnp.arange(size), prompt_thinking, controls, ids)


def accept_drafts(logits: jax.Array, drafts: jax.Array, counts: jax.Array, lengths: jax.Array,
                  prompt_thinking: jax.Array, controls: Controls, ids: TokenIds, *, max_new_tokens: jax.Array,
                  active: jax.Array, draft_limit: jax.Array | None = None) -> Acceptance:
    """Step 3: the causal choices (logits: float32 [b, B+1, vocab], row j the causal logits before
    draft position j — the pending row's, then the verification rows'), the accepted run and what
    the round emits, cut after the first EOS and at max_new_tokens. draft_limit: int32 [b], the
    most drafts a sequence may accept (a grammar's cut), or None."""
    batch, size = drafts.shape
    choices = causal_choices(logits, drafts, counts, lengths, prompt_thinking, controls, ids)
    accepted = jnp.sum(jnp.cumprod((drafts == choices[:, :size]).astype(jnp.int32), axis=1), axis=1)
    if draft_limit is not None:
        accepted = jnp.minimum(accepted, draft_limit)
    offsets = jnp.arange(size + 1)
    is_eos = jnp.any(choices[..., None] == ids.eos, axis=-1) & (offsets <= accepted[:, None])
    through_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, size + 1)
    emitted = jnp.minimum(jnp.minimum(accepted + 1, through_eos), max_new_tokens - lengths)
    emitted = jnp.where(active, emitted, 0)
    written = offsets[None, :] < emitted[:, None]                                     # [b, B+1]
    counts = counts.at[jnp.arange(batch)[:, None], choices].add(written.astype(jnp.int32))
    new_lengths = lengths + emitted
    finished = active & ((through_eos <= emitted) | (new_lengths >= max_new_tokens))
    return Acceptance(choices, accepted, emitted, counts, new_lengths, finished)


class Drafted(NamedTuple):
    """Step 1 of a round: the drafts and the state they were drafted on ([b] unless noted)."""

    model: ModelState            # the pending token appended
    drafts: jax.Array            # int32 [b, B]
    pending_logits: jax.Array    # float32 [b, 1, vocab]: the causal logits before the first draft
    distinct_experts: jax.Array  # float32: of the draft pass, mean over layers (zeros unless collected)


def draft_round(passes: ModelPasses, params: Any, size: int, coreset: bool, coreset_top_p: jax.Array,
                controls: Controls, ids: TokenIds, prompt_thinking: jax.Array, *, model: ModelState,
                pending: jax.Array, counts: jax.Array, lengths: jax.Array,
                distinct_experts: bool = False) -> Drafted:
    """Step 1: the pending token's row appended and the masked block denoised into drafts."""
    batch = pending.shape[0]
    masks = jnp.full((batch, size), ids.mask, jnp.int32)
    # the pending token's row (appended) and its logits, then the masked block's
    draft = passes.commit_and_denoise(params, pending[:, None], masks, model, coreset=coreset,
                                      coreset_top_p=coreset_top_p, committed_logits=True,
                                      distinct_experts=distinct_experts)
    drafts = draft_tokens(draft.logits[:, 1:], counts, lengths, prompt_thinking, controls, ids)
    distinct = (jnp.mean(draft.distinct_experts.astype(jnp.float32), axis=0) if distinct_experts
                else jnp.zeros((batch,), jnp.float32))
    return Drafted(draft.state, drafts, draft.logits[:, :1], distinct)


def verify_round(passes: ModelPasses, params: Any, size: int, controls: Controls, ids: TokenIds,
                 prompt_thinking: jax.Array, *, drafted: Drafted, model: ModelState, counts: jax.Array,
                 lengths: jax.Array, max_new_tokens: jax.Array, active: jax.Array,
                 allowed: jax.Array | None = None, draft_limit: jax.Array | None = None) -> RoundOutcome:
    """Steps 2-4: verify the drafts in one causal pass, accept, and roll back. model: the state the
    round started from (frozen for sequences not active); allowed: bool [b, B+1, vocab], row j the
    tokens a grammar takes before draft position j (logits outside it at -inf), or None;
    draft_limit: the drafts the grammar takes (`accept_drafts`)."""
    drafts = drafted.drafts
    verify = passes.recording_causal(params, drafts, drafted.model)
    logits = jnp.concatenate([drafted.pending_logits, verify.logits], axis=1)  # row j: before position j
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    out = accept_drafts(logits, drafts, counts, lengths, prompt_thinking, controls, ids,
                        max_new_tokens=max_new_tokens, active=active, draft_limit=draft_limit)
    rolled = passes.rolled_back(verify.state, jnp.where(active, out.accepted, 0), size)
    rolled = rolled._replace(length=jnp.where(active, rolled.length, model.length))  # not active: frozen
    next_pending = jnp.take_along_axis(out.choices, out.accepted[:, None], axis=1)[:, 0]
    return RoundOutcome(model=rolled, pending=next_pending, choices=out.choices, emitted=out.emitted,
                        counts=out.counts, lengths=out.lengths, finished=out.finished, drafts=drafts,
                        accepted=out.accepted, distinct_experts=drafted.distinct_experts)


def speculative_round(passes: ModelPasses, params: Any, size: int, coreset: bool, coreset_top_p: jax.Array,
                      controls: Controls, ids: TokenIds, prompt_thinking: jax.Array, *, max_new_tokens: jax.Array,
                      model: ModelState, pending: jax.Array, counts: jax.Array, lengths: jax.Array,
                      active: jax.Array, distinct_experts: bool = False) -> RoundOutcome:
    """Draft, verify, accept and roll back (the module docstring's steps 1–4) for every sequence at
    once; each at its own fill (`model.length` int32 [b]). controls: one for the batch (scalars)
    or one per sequence ([b] arrays). The draft pass's distinct experts are collected only with
    `distinct_experts` (zeros otherwise)."""
    drafted = draft_round(passes, params, size, coreset, coreset_top_p, controls, ids, prompt_thinking, model=model,
                          pending=pending, counts=counts, lengths=lengths, distinct_experts=distinct_experts)
    return verify_round(passes, params, size, controls, ids, prompt_thinking, drafted=drafted, model=model,
                        counts=counts, lengths=lengths, max_new_tokens=max_new_tokens, active=active)


def _initial(passes: ModelPasses, params: Any, spec: SpeculativeSpec, prompts: LeftPadded) -> SpeculativeState:
    """The prefill of all but each prompt's last token (the first round's pending token)."""
    prompt_ids, start = prompts.prompt_ids, prompts.start
    batch, size = prompt_ids.shape[0], spec.block_size
    vocab, limit = passes.config.vocab_size, spec.max_new_tokens
    capacity = spec.prompt_length + spec.max_new_tokens + size
    model_state = passes.new_state(batch, capacity, start)
    _, model_state = passes.prefill(params, prompt_ids[:, :-1], model_state, chunk_size=spec.chunk_size)
    model_state = model_state._replace(length=jnp.broadcast_to(model_state.length, (batch,)))
    rounds = None
    if spec.trajectory:
        rounds = Rounds(jnp.zeros((batch, limit, size), jnp.int32), jnp.zeros((batch, limit), jnp.int32),
                        jnp.zeros((batch, limit), jnp.int32), jnp.zeros(batch, jnp.int32))
    has_prefill = (spec.prompt_length - start) > 1
    return SpeculativeState(model=model_state, pending=prompt_ids[:, -1],
                            tokens=jnp.zeros((batch, limit), jnp.int32), counts=jnp.zeros((batch, vocab), jnp.int32),
                            finished=jnp.zeros(batch, bool), lengths=jnp.zeros(batch, jnp.int32),
                            nfe=has_prefill.astype(jnp.int32),
                            distinct_experts=jnp.zeros((batch, limit), jnp.float32), rounds=rounds,
                            round=jnp.int32(0))


def _record_round(spec: SpeculativeSpec, s: SpeculativeState, out: RoundOutcome, active: jax.Array) -> SpeculativeState:
    """The loop state after a round: its emitted tokens written, the round recorded."""
    batch, size, limit = s.pending.shape[0], spec.block_size, spec.max_new_tokens
    offsets = jnp.arange(size + 1)
    written = offsets[None, :] < out.emitted[:, None]                                 # [b, B+1]
    columns = jnp.where(written, s.lengths[:, None] + offsets, limit)                 # past the end: dropped
    tokens = s.tokens.at[jnp.arange(batch)[:, None], columns].set(out.choices, mode="drop")
    distinct = s.distinct_experts.at[:, s.round].set(jnp.where(active, out.distinct_experts, 0.0))
    rounds = s.rounds
    if spec.trajectory:
        at = jnp.where(active, s.round, limit)  # finished sequences: dropped
        put = lambda buffer, value: buffer.at[jnp.arange(batch), at].set(value, mode="drop")
        rounds = Rounds(put(rounds.drafts, out.drafts), put(rounds.accepted, out.accepted),
                        put(rounds.emitted, out.emitted), rounds.num_rounds + active)
    return SpeculativeState(model=out.model, pending=out.pending, tokens=tokens, counts=out.counts,
                            finished=s.finished | out.finished, lengths=out.lengths, nfe=s.nfe + 2 * active,
                            distinct_experts=distinct, rounds=rounds, round=s.round + 1)


@persistent_jit(static_argnames=("passes", "spec"))
def run_self_speculative(passes: ModelPasses, params: Any, spec: SpeculativeSpec, prompts: LeftPadded,
                         coreset_top_p: jax.Array, controls: Controls, ids: TokenIds) -> SpeculativeResults:
    """Prefill, then draft / verify / roll back rounds until every sequence is finished: one program.

    prompts: the left-padded prompts (`decoding.autoregressive.LeftPadded`); coreset_top_p: float32 [];
    passes: the model's pass interface (`CloverModel.passes`); params: in the layout it runs with.
    """
    def one_round(s: SpeculativeState) -> SpeculativeState:
        active = ~s.finished
        out = speculative_round(passes=passes, params=params, size=spec.block_size, coreset=spec.coreset,
                                coreset_top_p=coreset_top_p, controls=controls, ids=ids,
                                prompt_thinking=prompts.prompt_thinking, max_new_tokens=prompts.max_new_tokens,
                                model=s.model, pending=s.pending, counts=s.counts, lengths=s.lengths, active=active)
        return _record_round(spec, s, out, active)

    final = jax.lax.while_loop(lambda s: ~jnp.all(s.finished) & (s.round < spec.max_new_tokens), one_round,
                               _initial(passes, params, spec, prompts))
    return results_of(final)


def results_of(final: SpeculativeState) -> SpeculativeResults:
    return SpeculativeResults(final.tokens, final.lengths, final.nfe, final.distinct_experts, final.rounds)


# ---------------------------------------------------------------------- rounds under a grammar
@persistent_jit(static_argnames=("passes", "spec"))
def start_speculative(passes: ModelPasses, params: Any, spec: SpeculativeSpec, prompts: LeftPadded) -> SpeculativeState:
    """The prefill (host-driven rounds: the host's grammar cuts each round's drafts and masks its choices)."""
    return _initial(passes, params, spec, prompts)


@persistent_jit(static_argnames=("passes", "spec"))
def draft_step(passes: ModelPasses, params: Any, spec: SpeculativeSpec, prompts: LeftPadded,
               coreset_top_p: jax.Array, controls: Controls, ids: TokenIds, state: SpeculativeState) -> Drafted:
    """Step 1 of every sequence's round."""
    return draft_round(passes, params, spec.block_size, spec.coreset, coreset_top_p, controls, ids,
                       prompts.prompt_thinking, model=state.model, pending=state.pending, counts=state.counts,
                       lengths=state.lengths, distinct_experts=True)


@persistent_jit(static_argnames=("passes", "spec"), donate_argnames=("state",))
def verify_step(passes: ModelPasses, params: Any, spec: SpeculativeSpec, prompts: LeftPadded,
                controls: Controls, ids: TokenIds, state: SpeculativeState, *, drafted: Drafted,
                allowed: jax.Array, draft_limit: jax.Array) -> SpeculativeState:
    """Steps 2-4 of every sequence's round under the host's grammar (`verify_round`'s allowed and draft_limit)."""
    active = ~state.finished
    out = verify_round(passes, params, spec.block_size, controls, ids, prompts.prompt_thinking, drafted=drafted,
                       model=state.model, counts=state.counts, lengths=state.lengths,
                       max_new_tokens=prompts.max_new_tokens, active=active, allowed=allowed,
                       draft_limit=draft_limit)
    return _record_round(spec, state, out, active)
