"""The engine's compiled programs: the ragged forward of a step, and the decisions that read it.

`forward` runs one ragged pass (`clover_jax.core.ragged`) over every slot's work of the step; its
shape is the padded token count alone. It returns the final hidden states of each slot's logit
rows ([S, W, hidden]: small, and of one shape whatever the pass). The decisions then apply the LM
head to the rows they read (a denoising step of block size B: each slot's first B) and turn the
logits into tokens, each with the function `generate`'s loops run, over every slot of the engine at
once and masked to the slots the decision is for (on a CPU, over the decision's slots alone when
it has one: `_on_active`):

| program                 | static             | what it decides                                        |
|-------------------------|--------------------|--------------------------------------------------------|
| `decide_diffusion`      | B, sample, scores  | a denoising step (`decoding.block_loop.denoising_step`) |
| `decide_autoregressive` | sample             | the next token (`decoding.autoregressive.next_tokens`)  |
| `decide_drafts`         | B                  | a self-speculative round's drafts                       |
| `decide_verified`       | B                  | the round's accepted run (`speculative.accept_drafts`)  |
| `propose_diffusion`     | B, sample          | under a grammar: a denoising step's proposal            |
| `apply_diffusion`       | B, sample, scores  | under a grammar: the proposal as the host vetted it     |

None of them holds the backbone's forward pass, so the programs that do are one per padded token
count, whatever the modes and block sizes served (docs/serving.md, "The engine's shapes"); and no
decision's shape depends on the pass's, so they are one per block size and variant.

The programs are plain `jax.jit` (JAX's persistent compilation cache keeps them across
processes) rather than `clover_jax.core.executable_cache.persistent_jit`, whose per-call work
(describing every argument's pytree) would be paid on every step.

Under a constraint the grammars live on the host and their masks enter as data: an autoregressive
or verification decision takes the allowed tokens per slot (no program per grammar; a decision
with no constrained slot takes None, its own variant), and a diffusion step with a constrained slot
is split in two around the host's commit rule (`decoding.constraints.commit_rule`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.passes import ModelPasses
from clover_jax.core.ragged import COMPACT_PLATFORMS, PagedBatch, PagedState, on_live, slots_first
from decoding.autoregressive import next_tokens
from decoding.block_loop import StepRules, apply_step, denoising_step, frontier_choice, propose
from decoding.controls import Choice, Controls, TokenIds, choose, per_sequence_axes, process_batch, truncates
from decoding.engine.slot_states import (
    MAX_TOP_LOGPROBS,
    SCHEDULES,
    AutoregressiveSlots,
    BlockScores,
    DiffusionSlots,
    SpeculativeSlots,
)
from decoding.schedules.view import Decision
from decoding.speculative import accept_drafts, draft_tokens


@functools.partial(jax.jit, static_argnames=("passes", "coreset"), donate_argnames=("state",))
def forward(passes: ModelPasses, params: Any, state: PagedState, token_ids: jax.Array, batch: PagedBatch,
            coreset_top_p: jax.Array, *, coreset: bool) -> tuple[jax.Array, PagedState]:
    """One ragged pass: (the hidden states of each slot's logit rows [S, W, hidden], the state after it)."""
    out = passes.ragged(params, token_ids, batch, state, coreset=coreset, coreset_top_p=coreset_top_p)
    return out.hidden, out.state


def per_slot_choice(controls: Controls, sampling: jax.Array, sample: bool):
    """choose(processed [S, rows, V], keys [S]) -> Choice [S, rows] for slots that each decode
    greedily or by sampling (`sampling`: bool [S]; `sample`: some slot samples, else every slot
    takes the greedy choice alone, and the sampling program is not compiled). controls: [S] each."""
    def choose_rows(processed, keys):
        greedy = jax.vmap(lambda rows: choose(rows, controls, False, None))(processed)
        if not sample:
            return greedy
        def sampled_rows(truncate: bool):
            return jax.vmap(lambda rows, key, c: choose(rows, c, True, key, truncate=truncate),
                            in_axes=(0, 0, per_sequence_axes(controls)))(processed, keys, controls)
        # decided here, over the sampling slots, not inside the vmap (where a condition is a select of both)
        cut = jnp.any(sampling & truncates(controls, processed.shape[-1]))
        sampled = jax.lax.cond(cut, lambda: sampled_rows(True),
                               lambda: sampled_rows(False))
        return jax.tree_util.tree_map(lambda g, s: jnp.where(sampling[:, None], s, g), greedy, sampled)
    return choose_rows


def _where_slots(active: jax.Array, new, old):
    """Per leaf (leading slot axis): `new` where `active` (bool [S]), else `old`."""
    def pick(a, b):
        return jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    return jax.tree_util.tree_map(pick, new, old)


def _on_active(passes: ModelPasses, active: jax.Array, decide, slots, *per_slot):
    """`decide(slots, *per_slot)` -> (slots, report), every leaf with a leading slot axis [S],
    run where the platform compacts (a CPU) on the `active` slots alone when one is (`on_live`:
    widths 1 and S in one program). A lone request's step then applies the LM head and its
    controls to its own rows rather than to every slot's (on the medium benchmark model, 16 slots:
    most of the step). Each slot's decision reads its own rows alone, so the active slots' results
    equal the full width's; the other slots keep their structure and their report entries are
    zeros (the host reads the active slots' alone)."""
    size = active.shape[0]
    order = slots_first(active)

    def at_width(width: int):
        if width == size:
            return decide(slots, *per_slot)
        index = order[:width]
        take = lambda tree: jax.tree_util.tree_map(lambda leaf: leaf[index], tree)
        part, report = decide(take(slots), *take(per_slot))
        after = jax.tree_util.tree_map(lambda full, leaf: full.at[index].set(leaf), slots, part)
        widened = jax.tree_util.tree_map(
            lambda leaf: jnp.zeros((size,) + leaf.shape[1:], leaf.dtype).at[index].set(leaf), report)
        return after, widened

    return on_live(jnp.sum(active, dtype=jnp.int32), size, at_width, compact=passes.platform in COMPACT_PLATFORMS)


class DiffusionReport(NamedTuple):
    """What the host reads after a denoising step (small: no logits)."""

    closing: jax.Array          # bool [S]: the slot's block closed in this step
    finished: jax.Array         # bool [S]
    block: jax.Array            # int32 [S, B]: the slot's block after the step
    steps: jax.Array            # int32 [S]: denoising steps of the current block
    logprob: jax.Array          # `BlockScores` of the block (None unless asked for)
    top_ids: jax.Array
    top_values: jax.Array


def _fresh_progress(slots: DiffusionSlots, active: jax.Array, committed: jax.Array, ids: TokenIds, size: int):
    """The active slots' blocks narrowed to `size`, a committed slot's next block all masks."""
    held = slots.progress
    narrow = lambda array: array[:, :size]
    progress = held._replace(block=narrow(held.block), decided=narrow(held.decided), fixed=narrow(held.fixed),
                             finished=held.finished | ~active)
    fresh = committed[:, None]
    return progress._replace(
        block=jnp.where(fresh, ids.mask, progress.block), decided=progress.decided & ~fresh,
        fixed=progress.fixed & ~fresh, block_index=progress.block_index + committed,
        step=jnp.where(committed, 0, progress.step), post_fill=jnp.where(committed, 0, progress.post_fill),
        open=progress.open | committed)


def _step_rules(slots: DiffusionSlots, active: jax.Array, ids: TokenIds, sample: bool,
                fill_at_cap: bool = True) -> StepRules:
    """The step's rules; an inactive slot's choice is discarded, so it is made greedily (a slot left by
    a request that sampled under top-p must not make the others' sampling sort the vocabulary)."""
    controls = slots.controls
    return StepRules(controls=controls, ids=ids, steps_cap=slots.steps_cap,
                     choose=per_slot_choice(controls, slots.sample & active, sample),
                     schedule=lambda view: jax.vmap(SCHEDULES)(view, slots.schedule), fill_at_cap=fill_at_cap)


def _kept(passes: ModelPasses, params: Any, slots: DiffusionSlots, hidden: jax.Array, active: jax.Array, *,
          before, progress, details, ids: TokenIds, size: int, scores: bool) -> tuple[DiffusionSlots, DiffusionReport]:
    """The step's `progress` (narrowed) written back into the active slots, with the log-probabilities
    of what it decided when asked (`scores`), and the host's report."""
    held = slots.progress
    narrow = lambda array: array[:, :size]
    progress = progress._replace(finished=jnp.where(active, progress.finished, held.finished))
    widen = lambda full, part: full.at[:, :size].set(part)
    updated = progress._replace(block=widen(held.block, progress.block), decided=widen(held.decided, progress.decided),
                                fixed=widen(held.fixed, progress.fixed))
    kept = slots.scores
    if scores:
        narrow_scores = BlockScores(*(narrow(leaf) for leaf in kept))
        block_logits = passes.head_logits(params, hidden[:, :size])
        recorded = _scored(before, slots.facts, block_logits, slots.controls, ids, details, narrow_scores)
        kept = BlockScores(*(widen(full, part) for full, part in zip(kept, recorded, strict=True)))
    slots = slots._replace(progress=_where_slots(active, updated, held),
                           scores=_where_slots(active, kept, slots.scores))
    report_scores = tuple(narrow(leaf) for leaf in slots.scores) if scores else (None, None, None)
    return slots, DiffusionReport(details.closing & active, slots.progress.finished,
                                  narrow(slots.progress.block), slots.progress.step, *report_scores)


@functools.partial(jax.jit, static_argnames=("passes", "block_size", "sample", "scores"), donate_argnames=("slots",))
def decide_diffusion(passes: ModelPasses, params: Any, slots: DiffusionSlots, hidden: jax.Array, active: jax.Array,
                     committed: jax.Array, ids: TokenIds, *, block_size: int, sample: bool,
                     scores: bool) -> tuple[DiffusionSlots, DiffusionReport]:
    """A denoising step of the `active` slots (bool [S]: diffusion requests of block size
    `block_size` whose block the pass ran), from their logit rows 0..B-1 (`hidden` [S, W, hidden],
    the pass's; the LM head is applied here, to those rows). `committed` (bool [S]):
    slots whose pass committed their closed block — they start their next block first, all masks.
    sample: some active slot samples; scores: some asks for log-probabilities."""
    def decide(slots, hidden, active, committed):
        progress = _fresh_progress(slots, active, committed, ids, block_size)
        block_logits = passes.head_logits(params, hidden[:, :block_size])              # [S, B, vocab]
        after, details = denoising_step(progress, slots.facts, block_logits, _step_rules(slots, active, ids, sample))
        return _kept(passes, params, slots, hidden, active, before=progress, progress=after, details=details,
                     ids=ids, size=block_size, scores=scores)
    return _on_active(passes, active, decide, slots, hidden, active, committed)


# ---------------------------------------------------------------------- a denoising step under grammars
class DiffusionProposal(NamedTuple):
    """A denoising step before its decision is applied, for the host's grammars to vet
    (`decoding.constraints.commit_rule`): the schedule's proposal on the unmasked confidences. [S, B]
    unless noted."""

    block: jax.Array             # int32: the block before the step (a committed slot's all masks)
    decided: jax.Array           # bool
    fixed: jax.Array             # bool: prompt-tail positions
    capped: jax.Array            # bool [S]: this step reaches the slot's step cap (every mask must be decided)
    candidates: jax.Array        # int32: each position's candidate
    after: jax.Array             # bool: the schedule's decided set after the step
    edit: jax.Array              # bool: decided positions it replaces by their candidate
    keep_open: jax.Array         # bool [S]
    frontier_token: jax.Array    # int32 [S]: the frontier's candidate if its grammar allows it, else the choice
    #                              among the tokens it allows


@functools.partial(jax.jit, static_argnames=("passes", "block_size", "sample"), donate_argnames=("slots",))
def propose_diffusion(passes: ModelPasses, params: Any, slots: DiffusionSlots, hidden: jax.Array,
                      active: jax.Array, committed: jax.Array, ids: TokenIds, *, frontier: jax.Array,
                      allowed: jax.Array, block_size: int, sample: bool) -> tuple[DiffusionSlots, DiffusionProposal]:
    """`decide_diffusion`'s step up to the schedule's proposal (the committed slots' fresh blocks
    are kept in `slots`); `apply_diffusion` applies it as the host vetted it. frontier: int32 [S],
    the position whose candidate `allowed` (bool [S, V]) masks (any value where it is all ones)."""
    def propose_step(slots, hidden, active, committed, frontier, allowed):
        progress = _fresh_progress(slots, active, committed, ids, block_size)
        block_logits = passes.head_logits(params, hidden[:, :block_size])
        rules = _step_rules(slots, active, ids, sample, fill_at_cap=False)
        processed, keys, choice, decision = propose(progress, slots.facts, block_logits, rules)
        frontier_token = frontier_choice(processed, choice, keys, rules, frontier=frontier, allowed=allowed)
        held = slots.progress
        widen = lambda full, part: full.at[:, :block_size].set(part)
        fresh = held._replace(block=widen(held.block, progress.block), decided=widen(held.decided, progress.decided),
                              fixed=widen(held.fixed, progress.fixed), block_index=progress.block_index,
                              step=progress.step, post_fill=progress.post_fill, open=progress.open)
        slots = slots._replace(progress=_where_slots(active, fresh, held))
        return slots, DiffusionProposal(
            block=progress.block, decided=progress.decided, fixed=progress.fixed,
            capped=progress.step + 1 >= slots.steps_cap, candidates=choice.token, after=decision.decided,
            edit=decision.edit, keep_open=jnp.broadcast_to(decision.keep_open, active.shape),
            frontier_token=frontier_token)
    return _on_active(passes, active, propose_step, slots, hidden, active, committed, frontier, allowed)


@functools.partial(jax.jit, static_argnames=("passes", "block_size", "sample", "scores"), donate_argnames=("slots",))
def apply_diffusion(passes: ModelPasses, params: Any, slots: DiffusionSlots, hidden: jax.Array, active: jax.Array,
                    ids: TokenIds, *, tokens: jax.Array, after: jax.Array, edit: jax.Array, keep_open: jax.Array,
                    block_size: int, sample: bool, scores: bool) -> tuple[DiffusionSlots, DiffusionReport]:
    """The proposed step as the host let it stand: `tokens` (int32 [S, B], the candidates as
    vetted), the decided set `after` and the edits `edit` (bool [S, B]), `keep_open` (bool [S]). No
    step fills every mask at the cap: the host's `after` does (for a slot without a grammar, as
    `decide_diffusion` would)."""
    def apply(slots, hidden, active, tokens, after, edit, keep_open):
        progress = _fresh_progress(slots, active, jnp.zeros_like(active), ids, block_size)
        rules = _step_rules(slots, active, ids, sample, fill_at_cap=False)
        zeros = jnp.zeros(tokens.shape, jnp.float32)
        choice = Choice(token=tokens, confidence=zeros, margin=zeros, entropy=zeros)
        decision = Decision(decided=after, edit=edit, keep_open=keep_open)
        stepped, details = apply_step(progress, slots.facts, choice, decision, rules)
        return _kept(passes, params, slots, hidden, active, before=progress, progress=stepped, details=details,
                     ids=ids, size=block_size, scores=scores)
    return _on_active(passes, active, apply, slots, hidden, active, tokens, after, edit, keep_open)


def _scored(before, facts, logits: jax.Array, controls: Controls, ids: TokenIds, details,
            kept: BlockScores) -> BlockScores:
    """`kept` with the positions this step filled or edited given the log-probability of their new
    token under the step's processed distribution (`process`, as `denoising_step` computed it from
    the same logits, counts and response indices) and the top K there."""
    size = before.block.shape[1]
    response_index = facts.response_base[:, None] + before.block_index[:, None] * size + jnp.arange(size)[None, :]
    processed = process_batch(logits, before.counts, response_index, facts.prompt_thinking, controls, ids)
    logp = jax.nn.log_softmax(processed, axis=-1)
    chosen = jnp.take_along_axis(logp, details.choice.token[..., None], axis=-1)[..., 0]
    values, indices = jax.lax.top_k(logp, MAX_TOP_LOGPROBS)
    new = details.filled | details.edited
    return BlockScores(jnp.where(new, chosen, kept.logprob), jnp.where(new[..., None], indices, kept.top_ids),
                       jnp.where(new[..., None], values, kept.top_values))


class AutoregressiveReport(NamedTuple):
    token: jax.Array            # int32 [S]: the token each active slot chose
    finished: jax.Array         # bool [S]: it was the slot's last


@functools.partial(jax.jit, static_argnames=("passes", "sample"), donate_argnames=("slots",))
def decide_autoregressive(passes: ModelPasses, params: Any, slots: AutoregressiveSlots, hidden: jax.Array,
                          active: jax.Array, ids: TokenIds, allowed: jax.Array | None = None, *,
                          sample: bool) -> tuple[AutoregressiveSlots, AutoregressiveReport]:
    """The next token of each `active` slot (bool [S]) from its logit row 0 (the last causal row
    of its pass: the prompt's last, or its latest token's). allowed: bool [S, V], each slot's
    grammar's tokens (logits outside it are -inf before the controls), or None (no slot has one)."""
    def decide(slots, hidden, active, allowed):
        controls = slots.controls
        logits = passes.head_logits(params, hidden[:, 0])
        if allowed is not None:
            logits = jnp.where(allowed, logits, -jnp.inf)
        token = next_tokens(logits=logits, counts=slots.counts, index=slots.generated,
                            prompt_thinking=slots.prompt_thinking, sequence_keys=slots.key, controls=controls,
                            ids=ids, choose_rows=per_slot_choice(controls, slots.sample & active, sample))
        generated = slots.generated + active
        finished = active & (jnp.any(token[:, None] == ids.eos[None, :], axis=-1)
                             | (generated >= slots.max_new_tokens))
        counts = slots.counts.at[jnp.arange(token.shape[0]), token].add(active.astype(jnp.int32))
        return slots._replace(counts=counts, generated=generated), AutoregressiveReport(token, finished)
    return _on_active(passes, active, decide, slots, hidden, active, allowed)


@functools.partial(jax.jit, static_argnames=("passes", "block_size"), donate_argnames=("slots",))
def decide_drafts(passes: ModelPasses, params: Any, slots: SpeculativeSlots, hidden: jax.Array, active: jax.Array,
                  ids: TokenIds, *, block_size: int) -> tuple[SpeculativeSlots, jax.Array]:
    """A self-speculative round's drafts (int32 [S, B]) for the `active` slots, from their logit
    rows: row 0 the pending token's (kept for the round's acceptance), rows 1..B the drafted block's."""
    def decide(slots, hidden, active):
        logits = passes.head_logits(params, hidden[:, :block_size + 1])
        drafts = draft_tokens(logits[:, 1:], slots.counts, slots.lengths, slots.prompt_thinking,
                              slots.controls, ids)
        held = slots.drafts
        new = slots._replace(drafts=held.at[:, :block_size].set(drafts), pending_logits=logits[:, 0])
        slots = _where_slots(active, new, slots)
        return slots, slots.drafts[:, :block_size]
    return _on_active(passes, active, decide, slots, hidden, active)


class VerifiedReport(NamedTuple):
    choices: jax.Array          # int32 [S, B+1]: the first `emitted` are the round's tokens
    emitted: jax.Array          # int32 [S]
    finished: jax.Array         # bool [S]


@functools.partial(jax.jit, static_argnames=("passes", "block_size"), donate_argnames=("slots",))
def decide_verified(passes: ModelPasses, params: Any, slots: SpeculativeSlots, hidden: jax.Array,
                    active: jax.Array, ids: TokenIds, allowed: jax.Array | None = None,
                    draft_limit: jax.Array | None = None, *,
                    block_size: int) -> tuple[SpeculativeSlots, VerifiedReport]:
    """The round's acceptance for the `active` slots, from the verification rows' logits (rows
    0..B-1) after the pending token's (kept by `decide_drafts`). Under grammars: allowed (bool
    [S, B+1, V], row j the tokens allowed after the first j drafts) and draft_limit (int32 [S], the
    drafts each grammar takes), or None."""
    def decide(slots, hidden, active, allowed, draft_limit):
        logits = passes.head_logits(params, hidden[:, :block_size])
        rows = jnp.concatenate([slots.pending_logits[:, None], logits], axis=1)
        if allowed is not None:
            rows = jnp.where(allowed, rows, -jnp.inf)
        out = accept_drafts(rows, slots.drafts[:, :block_size], slots.counts, slots.lengths, slots.prompt_thinking,
                            slots.controls, ids, max_new_tokens=slots.max_new_tokens, active=active,
                            draft_limit=draft_limit)
        slots = _where_slots(active, slots._replace(counts=out.counts, lengths=out.lengths), slots)
        return slots, VerifiedReport(out.choices, out.emitted, out.finished)
    return _on_active(passes, active, decide, slots, hidden, active, allowed, draft_limit)
