"""`generate`'s three modes under a grammar: host-driven loops around the jitted steps.

The grammar lives on the host (llguidance), so a constrained decode is one compiled call per
step instead of one program for the whole decode, and the grammar's masks enter each call as
data (bool [b, V] or [b, B+1, V]; no program per grammar):

  * autoregressive: each next token's logits outside the allowed set are -inf before the
    controls and the choice (`decoding.autoregressive.autoregressive_step`);
  * self-speculative: a round's drafts are checked in order and the first the grammar refuses
    ends the draft (the round accepts at most the drafts before it); the verification's choices
    are masked as autoregressive decoding masks them (`decoding.speculative.verify_step`);
  * diffusion: the schedule proposes on the unmasked confidences (the frontier's candidate is
    masked), and `decoding.constraints.commit_rule` decides which commits stand
    (`decoding.block_loop.propose_step` / `apply_proposal`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import jax
import numpy as np

from decoding.autoregressive import autoregressive_step, start_autoregressive
from decoding.block_loop import apply_proposal, propose_step, results, start_prefill
from decoding.constraints.commit_rule import BlockGrammar, Proposal
from decoding.constraints.matcher import GrammarMatcher
from decoding.layouts import LoopCall
from decoding.speculative import draft_step, results_of, start_speculative, verify_step
from decoding.streaming import BlockReporter


class Trace:
    """What a constrained decode measured on the host: steps and the seconds the grammar took."""

    def __init__(self):
        self.steps = 0
        self.grammar_seconds = 0.0
        self.options: dict[str, int] = {}  # diffusion: how often each option of the commit rule stood

    @property
    def grammar_seconds_per_step(self) -> float:
        return self.grammar_seconds / max(self.steps, 1)

    @contextlib.contextmanager
    def grammar(self):
        """Time the host's grammar work inside the block."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.grammar_seconds += time.perf_counter() - started


# ---------------------------------------------------------------------- autoregressive
def autoregressive(call: LoopCall, matchers: Sequence[GrammarMatcher], trace: Trace):
    """(tokens [b, N], generated [b], NFE [b]) as `run_autoregressive` returns them."""
    passes, params, spec, prompts, key, controls, ids = call.args
    vocab = passes.config.vocab_size
    state = start_autoregressive(passes, params, spec, prompts)
    finished = np.zeros(len(matchers), bool)
    first = True
    while True:
        with trace.grammar():
            allowed = np.stack([np.ones(vocab, bool) if done else matcher.allowed()
                                for matcher, done in zip(matchers, finished, strict=True)])
        state = autoregressive_step(passes, params, spec, prompts, key, controls, ids, state, allowed=allowed,
                                    forward=not first)
        first = False
        trace.steps += 1
        token, now_finished, index = jax.device_get((state.token, state.finished, state.index))
        with trace.grammar():
            for i, matcher in enumerate(matchers):
                if not finished[i]:
                    matcher.consume([token[i]])
        finished = now_finished
        if finished.all() or index >= spec.max_new_tokens:
            return jax.device_get((state.tokens, state.lengths, state.nfe))


# ---------------------------------------------------------------------- self-speculative
def self_speculative(call: LoopCall, matchers: Sequence[GrammarMatcher], trace: Trace):
    """The final `SpeculativeResults`, as `run_self_speculative` returns them."""
    passes, params, spec, prompts, coreset_top_p, controls, ids = call.args
    vocab, size = passes.config.vocab_size, spec.block_size
    state = start_speculative(passes, params, spec, prompts)
    while True:
        drafted = draft_step(passes, params, spec, prompts, coreset_top_p, controls, ids, state)
        drafts, finished, lengths = jax.device_get((drafted.drafts, state.finished, state.lengths))
        allowed = np.ones((len(matchers), size + 1, vocab), bool)
        limit = np.full(len(matchers), size, np.int32)
        with trace.grammar():
            for i, matcher in enumerate(matchers):
                if not finished[i]:
                    limit[i] = draft_masks(matcher, drafts[i], allowed[i])
        state = verify_step(passes, params, spec, prompts, controls, ids, state, drafted=drafted, allowed=allowed,
                            draft_limit=limit)
        trace.steps += 1
        tokens, new_lengths, now_finished, rounds = jax.device_get(
            (state.tokens, state.lengths, state.finished, state.round))
        with trace.grammar():
            for i, matcher in enumerate(matchers):
                if not finished[i]:
                    matcher.consume(tokens[i, lengths[i]:new_lengths[i]])
        if now_finished.all() or rounds >= spec.max_new_tokens:
            return jax.device_get(results_of(state))


