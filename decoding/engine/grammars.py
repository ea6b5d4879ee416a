"""The engine's decisions under constraints: each request's grammar on the host, its masks as data.

A request under `GenerationConfig.constraint` carries its `GrammarMatcher` (compiled when it was
prepared). Before an autoregressive decision the engine reads each constrained slot's allowed
tokens (bool [S, V]; every token for the other slots), before a verification the allowed tokens
along the slot's drafts and how many drafts its grammar takes; the engine then consumes what the
decision emitted. A denoising step with a constrained slot runs as `decide_diffusion` split around
the host: `propose_diffusion`, the commit rule (`decoding.constraints.commit_rule.BlockGrammar.vet`)
for each constrained slot, then `apply_diffusion`. A decision without a constrained slot is the
unconstrained program itself.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from decoding.constraints.commit_rule import BlockGrammar, Proposal
from decoding.constraints.drivers import draft_masks
from decoding.engine import decisions
from decoding.engine.work import Tracked


# Each returns the decision's arguments after its common ones: none where no slot has a grammar, so
# that such a decision is the very program the engine precompiled (an argument given as None would
# be another).
def next_token_masks(chosen: Sequence[Tracked], slots: int, vocab: int) -> tuple[np.ndarray, ...]:
    """(allowed bool [S, V],): the tokens each constrained slot's grammar takes next; () if none has one."""
    constrained = [t for t in chosen if t.prepared.grammar is not None]
    if not constrained:
        return ()
    allowed = np.ones((slots, vocab), bool)
    for tracked in constrained:
        allowed[tracked.slot] = tracked.prepared.grammar.allowed()
    return (allowed,)


def verification_masks(chosen: Sequence[Tracked], slots: int, vocab: int, size: int) -> tuple[np.ndarray, ...]:
    """(allowed bool [S, B+1, V], draft_limit int32 [S]) of a verification: row j the tokens each
    grammar takes after the slot's first j drafts, as far as it takes them; () if no slot has a grammar."""
    constrained = [t for t in chosen if t.prepared.grammar is not None]
    if not constrained:
        return ()
    allowed = np.ones((slots, size + 1, vocab), bool)
    limit = np.full(slots, size, np.int32)
    for tracked in constrained:
        limit[tracked.slot] = draft_masks(tracked.prepared.grammar, np.asarray(tracked.drafts), allowed[tracked.slot])
    return allowed, limit


def block_grammar(tracked: Tracked) -> BlockGrammar:
    """The request's grammar open on its current block (block `tracked.blocks` of its response)."""
    prepared = tracked.prepared
    if tracked.block_grammar is None:
        tracked.block_grammar = BlockGrammar(prepared.grammar, prepared.config.constraint_gap_rule)
    if tracked.grammar_block != tracked.blocks:
        size = tracked.block_size
        first = tracked.blocks * size - len(prepared.prompt) % size  # response index of the block's row 0
        tracked.block_grammar.open_block(size, lo=max(0, -first), hi=prepared.max_new_tokens - first)
        tracked.grammar_block = tracked.blocks
    return tracked.block_grammar


def diffusion_step(chosen: Sequence[Tracked], passes, params: Any, structure, hidden: jax.Array, active: np.ndarray,
                   committed: np.ndarray, ids, *, mask_id: int, vocab: int, block_size: int, sample: bool,
                   scores: bool):
    """`decisions.decide_diffusion` (same arguments, same results) for a group of slots of which
    some decode under a grammar: the proposal, the grammars' verdicts, the step as they let it stand."""
    slots, size = active.shape[0], block_size
    frontier = np.full(slots, -1, np.int32)
    allowed = np.ones((slots, vocab), bool)
    for tracked in chosen:
        if tracked.prepared.grammar is None:
            continue
        grammar = block_grammar(tracked)
        decided = np.zeros(size, bool) if tracked.commits else np.asarray(tracked.block) != mask_id
        frontier[tracked.slot] = grammar.frontier(decided)
        if frontier[tracked.slot] >= 0:
            allowed[tracked.slot] = grammar.allowed()
    structure, proposed = decisions.propose_diffusion(passes, params, structure, hidden, active, committed, ids,
                                                      frontier=frontier, allowed=allowed, block_size=size,
                                                      sample=sample)
    proposed = jax.device_get(proposed)
    tokens, after, edit = (np.array(a) for a in (proposed.candidates, proposed.after, proposed.edit))
    for tracked in chosen:
        i = tracked.slot
        fixed, decided, block = proposed.fixed[i], proposed.decided[i], proposed.block[i]
        wanted = np.ones(size, bool) if proposed.capped[i] else after[i] | fixed  # the cap fills, as the rule lets it
        if tracked.prepared.grammar is None:
            after[i] = wanted
            continue
        edits = edit[i] & decided & wanted & ~fixed & (tokens[i] != block)
        verdict = block_grammar(tracked).vet(Proposal(block=block, decided=decided, candidates=tokens[i],
                                                      frontier_token=int(proposed.frontier_token[i]), after=wanted,
                                                      edit=edits))
        tokens[i], after[i], edit[i] = verdict.tokens, verdict.after, verdict.edit
    return decisions.apply_diffusion(passes, params, structure, hidden, active, ids, tokens=tokens, after=after,
                                     edit=edit, keep_open=proposed.keep_open, block_size=size, sample=sample,
                                     scores=scores)
