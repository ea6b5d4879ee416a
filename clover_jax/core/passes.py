"""The pass interface: the one way the decoders, `CloverModel` and training call the model.

Every forward of the model is one *pass* over a row of tokens at the end of a prefix state
(docs/design.md §3): its leading rows are causal (they append to the state), the rest are block
rows denoised against the state the causal rows leave. `ModelPasses` names the passes the
callers run, with named arguments:

| method               | causal rows          | block rows | logits of               | run by                          |
|----------------------|----------------------|------------|-------------------------|---------------------------------|
| `causal`             | all                  | none       | rows from `logits_from` | autoregressive steps, training  |
| `prefill`            | all, in chunks       | none       | all, the last or none   | decoders' prompts, `extend`     |
| `denoise`            | none                 | all        | every row               | denoising steps                 |
| `commit_and_denoise` | the committed tokens | the block  | the block's (or all)    | block commits, drafts, training |
| `recording_causal`   | all, recorded        | none       | every row               | self-speculative verification   |
| `ragged`             | each slot's segment  | each slot's | (hidden states)        | the serving engine's step       |

`ragged` runs the serving engine's step over a `clover_jax.core.ragged.PagedState` (K/V in pages,
GDN states in slots): every slot's causal segment, then its block, in one flat row of tokens. It
returns the final hidden states of the rows each slot needs logits of; `head_logits` turns them
into logits (the engine's decisions do, for the rows each decision reads).

The model side (`clover_jax.nn.model.TransformerPasses`) implements four primitives — `run` (one
pass, every argument named), `new_state`, `recording` and `rolled_back` — and holds what they
need. This module imports no Flax module, so the decoders depend on it and on the core only.

An implementation is a frozen, hashable dataclass: the jitted loops take it as a static
argument, and `clover_jax.core.executable_cache.describe` names it by its fields.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from clover_jax.core.config import CloverConfig
    from clover_jax.core.ragged import PagedBatch, PagedState
    from clover_jax.core.state import ModelState

Params = dict[str, Any]

# Tokens per causal pass of a long prefill (docs/design.md §1).
DEFAULT_CHUNK = 2048
LOGITS = ("all", "last", "none")


class PassMode(NamedTuple):
    """What kind of pass the layers run (static: each kind compiles once): the first `num_causal`
    rows are causal, the rest block rows, routed within their block's coreset when `coreset`
    (docs/design.md §3, §5). The layers take it as an argument of the pass."""

    num_causal: int
    coreset: bool = False


class PassOutput(NamedTuple):
    """logits: float32 [batch, rows from logits_from, vocab]; state: after the causal rows;
    distinct_experts: int32 [num_layers, batch], experts used by the block rows of each layer,
    collected on request (`distinct_experts=True`; None otherwise)."""

    logits: jax.Array
    state: "ModelState"
    distinct_experts: jax.Array


class RaggedOutput(NamedTuple):
    """hidden: [S, W, hidden] (after the final norm), the rows `batch.logit_rows` names, slot by slot;
    state: the `PagedState` after the pass."""

    hidden: jax.Array
    state: "PagedState"


class ModelPasses(abc.ABC):
    """The passes of one model (see the module docstring). params: the parameter pytree in the
    layout the model runs with; state: a `ModelState`; ids: int [batch, rows]."""

    # ------------------------------------------------------------------ what the model side provides
    @property
    @abc.abstractmethod
    def config(self) -> "CloverConfig":
        """The model's config (vocabulary, layer pattern, coreset defaults)."""

    @abc.abstractmethod
    def run(self, params: Params, input_ids: jax.Array, state: "ModelState", *, num_causal: int, logits_from: int,
            coreset: bool = False, coreset_top_p: Any = 1.0, commit: jax.Array | None = None,
            distinct_experts: bool = False) -> PassOutput:
        """One pass over `input_ids` at the end of `state`'s prefix: the first `num_causal` rows
        causal, the rest block rows, routed within their coreset with `coreset_top_p` when
        `coreset`; logits of rows `logits_from` onwards. commit: None, or bool [batch], which
        sequences append the causal rows (the others keep their state and denoise their block
        right after it; `clover_jax.core.state.rows_for`). With `distinct_experts`, the number of
        experts the block rows used in each layer (a diagnostic, collected only when asked)."""

    @abc.abstractmethod
    def new_state(self, batch: int, capacity: int, start: jax.Array | None = None) -> "ModelState":
        """Inside a trace: an empty state of `capacity` rows, `start` (int [batch]) marking left
        padding, placed as the model's mesh places states."""

    @abc.abstractmethod
    def ragged(self, params: Params, input_ids: jax.Array, batch: "PagedBatch", state: "PagedState", *,
               coreset: bool, coreset_top_p: Any) -> RaggedOutput:
        """The serving engine's step: `input_ids` (int32 [T]) laid out by `batch` over the slots
        of `state` (`clover_jax.core.ragged`); block rows route within their block's coreset when
        `coreset`. hidden: [S, W, hidden], the final hidden states of the rows `batch.logit_rows`
        names; state: the `PagedState` after every row's K/V is written and every writing causal
        segment has advanced its slot's GDN state."""

    @property
    @abc.abstractmethod
    def platform(self) -> str:
        """Where the passes run: "cpu" | "gpu" | "tpu" (what the kernels were chosen for)."""

    @abc.abstractmethod
    def head_logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        """The LM head: hidden states [..., hidden] (after the final norm) -> float32 [..., vocab]."""

    @abc.abstractmethod
    def new_paged_state(self, slots: int, num_pages: int, page_size: int) -> "PagedState":
        """Inside a trace: an empty paged state of `slots` GDN slots and `num_pages` K/V pages of
        `page_size` positions."""

    @abc.abstractmethod
    def recording(self, state: "ModelState", rows: int) -> "ModelState":
        """`state` ready for a recording causal pass of `rows` rows (`clover_jax.nn.rollback`)."""

    @abc.abstractmethod
    def rolled_back(self, state: "ModelState", keep: jax.Array, rows: int) -> "ModelState":
        """The state after a recording pass of `rows` rows, kept to its first `keep` (int [batch])
        rows per sequence; `length` comes back per sequence."""

    # ------------------------------------------------------------------ the named passes
    def causal(self, params: Params, ids: jax.Array, state: "ModelState", *, logits_from: int = 0) -> PassOutput:
        """Append every row of `ids` to `state`; logits of rows `logits_from` onwards."""
        return self.run(params, ids, state, num_causal=ids.shape[1], logits_from=logits_from)

    def denoise(self, params: Params, block_ids: jax.Array, state: "ModelState", *, coreset: bool,
                coreset_top_p: Any, distinct_experts: bool = False) -> PassOutput:
        """A denoising forward of `block_ids` (may hold masks) after `state`'s prefix, which it
        leaves as it is. logits: [batch, block, vocab]."""
        return self.run(params, block_ids, state, num_causal=0, logits_from=0, coreset=coreset,
                        coreset_top_p=coreset_top_p, distinct_experts=distinct_experts)

    def commit_and_denoise(self, params: Params, committed: jax.Array, block_ids: jax.Array, state: "ModelState",
                           *, coreset: bool, coreset_top_p: Any, committed_logits: bool = False,
                           commit: jax.Array | None = None, distinct_experts: bool = False) -> PassOutput:
        """Append `committed` (int [batch, C]) to `state` and denoise `block_ids` after it, in one
        pass. logits: the block rows' ([batch, block, vocab]), or with `committed_logits` the
        committed rows' first ([batch, C + block, vocab]). commit: None (every sequence commits)
        or bool [batch]: a sequence where it is False commits nothing — its state is left as it
        is and its block is denoised right after its prefix, as `denoise` would — so sequences at
        different points of their decode share one pass; `length` comes back per sequence."""
        rows = committed.shape[1]
        return self.run(params, jnp.concatenate([committed, block_ids], axis=1), state, num_causal=rows,
                        logits_from=0 if committed_logits else rows, coreset=coreset, coreset_top_p=coreset_top_p,
                        commit=commit, distinct_experts=distinct_experts)

    def recording_causal(self, params: Params, ids: jax.Array, state: "ModelState") -> PassOutput:
        """A causal pass over `ids` that can be rolled back to any of its rows: pass its state to
        `rolled_back(out.state, keep, rows=ids.shape[1])`. logits: every row's."""
        rows = ids.shape[1]
        return self.run(params, ids, self.recording(state, rows), num_causal=rows, logits_from=0)

    def prefill(self, params: Params, ids: jax.Array, state: "ModelState", *, chunk_size: int = DEFAULT_CHUNK,
                logits: str = "none") -> tuple[jax.Array | None, "ModelState"]:
        """Append `ids` (int [batch, tokens]) to `state`, `chunk_size` rows per causal pass.

        logits: "all" (float32 [batch, tokens, vocab]), "last" ([batch, 1, vocab]) or "none".
        The result equals one unchunked pass; memory holds one chunk's activations. Full chunks
        run under one `lax.scan` (one compiled chunk), then one pass takes the remainder.
        """
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
        batch, num_tokens = ids.shape
        first_logit = {"all": lambda n: 0, "last": lambda n: n - 1, "none": lambda n: n}[logits]
        num_full, remainder = divmod(num_tokens, chunk_size)
        pieces = []
        if num_full:
            chunks = jnp.swapaxes(ids[:, :num_full * chunk_size].reshape(batch, num_full, chunk_size), 0, 1)

            def step(state, chunk_ids):
                out = self.causal(params, chunk_ids, state, logits_from=first_logit(chunk_size))
                return out.state, out.logits

            state, chunk_logits = jax.lax.scan(step, state, chunks)  # [chunks, batch, rows, vocab]
            pieces.append(jnp.swapaxes(chunk_logits, 0, 1).reshape(batch, -1, chunk_logits.shape[-1]))
        if remainder:
            out = self.causal(params, ids[:, num_full * chunk_size:], state, logits_from=first_logit(remainder))
            state = out.state
            pieces.append(out.logits)
        if logits == "none":
            return None, state
        if logits == "last":
            return pieces[-1][:, -1:], state
        return jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0], state