def draft_masks(matcher: GrammarMatcher, drafts: np.ndarray, allowed: np.ndarray) -> int:
    """Fill allowed[j] (bool [B+1, V]) with the tokens the grammar takes after drafts[:j], for j up
    to the drafts it takes; returns how many it takes (the rows past them stay all ones)."""
    taken = matcher.accepts(drafts)
    before = matcher.consumed
    allowed[0] = matcher.allowed()
    for j in range(taken):
        matcher.consume([drafts[j]])
        allowed[j + 1] = matcher.allowed()
    matcher.rollback(matcher.consumed - before)
    return taken


# ---------------------------------------------------------------------- diffusion
def diffusion(call: LoopCall, grammars: Sequence[BlockGrammar], trace: Trace, *,
              reporter: BlockReporter | None = None, on_step: Callable[[dict], None] | None = None):
    """The final block-loop `Results`, as `run_block_decoder` returns them."""
    passes, params, spec, request, controls, ids = call.args
    vocab, size = passes.config.vocab_size, spec.block_size
    batch = len(grammars)
    response_base = np.asarray(request.response_base)
    max_new = np.asarray(request.max_new_tokens)

    def open_blocks(block_number: int) -> None:
        for i, grammar in enumerate(grammars):
            first = response_base[i] + block_number * size  # response index of the block's row 0
            grammar.open_block(size, lo=max(0, -first), hi=max_new[i] - first)

    state = start_prefill(passes, params, spec, request, controls, ids, track_steps=on_step is not None)
    open_blocks(0)
    block_number, commit = 0, False
    while True:
        block, decided, fixed, step, finished, open_ = jax.device_get(
            (state.progress.block, state.progress.decided, state.progress.fixed, state.progress.step,
             state.progress.finished, state.progress.open))
        if commit:  # the call commits the decided blocks and proposes on fresh ones
            block, decided = np.full_like(block, ids.mask), np.zeros_like(decided)
            fixed, step, open_ = np.zeros_like(fixed), np.zeros_like(step), ~finished
        active = open_ & ~finished
        frontier = np.full(batch, -1, np.int32)
        allowed = np.ones((batch, vocab), bool)
        with trace.grammar():
            for i, grammar in enumerate(grammars):
                if active[i]:
                    frontier[i] = grammar.frontier(decided[i])
                    if frontier[i] >= 0:
                        allowed[i] = grammar.allowed()
        state, proposed = propose_step(passes, params, spec, request, controls, ids, state, frontier=frontier,
                                       allowed=allowed, commit=commit)
        candidates, after, edit, frontier_token = (np.array(a) for a in jax.device_get(
            (proposed.choice.token, proposed.decision.decided, proposed.decision.edit, proposed.frontier_token)))
        with trace.grammar():
            capped = step + 1 >= spec.steps_cap  # the host fills at the cap, as the grammar lets it
            for i, grammar in enumerate(grammars):
                if not active[i]:
                    continue
                wanted = np.ones(size, bool) if capped[i] else after[i] | fixed[i]
                edits = edit[i] & decided[i] & wanted & ~fixed[i] & (candidates[i] != block[i])
                verdict = grammar.vet(Proposal(block=block[i], decided=decided[i], candidates=candidates[i],
                                               frontier_token=int(frontier_token[i]), after=wanted, edit=edits))
                trace.options[verdict.option] = trace.options.get(verdict.option, 0) + 1
                candidates[i], after[i], edit[i] = verdict.tokens, verdict.after, verdict.edit
        proposed = proposed._replace(choice=proposed.choice._replace(token=candidates),
                                     decision=proposed.decision._replace(decided=after, edit=edit))
        state = apply_proposal(passes, params, spec, request, controls, ids, state, proposed)
        trace.steps += 1
        if on_step is not None:
            on_step(jax.device_get(state.last_step))
        finished, open_ = jax.device_get((state.progress.finished, state.progress.open))
        commit = bool((~open_ | finished).all())
        if reporter is not None and commit:
            closed = np.asarray(jax.device_get(state.steps_per_block[:, block_number])) > 0
            reporter.report(block_number, np.asarray(jax.device_get(state.tokens[:, block_number])), closed)
        if finished.all():
            return jax.device_get(results(state))
        if commit:
            block_number += 1
            open_blocks(block_number)
