"""Which of a denoising step's commits a grammar lets stand (docs/structured_outputs.md).

A schedule commits positions of a block in any order; a grammar reads text left to right. The
rule here keeps one invariant: **some filling of the block's undecided positions makes every
decided token part of a text the grammar accepts as a prefix**, and it keeps a *witness* of it:
a token for every undecided position left of the last decided one. Each step the schedule
proposes fills (and, for editing schedules, edits and remasks); the first of these that keeps the
invariant is what the step does:

  a. the whole proposal, the undecided positions filled by this step's own candidates (the
     leftmost undecided position, the frontier, by its grammar-masked candidate);
  b. the proposal without its edits and remasks, and only the fills left of where (a) failed;
  c. only the frontier, filled by its masked candidate, the other gaps by the last witness;
  d. only the frontier, filled by the last witness's token (valid by the invariant).

So a step commits at least one token when the schedule asked for any (the frontier), and a block
always finishes. With `gap_rule="frontier"` a step's fills are first cut to the run that starts
at the frontier (no position past an undecided one is ever decided), the simpler rule measured
beside it. A block's positions outside the answer (the prompt's tail, past max_new_tokens, after
the answer's end-of-sequence token) are never checked.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from decoding.constraints.matcher import GrammarMatcher
from decoding.constraints.spec import GAP_RULES


class Proposal(NamedTuple):
    """One sequence's step, on the host. B = block size; bool/int arrays [B]."""

    block: np.ndarray            # int32: the block's tokens before the step (mask id where undecided)
    decided: np.ndarray          # bool: decided before the step
    candidates: np.ndarray       # int32: this step's candidate at each position
    frontier_token: int          # the frontier's candidate under the grammar's mask
    after: np.ndarray            # bool: what the schedule leaves decided (fills, kept, not remasked)
    edit: np.ndarray             # bool: decided positions the schedule replaces with their candidate


class Verdict(NamedTuple):
    """What the step does: `after` decided, each position's token (`tokens`), and which decided
    positions are edited; `option`: which of the rule's options (a-d) it is."""

    after: np.ndarray
    tokens: np.ndarray
    edit: np.ndarray
    option: str


