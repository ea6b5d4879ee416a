"""A held request on the host: where it stands, what it runs in the next pass, and what the pass's
decisions mean for it.

Every request held by the engine has a slot. It first *prefills* its causal prefix (docs/design.md
§4, §8: the prompt's whole blocks for diffusion, every prompt token for autoregressive decoding,
all but the pending last one for self-speculative decoding), in chunks the engine's token budget
allows, then *decodes*. In each pass a slot runs one `clover_jax.core.ragged.SlotWork`: its causal
rows (a prefill chunk, a closed block's commit, the latest token, the pending tokens of a
self-speculative round, or a round's verification rows) and then its block (a denoising step's
block, or a round's drafted block). The pass that ends a prefill also takes the first decoding
work, so a prompt's last chunk and its first block ride together.

Each request decodes exactly what `generate` decodes for it alone (the same steps, through the
same step functions), and its figures are counted as `generate` counts them: NFE is the prefill
(one, however many chunks; none without a causal prefix) plus one per denoising step
(diffusion), one per forward after the first token (autoregressive) or two per round
(self-speculative); a fused commit and denoising step counts once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from clover_jax.core.ragged import SlotWork
from decoding.engine.requests import PreparedRequest
from decoding.modes import Mode, strategy
from decoding.streaming import response_slice


@dataclasses.dataclass
class Outcome:
    """What one pass did for one request: tokens to report, and the finish reason if it ended."""

    tracked: "Tracked"
    tokens: list[int]
    finish: str | None
    logprobs: list | None = None  # diffusion, when the request asked: one (logprob, top ids, top logprobs) per token


@dataclasses.dataclass
class Tracked:
    """A request the engine holds (or queues), on the host."""

    number: int
    prepared: PreparedRequest
    listener: Any
    emitted: int = 0                    # response tokens reported
    nfe: int = 0
    steps_per_block: list = dataclasses.field(default_factory=list)
    done: bool = False                  # its last event was delivered
    cached: int = 0                     # prompt tokens restored from the prefix cache
    boundary: Any = None                # with a prefix cache: `prefix_cache.Boundary`
    slot: int | None = None             # its slot, once admitted
    pages: list = dataclasses.field(default_factory=list)  # the slot's pages, page i holding positions [iP, (i+1)P)
    reserved: int = 0                   # pages reserved for it in the pool
    filled: int = 0                     # positions its slot's state holds
    store_at: int = 0                   # prefix cache: keep the state once this many positions are filled (0: no)
    decoding: bool = False              # its prefill is done
    # diffusion
    block: list | None = None           # its current block as the device holds it
    commits: bool = False               # its block closed: the next pass commits it
    blocks: int = 0                     # blocks closed
    block_grammar: Any = None           # under a constraint: its `BlockGrammar`
    grammar_block: int = -1             # the block the grammar has open
    # autoregressive (the latest token) and self-speculative (the tokens emitted since the state's end)
    pending: list = dataclasses.field(default_factory=list)
    verifying: bool = False             # self-speculative: its drafts wait for the verification pass
    drafts: list = dataclasses.field(default_factory=list)
    response: list = dataclasses.field(default_factory=list)  # response tokens reported
    # what the last pass ran for it (set by `plan`, read by the engine after the pass)
    ran_prefill: int = 0
    ran_decode: bool = False
    starts: bool = False                # the pass ends its prefill: its decoding starts

    @property
    def mode(self) -> Mode:
        return self.prepared.mode

    @property
    def block_size(self) -> int:
        return self.prepared.config.block_size

    @property
    def prefix(self) -> list[int]:
        """The tokens it runs causally before decoding (docs/design.md §4, §8)."""
        return self.prepared.prompt[:strategy(self.mode).prefix_length(len(self.prepared.prompt), self.block_size)]

    def first_nfe(self) -> int:
        """The forward passes `generate` counts for its prefill."""
        prompt = len(self.prepared.prompt)
        if self.mode == Mode.DIFFUSION:
            return int(prompt >= self.block_size)
        if self.mode == Mode.SELF_SPECULATIVE:
            return int(prompt > 1)
        return 1


def decode_work(tracked: Tracked, mask: int) -> tuple[list[int], list[int], bool, list[int]]:
    """(causal tokens, block tokens, whether the causal rows write, logit rows as indices into
    causal + block) of a decoding request's next pass."""
    if tracked.mode == Mode.DIFFUSION:
        size = tracked.block_size
        causal = list(tracked.block) if tracked.commits else []
        block = [mask] * size if tracked.commits else list(tracked.block)
        return causal, block, True, list(range(len(causal), len(causal) + size))
    if tracked.mode == Mode.AUTOREGRESSIVE:
        return list(tracked.pending), [], True, [len(tracked.pending) - 1]
    size = tracked.block_size
    if tracked.verifying:
        return list(tracked.drafts), [], False, list(range(size))
    run = list(tracked.pending)
    return run, [mask] * size, True, [len(run) - 1] + list(range(len(run), len(run) + size))