class BlockGrammar:
    """The grammar's view of one sequence's current block. lo: the block's first position of the
    response (after the prompt's tail); hi: one past its last position within max_new_tokens. The
    matcher holds the answer's tokens up to the block's frontier (`prefix`)."""

    def __init__(self, matcher: GrammarMatcher, gap_rule: str = "witness"):
        if gap_rule not in GAP_RULES:
            raise ValueError(f"gap_rule must be one of {GAP_RULES}, got {gap_rule!r}")
        self.matcher = matcher
        self.gap_rule = gap_rule
        self.lo = self.hi = 0
        self.prefix: list[int] = []       # the block's tokens from lo that the matcher holds
        self.marks: list[int] = [0]       # marks[k]: the matcher's consumed count after prefix[:k]
        self.witness = np.zeros(0, np.int64)

    def open_block(self, size: int, lo: int, hi: int) -> None:
        """A new block: positions [lo, hi) are the answer's; none of it is held yet."""
        self.lo, self.hi = lo, max(lo, min(hi, size))
        self.prefix, self.marks = [], [self.matcher.consumed]
        self.witness = np.full(size, -1, np.int64)

    # ------------------------------------------------------------------ what the device needs
    def frontier(self, decided: np.ndarray) -> int:
        """The leftmost undecided position of the answer's span, or -1 (none, or the answer has ended)."""
        if self.matcher.ended:
            return -1
        open_ = np.flatnonzero(~decided[self.lo:self.hi])
        return self.lo + int(open_[0]) if open_.size else -1

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar takes at the frontier."""
        return self.matcher.allowed()

    # ------------------------------------------------------------------ the rule
    def vet(self, proposal: Proposal) -> Verdict:
        """The step the rule lets stand (the module's docstring); the matcher moves to the new frontier."""
        block, decided, candidates = proposal.block, proposal.decided, proposal.candidates
        size = len(block)
        span = np.zeros(size, bool)
        span[self.lo:self.hi] = True
        front = self.frontier(decided)
        after = proposal.after
        asked = bool((after & ~decided & span).any())
        if self.gap_rule == "frontier" and front >= 0:
            run = front
            while run < self.hi and after[run]:
                run += 1
            after = after & ~(span & ~decided & (np.arange(size) >= run))
        fills = after & ~decided
        gap = candidates.astype(np.int64)
        if front >= 0:
            gap[front] = proposal.frontier_token
        no_edit = np.zeros(size, bool)

        tokens = np.where(proposal.edit, gap, np.where(decided, block, gap))
        progressed = lambda verdict: not asked or bool((verdict.after & ~decided & span).any())
        verdict, failed_at = self._check(Verdict(after, tokens, proposal.edit, "a"))
        if verdict is not None and progressed(verdict):
            return self._settle(verdict)
        kept = np.where(decided, block, gap)
        if proposal.edit.any() or (~after & decided).any():  # without the edits and remasks
            verdict, failed_at = self._check(Verdict(decided | fills, kept, no_edit, "b"))
            if verdict is not None and progressed(verdict):
                return self._settle(verdict)
        early = fills & ~(span & (np.arange(size) >= failed_at))
        verdict, _ = self._check(Verdict(decided | early, kept, no_edit, "b"))
        if verdict is not None and (progressed(verdict) or front < 0):
            return self._settle(verdict)
        if front < 0:
            raise RuntimeError("the decided tokens no longer hold (a bug in the commit rule)")
        only_front = decided | (fills & ~span)
        only_front[front] = True
        witness = np.where(self.witness >= 0, self.witness, gap)
        for name, front_token in (("c", proposal.frontier_token), ("d", witness[front])):
            fill = witness.copy()
            fill[front] = front_token
            verdict, _ = self._check(Verdict(only_front, np.where(decided, block, fill), no_edit, name))
            if verdict is not None:
                return self._settle(verdict)
        raise RuntimeError("the grammar's witness no longer holds (a bug in the commit rule)")

    def _changed_from(self, verdict: Verdict) -> int:
        """The first held position (relative to lo) that the verdict edits or remasks, else len(prefix)."""
        held = slice(self.lo, self.lo + len(self.prefix))
        changed = np.flatnonzero((verdict.edit | ~verdict.after)[held])
        return int(changed[0]) if changed.size else len(self.prefix)

    def _rewind(self, keep: int) -> None:
        """Roll the matcher back to hold prefix[:keep]."""
        self.matcher.rollback(self.matcher.consumed - self.marks[keep])
        del self.prefix[keep:], self.marks[keep + 1:]

    def _hold(self, tokens) -> None:
        for token in tokens:
            self.matcher.consume([int(token)])
            self.prefix.append(int(token))
            self.marks.append(self.matcher.consumed)

    def _check(self, verdict: Verdict) -> tuple[Verdict | None, int]:
        """(the verdict, when the grammar takes every decided token of the answer's span with the
        undecided ones between them filled by the verdict's tokens, else None; where it failed)."""
        decided = np.flatnonzero(verdict.after[self.lo:self.hi])
        if not decided.size:
            return verdict, self.hi
        end = self.lo + int(decided[-1]) + 1
        keep = self._changed_from(verdict)
        start = self.lo + keep
        if end <= start:
            return verdict, self.hi
        held = self.prefix[keep:]
        self._rewind(keep)
        taken = self.matcher.accepts(verdict.tokens[start:end])
        self._hold(held)
        return (verdict, self.hi) if taken == end - start else (None, start + taken)

    def _settle(self, verdict: Verdict) -> Verdict:
        """Hold the verdict's tokens up to the new frontier; keep its gap tokens as the witness."""
        span = verdict.after[self.lo:self.hi]
        run = int(np.argmin(span)) if not span.all() else int(span.size)
        keep = min(self._changed_from(verdict), run)
        self._rewind(keep)
        self._hold(verdict.tokens[self.lo + keep:self.lo + run])
        decided = np.flatnonzero(span)
        last = self.lo + int(decided[-1]) if decided.size else self.lo
        positions = np.arange(len(verdict.after))
        self.witness = np.where(~verdict.after & (positions < last), verdict.tokens, -1)
        return verdict