def plan(tracked: Tracked, *, budget: int, prefill_budget: int, mask: int) -> SlotWork | None:
    """The request's work in the next pass (None: nothing fits): at most `prefill_budget` prompt
    tokens of its prefill and `budget` tokens in all. Notes what it runs on `tracked` (`ran_prefill`,
    `ran_decode`, `starts`). A prefill chunk stops at the prefix cache's store point (`store_at`),
    and the pass that ends the prefill also runs the first decoding work if it fits — unless that
    work appends rows to a state the cache is to keep as the prefill left it."""
    tracked.ran_prefill, tracked.ran_decode, tracked.starts = 0, False, False
    causal = []
    if not tracked.decoding:
        prefix = tracked.prefix
        end = tracked.store_at if tracked.store_at > tracked.filled else len(prefix)
        causal = list(prefix[tracked.filled:min(end, tracked.filled + prefill_budget, tracked.filled + budget)])
        tracked.ran_prefill = len(causal)
        if tracked.filled + len(causal) < len(prefix):
            return SlotWork(tracked.slot, tracked.filled, tuple(causal)) if causal else None
        tracked.decoding = tracked.starts = True  # undone by `unplan` when the pass does not run
        if tracked.mode == Mode.AUTOREGRESSIVE:
            # the prompt's last row gives the first token (a prompt always has a token to prefill)
            tracked.ran_decode = True
            return SlotWork(tracked.slot, tracked.filled, tuple(causal), logit_rows=(len(causal) - 1,))
    more, block, writes, logits = decode_work(tracked, mask)
    keeps_prefill = bool(causal and more) and tracked.store_at == tracked.filled + len(causal)
    if len(causal) + len(more) + len(block) > budget or keeps_prefill:
        if tracked.starts:
            tracked.decoding = tracked.starts = False
        return SlotWork(tracked.slot, tracked.filled, tuple(causal)) if causal else None
    tracked.ran_decode = True
    offset = len(causal)
    return SlotWork(tracked.slot, tracked.filled, tuple(causal + more), tuple(block), writes,
                    tuple(offset + row for row in logits))


def unplan(tracked: Tracked) -> None:
    """Forget a plan whose pass did not run."""
    if tracked.starts:
        tracked.decoding = False
    tracked.ran_prefill, tracked.ran_decode, tracked.starts = 0, False, False


def diffusion_outcome(tracked: Tracked, *, closing: bool, finished: bool, block: np.ndarray, steps: int,
                      scores, eos: frozenset) -> Outcome | None:
    """After a denoising step of the request's block: its block, and on closing the block's
    response tokens (and their log-probabilities when asked for)."""
    tracked.block = [int(token) for token in block]
    tracked.nfe += 1
    tokens, finish, logprobs = [], None, None
    if closing:
        size = tracked.block_size
        prompt = len(tracked.prepared.prompt)
        first_row = prompt % size if tracked.blocks == 0 else 0
        tokens, _ = response_slice(block, first_row, tracked.prepared.max_new_tokens - tracked.emitted, eos)
        tracked.blocks += 1
        tracked.steps_per_block.append(int(steps))
        top = tracked.prepared.logprobs
        if top is not None:
            logprob, top_ids, top_values = scores
            rows = range(first_row, first_row + len(tokens))
            logprobs = [(float(logprob[r]), top_ids[r, :top].tolist(), top_values[r, :top].tolist()) for r in rows]
        tracked.commits = not finished
    if finished:
        finish = "eos" if tokens and tokens[-1] in eos else "length"
    return Outcome(tracked, tokens, finish, logprobs) if tokens or finish else None


def autoregressive_outcome(tracked: Tracked, *, token: int, finished: bool, eos: frozenset) -> Outcome:
    tracked.pending = [token]
    tracked.steps_per_block.append(1)
    if not finished:
        tracked.nfe += 1  # the forward of this token, which the next pass runs
    return Outcome(tracked, [token], ("eos" if token in eos else "length") if finished else None)


def verified_outcome(tracked: Tracked, *, choices: np.ndarray, emitted: int, finished: bool,
                     eos: frozenset) -> Outcome:
    tokens = [int(token) for token in choices[:emitted]]
    tracked.pending, tracked.verifying, tracked.drafts = tokens, False, []
    tracked.steps_per_block.append(1)
    tracked.nfe += 1
    finish = ("eos" if tokens and tokens[-1] in eos else "length") if finished else None
    return Outcome(tracked, tokens, finish)
